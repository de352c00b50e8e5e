#include "pipeline/link_endpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "gtest/gtest.h"
#include "storage/memory_message_store.h"

namespace aqswarm::pipeline {
namespace {

constexpr int64_t kRows = 4, kCols = 32, kBatch = 3;

LinkEndpointOptions Options(compression::LinkMode mode, RowPrecision p = RowPrecision::kFloat16) {
  LinkEndpointOptions o;
  o.link.link = {0, 0};
  o.link.generation = 1;
  o.link.rows = kRows;
  o.link.cols = kCols;
  o.link.precision = p;
  o.codec.mode = mode;
  o.codec.quantizer.bits = 3;
  o.codec.quantizer.min_compress_elements = 1;
  o.codec.stored = p;
  o.codec.warmup_epochs = 1;
  o.micro_batch = kBatch;
  o.prefetch_batches = 2;
  return o;
}

// Activations that drift slowly with the epoch, like a model being trained.
std::vector<float> Acts(absl::Span<const uint64_t> samples, int epoch) {
  std::vector<float> a;
  for (uint64_t s : samples) {
    Rng rng(s);
    for (int64_t i = 0; i < kRows * kCols; ++i) {
      a.push_back(static_cast<float>(rng.UnitDouble() * 2 - 1 + 0.05 * epoch * std::sin(i + s)));
    }
  }
  return a;
}

struct Harness {
  explicit Harness(LinkEndpointOptions o) : Harness(o, o) {}
  Harness(LinkEndpointOptions send, LinkEndpointOptions recv) {
    send_store = *storage::MemoryMessageStore::Create({});
    recv_store = *storage::MemoryMessageStore::Create({});
    sender = *ActivationSender::Create(send_store.get(), send);
    receiver = *ActivationReceiver::Create(recv_store.get(), recv);
  }
  // Sends one micro-batch, serving resends; returns the receiver's input.
  std::vector<float> Transfer(uint64_t step, uint32_t mb, int epoch, absl::Span<const uint64_t> samples,
                              int* resends = nullptr) {
    std::vector<float> acts = Acts(samples, epoch), got;
    v1::ActivationBatch batch;
    { auto st = sender->Encode(step, mb, epoch, samples, acts, &batch); EXPECT_TRUE(st.ok()) << st; }
    { auto st = receiver->Begin(step, mb, samples); EXPECT_TRUE(st.ok()) << st; }
    std::vector<uint64_t> missing;
    { auto st = receiver->Apply(batch, &missing); EXPECT_TRUE(st.ok()) << st; }
    while (!missing.empty()) {
      if (resends) *resends += missing.size();
      EXPECT_TRUE(sender->EncodeResend(step, mb, epoch, samples, acts, missing, &batch).ok());
      EXPECT_TRUE(receiver->Apply(batch, &missing).ok());
    }
    EXPECT_TRUE(receiver->Take(&got).ok());
    return got;
  }
  std::unique_ptr<storage::MemoryMessageStore> send_store, recv_store;
  std::unique_ptr<ActivationSender> sender;
  std::unique_ptr<ActivationReceiver> receiver;
};

std::vector<uint64_t> Order(int epoch) {
  std::vector<uint64_t> o = {5, 1, 8, 2, 7, 3};
  if (epoch % 2) std::reverse(o.begin(), o.end());
  return o;
}

void ExpectStoresIdentical(Harness& h, const LinkEndpointOptions& o, std::vector<uint64_t> ids = Order(0)) {
  ASSERT_TRUE(h.sender->Close().ok());
  ASSERT_TRUE(h.receiver->Close().ok());
  std::vector<std::vector<float>> a(ids.size(), std::vector<float>(kRows * kCols)), b = a;
  std::vector<absl::Span<float>> sa, sb;
  for (size_t i = 0; i < ids.size(); ++i) {
    sa.push_back(absl::MakeSpan(a[i]));
    sb.push_back(absl::MakeSpan(b[i]));
  }
  std::vector<storage::RowRead> ra(ids.size()), rb(ids.size());
  ASSERT_TRUE(h.send_store->GetBatch(o.link, ids, sa, absl::MakeSpan(ra)).ok());
  ASSERT_TRUE(h.recv_store->GetBatch(o.link, ids, sb, absl::MakeSpan(rb)).ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(ra[i].status.ok() && rb[i].status.ok());
    EXPECT_EQ(0, std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4)) << "sample " << ids[i];
    EXPECT_EQ(ra[i].payload_checksum, rb[i].payload_checksum);
    // What DELTA messages carry: the codec's checksum of m is the store's.
    EXPECT_EQ(ra[i].payload_checksum,
              compression::AqsgdLinkCodec::RowChecksum(o.link.precision, kRows, kCols, a[i]));
  }
}

// Precision of m, and resident_bytes: the default (the epoch's rows stay
// resident) or 0 (streamed through the prefetcher every micro-batch).
class AqsgdLinkTest : public ::testing::TestWithParam<std::tuple<RowPrecision, uint64_t>> {};

TEST_P(AqsgdLinkTest, BothStoresBitIdenticalAfterEpochsAndDeltasApproachFull) {
  LinkEndpointOptions o = Options(compression::LinkMode::kAqsgd, std::get<0>(GetParam()));
  o.resident_bytes = std::get<1>(GetParam());
  Harness h(o);
  uint64_t step = 0;
  for (int epoch = 0; epoch < 4; ++epoch) {
    ASSERT_TRUE(h.sender->StartEpoch(Order(epoch)).ok());
    ASSERT_TRUE(h.receiver->StartEpoch(Order(epoch)).ok());
    for (uint32_t mb = 0; mb < 2; ++mb, ++step) {
      const std::vector<uint64_t> order = Order(epoch);
      std::vector<uint64_t> s(order.begin() + mb * kBatch, order.begin() + (mb + 1) * kBatch);
      std::vector<float> got = h.Transfer(step, mb, epoch, s), want = Acts(s, epoch);
      double err = 0, norm = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        err += (got[i] - want[i]) * (got[i] - want[i]);
        norm += want[i] * want[i];
      }
      // Epoch 0 is FULL (fp16/int8 rounding only); later epochs are 3-bit
      // deltas of a small drift, still close to the truth.
      EXPECT_LT(std::sqrt(err / norm), epoch == 0 ? 0.01 : 0.05) << "epoch " << epoch;
    }
  }
  EXPECT_EQ(h.sender->stats().full_rows, 6u);
  EXPECT_EQ(h.sender->stats().delta_rows, 18u);
  EXPECT_LT(h.sender->stats().payload_bytes, h.sender->stats().raw_bytes / 2);
  ExpectStoresIdentical(h, o);
}

