// Writes the seed corpora of the fuzz targets (fuzz/corpus/<target>/) from
// the real encoders, so that seeds are what honest peers, stores and
// operators produce:
//   build-fuzz/fuzz/fuzz_seed_gen fuzz/corpus     (scripts/fuzz.sh --seeds)
// Join tokens carry random nonces and job defaults follow the code, so a
// rerun rewrites some seeds; the rest are the same bytes every time.
#include <sys/stat.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/join_token.h"
#include "common/row_format.h"
#include "compression/aqsgd_codec.h"
#include "compression/codec.h"
#include "compression/global_qsgd.h"
#include "coordinator/coordinator_state.h"
#include "fuzz/exchange_fuzz_config.h"
#include "fuzz/fuzz_input.h"
#include "pipeline/dp_allreduce.h"
#include "pipeline/job_spec.h"
#include "pipeline/link_endpoint.h"
#include "pipeline/safetensors.h"
#include "proto/state.pb.h"
#include "common/checksum.h"
#include "storage/memory_message_store.h"
#include "storage/row_codec.h"
#include "storage/state_store.h"

using namespace aqswarm;
namespace fs = std::filesystem;

namespace {

std::string g_root;

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::cerr << "fuzz_seed_gen: " << what << ": " << s << "\n";
    std::exit(1);
  }
}

void Write(const std::string& target, int index, const std::string& bytes) {
  const fs::path dir = fs::path(g_root) / target;
  fs::create_directories(dir);
  char name[32];
  std::snprintf(name, sizeof name, "seed-%02d", index);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

std::vector<float> Values(size_t n, int salt) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<int>((i * 37 + salt * 11) % 101) - 50) / 25.0f;
  return v;
}

// The tiled codec on its midtread grid.
compression::CodecOptions MidtreadTiles(int bits, int64_t tile) {
  compression::CodecOptions o;
  o.codec = v1::CODEC_TILED;
  o.bits = bits;
  o.bucket_size = tile;
  o.tile_grid = v1::TILE_GRID_MIDTREAD;
  o.min_compress_elements = 1;
  return o;
}

void CodecSeeds() {
  int k = 0;
  const std::vector<float> v = Values(64, 1);
  const int64_t shape[] = {8, 8};
  for (v1::Codec c : {v1::CODEC_RAW_F32, v1::CODEC_RAW_F16, v1::CODEC_FIXED_POINT, v1::CODEC_QSGD,
                      v1::CODEC_MINMAX}) {
    for (bool checksum : {false, true}) {
      compression::CodecOptions o;
      o.codec = c;
      o.bits = 4;
      o.bucket_size = 16;
      o.min_compress_elements = 1;
      o.checksum = checksum;
      v1::EncodedTensor t;
      Check(compression::Encode(o, v, shape, 7, &t), "encode");
      Write("codec_decode", k++, t.SerializeAsString());
    }
  }
  for (v1::LevelFamily levels : {v1::LEVELS_UNIFORM, v1::LEVELS_EXPONENTIAL}) {
    compression::GlobalQsgdOptions o;
    o.bits = 8;
    o.levels = levels;
    o.bucket_size = 16;
    o.num_workers = 2;
    std::vector<float> scales(4);
    Check(compression::LocalBucketMaxAbs(v, 16, absl::MakeSpan(scales)), "max abs");
    v1::EncodedTensor t;
    Check(compression::EncodeGlobalQsgd(o, v, shape, scales, 3, &t), "global qsgd");
    Write("codec_decode", k++, t.SerializeAsString());
  }
  // The tiled codec (tiles of 16, every tile rotated), then zstd-coded codes
  // of a row zstd shrinks (three values repeated).
  std::vector<float> repeated(256);
  for (size_t i = 0; i < repeated.size(); ++i) repeated[i] = static_cast<float>(i % 3);
  const int64_t repeated_shape[] = {4, 64};
  for (bool entropy : {false, true}) {
    compression::CodecOptions o;
    o.codec = v1::CODEC_TILED;
    o.bits = 3;
    o.bucket_size = 16;
    o.rotation = compression::TileRotation::kAll;
    o.min_compress_elements = 1;
    o.entropy = entropy;
    v1::EncodedTensor t;
    Check(entropy ? compression::Encode(o, repeated, repeated_shape, 7, &t) : compression::Encode(o, v, shape, 7, &t),
          "tiled");
    if (entropy && t.entropy() != v1::ENTROPY_ZSTD) Check(absl::InternalError("zstd did not shrink the seed"), "zstd");
    Write("codec_decode", k++, t.SerializeAsString());
  }
  // The tiled codec's midtread grid (2 bits: ternary).
  v1::EncodedTensor mt;
  Check(compression::Encode(MidtreadTiles(2, 16), v, shape, 7, &mt), "tiled midtread");
  Write("codec_decode", k++, mt.SerializeAsString());
}

