#include "pipeline/link_endpoint.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "common/status_macros.h"
#include "compression/token_reference.h"

namespace aqswarm::pipeline {
namespace {

using compression::LinkMode;

bool Stateful(const LinkEndpointOptions& o) { return o.codec.mode == LinkMode::kAqsgd; }

uint32_t RowKey(uint64_t step, uint32_t mb, uint64_t sample) {
  return StreamKey(step * 0x10000 + mb, sample);
}

absl::StatusOr<std::unique_ptr<storage::Prefetcher>> MakePrefetcher(storage::MessageStore* store,
                                                                     const LinkEndpointOptions& o) {
  if (!Stateful(o)) return std::unique_ptr<storage::Prefetcher>();
  if (store == nullptr) return absl::InvalidArgumentError("aqsgd links need a message store");
  storage::Prefetcher::Options p;
  p.link = o.link;
  p.micro_batch = o.micro_batch;
  p.prefetch_batches = o.prefetch_batches;
  p.inline_read_bytes = o.inline_read_bytes;
  return storage::Prefetcher::Create(store, p);
}

void CountRow(const v1::AqsgdRow& row, int64_t values, LinkEndpointStats* s) {
  switch (row.kind()) {
    case v1::AqsgdRow::KIND_FULL: ++s->full_rows; break;
    case v1::AqsgdRow::KIND_DELTA: ++s->delta_rows; break;
    default: ++s->direct_rows; break;
  }
  s->payload_bytes += compression::EncodedBytes(row.tensor());
  s->raw_bytes += static_cast<uint64_t>(values) * 4;
}

// Adds ||a - rec||^2 and ||a||^2 to the error sums. Sixteen float lanes
// over blocks of 256 values, each block's sum then added in double: the
// compiler vectorises the lanes (a single double accumulator is a serial
// chain it may not reorder), and float error stays ~1e-6 relative per block,
// plenty for a metric.
void AddError(absl::Span<const float> a, absl::Span<const float> rec, double* error_sq, double* signal_sq) {
  constexpr size_t kLanes = 16, kBlock = 256;
  const float* pa = a.data();  // raw pointers: no per-element bounds checks
  const float* pr = rec.data();
  double e = 0, s = 0;
  size_t i = 0;
  for (; i + kBlock <= a.size(); i += kBlock) {
    float el[kLanes] = {}, sl[kLanes] = {};
    for (size_t j = i; j < i + kBlock; j += kLanes) {
      for (size_t k = 0; k < kLanes; ++k) {
        const float d = pa[j + k] - pr[j + k];
        el[k] += d * d;
        sl[k] += pa[j + k] * pa[j + k];
      }
    }
    for (size_t k = 0; k < kLanes; ++k) {
      e += el[k];
      s += sl[k];
    }
  }
  for (; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - rec[i];
    e += d * d;
    s += static_cast<double>(a[i]) * a[i];
  }
  *error_sq += e;
  *signal_sq += s;
}

// What the receiver of `row` reconstructs for `a`: m after the update for
// AQ-SGD rows, the decoded row for DIRECT ones.
absl::Status AddRowError(const v1::AqsgdRow& row, absl::Span<const float> a, absl::Span<const float> m,
                         std::vector<float>* scratch, LinkEndpointStats* s) {
  if (row.kind() != v1::AqsgdRow::KIND_DIRECT) {
    AddError(a, m, &s->error_sq, &s->signal_sq);
    return absl::OkStatus();
  }
  scratch->resize(a.size());
  AQSWARM_RETURN_IF_ERROR(compression::Decode(row.tensor(), absl::MakeSpan(*scratch)));
  AddError(a, *scratch, &s->error_sq, &s->signal_sq);
  return absl::OkStatus();
}

// Starts an endpoint's epoch: resident if it fits, else streamed through the
// prefetcher. Going resident, the prefetcher's queued writes reach the store
// first: resident rows are read from the store directly.
absl::Status StartEndpointEpoch(ResidentRows* resident, storage::Prefetcher* prefetcher, uint64_t budget,
                                std::vector<uint64_t> order) {
  if (prefetcher == nullptr) return absl::OkStatus();
  const bool was = resident->active();
  AQSWARM_ASSIGN_OR_RETURN(const bool now, resident->StartEpoch(order, budget));
  if (now) return was ? absl::OkStatus() : prefetcher->Flush();
  return prefetcher->SetOrder(std::move(order));
}

// Close of an endpoint: resident rows back to the store, then the
// prefetcher's queued writes.
absl::Status CloseEndpoint(std::unique_ptr<ResidentRows>* resident, std::unique_ptr<storage::Prefetcher>* prefetcher) {
  absl::Status s;
  if (*resident != nullptr) s.Update((*resident)->WriteBack(nullptr));
  resident->reset();
  if (*prefetcher == nullptr) return s;
  s.Update((*prefetcher)->Close());
  prefetcher->reset();
  return s;
}

}  // namespace

class LinkReference {
 public:
  // Null unless the options ask for a reference.
  static absl::StatusOr<std::unique_ptr<LinkReference>> Create(const LinkEndpointOptions& o) {
    if (!o.first_visit_reference) return nullptr;
    if (o.codec.mode != compression::LinkMode::kAqsgd || !o.codec.first_visit.has_value()) {
      return absl::InvalidArgumentError("a first-visit reference needs AQ-SGD links with a first-visit codec");
    }
    if (!o.tokens || o.vocab <= 0) {
      return absl::InvalidArgumentError("a first-visit reference needs the samples' tokens and the vocabulary size");
    }
    return std::unique_ptr<LinkReference>(new LinkReference(o));
  }