INSTANTIATE_TEST_SUITE_P(PrecisionsResidentOrStreamed, AqsgdLinkTest,
                         ::testing::Combine(::testing::Values(RowPrecision::kFloat32, RowPrecision::kFloat16,
                                                              RowPrecision::kInt8),
                                            ::testing::Values(LinkEndpointOptions().resident_bytes, uint64_t{0})));

// A resident end and a streamed one hold the same m: the sender keeps its
// rows resident while an epoch fits its budget (6 rows) and streams the
// epochs that do not (9 samples), writing its rows back as it switches; the
// receiver always streams. No DELTA is ever refused, and after Close both
// stores hold the same rows.
TEST(AqsgdLinkResidentTest, ResidentAndStreamedEndsAgreeAcrossSwitches) {
  LinkEndpointOptions o = Options(compression::LinkMode::kAqsgd);
  LinkEndpointOptions send = o, recv = o;
  send.resident_bytes = 6 * kRows * kCols * sizeof(float);
  recv.resident_bytes = 0;
  Harness h(send, recv);
  const std::vector<uint64_t> small = Order(0), big = {5, 1, 8, 2, 7, 3, 11, 12, 13};
  uint64_t step = 0;
  int resends = 0;
  for (int epoch = 0; epoch < 6; ++epoch) {
    const std::vector<uint64_t>& order = epoch % 3 == 1 ? big : small;
    ASSERT_TRUE(h.sender->StartEpoch(order).ok());
    ASSERT_TRUE(h.receiver->StartEpoch(order).ok());
    for (size_t b = 0; b * kBatch < order.size(); ++b, ++step) {
      std::vector<uint64_t> s(order.begin() + b * kBatch, order.begin() + (b + 1) * kBatch);
      h.Transfer(step, static_cast<uint32_t>(b), epoch + 1, s, &resends);  // epoch + 1: past the warm-up
    }
  }
  EXPECT_EQ(resends, 0);
  EXPECT_EQ(h.sender->stats().full_rows, 9u) << "each sample FULL once";
  ExpectStoresIdentical(h, o);
}

// Epochs alternating between two disjoint sets of 6 samples (as a DP
// grid deals them), past the warm-up; returns the rows resent.
int AlternateEpochs(Harness& h, int epochs) {
  const std::vector<uint64_t> a = Order(0), b = {11, 12, 13, 14, 15, 16};
  uint64_t step = 0;
  int resends = 0;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    const std::vector<uint64_t>& order = epoch % 2 ? b : a;
    EXPECT_TRUE(h.sender->StartEpoch(order).ok());
    EXPECT_TRUE(h.receiver->StartEpoch(order).ok());
    for (uint32_t mb = 0; mb < 2; ++mb, ++step) {
      std::vector<uint64_t> s(order.begin() + mb * kBatch, order.begin() + (mb + 1) * kBatch);
      h.Transfer(step, mb, epoch + 1, s, &resends);
    }
  }
  return resends;
}