void AqsgdRowSeeds() {
  int k = 0;
  const int64_t rows = 4, cols = 8;
  const std::vector<float> a = Values(rows * cols, 2);
  for (int mode = 0; mode < 3; ++mode) {
    for (int stored = 0; stored < 3; ++stored) {
      compression::AqsgdLinkOptions o;
      o.mode = static_cast<compression::LinkMode>(mode);
      o.stored = static_cast<RowPrecision>(stored);
      o.quantizer.bits = 4;
      o.quantizer.min_compress_elements = 1;
      o.warmup_epochs = 0;
      auto codec = compression::AqsgdLinkCodec::Create(o);
      Check(codec.status(), "aqsgd codec");
      for (bool seen : {false, true}) {
        if (mode != 0 && seen) continue;
        std::vector<float> m(rows * cols, 0.0f);
        v1::AqsgdRow row;
        Check((*codec)->EncodeRow({.seen = seen, .epoch = 1, .sample_id = 5}, a, rows, cols, absl::MakeSpan(m), 9,
                                  &row),
              "encode row");
        fuzz::FuzzOutput out;
        out.U8(mode).U8(stored).U8(o.quantizer.bits - 1).U8(rows - 1).U8(cols - 1).U8(0);
        out.Bytes(row.SerializeAsString());
        Write("aqsgd_row", k++, out.str());
      }
    }
  }
  // A tiled first visit against a first-visit reference of zeros (the
  // target's reference is its m fill: fill byte 0).
  compression::AqsgdLinkOptions o;
  o.quantizer.bits = 4;
  o.quantizer.min_compress_elements = 1;
  o.warmup_epochs = 0;
  o.first_visit = MidtreadTiles(3, 8);
  auto codec = compression::AqsgdLinkCodec::Create(o);
  Check(codec.status(), "aqsgd codec");
  const std::vector<float> zeros(rows * cols, 0.0f);
  std::vector<float> m(rows * cols, 0.0f);
  v1::AqsgdRow row;
  Check((*codec)->EncodeRow({.sample_id = 5, .reference = zeros}, a, rows, cols, absl::MakeSpan(m), 9, &row),
        "encode row with a reference");
  fuzz::FuzzOutput out;
  out.U8(0).U8(static_cast<uint8_t>(RowPrecision::kFloat16)).U8(3).U8(rows - 1).U8(cols - 1).U8(0);
  out.Bytes(row.SerializeAsString());
  Write("aqsgd_row", k++, out.str());
}