  // Commits the last step's records when `step` is a new one, then loads the
  // tokens of the micro-batch's samples.
  absl::Status Begin(uint64_t step, absl::Span<const uint64_t> samples) {
    if (step_.has_value() && *step_ != step) {
      table_.Commit();
      referenced_.clear();
    }
    step_ = step;
    tokens_.clear();
    AQSWARM_RETURN_IF_ERROR(tokens_fn_(samples, &tokens_));
    if (tokens_.size() != samples.size() * static_cast<size_t>(rows_)) {
      return absl::InternalError(absl::StrCat("token source gave ", tokens_.size(), " tokens for ", samples.size(),
                                              " samples of ", rows_));
    }
    return absl::OkStatus();
  }
  // R of the micro-batch's sample i (valid until the next call).
  absl::StatusOr<absl::Span<const float>> For(size_t i) {
    AQSWARM_RETURN_IF_ERROR(table_.Gather(Tokens(i), absl::MakeSpan(r_)));
    return absl::MakeConstSpan(r_);
  }
  // Sample i's row ended FULL with `m`.
  absl::Status Record(uint32_t micro_batch, size_t i, absl::Span<const float> m) {
    return table_.Record(micro_batch, static_cast<uint32_t>(i), Tokens(i), m);
  }
  // Sender: `sample` of `micro_batch` went with the reference this step.
  void Referenced(uint32_t micro_batch, uint64_t sample) { referenced_.insert({micro_batch, sample}); }
  // Sender: a resend of `sample`; one that had gone with the reference means
  // the receiver's table differs, and has reset itself: reset too.
  void Resending(uint32_t micro_batch, uint64_t sample) {
    if (referenced_.contains({micro_batch, sample})) table_.Reset();
  }
  // Receiver: a row's reference did not match.
  void Mismatch() { table_.Reset(); }

 private:
  explicit LinkReference(const LinkEndpointOptions& o)
      : table_(o.vocab, o.link.rows, o.link.cols),
        tokens_fn_(o.tokens),
        rows_(o.link.rows),
        r_(static_cast<size_t>(o.link.num_values())) {}
  absl::Span<const int32_t> Tokens(size_t i) const {
    return absl::MakeConstSpan(tokens_).subspan(i * static_cast<size_t>(rows_), static_cast<size_t>(rows_));
  }