// A DP grid deals each epoch's samples anew: while every sample's row fits,
// rows of other epochs stay resident too, and the store is read once per
// sample and written only at Close.
TEST(AqsgdLinkResidentTest, RowsOfOtherEpochsStayWhileAllFit) {
  LinkEndpointOptions o = Options(compression::LinkMode::kAqsgd);
  o.resident_bytes = 12 * kRows * kCols * sizeof(float);
  Harness h(o);
  EXPECT_EQ(AlternateEpochs(h, 6), 0);
  EXPECT_EQ(h.sender->stats().full_rows, 12u);
  EXPECT_EQ(h.send_store->GetStats().rows_written, 0u) << "nothing written before Close";
  EXPECT_EQ(h.send_store->GetStats().rows_unseen, 12u) << "each row looked up once";
  ExpectStoresIdentical(h, o);
  EXPECT_EQ(h.send_store->GetStats().rows_written, 12u);
}

// When the other epochs' rows do not fit beside this one's, they go back to
// the store and are read again when their samples return: the ends still
// agree, with no resend.
TEST(AqsgdLinkResidentTest, RowsOfOtherEpochsGoBackWhenTheyDoNotFit) {
  LinkEndpointOptions o = Options(compression::LinkMode::kAqsgd);
  o.resident_bytes = 8 * kRows * kCols * sizeof(float);
  Harness h(o);
  EXPECT_EQ(AlternateEpochs(h, 6), 0);
  EXPECT_EQ(h.sender->stats().full_rows, 12u);
  EXPECT_EQ(h.sender->stats().delta_rows, 24u);
  EXPECT_EQ(h.send_store->GetStats().rows_written, 5u * 6) << "each epoch's rows written back as the next starts";
  ExpectStoresIdentical(h, o);
}

// Resident rows live in slabs: rows of 1/3 of a slab fill slabs three at a
// time, rows dropped by a write-back are reused before a new slab is added,
// every row starts zeroed and unseen, and the last write-back frees the
// slabs; what was written back reads back as the same values.
TEST(AqsgdLinkResidentTest, RowsLiveInSlabsAndAreReused) {
  storage::LinkSpec link;
  link.link = {0, 0};
  link.generation = 1;
  link.rows = 1;
  link.cols = static_cast<int64_t>(ResidentRows::kSlabBytes / sizeof(float) / 3);
  link.precision = RowPrecision::kFloat32;
  auto store = *storage::MemoryMessageStore::Create({});
  ResidentRows resident(store.get(), link);
  ASSERT_TRUE(*resident.StartEpoch({1, 2, 3, 4}, 1ull << 30));
  std::vector<ResidentRows::Row*> rows;
  const std::vector<uint64_t> first = {1, 2, 3, 4};
  ASSERT_TRUE(resident.Rows(first, &rows).ok());
  EXPECT_EQ(resident.slabs(), 2u);
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_FALSE(rows[i]->present);
    EXPECT_EQ(rows[i]->m.size(), static_cast<size_t>(link.cols));
    for (size_t j = 0; j < i; ++j) {
      EXPECT_TRUE(rows[i]->m.data() + rows[i]->m.size() <= rows[j]->m.data() ||
                  rows[j]->m.data() + rows[j]->m.size() <= rows[i]->m.data())
          << "rows " << i << " and " << j << " overlap";
    }
    std::fill(rows[i]->m.begin(), rows[i]->m.end(), static_cast<float>(first[i]));
    resident.Updated(rows[i]);
  }
  const absl::flat_hash_set<uint64_t> keep = {1, 2};
  ASSERT_TRUE(resident.WriteBack(&keep).ok());
  EXPECT_EQ(resident.size(), 2u);
  ASSERT_TRUE(resident.Rows(std::vector<uint64_t>{5, 6}, &rows).ok());
  EXPECT_EQ(resident.slabs(), 2u) << "the slots of 3 and 4 (or the free ones) were used";
  for (ResidentRows::Row* r : rows) {
    EXPECT_FALSE(r->present);
    EXPECT_TRUE(std::all_of(r->m.begin(), r->m.end(), [](float v) { return v == 0.0f; })) << "a reused row is zeroed";
  }
  ASSERT_TRUE(resident.Rows(std::vector<uint64_t>{4, 7, 8}, &rows).ok());
  EXPECT_EQ(resident.slabs(), 3u) << "7 rows in slabs of 3";
  ASSERT_TRUE(rows[0]->present) << "4 was written back and read again";
  EXPECT_EQ(rows[0]->m[0], 4.0f);
  EXPECT_EQ(rows[0]->m[link.cols - 1], 4.0f);
  EXPECT_FALSE(rows[1]->present);
  EXPECT_FALSE(rows[2]->present);
  ASSERT_TRUE(resident.WriteBack(nullptr).ok());
  EXPECT_FALSE(resident.active());
  EXPECT_EQ(resident.size(), 0u);
  EXPECT_EQ(resident.slabs(), 0u);
}