void LinkFrameSeeds() {
  int k = 0;
  const int64_t rows = 4, cols = 8, mb = 2;
  for (int mode = 0; mode < 3; ++mode) {
    const auto link_mode = mode == 0 ? v1::LinkCompression::aqsgd
                           : mode == 1 ? v1::LinkCompression::directq
                                       : v1::LinkCompression::fp32;
    pipeline::LinkEndpointOptions o;
    o.link.rows = rows;
    o.link.cols = cols;
    o.link.precision = RowPrecision::kFloat16;
    o.codec.mode = static_cast<compression::LinkMode>(mode);
    o.codec.stored = RowPrecision::kFloat16;
    o.codec.quantizer.bits = 4;
    o.codec.quantizer.min_compress_elements = 1;
    o.codec.warmup_epochs = 0;
    o.micro_batch = mb;
    o.resident_bytes = 0;
    o.prefetch_batches = 2;
    auto store = storage::MemoryMessageStore::Create({});
    Check(store.status(), "store");
    auto sender = pipeline::ActivationSender::Create(mode == 0 ? store->get() : nullptr, o);
    Check(sender.status(), "sender");
    std::vector<uint64_t> order(4 * mb);
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    Check((*sender)->StartEpoch(order), "start epoch");
    fuzz::FuzzOutput out;
    out.U8(mode).U8(1).U8(3).U8(5).U8(rows - 1).U8(cols - 1).U8(mb - 1).U8(0);
    for (uint32_t m = 0; m < 2; ++m) {
      const std::vector<uint64_t> samples(order.begin() + m * mb, order.begin() + (m + 1) * mb);
      v1::LinkFrame f;
      Check((*sender)->Encode(0, m, 0, samples, Values(mb * rows * cols, m), f.mutable_activations()), "encode");
      out.Record(f.SerializeAsString());
    }
    v1::LinkCompression compression;
    compression.set_mode(link_mode);
    compression.set_bw_bits(6);
    const pipeline::GradientCodec grads(compression, rows, cols);
    v1::LinkFrame g;
    g.mutable_gradients()->set_step(0);
    g.mutable_gradients()->set_partial_grad_sq_norm(1.5);
    Check(grads.Encode(Values(mb * rows * cols, 3), mb, 1, g.mutable_gradients()->mutable_grad()), "grad");
    out.Record(g.SerializeAsString());
    v1::LinkFrame c;
    c.mutable_commit()->set_step(0);
    c.mutable_commit()->set_total_grad_sq_norm(2.0);
    c.mutable_commit()->mutable_tied()->add_rows(1);
    compression::CodecOptions raw;
    raw.codec = v1::CODEC_RAW_F32;
    const int64_t tied_shape[] = {1, cols};
    Check(compression::Encode(raw, Values(cols, 4), tied_shape, 0, c.mutable_commit()->mutable_tied()->mutable_values()),
          "tied");
    out.Record(c.SerializeAsString());
    v1::LinkFrame e;
    Check((*sender)->EncodeEval(1, 0, Values(mb * rows * cols, 5), mb, e.mutable_activations()), "eval");
    out.Record(e.SerializeAsString());
    v1::LinkFrame h;
    h.mutable_hello()->set_job_name("fuzz");
    h.mutable_hello()->set_seq_len(rows);
    h.mutable_hello()->set_d_model(cols);
    h.mutable_hello()->set_plan(3);
    h.mutable_hello()->set_link_protocol(2);
    out.Record(h.SerializeAsString());
    Check((*sender)->Close(), "close");
    Write("link_frame", k++, out.str());
  }
}

// Replicas of one stage as threads, exchanging through a map; what rank
// `record` receives is written down in the order it asks for it.
class Hub {
 public:
  using Key = std::tuple<int, int, uint64_t, uint32_t, int, uint32_t, uint32_t>;
  class Endpoint final : public pipeline::ReplicaExchange {
   public:
    Endpoint(Hub* hub, int rank) : hub_(hub), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return hub_->size_; }
    absl::Status Send(int to, const v1::ExchangeChunk& c) override {
      std::lock_guard<std::mutex> l(hub_->mu_);
      hub_->box_[{to, rank_, c.step(), c.round(), c.phase(), c.bucket(), c.chunk()}] = c;
      hub_->cv_.notify_all();
      return absl::OkStatus();
    }
    absl::StatusOr<v1::ExchangeChunk> Receive(int from, uint64_t step, uint32_t round, v1::ExchangeChunk::Phase phase,
                                              uint32_t bucket, uint32_t chunk) override {
      std::unique_lock<std::mutex> l(hub_->mu_);
      const Key key{rank_, from, step, round, phase, bucket, chunk};
      if (!hub_->cv_.wait_for(l, std::chrono::seconds(10), [&] { return hub_->box_.count(key) > 0; })) {
        return absl::DeadlineExceededError("seed hub: no chunk");
      }
      v1::ExchangeChunk c = hub_->box_[key];
      if (rank_ == hub_->record_) hub_->recorded_.push_back(c.SerializeAsString());
      return c;
    }

   private:
    Hub* hub_;
    int rank_;
  };
  Hub(int size, int record) : size_(size), record_(record) {}
  std::vector<std::string> recorded_;

 private:
  int size_, record_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, v1::ExchangeChunk> box_;
};