  compression::TokenReference table_;
  std::function<absl::Status(absl::Span<const uint64_t>, std::vector<int32_t>*)> tokens_fn_;
  const int64_t rows_;
  std::optional<uint64_t> step_;
  absl::flat_hash_set<std::pair<uint32_t, uint64_t>> referenced_;
  std::vector<int32_t> tokens_;
  std::vector<float> r_;
};

// ---------------------------------------------------------------- resident rows

absl::StatusOr<bool> ResidentRows::StartEpoch(const std::vector<uint64_t>& order, uint64_t budget) {
  const absl::flat_hash_set<uint64_t> wanted(order.begin(), order.end());
  const uint64_t fit = budget / (static_cast<uint64_t>(link_.num_values()) * sizeof(float));  // rows
  active_ = budget > 0 && wanted.size() <= fit;
  if (!active_) {
    AQSWARM_RETURN_IF_ERROR(WriteBack(nullptr));
    return false;
  }
  // Rows of samples this epoch does not have (a DP grid deals each epoch's
  // samples anew) stay while all fit; else back to the store, out of memory.
  size_t total = rows_.size();
  for (uint64_t sample : wanted) total += rows_.count(sample) == 0 ? 1 : 0;
  if (total > fit) AQSWARM_RETURN_IF_ERROR(WriteBack(&wanted));
  return true;
}

ResidentRows::Row* ResidentRows::Allocate() {
  if (free_.empty()) {
    const uint64_t n = link_.num_values();
    const uint64_t per_slab = std::max<uint64_t>(1, kSlabBytes / (n * sizeof(float)));
    Slab slab{std::make_unique<float[]>(per_slab * n), std::make_unique<Row[]>(per_slab)};
    for (uint64_t k = per_slab; k-- > 0;) {
      slab.rows[k].m = absl::MakeSpan(slab.values.get() + k * n, n);
      free_.push_back(&slab.rows[k]);
    }
    slabs_.push_back(std::move(slab));
  }
  Row* row = free_.back();
  free_.pop_back();
  std::fill(row->m.begin(), row->m.end(), 0.0f);
  row->checksum = 0;
  row->present = false;
  row->dirty = false;
  return row;
}

void ResidentRows::Drop(uint64_t sample) {
  auto it = rows_.find(sample);
  if (it == rows_.end()) return;
  free_.push_back(it->second);
  rows_.erase(it);
}

absl::Status ResidentRows::Rows(absl::Span<const uint64_t> samples, std::vector<Row*>* rows) {
  rows->resize(samples.size());
  std::vector<uint64_t> load;
  std::vector<Row*> loaded;
  std::vector<absl::Span<float>> out;
  for (size_t i = 0; i < samples.size(); ++i) {
    auto [it, inserted] = rows_.try_emplace(samples[i], nullptr);
    if (inserted) {
      it->second = Allocate();
      load.push_back(samples[i]);
      loaded.push_back(it->second);
      out.push_back(it->second->m);
    }
    (*rows)[i] = it->second;
  }
  if (load.empty()) return absl::OkStatus();
  std::vector<storage::RowRead> reads(load.size());
  AQSWARM_RETURN_IF_ERROR(store_->GetBatch(link_, load, out, absl::MakeSpan(reads)));
  for (size_t j = 0; j < load.size(); ++j) {
    if (reads[j].status.ok()) {
      loaded[j]->present = true;
      loaded[j]->checksum = reads[j].payload_checksum;
    } else if (!storage::IsUnseen(reads[j].status)) {
      // An I/O error: forget this batch's rows not yet taken in, so that
      // the next use reads them again.
      for (size_t k = j; k < load.size(); ++k) Drop(load[k]);
      return reads[j].status;
    }
  }
  return absl::OkStatus();
}

absl::Status ResidentRows::WriteBack(const absl::flat_hash_set<uint64_t>* keep) {
  std::vector<uint64_t> leaving, ids;
  std::vector<Row*> dirty;
  std::vector<absl::Span<const float>> values;
  for (const auto& [sample, row] : rows_) {
    if (keep != nullptr && keep->contains(sample)) continue;
    leaving.push_back(sample);
    if (!row->dirty) continue;
    ids.push_back(sample);
    dirty.push_back(row);
    values.push_back(row->m);
  }
  constexpr size_t kBatch = 64;  // rows per store batch
  for (size_t b = 0; b < ids.size(); b += kBatch) {
    const size_t n = std::min(kBatch, ids.size() - b);
    AQSWARM_RETURN_IF_ERROR(store_->PutBatch(link_, absl::MakeConstSpan(ids).subspan(b, n),
                                             absl::MakeConstSpan(values).subspan(b, n)));
    for (size_t k = b; k < b + n; ++k) dirty[k]->dirty = false;
  }
  for (uint64_t id : leaving) Drop(id);
  if (rows_.empty()) {
    free_.clear();
    slabs_.clear();
  }
  if (keep == nullptr) active_ = false;
  return absl::OkStatus();
}

void ResidentRows::Updated(Row* row) {
  row->present = true;
  row->dirty = true;
  row->checksum = compression::AqsgdLinkCodec::RowChecksum(link_.precision, link_.rows, link_.cols, row->m, &scratch_);
}

absl::StatusOr<RowPrecision> StoredRowPrecision(const v1::LinkCompression& c) {
  switch (c.m_precision()) {
    case v1::LinkCompression::MPrecision::fp32: return RowPrecision::kFloat32;
    case v1::LinkCompression::MPrecision::fp16: return RowPrecision::kFloat16;
    case v1::LinkCompression::MPrecision::int8: return RowPrecision::kInt8;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("compression.m_precision ", c.m_precision(), " is not fp32, fp16 or int8"));
  }
}

namespace {

compression::TileRotation TileRotationOf(const v1::LinkCompression& c) {
  switch (c.rotation()) {
    case v1::LinkCompression::Rotation::none: return compression::TileRotation::kNone;
    case v1::LinkCompression::Rotation::all: return compression::TileRotation::kAll;
    default: return compression::TileRotation::kOutliers;  // outliers, and unset (the default)
  }
}

}  // namespace

compression::CodecOptions TiledCodecOptions(const v1::LinkCompression& c, int bits) {
  compression::CodecOptions o;
  o.codec = v1::CODEC_TILED;
  o.bits = bits;
  o.bucket_size = c.tile_size() ? c.tile_size() : kDefaultTileSize;
  o.rotation = TileRotationOf(c);
  o.tile_order = c.tile_along() == v1::LinkCompression::TileAlong::tokens ? v1::TILES_DOWN_COLUMNS : v1::TILES_ALONG_ROWS;
  o.tile_grid = c.tile_grid() == v1::LinkCompression::TileGrid::midtread ? v1::TILE_GRID_MIDTREAD : v1::TILE_GRID_MIDRISE;
  o.min_compress_elements = 1;
  o.entropy = c.entropy_coding();
  return o;
}