// A clean restart keeps the deltas going: Close writes the resident rows
// back, and a new sender on the same store reads them as its m. A receiver
// that lost its rows instead (a fresh store, as after a crash before any
// write-back) asks for each of them once and the ends agree again.
TEST(AqsgdLinkResidentTest, RestartsResumeFromTheStoreOrResendOnce) {
  LinkEndpointOptions o = Options(compression::LinkMode::kAqsgd);
  Harness h(o);
  const std::vector<uint64_t> order = Order(0);
  uint64_t step = 0;
  auto epoch = [&](int e, int* resends) {
    ASSERT_TRUE(h.sender->StartEpoch(order).ok());
    ASSERT_TRUE(h.receiver->StartEpoch(order).ok());
    for (uint32_t mb = 0; mb < 2; ++mb, ++step) {
      std::vector<uint64_t> s(order.begin() + mb * kBatch, order.begin() + (mb + 1) * kBatch);
      h.Transfer(step, mb, e, s, resends);
    }
  };
  int resends = 0;
  epoch(1, &resends);  // FULL rows (unseen samples)
  epoch(2, &resends);
  ASSERT_TRUE(h.sender->Close().ok());
  h.sender = *ActivationSender::Create(h.send_store.get(), o);
  epoch(3, &resends);
  EXPECT_EQ(resends, 0);
  EXPECT_EQ(h.sender->stats().delta_rows, 6u) << "the restarted sender read its m back";
  h.receiver.reset();  // (closes into the old store, which is then lost)
  h.recv_store = *storage::MemoryMessageStore::Create({});
  h.receiver = *ActivationReceiver::Create(h.recv_store.get(), o);
  epoch(4, &resends);
  EXPECT_EQ(resends, 6) << "the receiver lost every row: each resent once";
  epoch(5, &resends);
  EXPECT_EQ(resends, 6);
  ExpectStoresIdentical(h, o);
}

TEST(AqsgdLinkRecoveryTest, CorruptOrLostReceiverRowIsResentAndStoresReconverge) {
  LinkEndpointOptions o = Options(compression::LinkMode::kAqsgd);
  Harness h(o);
  ASSERT_TRUE(h.sender->StartEpoch(Order(0)).ok());
  ASSERT_TRUE(h.receiver->StartEpoch(Order(0)).ok());
  std::vector<uint64_t> s0 = {5, 1, 8}, s1 = {2, 7, 3};
  h.Transfer(0, 0, 0, s0);
  h.Transfer(1, 1, 0, s1);
  ASSERT_TRUE(h.receiver->Close().ok());  // flush write-behind before corrupting
  // Sample 1: a flipped payload bit (the store reports DataLoss, the receiver
  // treats it as unseen); sample 7: truncated row. The sender still sends
  // DELTAs for both, whose checksums cannot match: each must be resent once.
  ASSERT_TRUE(h.recv_store->MutateRowForTesting(o.link.link, 1, [](std::string* v) { (*v)[v->size() - 3] ^= 0x40; }).ok());
  ASSERT_TRUE(h.recv_store->MutateRowForTesting(o.link.link, 7, [](std::string* v) { v->resize(v->size() / 2); }).ok());
  h.receiver = *ActivationReceiver::Create(h.recv_store.get(), o);
  ASSERT_TRUE(h.sender->StartEpoch(Order(0)).ok());
  ASSERT_TRUE(h.receiver->StartEpoch(Order(0)).ok());
  int resends = 0;
  h.Transfer(2, 0, 1, s0, &resends);
  h.Transfer(3, 1, 1, s1, &resends);
  EXPECT_EQ(resends, 2);
  EXPECT_EQ(h.sender->stats().resend_rows, 2u);
  EXPECT_EQ(h.sender->stats().delta_rows, 6u);
  ExpectStoresIdentical(h, o);
}