void ExchangeSeeds() {
  int k = 0;
  std::vector<fuzz::ExchangeFuzzConfig> configs;
  for (int codec = 0; codec < 4; ++codec) {
    fuzz::ExchangeFuzzConfig c;
    c.size = 2 + codec % 2;
    c.rank = codec % c.size;
    c.n = 40;
    c.codec = codec;
    c.bits = 2;        // 4 bits
    c.bucket = 7;      // buckets of 8, allreduce buckets of 15
    c.error_feedback = codec >= 2;
    configs.push_back(c);
  }
  for (int levels = 0; levels < 2; ++levels) {
    fuzz::ExchangeFuzzConfig c;
    c.global_qsgd = true;
    c.size = 3;
    c.rank = 1;
    c.n = 40;
    c.bits = 6;        // 8 bits
    c.bucket = 7;
    c.levels = levels;
    configs.push_back(c);
  }
  for (const fuzz::ExchangeFuzzConfig& cfg : configs) {
    Hub hub(cfg.size, cfg.rank);
    std::vector<std::thread> threads;
    std::vector<absl::Status> status(cfg.size);
    for (int r = 0; r < cfg.size; ++r) {
      threads.emplace_back([&, r] {
        Hub::Endpoint ex(&hub, r);
        std::vector<float> in(cfg.n), out(cfg.n);
        for (int64_t i = 0; i < cfg.n; ++i) in[i] = static_cast<float>((i * 37 + r * 11) % 101 - 50) / 25.0f;
        if (cfg.global_qsgd) {
          status[r] = pipeline::GlobalQsgdAllReduceMean(ex, cfg.GlobalOptions(), 7, 0, in, absl::MakeSpan(out));
        } else {
          std::vector<float> we, se;
          status[r] = pipeline::AllReduceMean(ex, cfg.Options(), 7, 0, in, absl::MakeSpan(out),
                                              cfg.error_feedback ? &we : nullptr, cfg.error_feedback ? &se : nullptr);
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const absl::Status& s : status) Check(s, "allreduce");
    fuzz::FuzzOutput out;
    cfg.Write(out);
    for (const std::string& c : hub.recorded_) out.Record(c);
    Write("exchange_chunk", k++, out.str());
  }
}

void StoredRowSeeds() {
  int k = 0;
  for (int p = 0; p < 3; ++p) {
    storage::LinkSpec link;
    link.link = {1, 2};
    link.generation = 3;
    link.rows = 4;
    link.cols = 8;
    link.precision = static_cast<RowPrecision>(p);
    const std::string key = storage::internal::EncodeKey(storage::internal::kRowKind, link.link, 42);
    std::string value;
    Check(storage::internal::EncodeRowValue(key, link, Values(32, p), &value), "row value");
    const std::string index_key = storage::internal::EncodeKey(storage::internal::kIndexKind, link.link, 42);
    fuzz::FuzzOutput out;
    out.U8(0).Record(key).Record(value).Record(storage::internal::EncodeIndexValue(key, 17, value.size()));
    Write("stored_row", k++, out.str());
  }
}

void JobSpecSeeds(const std::string& examples) {
  int k = 0;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(examples)) {
    if (e.path().extension() == ".json") files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  for (const fs::path& p : files) {
    std::ifstream f(p);
    std::stringstream ss;
    ss << f.rdbuf();
    Write("jobspec", k++, ss.str());
    if (p.filename() == "tiny_aqsgd.json" || p.filename() == "tiny_dp.json") {
      auto job = pipeline::ParseJobSpec(ss.str());
      Check(job.status(), "job");
      Write("jobspec", k++, "\x01" + job->SerializeAsString());
    }
  }
}

void JoinTokenSeeds() {
  // The target's secret and clock (fuzz/join_token_fuzz.cc).
  const char* secret = "fuzz-secret-0123456789abcdef0123";
  const int64_t now = 1'800'000'000;
  int k = 0;
  for (const auto& [peer, expiry] : std::vector<std::pair<std::string, int64_t>>{
           {"peer-a", now + 3600}, {"*", now + 60}, {"peer-b", now - 1}}) {
    auto token = IssueJoinToken(secret, "swarm-1", peer, expiry);
    Check(token.status(), "token");
    Write("join_token", k++, std::string(1, '\0') + *token);
  }
  fuzz::FuzzOutput out;
  out.U8(1).Record("swarm-1").Record("peer-a").U64(now + 3600);
  Write("join_token", k++, out.str());
}

void SafetensorsSeeds() {
  const std::vector<float> a = Values(6, 1), b = Values(4, 2);
  Write("safetensors", 0,
        pipeline::SerializeSafetensors({{"wte.weight", {2, 3}, a}, {"ln.bias", {4}, b}}, {{"step", "12"}}));
  Write("safetensors", 1, pipeline::SerializeSafetensors({{"x", {}, absl::MakeConstSpan(a).subspan(0, 1)}}, {}));
}

void CoordinatorStateSeeds() {
  const fs::path dir = fs::temp_directory_path() / "aqswarm-fuzz-seed-state";
  fs::remove_all(dir);
  {
    auto state = coordinator::CoordinatorState::Open({dir.string(), false});
    Check(state.status(), "state");
    coordinator::CoordinatorState::Change c;
    auto job = pipeline::ParseJobSpec(R"({"name":"seed","model":{"seqLen":16,"dModel":16,"nLayer":2,"nHead":2},
        "data":{"corpus":"data/sotu","tokenizer":"data/gpt2"},"stages":2})");
    Check(job.status(), "job");
    c.PutJob(*job);
    c.PutCounters({.assignment_version = 4, .next_peer_id = 3, .next_generation = 5});
    for (uint64_t id : {1, 2}) {
      coordinator::Member m;
      m.id = id;
      m.name = "peer-" + std::to_string(id);
      m.session_token = "0123456789abcdef0123456789abcdef";
      m.stage_link_address = "127.0.0.1:700" + std::to_string(id);
      m.gradient_exchange_address = "127.0.0.1:710" + std::to_string(id);
      m.state_transfer_address = "127.0.0.1:720" + std::to_string(id);
      m.seconds_per_layer = 0.01;
      m.memory_bytes = 1 << 30;
      m.joined_at = absl::FromUnixSeconds(1'700'000'000);
      m.lease_expiry = absl::FromUnixSeconds(1'700'000'060);
      m.held[id - 1] = {0, 10};
      c.PutMember(m);
    }
    coordinator::LinkEstimate e;
    e.measured = true;
    e.measured_at = absl::FromUnixSeconds(1'700'000'010);
    c.PutLink(1, 2, e);
    coordinator::Grid g = coordinator::Grid::Empty(2, 1);
    g.slots = {1, 2};
    g.forward_generation = {4};
    g.replica_generation = {1, 2};
    g.plan_version = 2;
    g.resume_step = 10;
    c.PutGrid(g);
    coordinator::SwarmProgress p;
    p.progress.step = 12;
    p.progress.loss = 3.5;
    p.checkpoint_step = 10;
    c.PutProgress(p);
    c.PutDataIdentity({"0123456789abcdef", "fedcba9876543210"});
    Check((*state)->Commit(c), "commit");
    auto loaded = (*state)->Load();
    Check(loaded.status(), "load");
  }
  auto store = storage::StateStore::Open({dir.string(), false});
  Check(store.status(), "store");
  auto all = (*store)->Scan("");
  Check(all.status(), "scan");
  fuzz::FuzzOutput everything, members;
  for (const auto& [key, value] : *all) {
    everything.Record(key).Record(value);
    if (key.rfind("members/", 0) == 0) members.Record(key).Record(value);
  }
  Write("coordinator_state", 0, everything.str());
  Write("coordinator_state", 1, members.str());
  store->reset();
  fs::remove_all(dir);
}

// Chunked as StateTransferServer does (peer/state_transfer.cc).
void StateChunkSeeds() {
  int k = 0;
  for (const auto& [size, chunk] : std::vector<std::pair<size_t, size_t>>{{300, 100}, {250, 64}, {0, 16}, {5, 16}}) {
    std::string state(size, '\0');
    for (size_t i = 0; i < size; ++i) state[i] = static_cast<char>(i * 7 + 3);
    const uint64_t sum = Checksum64(state.data(), state.size());
    fuzz::FuzzOutput out;
    out.U8(20);  // max_bytes 1 MiB
    size_t off = 0;
    do {
      const size_t len = std::min(chunk, size - off);
      v1::StateChunk c;
      c.set_total_bytes(size);
      c.set_offset(off);
      c.set_step(12);
      c.set_data(state.substr(off, len));
      off += len;
      if (off == size) c.set_checksum(sum);
      out.Record(c.SerializeAsString());
    } while (off < size);
    Write("state_chunks", k++, out.str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fuzz_seed_gen <corpus dir>   (run from the repository root: reads examples/)\n";
    return 2;
  }
  g_root = argv[1];
  CodecSeeds();
  AqsgdRowSeeds();
  LinkFrameSeeds();
  ExchangeSeeds();
  StoredRowSeeds();
  JobSpecSeeds("examples");
  JoinTokenSeeds();
  SafetensorsSeeds();
  CoordinatorStateSeeds();
  StateChunkSeeds();
  std::cout << "fuzz_seed_gen: wrote " << g_root << "\n";
  return 0;
}