absl::StatusOr<LinkEndpointOptions> LinkOptionsFromJob(const v1::JobSpec& job, uint32_t pipeline,
                                                       uint32_t boundary, uint64_t generation) {
  LinkEndpointOptions o;
  o.link.link = {pipeline, boundary};
  o.link.generation = generation;
  o.link.rows = job.model().seq_len();
  o.link.cols = job.model().d_model();
  AQSWARM_ASSIGN_OR_RETURN(o.link.precision, StoredRowPrecision(job.compression()));
  switch (job.compression().mode()) {
    case v1::LinkCompression::aqsgd: o.codec.mode = LinkMode::kAqsgd; break;
    case v1::LinkCompression::directq: o.codec.mode = LinkMode::kDirectQ; break;
    default: o.codec.mode = LinkMode::kFp32; break;
  }
  const v1::LinkCompression& c = job.compression();
  if (c.mode() == v1::LinkCompression::tiled) {
    o.codec.mode = LinkMode::kDirectQ;
    o.codec.quantizer = TiledCodecOptions(c, static_cast<int>(c.fw_bits()));
  } else {
    o.codec.quantizer.codec = v1::CODEC_FIXED_POINT;
    o.codec.quantizer.bits = static_cast<int>(c.fw_bits());
    // A link row is one sample's activations: always quantize it, however small
    // (the codec's default raw pass-through for tiny tensors is meant for
    // biases and norms, not for rows; below 1024 values it silently sent fp32).
    o.codec.quantizer.min_compress_elements = 1;
    o.codec.quantizer.entropy = c.entropy_coding();
  }
  const int first_visit_bits = static_cast<int>(c.first_visit_bits() ? c.first_visit_bits() : c.fw_bits());
  if (c.mode() == v1::LinkCompression::aqsgd && c.first_visit() == v1::LinkCompression::FirstVisit::tiled) {
    o.codec.first_visit = TiledCodecOptions(c, first_visit_bits);
  } else if (c.mode() == v1::LinkCompression::aqsgd && c.first_visit() == v1::LinkCompression::FirstVisit::fixed_point) {
    o.codec.first_visit = o.codec.quantizer;  // the deltas' codec (per-channel fixed point), at its own bits
    o.codec.first_visit->bits = first_visit_bits;
  }
  o.codec.stored = o.link.precision;
  o.codec.warmup_epochs = job.compression().warmup_epochs();
  if (job.compression().has_resident_bytes()) o.resident_bytes = job.compression().resident_bytes();
  o.micro_batch = job.micro_batch_size();
  o.first_visit_reference = c.first_visit_reference();
  o.vocab = job.model().vocab_size();
  return o;
}

// ---------------------------------------------------------------- sender

ActivationSender::ActivationSender(storage::MessageStore* store, const LinkEndpointOptions& options)
    : options_(options), store_(store) {}

ActivationSender::~ActivationSender() { Close().IgnoreError(); }

absl::StatusOr<std::unique_ptr<ActivationSender>> ActivationSender::Create(storage::MessageStore* store,
                                                                           const LinkEndpointOptions& options) {
  std::unique_ptr<ActivationSender> s(new ActivationSender(store, options));
  AQSWARM_ASSIGN_OR_RETURN(s->codec_, compression::AqsgdLinkCodec::Create(options.codec));
  AQSWARM_ASSIGN_OR_RETURN(s->reference_, LinkReference::Create(options));
  AQSWARM_ASSIGN_OR_RETURN(s->prefetcher_, MakePrefetcher(store, options));
  if (s->prefetcher_ != nullptr) s->resident_ = std::make_unique<ResidentRows>(store, options.link);
  return s;
}

absl::Status ActivationSender::StartEpoch(std::vector<uint64_t> order) {
  return StartEndpointEpoch(resident_.get(), prefetcher_.get(), options_.resident_bytes, std::move(order));
}