// A per-token first-visit reference (compression.firstVisitReference) on
// activations that are mostly a function of their token: first visits of
// later steps subtract what earlier steps taught both ends, and quantize far
// closer; both ends stay bit-identical without a resend. A receiver that
// restarts loses its table: the first visits of that step it cannot match
// are resent (without the reference), both ends reset their tables, and from
// the next step on they agree again with no resends; m stays bit-identical.
TEST(FirstVisitReferenceTest, EndsStayBitIdenticalTheErrorFallsAndALostTableCostsOnlyResends) {
  constexpr int64_t kVocab = 10;
  auto token = [](uint64_t sample, int64_t t) { return static_cast<int32_t>((sample * 7 + t) % kVocab); };
  auto options = [&](bool reference) {
    LinkEndpointOptions o = Options(compression::LinkMode::kAqsgd);
    compression::CodecOptions tiled = TiledCodecOptions(v1::LinkCompression(), 3);
    tiled.bucket_size = 32;
    tiled.tile_grid = v1::TILE_GRID_MIDTREAD;
    o.codec.first_visit = tiled;
    o.first_visit_reference = reference;
    o.vocab = kVocab;
    o.tokens = [&](absl::Span<const uint64_t> samples, std::vector<int32_t>* out) {
      for (uint64_t s : samples) {
        for (int64_t t = 0; t < kRows; ++t) out->push_back(token(s, t));
      }
      return absl::OkStatus();
    };
    return o;
  };
  auto acts = [&](absl::Span<const uint64_t> samples) {
    std::vector<float> a;
    for (uint64_t s : samples) {
      Rng rng(s);
      for (int64_t t = 0; t < kRows; ++t) {
        for (int64_t j = 0; j < kCols; ++j) {
          a.push_back(static_cast<float>(3 * std::sin(token(s, t) * 31 + j) + 0.1 * (rng.UnitDouble() - 0.5)));
        }
      }
    }
    return a;
  };
  struct Run {
    int resends = 0;
    double error = 0;  // relative error of the first visits
  };
  auto run = [&](Harness& h, uint64_t first_sample, uint64_t steps, uint64_t step0) {
    Run r;
    std::vector<uint64_t> order;
    for (uint64_t id = first_sample; id < first_sample + steps * kBatch; ++id) order.push_back(id);
    EXPECT_TRUE(h.sender->StartEpoch(order).ok());
    EXPECT_TRUE(h.receiver->StartEpoch(order).ok());
    const LinkEndpointStats before = h.sender->stats();
    for (uint64_t k = 0; k < steps; ++k) {
      std::vector<uint64_t> samples;
      for (int64_t i = 0; i < kBatch; ++i) samples.push_back(first_sample + k * kBatch + i);
      const std::vector<float> a = acts(samples);
      v1::ActivationBatch batch;
      std::vector<uint64_t> missing;
      std::vector<float> got;
      EXPECT_TRUE(h.sender->Encode(step0 + k, 0, 0, samples, a, &batch).ok());
      EXPECT_TRUE(h.receiver->Begin(step0 + k, 0, samples).ok());
      EXPECT_TRUE(h.receiver->Apply(batch, &missing).ok());
      while (!missing.empty()) {
        r.resends += missing.size();
        EXPECT_TRUE(h.sender->EncodeResend(step0 + k, 0, 0, samples, a, missing, &batch).ok());
        for (const auto& row : batch.rows()) EXPECT_FALSE(row.has_reference_checksum());
        EXPECT_TRUE(h.receiver->Apply(batch, &missing).ok());
      }
      EXPECT_TRUE(h.receiver->Take(&got).ok());
    }
    const LinkEndpointStats& after = h.sender->stats();
    r.error = std::sqrt((after.error_sq - before.error_sq) / (after.signal_sq - before.signal_sq));
    return r;
  };
  std::vector<uint64_t> all;
  for (uint64_t id = 0; id < 60; ++id) all.push_back(id);
  Harness plain(options(false)), ref(options(true));
  // Step 0 meets every token; steps 1.. use what it taught.
  EXPECT_EQ(run(plain, 0, 1, 0).resends, 0);
  EXPECT_EQ(run(ref, 0, 1, 0).resends, 0);
  const Run p = run(plain, 3, 9, 1), q = run(ref, 3, 9, 1);
  EXPECT_EQ(p.resends, 0);
  EXPECT_EQ(q.resends, 0);
  EXPECT_LT(q.error * 3, p.error) << "with " << q.error << ", without " << p.error;
  // The receiver restarts on the same store: its table is gone.
  ASSERT_TRUE(ref.receiver->Close().ok());
  ref.receiver = *ActivationReceiver::Create(ref.recv_store.get(), options(true));
  EXPECT_GT(run(ref, 30, 1, 10).resends, 0);
  const Run healed = run(ref, 33, 9, 11);
  EXPECT_EQ(healed.resends, 0);
  EXPECT_LT(healed.error * 3, p.error);
  ExpectStoresIdentical(ref, options(true), all);
  // A reference needs the tokens and AQ-SGD with a first-visit codec.
  LinkEndpointOptions no_tokens = options(true);
  no_tokens.tokens = nullptr;
  EXPECT_FALSE(ActivationSender::Create(ref.send_store.get(), no_tokens).ok());
  LinkEndpointOptions raw = options(true);
  raw.codec.first_visit.reset();
  EXPECT_FALSE(ActivationReceiver::Create(ref.recv_store.get(), raw).ok());
}

TEST(LinkOptionsTest, ResidentBytesComeFromTheJobOrTheDefault) {
  v1::JobSpec job;
  job.mutable_model()->set_seq_len(kRows);
  job.mutable_model()->set_d_model(kCols);
  job.mutable_compression()->set_mode(v1::LinkCompression::aqsgd);
  job.mutable_compression()->set_m_precision(v1::LinkCompression::MPrecision::fp16);
  job.mutable_compression()->set_fw_bits(3);
  auto o = LinkOptionsFromJob(job, 0, 0, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->resident_bytes, LinkEndpointOptions().resident_bytes);
  EXPECT_GT(o->resident_bytes, 0u);
  for (uint64_t b : {uint64_t{0}, uint64_t{4096}}) {
    job.mutable_compression()->set_resident_bytes(b);
    o = LinkOptionsFromJob(job, 0, 0, 1);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->resident_bytes, b);
  }
}

TEST(LinkOptionsTest, FirstVisitsAreRawTiledOrFixedPointAtTheirOwnBits) {
  v1::JobSpec job;
  job.mutable_model()->set_seq_len(kRows);
  job.mutable_model()->set_d_model(kCols);
  job.mutable_model()->set_vocab_size(100);
  v1::LinkCompression* c = job.mutable_compression();
  c->set_mode(v1::LinkCompression::aqsgd);
  c->set_m_precision(v1::LinkCompression::MPrecision::fp16);
  c->set_fw_bits(3);
  c->set_entropy_coding(true);
  auto o = LinkOptionsFromJob(job, 0, 0, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->codec.first_visit.has_value());
  EXPECT_FALSE(o->first_visit_reference);
  c->set_first_visit(v1::LinkCompression::FirstVisit::fixed_point);
  c->set_first_visit_bits(4);
  c->set_first_visit_reference(true);
  o = LinkOptionsFromJob(job, 0, 0, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_TRUE(o->codec.first_visit.has_value());
  EXPECT_EQ(o->codec.first_visit->codec, v1::CODEC_FIXED_POINT);
  EXPECT_EQ(o->codec.first_visit->bits, 4);
  EXPECT_TRUE(o->codec.first_visit->entropy);
  EXPECT_EQ(o->codec.quantizer.bits, 3);
  EXPECT_TRUE(o->first_visit_reference);
  EXPECT_EQ(o->vocab, 100);
  c->set_first_visit(v1::LinkCompression::FirstVisit::tiled);
  c->set_tile_grid(v1::LinkCompression::TileGrid::midtread);
  o = LinkOptionsFromJob(job, 0, 0, 1);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->codec.first_visit->codec, v1::CODEC_TILED);
  EXPECT_EQ(o->codec.first_visit->tile_grid, v1::TILE_GRID_MIDTREAD);
  EXPECT_EQ(o->codec.first_visit->bits, 4);
}

TEST(StatelessLinkTest, Fp32IsExactAndDirectQIsClose) {
  for (auto mode : {compression::LinkMode::kFp32, compression::LinkMode::kDirectQ}) {
    Harness h(Options(mode));
    std::vector<uint64_t> s = {4, 9, 6};
    std::vector<float> got = h.Transfer(0, 0, 2, s), want = Acts(s, 2);
    if (mode == compression::LinkMode::kFp32) {
      EXPECT_EQ(got, want);
      EXPECT_EQ(h.sender->stats().payload_bytes, h.sender->stats().raw_bytes);
    } else {
      double err = 0;
      for (size_t i = 0; i < got.size(); ++i) err = std::max(err, static_cast<double>(std::fabs(got[i] - want[i])));
      EXPECT_LT(err, 0.27);  // 3 bits: the asymmetric grid tops out at 3/4 of the (rounded-up) scale
      EXPECT_GT(err, 0.0);
    }
    EXPECT_EQ(h.sender->stats().direct_rows, 3u);
  }
}