absl::Status ActivationSender::Encode(uint64_t step, uint32_t mb, uint32_t epoch, absl::Span<const uint64_t> samples,
                                      absl::Span<const float> acts, v1::ActivationBatch* out) {
  const int64_t n = options_.link.num_values();
  if (static_cast<int64_t>(acts.size()) != n * static_cast<int64_t>(samples.size())) {
    return absl::InvalidArgumentError(absl::StrCat("activations hold ", acts.size(), " values, expected ",
                                                   samples.size(), " rows of ", n));
  }
  out->Clear();
  out->set_step(step);
  out->set_micro_batch(mb);
  out->set_epoch(epoch);
  if (reference_ != nullptr) AQSWARM_RETURN_IF_ERROR(reference_->Begin(step, samples));
  if (resident_ != nullptr && resident_->active()) {
    // m updated in place. Should a row fail (m unchanged), the rows before it
    // have moved on without being sent: the receiver's checksum check asks
    // for them again (RESEND).
    AQSWARM_RETURN_IF_ERROR(resident_->Rows(samples, &rows_));
    for (size_t i = 0; i < samples.size(); ++i) {
      ResidentRows::Row* r = rows_[i];
      compression::RowContext ctx;
      ctx.seen = r->present;
      if (ctx.seen) ctx.m_checksum = r->checksum;
      ctx.epoch = epoch;
      ctx.sample_id = samples[i];
      if (reference_ != nullptr) {
        AQSWARM_ASSIGN_OR_RETURN(ctx.reference, reference_->For(i));
      }
      v1::AqsgdRow* row = out->add_rows();
      AQSWARM_RETURN_IF_ERROR(codec_->EncodeRow(ctx, acts.subspan(i * n, n), options_.link.rows, options_.link.cols,
                                                absl::MakeSpan(r->m), RowKey(step, mb, samples[i]), row));
      resident_->Updated(r);
      if (reference_ != nullptr && row->kind() == v1::AqsgdRow::KIND_FULL) {
        AQSWARM_RETURN_IF_ERROR(reference_->Record(mb, i, r->m));
        if (row->has_reference_checksum()) reference_->Referenced(mb, samples[i]);
      }
      CountRow(*row, n, &stats_);
      AQSWARM_RETURN_IF_ERROR(AddRowError(*row, acts.subspan(i * n, n), r->m, &decoded_, &stats_));
    }
    return absl::OkStatus();
  }
  std::vector<std::vector<float>> rows;
  std::vector<storage::RowRead> reads(samples.size());
  if (prefetcher_ != nullptr) {
    AQSWARM_RETURN_IF_ERROR(prefetcher_->TakeBatch(samples, &rows, absl::MakeSpan(reads)));
  }
  for (size_t i = 0; i < samples.size(); ++i) {
    // The stateless modes keep no m: their rows are DIRECT.
    const absl::Span<float> m = prefetcher_ != nullptr ? absl::MakeSpan(rows[i]) : absl::Span<float>();
    if (!reads[i].status.ok() && !storage::IsUnseen(reads[i].status)) return reads[i].status;
    compression::RowContext ctx;
    ctx.seen = reads[i].status.ok() && prefetcher_ != nullptr;
    if (ctx.seen) ctx.m_checksum = reads[i].payload_checksum;  // the store's: no hashing here
    ctx.epoch = epoch;
    ctx.sample_id = samples[i];
    if (reference_ != nullptr) {
      AQSWARM_ASSIGN_OR_RETURN(ctx.reference, reference_->For(i));
    }
    v1::AqsgdRow* row = out->add_rows();
    AQSWARM_RETURN_IF_ERROR(codec_->EncodeRow(ctx, acts.subspan(i * n, n), options_.link.rows, options_.link.cols,
                                              m, RowKey(step, mb, samples[i]), row));
    if (reference_ != nullptr && row->kind() == v1::AqsgdRow::KIND_FULL) {
      AQSWARM_RETURN_IF_ERROR(reference_->Record(mb, i, m));
      if (row->has_reference_checksum()) reference_->Referenced(mb, samples[i]);
    }
    CountRow(*row, n, &stats_);
    AQSWARM_RETURN_IF_ERROR(AddRowError(*row, acts.subspan(i * n, n), m, &decoded_, &stats_));
  }
  if (prefetcher_ != nullptr) AQSWARM_RETURN_IF_ERROR(prefetcher_->PutBatch(samples, std::move(rows)));
  return absl::OkStatus();
}

absl::Status ActivationSender::EncodeResend(uint64_t step, uint32_t mb, uint32_t epoch,
                                            absl::Span<const uint64_t> samples, absl::Span<const float> acts,
                                            absl::Span<const uint64_t> resend_ids, v1::ActivationBatch* out) {
  const int64_t n = options_.link.num_values();
  out->Clear();
  out->set_step(step);
  out->set_micro_batch(mb);
  out->set_epoch(epoch);
  out->set_resend(true);
  if (reference_ != nullptr) AQSWARM_RETURN_IF_ERROR(reference_->Begin(step, samples));
  std::vector<uint64_t> ids;
  std::vector<std::vector<float>> rows;
  for (uint64_t id : resend_ids) {
    auto it = std::find(samples.begin(), samples.end(), id);
    if (it == samples.end()) {
      return absl::InvalidArgumentError(absl::StrCat("resend asks for sample ", id, ", not in micro-batch ", mb));
    }
    if (std::find(ids.begin(), ids.end(), id) != ids.end()) continue;
    const size_t i = it - samples.begin();
    if (reference_ != nullptr) reference_->Resending(mb, id);
    compression::RowContext ctx;
    ctx.seen = true;
    ctx.force_full = true;
    ctx.epoch = epoch;
    ctx.sample_id = id;
    const bool resident = resident_ != nullptr && resident_->active();
    if (resident) {
      AQSWARM_RETURN_IF_ERROR(resident_->Rows(absl::MakeConstSpan(&id, 1), &rows_));
    } else {
      rows.emplace_back(n);
    }
    absl::Span<float> m = resident ? absl::MakeSpan(rows_[0]->m) : absl::MakeSpan(rows.back());
    v1::AqsgdRow* row = out->add_rows();
    AQSWARM_RETURN_IF_ERROR(
        codec_->EncodeRow(ctx, acts.subspan(i * n, n), options_.link.rows, options_.link.cols, m, RowKey(step, mb, id), row));
    if (resident) resident_->Updated(rows_[0]);
    if (reference_ != nullptr) AQSWARM_RETURN_IF_ERROR(reference_->Record(mb, i, m));  // a resend is FULL
    CountRow(*row, n, &stats_);
    AQSWARM_RETURN_IF_ERROR(AddRowError(*row, acts.subspan(i * n, n), m, &decoded_, &stats_));
    ++stats_.resend_rows;
    ids.push_back(id);
  }
  if (prefetcher_ != nullptr && !rows.empty()) AQSWARM_RETURN_IF_ERROR(prefetcher_->PutBatch(ids, std::move(rows)));
  return absl::OkStatus();
}