// The sender's error sums are ||a - what the receiver reconstructs||^2 and
// ||a||^2, here for rows of 9 x 32 = 288 values (one 256-value block of the
// vectorised sum and a tail), DirectQ and AQ-SGD alike.
TEST(LinkStatsTest, ErrorSumsMatchWhatTheReceiverReconstructs) {
  for (auto mode : {compression::LinkMode::kDirectQ, compression::LinkMode::kAqsgd}) {
    LinkEndpointOptions o = Options(mode);
    o.link.rows = 9;
    o.codec.warmup_epochs = 0;
    auto send_store = *storage::MemoryMessageStore::Create({});
    auto recv_store = *storage::MemoryMessageStore::Create({});
    auto sender = *ActivationSender::Create(send_store.get(), o);
    auto receiver = *ActivationReceiver::Create(recv_store.get(), o);
    const std::vector<uint64_t> samples = {3, 1, 2};
    double error_sq = 0, signal_sq = 0;
    for (int epoch = 0; epoch < 2; ++epoch) {  // AQ-SGD: FULL rows, then deltas
      Rng rng(100 + epoch);
      std::vector<float> acts(samples.size() * o.link.num_values()), got;
      for (float& a : acts) a = static_cast<float>(rng.UnitDouble() * 4 - 2);
      v1::ActivationBatch batch;
      std::vector<uint64_t> missing;
      ASSERT_TRUE(sender->Encode(epoch, 0, epoch, samples, acts, &batch).ok());
      ASSERT_TRUE(receiver->Begin(epoch, 0, samples).ok());
      ASSERT_TRUE(receiver->Apply(batch, &missing).ok());
      ASSERT_TRUE(missing.empty());
      ASSERT_TRUE(receiver->Take(&got).ok());
      for (size_t i = 0; i < acts.size(); ++i) {
        error_sq += (static_cast<double>(acts[i]) - got[i]) * (static_cast<double>(acts[i]) - got[i]);
        signal_sq += static_cast<double>(acts[i]) * acts[i];
      }
    }
    EXPECT_GT(error_sq, 0);
    EXPECT_NEAR(sender->stats().error_sq, error_sq, 1e-5 * error_sq);
    EXPECT_NEAR(sender->stats().signal_sq, signal_sq, 1e-5 * signal_sq);
  }
}

TEST(LinkValidationTest, MalformedAndOutOfOrderBatchesAreRejected) {
  LinkEndpointOptions o = Options(compression::LinkMode::kAqsgd);
  Harness h(o);
  std::vector<uint64_t> s = {5, 1, 8};
  ASSERT_TRUE(h.sender->StartEpoch(Order(0)).ok());
  ASSERT_TRUE(h.receiver->StartEpoch(Order(0)).ok());
  std::vector<float> acts = Acts(s, 0);
  v1::ActivationBatch good;
  ASSERT_TRUE(h.sender->Encode(7, 0, 0, s, acts, &good).ok());
  std::vector<uint64_t> missing;
  ASSERT_TRUE(h.receiver->Begin(7, 0, s).ok());
  auto expect_reject = [&](v1::ActivationBatch b, const char* needle) {
    absl::Status st = h.receiver->Apply(b, &missing);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st;
  };
  v1::ActivationBatch b = good;
  b.set_step(8);
  expect_reject(b, "out-of-order");
  b = good;
  b.mutable_rows(1)->set_sample_id(99);
  expect_reject(b, "not in micro-batch");
  b = good;
  b.mutable_rows(1)->set_sample_id(5);
  expect_reject(b, "twice");
  b = good;
  b.mutable_rows()->RemoveLast();
  expect_reject(b, "rows");
  b = good;
  b.mutable_rows(0)->set_kind(v1::AqsgdRow::KIND_DIRECT);
  expect_reject(b, "not allowed");
  b = good;
  b.mutable_rows(0)->mutable_tensor()->mutable_payload()->resize(3);
  EXPECT_FALSE(h.receiver->Apply(b, &missing).ok());
  // The good batch still applies after all those rejections: nothing was lost.
  ASSERT_TRUE(h.receiver->Apply(good, &missing).ok());
  EXPECT_TRUE(missing.empty());
  std::vector<float> got;
  EXPECT_TRUE(h.receiver->Take(&got).ok());
}