absl::Status ActivationSender::EncodeEval(uint64_t step, uint32_t mb, absl::Span<const float> acts, int64_t batch,
                                          v1::ActivationBatch* out) {
  const int64_t n = options_.link.num_values();
  if (static_cast<int64_t>(acts.size()) != n * batch) return absl::InvalidArgumentError("eval activations: bad size");
  out->Clear();
  out->set_step(step);
  out->set_micro_batch(mb);
  out->set_eval(true);
  compression::CodecOptions raw;
  raw.codec = v1::CODEC_RAW_F32;
  for (int64_t i = 0; i < batch; ++i) {
    v1::AqsgdRow* row = out->add_rows();
    row->set_kind(v1::AqsgdRow::KIND_DIRECT);
    AQSWARM_RETURN_IF_ERROR(compression::Encode(raw, acts.subspan(i * n, n), {options_.link.rows, options_.link.cols},
                                                0, row->mutable_tensor()));
  }
  return absl::OkStatus();
}

storage::PrefetcherStats ActivationSender::prefetcher_stats() const {
  return prefetcher_ != nullptr ? prefetcher_->GetStats() : storage::PrefetcherStats();
}

absl::Status ActivationSender::Close() { return CloseEndpoint(&resident_, &prefetcher_); }

// ---------------------------------------------------------------- receiver

ActivationReceiver::ActivationReceiver(storage::MessageStore* store, const LinkEndpointOptions& options)
    : options_(options), store_(store) {}

ActivationReceiver::~ActivationReceiver() { Close().IgnoreError(); }

absl::StatusOr<std::unique_ptr<ActivationReceiver>> ActivationReceiver::Create(storage::MessageStore* store,
                                                                               const LinkEndpointOptions& options) {
  std::unique_ptr<ActivationReceiver> r(new ActivationReceiver(store, options));
  AQSWARM_ASSIGN_OR_RETURN(r->codec_, compression::AqsgdLinkCodec::Create(options.codec));
  AQSWARM_ASSIGN_OR_RETURN(r->reference_, LinkReference::Create(options));
  AQSWARM_ASSIGN_OR_RETURN(r->prefetcher_, MakePrefetcher(store, options));
  if (r->prefetcher_ != nullptr) r->resident_ = std::make_unique<ResidentRows>(store, options.link);
  return r;
}

absl::Status ActivationReceiver::StartEpoch(std::vector<uint64_t> order) {
  return StartEndpointEpoch(resident_.get(), prefetcher_.get(), options_.resident_bytes, std::move(order));
}

absl::Status ActivationReceiver::Begin(uint64_t step, uint32_t mb, absl::Span<const uint64_t> samples) {
  if (active_) return absl::FailedPreconditionError("previous micro-batch not taken");
  step_ = step;
  micro_batch_ = mb;
  samples_.assign(samples.begin(), samples.end());
  reads_.assign(samples.size(), storage::RowRead());
  done_.assign(samples.size(), false);
  dirty_.assign(samples.size(), false);
  full_.assign(samples.size(), false);
  rows_.clear();
  if (reference_ != nullptr) AQSWARM_RETURN_IF_ERROR(reference_->Begin(step, samples));
  if (resident_ != nullptr && resident_->active()) {
    AQSWARM_RETURN_IF_ERROR(resident_->Rows(samples, &rows_));
    for (size_t i = 0; i < samples.size(); ++i) {
      if (!rows_[i]->present) reads_[i].status = absl::NotFoundError("unseen");
      reads_[i].payload_checksum = rows_[i]->checksum;
    }
  } else if (prefetcher_ != nullptr) {
    AQSWARM_RETURN_IF_ERROR(prefetcher_->TakeBatch(samples, &m_, absl::MakeSpan(reads_)));
    for (const auto& r : reads_) {
      if (!r.status.ok() && !storage::IsUnseen(r.status)) return r.status;
    }
  } else {
    // Decoded rows land here; the buffers are kept from one micro-batch to
    // the next (every row is written before Take reads it).
    m_.resize(samples.size());
    for (std::vector<float>& row : m_) row.resize(options_.link.num_values());
  }
  active_ = true;
  return absl::OkStatus();
}