// A hostile upstream puts NaN (raw) into a DELTA row and a FULL row: each
// is refused as non-finite naming the sample, m(xi) does not take it, and
// the honest batches that follow apply without a resend, both stores equal.
TEST(LinkValidationTest, NonFiniteRowsAreRefusedAndMStaysBitIdentical) {
  for (bool resident : {true, false}) {
    LinkEndpointOptions o = Options(compression::LinkMode::kAqsgd);
    o.codec.warmup_epochs = 0;
    if (!resident) o.resident_bytes = 0;
    Harness h(o);
    const std::vector<uint64_t> s0 = {5, 1, 8}, s1 = {2, 7, 3};
    ASSERT_TRUE(h.sender->StartEpoch(Order(0)).ok());
    ASSERT_TRUE(h.receiver->StartEpoch(Order(0)).ok());
    h.Transfer(0, 0, 0, s0);
    h.Transfer(1, 1, 0, s1);
    ASSERT_TRUE(h.sender->StartEpoch(Order(0)).ok());
    ASSERT_TRUE(h.receiver->StartEpoch(Order(0)).ok());
    for (uint32_t mb = 0; mb < 2; ++mb) {
      const std::vector<uint64_t>& s = mb == 0 ? s0 : s1;
      const std::vector<float> acts = Acts(s, 1);
      v1::ActivationBatch good;
      ASSERT_TRUE(h.sender->Encode(2 + mb, mb, 1, s, acts, &good).ok());
      ASSERT_EQ(good.rows(0).kind(), v1::AqsgdRow::KIND_DELTA);
      v1::ActivationBatch bad = good;
      compression::CodecOptions raw;
      raw.codec = v1::CODEC_RAW_F32;
      std::vector<float> poison(kRows * kCols, 0.01f);
      ASSERT_TRUE(compression::Encode(raw, poison, {kRows, kCols}, 0, bad.mutable_rows(0)->mutable_tensor()).ok());
      const float nan = NAN;
      std::memcpy(bad.mutable_rows(0)->mutable_tensor()->mutable_payload()->data() + 4 * 9, &nan, 4);
      if (mb == 1) bad.mutable_rows(0)->set_kind(v1::AqsgdRow::KIND_FULL);
      ASSERT_TRUE(h.receiver->Begin(2 + mb, mb, s).ok());
      std::vector<uint64_t> missing;
      const absl::Status st = h.receiver->Apply(bad, &missing);
      EXPECT_TRUE(compression::IsNonFiniteError(st)) << st;
      EXPECT_NE(st.message().find(absl::StrCat("sample ", s[0])), std::string::npos) << st;
      ASSERT_TRUE(h.receiver->Apply(good, &missing).ok());
      EXPECT_TRUE(missing.empty()) << "the refused row changed m(xi): its DELTA no longer matches";
      std::vector<float> got;
      ASSERT_TRUE(h.receiver->Take(&got).ok());
      for (float v : got) ASSERT_TRUE(std::isfinite(v));
    }
    ExpectStoresIdentical(h, o);
  }
}

TEST(GradientCodecTest, ShapeAndCodecAreChecked) {
  v1::LinkCompression compression;
  compression.set_mode(v1::LinkCompression::aqsgd);
  compression.set_bw_bits(6);
  GradientCodec g(compression, kRows, kCols);
  std::vector<float> grad(2 * kRows * kCols, 0.25f), out;
  v1::EncodedTensor msg;
  ASSERT_TRUE(g.Encode(grad, 2, 1, &msg).ok());
  ASSERT_TRUE(g.Decode(msg, 2, &out).ok());
  EXPECT_EQ(out.size(), grad.size());
  EXPECT_FALSE(g.Decode(msg, 3, &out).ok());
  msg.set_bits(9);
  EXPECT_FALSE(g.Decode(msg, 2, &out).ok());
}

// compression.bw_codec "tiled": one scale per token's tile of channels. On
// gradients whose size differs from token to token (as a loss's do), 4-bit
// tiles lose less than 4-bit per-channel fixed point, whose channel scale is
// set by the largest token; a link expecting tiled gradients refuses fixed
// point ones.
TEST(GradientCodecTest, TiledGradientsFollowEachTokensScale) {
  v1::LinkCompression fixed;
  fixed.set_mode(v1::LinkCompression::aqsgd);
  fixed.set_bw_bits(4);
  v1::LinkCompression tiled = fixed;
  tiled.set_bw_codec(v1::LinkCompression::BwCodec::tiled);
  tiled.set_tile_size(kCols);
  GradientCodec f(fixed, kRows, kCols), t(tiled, kRows, kCols);
  std::vector<float> grad;
  Rng rng(5);
  for (int64_t row = 0; row < kBatch * kRows; ++row) {
    const double size = std::ldexp(1.0, -static_cast<int>(row % 6));  // 1 .. 1/32
    for (int64_t c = 0; c < kCols; ++c) grad.push_back(static_cast<float>(size * (rng.UnitDouble() * 2 - 1)));
  }
  v1::EncodedTensor fmsg, tmsg;
  ASSERT_TRUE(f.Encode(grad, kBatch, 1, &fmsg).ok());
  ASSERT_TRUE(t.Encode(grad, kBatch, 1, &tmsg).ok());
  EXPECT_EQ(tmsg.codec(), v1::CODEC_TILED);
  std::vector<float> out;
  ASSERT_TRUE(t.Decode(tmsg, kBatch, &out).ok());
  ASSERT_EQ(out.size(), grad.size());
  const double fixed_err = f.stats().error_sq / f.stats().signal_sq;
  const double tiled_err = t.stats().error_sq / t.stats().signal_sq;
  EXPECT_LT(tiled_err * 2, fixed_err) << "relative squared error: tiled " << tiled_err << ", fixed " << fixed_err;
  const absl::Status refused = t.Decode(fmsg, kBatch, &out);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("is not the link's"), std::string::npos) << refused;
}

}  // namespace
}  // namespace aqswarm::pipeline