absl::Status ActivationReceiver::Apply(const v1::ActivationBatch& batch, std::vector<uint64_t>* missing) {
  if (!active_) return absl::FailedPreconditionError("activation batch with no micro-batch expected");
  if (batch.step() != step_ || batch.micro_batch() != micro_batch_) {
    return absl::InvalidArgumentError(absl::StrCat("out-of-order activations: got step ", batch.step(),
                                                   " micro-batch ", batch.micro_batch(), ", expected step ", step_,
                                                   " micro-batch ", micro_batch_));
  }
  if (batch.eval()) return absl::InvalidArgumentError("eval batch where a training batch was expected");
  if (!batch.resend() && batch.rows_size() != static_cast<int>(samples_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("batch has ", batch.rows_size(), " rows, micro-batch has ",
                                                   samples_.size(), " samples"));
  }
  const bool stateful = prefetcher_ != nullptr;
  // Validate every row's identity before changing anything.
  std::vector<size_t> index(batch.rows_size());
  for (int r = 0; r < batch.rows_size(); ++r) {
    const v1::AqsgdRow& row = batch.rows(r);
    auto it = std::find(samples_.begin(), samples_.end(), row.sample_id());
    if (it == samples_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("row for sample ", row.sample_id(), " not in micro-batch ",
                                                     micro_batch_));
    }
    index[r] = it - samples_.begin();
    if (std::count(index.begin(), index.begin() + r, index[r]) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("sample ", row.sample_id(), " appears twice"));
    }
    const auto kind = row.kind();
    const bool ok_kind = stateful ? (kind == v1::AqsgdRow::KIND_FULL || (!batch.resend() && kind == v1::AqsgdRow::KIND_DELTA))
                                  : (kind == v1::AqsgdRow::KIND_DIRECT && !batch.resend());
    if (!ok_kind) {
      return absl::InvalidArgumentError(absl::StrCat("row kind ", v1::AqsgdRow::Kind_Name(kind),
                                                     batch.resend() ? " in a resend" : "", " not allowed on this link"));
    }
    if (batch.resend() && done_[index[r]]) {
      return absl::InvalidArgumentError(absl::StrCat("resend of sample ", row.sample_id(), " that was applied"));
    }
  }
  for (int r = 0; r < batch.rows_size(); ++r) {
    const size_t i = index[r];
    const bool delta = stateful && batch.rows(r).kind() == v1::AqsgdRow::KIND_DELTA;
    compression::ReceiveResult res = compression::ReceiveResult::kResendNeeded;
    if (!delta || reads_[i].status.ok()) {  // a DELTA with no m here (unseen, corrupt) needs a RESEND
      std::optional<uint64_t> m_checksum;  // the store's, for a DELTA: no hashing here
      if (delta) m_checksum = reads_[i].payload_checksum;
      absl::Span<const float> reference;
      if (reference_ != nullptr && batch.rows(r).has_reference_checksum()) {
        AQSWARM_ASSIGN_OR_RETURN(reference, reference_->For(i));
      }
      absl::StatusOr<compression::ReceiveResult> decoded =
          codec_->DecodeRow(batch.rows(r), options_.link.rows, options_.link.cols, Row(i), m_checksum, reference);
      if (!decoded.ok()) {
        // The row's m is unchanged (DecodeRow); rows before it were applied.
        absl::Status s(decoded.status().code(),
                       absl::StrCat("row of sample ", batch.rows(r).sample_id(), " (",
                                    v1::AqsgdRow::Kind_Name(batch.rows(r).kind()), "): ", decoded.status().message()));
        decoded.status().ForEachPayload(
            [&](absl::string_view url, const absl::Cord& payload) { s.SetPayload(url, payload); });
        return s;
      }
      res = *decoded;
    }
    CountRow(batch.rows(r), options_.link.num_values(), &stats_);
    if (res == compression::ReceiveResult::kResendNeeded && reference_ != nullptr &&
        batch.rows(r).has_reference_checksum()) {
      reference_->Mismatch();
    }
    if (res == compression::ReceiveResult::kApplied) {
      done_[i] = true;
      dirty_[i] = stateful;
      full_[i] = batch.rows(r).kind() == v1::AqsgdRow::KIND_FULL;
      if (!rows_.empty()) resident_->Updated(rows_[i]);
    } else {
      ++stats_.resend_rows;
    }
  }
  missing->clear();
  for (size_t i = 0; i < samples_.size(); ++i) {
    if (!done_[i]) missing->push_back(samples_[i]);
  }
  return absl::OkStatus();
}

absl::Status ActivationReceiver::Take(std::vector<float>* acts) {
  if (!active_) return absl::FailedPreconditionError("no micro-batch to take");
  for (size_t i = 0; i < samples_.size(); ++i) {
    if (!done_[i]) return absl::FailedPreconditionError(absl::StrCat("sample ", samples_[i], " not received"));
  }
  const int64_t n = options_.link.num_values();
  acts->resize(samples_.size() * n);
  for (size_t i = 0; i < samples_.size(); ++i) std::memcpy(acts->data() + i * n, Row(i).data(), n * sizeof(float));
  if (reference_ != nullptr) {
    for (size_t i = 0; i < samples_.size(); ++i) {
      if (full_[i]) AQSWARM_RETURN_IF_ERROR(reference_->Record(micro_batch_, i, Row(i)));
    }
  }
  active_ = false;
  if (!rows_.empty()) return absl::OkStatus();  // resident: updated in place
  if (prefetcher_ != nullptr) {
    std::vector<uint64_t> ids;
    std::vector<std::vector<float>> rows;
    for (size_t i = 0; i < samples_.size(); ++i) {
      if (!dirty_[i]) continue;
      ids.push_back(samples_[i]);
      rows.push_back(std::move(m_[i]));
    }
    AQSWARM_RETURN_IF_ERROR(prefetcher_->PutBatch(ids, std::move(rows)));
  }
  return absl::OkStatus();
}

absl::Status ActivationReceiver::ApplyEval(const v1::ActivationBatch& batch, int64_t batch_size,
                                           std::vector<float>* acts) {
  if (!batch.eval()) return absl::InvalidArgumentError("expected an eval batch");
  if (batch.rows_size() != batch_size) {
    return absl::InvalidArgumentError(absl::StrCat("eval batch has ", batch.rows_size(), " rows, expected ", batch_size));
  }
  const int64_t n = options_.link.num_values();
  acts->resize(batch_size * n);
  for (int64_t i = 0; i < batch_size; ++i) {
    const v1::EncodedTensor& t = batch.rows(i).tensor();
    if (batch.rows(i).kind() != v1::AqsgdRow::KIND_DIRECT || t.codec() != v1::CODEC_RAW_F32 ||
        t.shape_size() != 2 || t.shape(0) != options_.link.rows || t.shape(1) != options_.link.cols) {
      return absl::InvalidArgumentError("eval rows must be raw float32 [seq_len, d_model]");
    }
    AQSWARM_RETURN_IF_ERROR(compression::Decode(t, absl::MakeSpan(acts->data() + i * n, n)));
  }
  return absl::OkStatus();
}

storage::PrefetcherStats ActivationReceiver::prefetcher_stats() const {
  return prefetcher_ != nullptr ? prefetcher_->GetStats() : storage::PrefetcherStats();
}

absl::Status ActivationReceiver::Close() { return CloseEndpoint(&resident_, &prefetcher_); }

absl::Span<float> ActivationReceiver::Row(size_t i) {
  return rows_.empty() ? absl::MakeSpan(m_[i]) : absl::MakeSpan(rows_[i]->m);
}

// ---------------------------------------------------------------- gradients

GradientCodec::GradientCodec(const v1::LinkCompression& compression, int64_t seq_len, int64_t d_model)
    : seq_len_(seq_len), d_model_(d_model) {
  if (compression.mode() == v1::LinkCompression::fp32 ||
      compression.mode() == v1::LinkCompression::MODE_UNSPECIFIED) {
    options_.codec = v1::CODEC_RAW_F32;
  } else if (compression.mode() == v1::LinkCompression::tiled || compression.bw_codec() == v1::LinkCompression::BwCodec::tiled) {
    options_ = TiledCodecOptions(compression, static_cast<int>(compression.bw_bits()));
  } else {
    options_.codec = v1::CODEC_FIXED_POINT;
    options_.bits = static_cast<int>(compression.bw_bits());
    options_.min_compress_elements = 1;
    options_.entropy = compression.entropy_coding();
  }
}

absl::Status GradientCodec::Encode(absl::Span<const float> grad, int64_t batch, uint32_t rng_key,
                                   v1::EncodedTensor* out) const {
  AQSWARM_RETURN_IF_ERROR(compression::Encode(options_, grad, {batch, seq_len_, d_model_}, rng_key, out));
  ++stats_.tensors;
  stats_.payload_bytes += compression::EncodedBytes(*out);
  stats_.raw_bytes += grad.size() * sizeof(float);
  if (out->codec() == v1::CODEC_RAW_F32) {
    AddError(grad, grad, &stats_.error_sq, &stats_.signal_sq);
  } else {
    decoded_.resize(grad.size());
    AQSWARM_RETURN_IF_ERROR(compression::Decode(*out, absl::MakeSpan(decoded_)));
    AddError(grad, decoded_, &stats_.error_sq, &stats_.signal_sq);
  }
  return absl::OkStatus();
}

absl::Status GradientCodec::Decode(const v1::EncodedTensor& msg, int64_t batch, std::vector<float>* out) const {
  if (msg.shape_size() != 3 || msg.shape(0) != batch || msg.shape(1) != seq_len_ || msg.shape(2) != d_model_) {
    return absl::InvalidArgumentError(absl::StrCat("gradient shape must be [", batch, ",", seq_len_, ",", d_model_,
                                                   "]"));
  }
  // Tiny tensors travel raw whatever the codec (compression/codec.h).
  if (msg.codec() != options_.codec && msg.codec() != v1::CODEC_RAW_F32) {
    return absl::InvalidArgumentError(absl::StrCat("gradient codec ", compression::CodecName(msg.codec()),
                                                   " is not the link's ", compression::CodecName(options_.codec)));
  }
  std::vector<float> tmp(static_cast<size_t>(batch * seq_len_ * d_model_));
  AQSWARM_RETURN_IF_ERROR(compression::Decode(msg, absl::MakeSpan(tmp)));
  *out = std::move(tmp);
  return absl::OkStatus();
}

}  // namespace aqswarm::pipeline
