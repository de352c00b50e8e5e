#include "pipeline/job_spec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/data_identity.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "compression/global_qsgd.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "pipeline/quantized_adam.h"
#include "proto/job_format.h"
#include "pipeline/step_schedule.h"

namespace aqswarm::pipeline {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("job spec: ", field, ": ", why));
}

// dp.variance_refresh_steps when unset (quantized_adam): docs/CONVERGENCE.md.
constexpr uint32_t kDefaultVarianceRefreshSteps = 4;

template <typename T>
void Default(T* field, T value) {
  if (*field == T{}) *field = value;
}

}  // namespace

uint32_t DefaultQuantizedAdamWarmup(const v1::JobSpec& job) {
  // 0/1 Adam's first phase: 16 full-precision steps before its variance
  // interval first doubles.
  constexpr uint64_t kZeroOneAdamFirstPhase = 16;
  const uint64_t steps = job.max_steps() > 0 ? job.max_steps() : job.optimizer().total_steps();
  const uint64_t w = steps == 0 ? kZeroOneAdamFirstPhase : std::min(kZeroOneAdamFirstPhase, steps / 16);
  return static_cast<uint32_t>(std::max<uint64_t>(w, kMinQuantizedAdamWarmup));
}

void ApplyJobDefaults(v1::JobSpec* job) {
  if (job->name().empty()) job->set_name("job");
  auto* m = job->mutable_model();
  if (m->vocab_size() == 0) m->set_vocab_size(50257);
  if (m->seq_len() == 0) m->set_seq_len(128);
  if (m->d_model() == 0) m->set_d_model(256);
  if (m->n_layer() == 0) m->set_n_layer(4);
  if (m->n_head() == 0) m->set_n_head(4);
  if (m->family() == v1::ModelSpec::Family::UNSPECIFIED) m->set_family(v1::ModelSpec::Family::gpt2);
  if (job->precision() == v1::JobSpec::Precision::UNSPECIFIED) job->set_precision(v1::JobSpec::Precision::fp32);
  auto* d = job->mutable_data();
  if (d->validation_fraction() == 0) d->set_validation_fraction(0.05);
  auto* o = job->mutable_optimizer();
  if (o->lr() == 0) o->set_lr(6e-4);
  if (o->beta1() == 0) o->set_beta1(0.9);
  if (o->beta2() == 0) o->set_beta2(0.999);
  if (o->eps() == 0) o->set_eps(1e-8);
  if (job->micro_batch_size() == 0) job->set_micro_batch_size(4);
  if (job->micro_batches_per_step() == 0) job->set_micro_batches_per_step(4);
  if (job->epochs() == 0) job->set_epochs(1);
  auto* c = job->mutable_compression();
  if (c->mode() == v1::LinkCompression::MODE_UNSPECIFIED) c->set_mode(v1::LinkCompression::fp32);
  if (c->fw_bits() == 0) c->set_fw_bits(4);
  if (c->bw_bits() == 0) c->set_bw_bits(8);
  if (c->m_precision() == v1::LinkCompression::MPrecision::UNSPECIFIED) {
    c->set_m_precision(v1::LinkCompression::MPrecision::fp16);
  }
  if (c->store() == v1::LinkCompression::Store::UNSPECIFIED) c->set_store(v1::LinkCompression::Store::rocksdb);
  if (c->tile_grid() == v1::LinkCompression::TileGrid::UNSPECIFIED) {
    c->set_tile_grid(v1::LinkCompression::TileGrid::midrise);
  }
  if (job->stages() == 0) job->set_stages(1);
  if (job->data_parallel() == 0) job->set_data_parallel(1);
  if (job->device().empty()) job->set_device("cpu");
  if (job->threads() == 0) job->set_threads(1);
  auto* dp = job->mutable_dp();
  if (dp->optimizer() == v1::DataParallelSpec::OPTIMIZER_UNSPECIFIED) {
    dp->set_optimizer(v1::DataParallelSpec::adamw);
  }
  if (dp->bits() == 0) dp->set_bits(4);
  if (dp->bucket_size() == 0) dp->set_bucket_size(512);
  if (dp->codec() == v1::DataParallelSpec::CODEC_UNSPECIFIED) dp->set_codec(v1::DataParallelSpec::minmax);
  if (dp->transport() == v1::DataParallelSpec::TRANSPORT_UNSPECIFIED) {
    dp->set_transport(v1::DataParallelSpec::gradient_exchange);
  }
  if (dp->frozen_variance() == v1::DataParallelSpec::FROZEN_VARIANCE_UNSPECIFIED) {
    dp->set_frozen_variance(v1::DataParallelSpec::raise_at_bound);
  }
  if (dp->robust() == v1::DataParallelSpec::ROBUST_UNSPECIFIED) dp->set_robust(v1::DataParallelSpec::robust_off);
  if (dp->robust() != v1::DataParallelSpec::robust_off && dp->robust_clip() == 0) dp->set_robust_clip(2);
  if (dp->optimizer() == v1::DataParallelSpec::quantized_adam && !dp->has_warmup_steps()) {
    dp->set_warmup_steps(DefaultQuantizedAdamWarmup(*job));
  }
  if (dp->optimizer() == v1::DataParallelSpec::quantized_adam && !dp->has_variance_refresh_steps()) {
    dp->set_variance_refresh_steps(kDefaultVarianceRefreshSteps);
  }
  if (dp->optimizer() == v1::DataParallelSpec::diloco) {
    if (dp->inner_steps() == 0) dp->set_inner_steps(32);
    if (!dp->has_outer_lr()) dp->set_outer_lr(0.7);
    if (!dp->has_outer_momentum()) dp->set_outer_momentum(0.9);
  }
  if (dp->layerwise_every_steps() > 0) {
    if (dp->layerwise_min_bits() == 0) dp->set_layerwise_min_bits(2);
    if (dp->layerwise_max_bits() == 0) dp->set_layerwise_max_bits(8);
  }
  if (job->eval_batches() == 0) job->set_eval_batches(8);
  if (job->schedule() == v1::JobSpec::Schedule::UNSPECIFIED) job->set_schedule(v1::JobSpec::Schedule::adaptive);
}

// Slowest link rate a job may shape to, in Mbit/s (1 kbit/s).
constexpr double kMinBandwidthMbps = 0.001;

namespace {

// The fields of 0/1 Adam's schedules, DiLoCo and layer-wise bits.
absl::Status ValidateDataParallelSchedules(const v1::JobSpec& job) {
  const auto& dp = job.dp();
  const bool qadam = dp.optimizer() == v1::DataParallelSpec::quantized_adam;
  const bool diloco = dp.optimizer() == v1::DataParallelSpec::diloco;
  if (dp.warmup_bits() > 0 && !qadam) {
    return Invalid("dp.warmup_bits", "compresses quantized_adam's warm-up and variance-refresh gradients; set "
                                     "dp.optimizer to quantized_adam or drop it");
  }
  if (dp.entropy_coding() && !qadam && !diloco) {
    return Invalid("dp.entropy_coding", "codes quantized_adam's or diloco's compressed exchanges; adamw sends float32");
  }
  if (dp.entropy_coding() && dp.codec() == v1::DataParallelSpec::global_qsgd) {
    return Invalid("dp.entropy_coding", "is for the minmax codec (Global-QSGD combines its codes without decoding)");
  }
  if (dp.warmup_bits() == 1 || dp.warmup_bits() > 8) {
    return Invalid("dp.warmup_bits", absl::StrCat(dp.warmup_bits(), " is not 0 (float32) or in [2, 8]"));
  }
  if (dp.refresh_growth() > 0 && !qadam) {
    return Invalid("dp.refresh_growth", "grows quantized_adam's variance-refresh interval; set dp.optimizer to "
                                        "quantized_adam or drop it");
  }
  if (dp.refresh_growth() > 0 && dp.variance_refresh_steps() == 0) {
    return Invalid("dp.refresh_growth", "needs dp.variance_refresh_steps > 0 (the first interval)");
  }
  if (dp.refresh_growth() > 1000000) return Invalid("dp.refresh_growth", "at most 1000000");
  if ((dp.max_local_steps() > 0 || dp.local_step_growth() > 0) && !qadam) {
    return Invalid("dp.max_local_steps", "0/1 Adam's local steps are quantized_adam's; set dp.optimizer to "
                                         "quantized_adam, or use dp.optimizer diloco with dp.inner_steps");
  }
  if (dp.max_local_steps() > 4096) return Invalid("dp.max_local_steps", "at most 4096");
  if (dp.local_step_growth() > 0 && dp.max_local_steps() <= 1) {
    return Invalid("dp.local_step_growth", "grows the interval between syncs up to dp.max_local_steps, which is "
                                           "0 or 1 (no local steps); set dp.max_local_steps > 1 or drop it");
  }
  if (dp.local_step_growth() > 1000000) return Invalid("dp.local_step_growth", "at most 1000000");
  const bool diloco_field = dp.inner_steps() > 0 || dp.has_outer_lr() || dp.has_outer_momentum() || dp.fragments() > 0;
  if (diloco_field && !diloco) {
    return Invalid(dp.inner_steps() > 0 ? "dp.inner_steps" : dp.fragments() > 0 ? "dp.fragments" : "dp.outer_lr",
                   "is diloco's; set dp.optimizer to diloco or drop it");
  }
  if (diloco) {
    if (dp.inner_steps() < 1 || dp.inner_steps() > 100000) return Invalid("dp.inner_steps", "must be in [1, 100000]");
    if (!(dp.outer_lr() > 0) || !std::isfinite(dp.outer_lr()) || dp.outer_lr() > 10) {
      return Invalid("dp.outer_lr", absl::StrCat(dp.outer_lr(), " is not in (0, 10] (default 0.7)"));
    }
    if (!(dp.outer_momentum() >= 0) || !(dp.outer_momentum() < 1)) {
      return Invalid("dp.outer_momentum", absl::StrCat(dp.outer_momentum(), " is not in [0, 1) (default 0.9)"));
    }
    if (dp.fragments() > dp.inner_steps()) {
      return Invalid("dp.fragments", absl::StrCat(dp.fragments(), " fragments cannot be staggered over ",
                                                  dp.inner_steps(), " inner steps (at most dp.inner_steps)"));
    }
    if (dp.codec() == v1::DataParallelSpec::global_qsgd && dp.robust() != v1::DataParallelSpec::robust_off &&
        dp.robust() != v1::DataParallelSpec::ROBUST_UNSPECIFIED) {
      return Invalid("dp.robust", "global_qsgd sums the replicas' codes without decoding them, so no contribution "
                                  "can be clipped; use dp.codec minmax with dp.robust");
    }
    if (dp.delayed_update()) {
      return Invalid("dp.delayed_update", "is for per-step exchanges; diloco already exchanges once every "
                                          "dp.inner_steps (use dp.fragments to spread its exchanges)");
    }
  }
  if (dp.layerwise_every_steps() > 0) {
    if (!qadam && !diloco) {
      return Invalid("dp.layerwise_every_steps", "chooses the bits of a compressed exchange (quantized_adam or "
                                                 "diloco); dp.optimizer adamw exchanges float32");
    }
    if (dp.codec() == v1::DataParallelSpec::global_qsgd) {
      return Invalid("dp.layerwise_every_steps", "chooses min-max bit widths; use dp.codec minmax");
    }
    if (dp.layerwise_min_bits() < 1 || dp.layerwise_max_bits() > 8 ||
        dp.layerwise_min_bits() > dp.layerwise_max_bits()) {
      return Invalid("dp.layerwise_min_bits", absl::StrCat("[", dp.layerwise_min_bits(), ", ",
                                                           dp.layerwise_max_bits(), "] is not a range in [1, 8]"));
    }
    if (dp.bits() < dp.layerwise_min_bits() || dp.bits() > dp.layerwise_max_bits()) {
      return Invalid("dp.bits", absl::StrCat(dp.bits(), " (the uniform plan whose error is the budget) is outside "
                                             "[dp.layerwise_min_bits, dp.layerwise_max_bits]"));
    }
    if (dp.layerwise_every_steps() > 1000000) return Invalid("dp.layerwise_every_steps", "at most 1000000");
  } else if (dp.layerwise_min_bits() > 0 || dp.layerwise_max_bits() > 0) {
    return Invalid("dp.layerwise_min_bits", "needs dp.layerwise_every_steps > 0");
  }
  return absl::OkStatus();
}

}  // namespace

DataSource DataSourceFor(const v1::DataSpec& data) {
  return DataSource{data.corpus(), data.tokenizer(), data.text_field(), data.cache_dir()};
}

namespace {

// Every enum field of `m` (at `path`) holds one of its values: a binary job,
// or a JSON number, can carry any other.
absl::Status ValidateEnums(const google::protobuf::Message& m, const std::string& path) {
  const google::protobuf::Reflection* r = m.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const google::protobuf::FieldDescriptor* f : fields) {
    const std::string where = absl::StrCat(path, f->name());
    if (f->is_repeated()) continue;  // the job has no repeated messages or enums
    if (f->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE) {
      AQSWARM_RETURN_IF_ERROR(ValidateEnums(r->GetMessage(m, f), absl::StrCat(where, ".")));
    } else if (f->type() == google::protobuf::FieldDescriptor::TYPE_ENUM &&
               f->enum_type()->FindValueByNumber(r->GetEnumValue(m, f)) == nullptr) {
      return Invalid(where, absl::StrCat(r->GetEnumValue(m, f), " is not ", job_format::JobEnumChoices(f->enum_type())));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobSpec(const v1::JobSpec& job) {
  AQSWARM_RETURN_IF_ERROR(ValidateEnums(job, ""));
  const auto& m = job.model();
  if (m.vocab_size() < 2) return Invalid("model.vocab_size", "must be >= 2");
  if (m.seq_len() < 2 || m.seq_len() > 8192) return Invalid("model.seq_len", "must be in [2, 8192]");
  if (m.n_head() == 0 || m.d_model() % m.n_head() != 0) {
    return Invalid("model.d_model", absl::StrCat(m.d_model(), " is not divisible by n_head ", m.n_head()));
  }
  if (m.n_layer() == 0 || m.n_layer() > 4096) return Invalid("model.n_layer", "must be in [1, 4096]");
  // Bounds that keep every parameter count well inside int64.
  if (m.vocab_size() > (1u << 24)) return Invalid("model.vocab_size", "at most 2^24");
  if (m.d_model() > (1u << 16)) return Invalid("model.d_model", "at most 65536");
  if (m.d_ff() > (1u << 20)) return Invalid("model.d_ff", "at most 2^20");
  if (m.family() == v1::ModelSpec::Family::UNSPECIFIED) return Invalid("model.family", "is not set (gpt2 or llama)");
  if (m.n_kv_head() != 0 && (m.n_kv_head() > m.n_head() || m.n_head() % m.n_kv_head() != 0)) {
    return Invalid("model.n_kv_head", absl::StrCat(m.n_kv_head(), " does not divide n_head ", m.n_head()));
  }
  if (m.rope_theta() < 0) return Invalid("model.rope_theta", "must be >= 0");
  if (m.norm_eps() < 0 || m.norm_eps() > 1) return Invalid("model.norm_eps", "must be in [0, 1]");
  if (!m.init_from().empty() && !m.init_weights().empty()) {
    return Invalid("model.init_from", "set init_from or init_weights, not both");
  }
  if (job.precision() == v1::JobSpec::Precision::UNSPECIFIED) return Invalid("precision", "is not set (fp32, bf16 or fp16)");
  if (job.optimizer().initial_loss_scale() < 0 || !std::isfinite(job.optimizer().initial_loss_scale())) {
    return Invalid("optimizer.initial_loss_scale", "must be a finite number >= 0");
  }
  if (DynamicLossScaling(job) && job.data_parallel() > 1) {
    return absl::UnimplementedError(
        "dynamic loss scaling (precision fp16 or optimizer.loss_scale dynamic) with data_parallel > 1 is not "
        "built: replicas would have to agree on every skipped step; use precision bf16");
  }
  if (job.stages() > m.n_layer()) {
    return Invalid("stages", absl::StrCat(job.stages(), " stages but only ", m.n_layer(), " layers"));
  }
  if (job.stages() > 64) return Invalid("stages", "at most 64");
  if (job.data_parallel() > 64) return Invalid("data_parallel", "at most 64");
  const auto& d = job.data();
  if (d.validation_fraction() < 0 || d.validation_fraction() >= 1) {
    return Invalid("data.validation_fraction", "must be in [0, 1)");
  }
  AQSWARM_RETURN_IF_ERROR(ValidateHashHex(d.dataset_hash(), "data.datasetHash"));
  AQSWARM_RETURN_IF_ERROR(ValidateHashHex(d.tokenizer_hash(), "data.tokenizerHash"));
  const auto& o = job.optimizer();
  if (!(o.lr() > 0) || o.lr() > 10) return Invalid("optimizer.lr", "must be in (0, 10]");
  if (o.min_lr() < 0 || o.min_lr() > o.lr()) return Invalid("optimizer.min_lr", "must be in [0, lr]");
  if (o.beta1() < 0 || o.beta1() >= 1) return Invalid("optimizer.beta1", "must be in [0, 1)");
  if (o.beta2() < 0 || o.beta2() >= 1) return Invalid("optimizer.beta2", "must be in [0, 1)");
  if (!(o.eps() > 0)) return Invalid("optimizer.eps", "must be > 0");
  if (o.weight_decay() < 0) return Invalid("optimizer.weight_decay", "must be >= 0");
  if (o.grad_clip() < 0) return Invalid("optimizer.grad_clip", "must be >= 0");
  if (o.total_steps() != 0 && o.warmup_steps() > o.total_steps()) {
    return Invalid("optimizer.warmup_steps", "exceeds total_steps");
  }
  if (job.micro_batch_size() > 4096) return Invalid("micro_batch_size", "at most 4096");
  if (job.micro_batches_per_step() > 4096) return Invalid("micro_batches_per_step", "at most 4096");
  const auto& c = job.compression();
  if (c.fw_bits() < 1 || c.fw_bits() > 8) {
    return Invalid("compression.fw_bits", absl::StrCat(c.fw_bits(), " is not in [1, 8]"));
  }
  if (c.bw_bits() < 1 || c.bw_bits() > 8) {
    return Invalid("compression.bw_bits", absl::StrCat(c.bw_bits(), " is not in [1, 8]"));
  }
  using Compression = v1::LinkCompression;
  if (c.m_precision() == Compression::MPrecision::UNSPECIFIED) {
    return Invalid("compression.m_precision", "is not set (fp32, fp16 or int8)");
  }
  const bool compressed_first_visits =
      c.first_visit() == Compression::FirstVisit::tiled || c.first_visit() == Compression::FirstVisit::fixed_point;
  if (compressed_first_visits && c.mode() != Compression::aqsgd) {
    return Invalid("compression.first_visit",
                   "compressed first visits are for mode aqsgd (mode tiled is tiled throughout, directq fixed point)");
  }
  if (c.first_visit_bits() > 8) {
    return Invalid("compression.first_visit_bits", absl::StrCat(c.first_visit_bits(), " is not in [1, 8]"));
  }
  if (c.tile_size() != 0 && (c.tile_size() < 16 || c.tile_size() > 1024 || (c.tile_size() & (c.tile_size() - 1)) != 0)) {
    return Invalid("compression.tile_size", absl::StrCat(c.tile_size(), " is not a power of two in [16, 1024]"));
  }
  if (c.tile_grid() == Compression::TileGrid::midtread) {
    const bool tiled = c.mode() == Compression::tiled;
    const uint32_t first = c.first_visit() == Compression::FirstVisit::tiled
                               ? (c.first_visit_bits() ? c.first_visit_bits() : c.fw_bits())
                               : 0;
    const bool tiled_bw = tiled || c.bw_codec() == Compression::BwCodec::tiled;
    if ((tiled && c.fw_bits() == 1) || (tiled_bw && c.bw_bits() == 1) || first == 1) {
      return Invalid("compression.tile_grid", "the midtread grid needs tiled codes of 2 bits or more");
    }
  }
  if (c.first_visit_reference()) {
    if (c.mode() != Compression::aqsgd || !compressed_first_visits) {
      return Invalid("compression.first_visit_reference", "needs mode aqsgd with firstVisit tiled or fixed_point");
    }
    const uint64_t table_bytes = uint64_t{job.model().vocab_size()} * job.model().d_model() * 4;
    if (table_bytes > (uint64_t{1} << 30)) {
      return Invalid("compression.first_visit_reference",
                     absl::StrCat("its table (vocab x d_model floats) would take ", table_bytes,
                                  " bytes per link end, over 1 GiB"));
    }
  }
  if (c.bw_codec() == Compression::BwCodec::tiled && c.mode() != Compression::aqsgd &&
      c.mode() != Compression::directq && c.mode() != Compression::tiled) {
    return Invalid("compression.bw_codec", "fp32 links send raw gradients; tiled gradients need mode directq, aqsgd "
                                           "or tiled");
  }
  if (c.bw_codec() == Compression::BwCodec::fixed_point && c.mode() == Compression::tiled) {
    return Invalid("compression.bw_codec", "mode tiled sends its gradients tiled; drop bw_codec or use mode aqsgd or "
                                           "directq");
  }
  if (c.entropy_coding() && c.mode() == v1::LinkCompression::fp32) {
    return Invalid("compression.entropy_coding", "fp32 links send raw floats; it needs mode directq, aqsgd or tiled");
  }
  if (c.store() == Compression::Store::UNSPECIFIED) return Invalid("compression.store", "is not set (rocksdb or memory)");
  if (c.resident_bytes() > (uint64_t{1} << 40)) {
    return Invalid("compression.resident_bytes", absl::StrCat(c.resident_bytes(), " is over 1 TiB"));
  }
  const auto& s = job.shaping();
  // 0 = unshaped; otherwise at least 1 kbit/s (a frame's emulated wire time
  // must stay finite) and finite.
  auto bad_bandwidth = [](double b) { return !std::isfinite(b) || b < 0 || (b > 0 && b < kMinBandwidthMbps); };
  if (bad_bandwidth(s.bandwidth_mbps())) {
    return Invalid("shaping.bandwidth_mbps", absl::StrCat(s.bandwidth_mbps(), " is not 0 (unshaped) or in [",
                                                          kMinBandwidthMbps, ", inf) Mbit/s"));
  }
  if (s.bandwidth_schedule_mbps_size() > 1024) return Invalid("shaping.bandwidth_schedule_mbps", "at most 1024 entries");
  for (double b : s.bandwidth_schedule_mbps()) {
    if (bad_bandwidth(b)) {
      return Invalid("shaping.bandwidth_schedule_mbps",
                     absl::StrCat(b, " is not 0 (unshaped) or in [", kMinBandwidthMbps, ", inf) Mbit/s"));
    }
  }
  if (s.latency_ms() < 0 || s.latency_ms() > 10000) return Invalid("shaping.latency_ms", "must be in [0, 10000]");
  if (job.device() != "cpu" && job.device().rfind("cuda", 0) != 0) {
    return Invalid("device", absl::StrCat("'", job.device(), "' is not cpu or cuda[:N]"));
  }
  if (job.threads() > 256) return Invalid("threads", "at most 256");
  const auto& dp = job.dp();
  if (dp.bits() < 1 || dp.bits() > 8) return Invalid("dp.bits", absl::StrCat(dp.bits(), " is not in [1, 8]"));
  if (dp.bucket_size() < 8 || dp.bucket_size() > (1u << 24)) {
    return Invalid("dp.bucket_size", "must be in [8, 2^24]");
  }
  if (dp.codec() == v1::DataParallelSpec::global_qsgd) {
    if (dp.optimizer() == v1::DataParallelSpec::adamw) {
      return Invalid("dp.codec", "global_qsgd compresses quantized_adam's momentum or diloco's pseudo-gradient "
                                 "exchange, but dp.optimizer is adamw (raw float32 gradients); set dp.optimizer to "
                                 "quantized_adam or diloco, or drop dp.codec");
    }
    if (dp.bits() < 2) return Invalid("dp.bits", "global_qsgd needs 2..8 bits (1 bit is minmax only)");
    // The shared grid must hold the sums of every replica's codes: ask the
    // encoder itself (exponential levels need 1 + ceil(log2 D) spare exponents).
    compression::GlobalQsgdOptions g;
    g.bits = static_cast<int>(dp.bits());
    g.levels = v1::LEVELS_EXPONENTIAL;
    g.bucket_size = dp.bucket_size();
    g.num_workers = static_cast<int>(std::max<uint32_t>(1, job.data_parallel()));
    const float zero = 0, one = 1;
    const int64_t shape[] = {1};
    v1::EncodedTensor probe;
    const absl::Status fits =
        compression::EncodeGlobalQsgd(g, absl::MakeConstSpan(&zero, 1), shape, absl::MakeConstSpan(&one, 1), 0, &probe);
    if (!fits.ok()) {
      return Invalid("dp.bits", absl::StrCat(dp.bits(), "-bit global_qsgd codes cannot carry sums of ",
                                             job.data_parallel(), " replicas: ", fits.message()));
    }
  }
  if (dp.robust() != v1::DataParallelSpec::ROBUST_UNSPECIFIED && dp.robust() != v1::DataParallelSpec::robust_off) {
    // pipeline/dp_allreduce.h: the owner of each chunk combines the
    // replicas' contributions; D = 2 bounds the larger by the smaller but has
    // no majority to tell which replica is honest (D >= 3 outvotes one).
    if (!(dp.robust_clip() > 0) || !std::isfinite(dp.robust_clip()) || dp.robust_clip() > 1e6) {
      return Invalid("dp.robust_clip", absl::StrCat(dp.robust_clip(), " must be a finite multiple of the median "
                                                                      "norm in (0, 1e6] (default 2)"));
    }
    if (dp.transport() == v1::DataParallelSpec::nccl && job.data_parallel() > 1) {
      return Invalid("dp.robust", "robust aggregation runs at the chunk owners of the gradient_exchange transport; "
                                  "with dp.transport nccl drop dp.robust");
    }
    if (dp.codec() == v1::DataParallelSpec::global_qsgd && dp.optimizer() == v1::DataParallelSpec::quantized_adam) {
      return Invalid("dp.robust", "global_qsgd sums the replicas' codes without decoding them, so no contribution "
                                  "can be clipped; use dp.codec minmax with dp.robust");
    }
  } else if (dp.robust_clip() != 0 && (!(dp.robust_clip() > 0) || !std::isfinite(dp.robust_clip()))) {
    return Invalid("dp.robust_clip", "must be a finite number > 0");
  }
  if (dp.variance_refresh_steps() > 0 && dp.optimizer() != v1::DataParallelSpec::quantized_adam) {
    return Invalid("dp.variance_refresh_steps", "refreshes quantized_adam's frozen variance, but dp.optimizer is adamw "
                                                "(its variance is never frozen); set dp.optimizer to quantized_adam "
                                                "or drop dp.variance_refresh_steps");
  }
  if (dp.variance_refresh_steps() > 1000000) return Invalid("dp.variance_refresh_steps", "at most 1000000");
  AQSWARM_RETURN_IF_ERROR(ValidateDataParallelSchedules(job));
  const bool shaped = s.bandwidth_mbps() > 0 || std::any_of(s.bandwidth_schedule_mbps().begin(),
                                                              s.bandwidth_schedule_mbps().end(),
                                                              [](double b) { return b > 0; });
  if (dp.transport() == v1::DataParallelSpec::nccl && job.data_parallel() > 1 && shaped) {
    return Invalid("dp.transport", "nccl is not shaped, but the job shapes its links (shaping.bandwidth_mbps or "
                                   "shaping.bandwidth_schedule_mbps); "
                                   "use the gradient_exchange transport to emulate slow links");
  }
  if (dp.delayed_update() && dp.transport() == v1::DataParallelSpec::nccl && job.data_parallel() > 1) {
    return Invalid("dp.delayed_update", "runs the exchange on a background thread over the gradient_exchange "
                                        "transport; with dp.transport nccl drop dp.delayed_update");
  }
  // Empty (a job stored before the field existed) means the default; every
  // schedule trains to the same weights.
  AQSWARM_RETURN_IF_ERROR(StepScheduleFromJob(job).status());
  if (job.schedule_in_flight() > 4096) return Invalid("schedule_in_flight", "at most 4096");
  if (job.checkpoint_every_steps() > 1000000) return Invalid("checkpoint_every_steps", "at most 1000000");
  return absl::OkStatus();
}

namespace {

// Fields renamed in a job's JSON: the old name is still read, with a
// warning, for one release after the rename.
struct RenamedField {
  const char* message;   // full name of the message holding it
  const char* old_name;  // as jobs wrote it (JSON camelCase)
  const char* new_name;  // the field's JSON name now
};
constexpr RenamedField kRenamedFields[] = {
    {"aqswarm.v1.DataSpec", "tokenizerDir", "tokenizer"},
};

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                        std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (same ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

const google::protobuf::FieldDescriptor* FindJsonField(const google::protobuf::Descriptor* d, std::string_view key) {
  for (int i = 0; i < d->field_count(); ++i) {
    const auto* f = d->field(i);
    if (f->json_name() == key || f->name() == key) return f;
  }
  return nullptr;
}

// An enum field's JSON string, for protobuf's parser: "" is the field's 0
// (UNSPECIFIED: the default), a json_alias ("1f1b") its value's name; a
// name of no value is an error listing the choices.
absl::Status CheckEnumName(nlohmann::json& item, const google::protobuf::FieldDescriptor* f, const std::string& where) {
  if (!item.is_string()) return absl::OkStatus();  // a number: ValidateJobSpec checks it
  const std::string name = item.get<std::string>();
  if (name.empty()) {
    item = 0;
    return absl::OkStatus();
  }
  const google::protobuf::EnumValueDescriptor* v = job_format::FindJobEnumValue(f->enum_type(), name);
  if (v == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", where, ": '", name, "' is not ",
                                                   job_format::JobEnumChoices(f->enum_type())));
  }
  item = v->name();
  return absl::OkStatus();
}

// Walks `obj` (a JSON object for message `d`, at `path`) before protobuf's
// parser sees it: renamed fields are moved to their new names (a warning
// each); an unknown field is an error naming the message, the field and the
// closest valid name; a scalar field given an object or array is refused
// here (so nothing nests deeper than the messages do); enum names are
// checked and aliases resolved (CheckEnumName).
absl::Status CheckJsonFields(nlohmann::json& obj, const google::protobuf::Descriptor* d, const std::string& path,
                             std::vector<std::string>* warnings) {
  std::vector<std::pair<std::string, std::string>> renames;
  for (auto& [key, value] : obj.items()) {
    const std::string where = path.empty() ? key : absl::StrCat(path, ".", key);
    const google::protobuf::FieldDescriptor* f = FindJsonField(d, key);
    if (f == nullptr) {
      for (const RenamedField& r : kRenamedFields) {
        if (d->full_name() == r.message && key == r.old_name) {
          f = FindJsonField(d, r.new_name);
          renames.emplace_back(key, r.new_name);
          warnings->push_back(absl::StrCat("job spec: ", where, " is now ", path.empty() ? "" : absl::StrCat(path, "."),
                                           r.new_name, "; the old name is read for one release, rename it"));
        }
      }
    }
    if (f == nullptr) {
      std::string closest;
      size_t best = std::string::npos;
      for (int i = 0; i < d->field_count(); ++i) {
        const size_t dist = EditDistance(key, d->field(i)->json_name());
        if (dist < best) best = dist, closest = d->field(i)->json_name();
      }
      return absl::InvalidArgumentError(absl::StrCat("job spec: ", where, ": no such field in ", d->name(),
                                                     closest.empty() ? "" : absl::StrCat("; did you mean '", closest, "'?")));
    }
    if (value.is_null()) continue;
    const bool message = f->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE &&
                         f->message_type()->file()->package() != "google.protobuf";
    if (f->is_map()) {
      if (!value.is_object()) return absl::InvalidArgumentError(absl::StrCat("job spec: ", where, ": expects an object"));
      const google::protobuf::FieldDescriptor* v = f->message_type()->map_value();
      for (auto& [k, item] : value.items()) {
        if (v->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE && item.is_object()) {
          AQSWARM_RETURN_IF_ERROR(CheckJsonFields(item, v->message_type(), absl::StrCat(where, ".", k), warnings));
        } else if (item.is_structured()) {
          return absl::InvalidArgumentError(absl::StrCat("job spec: ", where, ".", k, ": expects a single value"));
        }
      }
      continue;
    }
    if (f->is_repeated() && !value.is_array()) {
      return absl::InvalidArgumentError(absl::StrCat("job spec: ", where, ": expects an array"));
    }
    std::vector<nlohmann::json*> items;
    if (f->is_repeated()) {
      for (auto& item : value) items.push_back(&item);
    } else {
      items.push_back(&value);
    }
    for (nlohmann::json* item : items) {
      if (message && !item->is_object()) {
        return absl::InvalidArgumentError(absl::StrCat("job spec: ", where, ": expects an object"));
      }
      if (message) {
        AQSWARM_RETURN_IF_ERROR(CheckJsonFields(*item, f->message_type(), where, warnings));
      } else if (f->type() == google::protobuf::FieldDescriptor::TYPE_ENUM) {
        AQSWARM_RETURN_IF_ERROR(CheckEnumName(*item, f, where));
      } else if (item->is_structured()) {
        return absl::InvalidArgumentError(absl::StrCat("job spec: ", where, ": expects ",
                                                       f->is_repeated() ? "an array of single values" : "a single value",
                                                       ", not an ", item->is_object() ? "object" : "array"));
      }
    }
  }
  for (const auto& [from, to] : renames) {
    if (obj.contains(to)) {
      return absl::InvalidArgumentError(absl::StrCat("job spec: ", path.empty() ? "" : absl::StrCat(path, "."), from,
                                                     " and ", to, " both set (", from, " is ", to, "'s old name)"));
    }
    obj[to] = std::move(obj[from]);
    obj.erase(from);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::JobSpec> ReadJobSpecJson(std::string_view json, std::vector<std::string>* warnings) {
  nlohmann::json tree;
  try {
    tree = nlohmann::json::parse(json.begin(), json.end());
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: not valid JSON: ", e.what()));
  }
  if (!tree.is_object()) return absl::InvalidArgumentError("job spec: expects a JSON object");
  std::vector<std::string> said;
  AQSWARM_RETURN_IF_ERROR(CheckJsonFields(tree, v1::JobSpec::descriptor(), "", &said));
  for (const std::string& w : said) {
    if (warnings != nullptr) {
      warnings->push_back(w);
    } else {
      AQSWARM_LOG(WARNING) << w;
    }
  }
  v1::JobSpec job;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status = google::protobuf::util::JsonStringToMessage(tree.dump(), &job, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", status.ToString()));
  }
  return job;
}

absl::StatusOr<v1::JobSpec> ParseJobSpec(std::string_view json, std::vector<std::string>* warnings) {
  AQSWARM_ASSIGN_OR_RETURN(v1::JobSpec job, ReadJobSpecJson(json, warnings));
  ApplyJobDefaults(&job);
  AQSWARM_RETURN_IF_ERROR(ValidateJobSpec(job));
  return job;
}

namespace {

// The JSON form of `obj` (message `d` as protobuf prints it) as jobs are
// written: an enum at 0 (UNSPECIFIED: the field's default) as "", a value
// with a json_alias as the alias.
void WriteEnumNames(nlohmann::ordered_json& obj, const google::protobuf::Descriptor* d) {
  for (auto& [key, value] : obj.items()) {
    const google::protobuf::FieldDescriptor* f = FindJsonField(d, key);
    if (f == nullptr || f->is_repeated() || f->is_map()) continue;
    if (f->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE && value.is_object()) {
      WriteEnumNames(value, f->message_type());
    } else if (f->type() == google::protobuf::FieldDescriptor::TYPE_ENUM && value.is_string()) {
      const google::protobuf::EnumValueDescriptor* v = f->enum_type()->FindValueByName(value.get<std::string>());
      if (v != nullptr) value = v->number() == 0 ? std::string() : job_format::JobEnumJsonName(v);
    }
  }
}

}  // namespace

std::string JobSpecJson(const v1::JobSpec& job) {
  google::protobuf::util::JsonPrintOptions po;
  po.always_print_primitive_fields = true;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(job, &json, po);
  nlohmann::ordered_json tree = nlohmann::ordered_json::parse(json);
  WriteEnumNames(tree, v1::JobSpec::descriptor());
  return tree.dump(1) + "\n";
}

absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("job spec: cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  std::vector<std::string> warnings;
  auto job = ParseJobSpec(ss.str(), &warnings);
  for (const std::string& w : warnings) AQSWARM_LOG(WARNING) << path << ": " << w;
  if (!job.ok()) {
    return absl::Status(job.status().code(), absl::StrCat(path, ": ", job.status().message()));
  }
  return job;
}

double LearningRateAt(const v1::OptimizerSpec& opt, int64_t step) {
  const double lr = opt.lr();
  if (opt.warmup_steps() > 0 && step < opt.warmup_steps()) {
    return lr * static_cast<double>(step + 1) / opt.warmup_steps();
  }
  if (opt.total_steps() == 0) return lr;
  if (step >= opt.total_steps()) return opt.min_lr();
  const double span = static_cast<double>(opt.total_steps() - opt.warmup_steps());
  const double frac = span <= 0 ? 1.0 : static_cast<double>(step - opt.warmup_steps()) / span;
  return lr + (opt.min_lr() - lr) * frac;
}

namespace {

// The blocks of stage `stage` of `num_stages`: the split of StageRangeFor
// (pipeline/stage_model.h), which this must match.
int64_t StageBlocks(const v1::ModelSpec& spec, int stage, int num_stages) {
  const int64_t n = spec.n_layer(), base = n / num_stages, extra = n % num_stages;
  return base + (stage < extra ? 1 : 0);
}

int64_t KvDim(const v1::ModelSpec& s) {
  return KeyValueHeads(s) * (s.d_model() / s.n_head());
}

int64_t BlockParameterCount(const v1::ModelSpec& s) {
  const int64_t d = s.d_model(), f = FeedForwardDim(s);
  if (s.family() == v1::ModelSpec::Family::llama) {
    // 2 RMSNorm weights, q [d, d], k and v [kv, d], o [d, d], gate/up/down.
    return 2 * d + d * d + 2 * KvDim(s) * d + d * d + 3 * d * f;
  }
  // ln_1, c_attn (+bias), c_proj (+bias), ln_2, c_fc (+bias), mlp c_proj (+bias).
  return 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * f + f) + (f * d + d);
}

// Values per token and block that autograd keeps for backward (see the header).
int64_t KeptValuesPerTokenAndBlock(const v1::ModelSpec& s) {
  const int64_t d = s.d_model(), attention = int64_t{s.n_head()} * s.seq_len();
  if (s.family() == v1::ModelSpec::Family::llama) return 7 * d + 3 * KvDim(s) + 4 * FeedForwardDim(s) + attention;
  return 17 * d + attention;
}

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kStageProcessBytes = 512 * kMiB;     // libtorch, gRPC, the store, the corpus
constexpr int64_t kDefaultResidentBytes = 64 * kMiB;  // compression.resident_bytes unset
// One micro-batch's float32 logits [B, T, V] are alive this many times at the
// last stage's peak (logits, log-softmax, their gradients, the allocator's
// slack): 5 to 7 measured on a 4-layer d 64 GPT (docs/MODELS.md).
constexpr int64_t kLogitsCopies = 6;
// Writing a stage state (every checkpoint_every_steps) serializes weights and
// AdamW m and v (12 B/param) into one buffer while the gradients are still
// held: up to ~11 B/param more at the peak, measured on GPT-2 small's stages
// (docs/MODELS.md).
constexpr int64_t kCheckpointBytesPerParameter = 12;
// With tie_embeddings across stages every stage holds the tied gradient
// ([V, d] float32) in flight about this many times (the last stage sends it,
// middle stages relay it, stage 0 receives it): ~500 MB measured for GPT-2
// small's 154 MB on each stage.
constexpr int64_t kTiedGradientCopies = 3;

std::string GiB(int64_t bytes) { return absl::StrFormat("%.1f GiB", static_cast<double>(bytes) / (kMiB * 1024.0)); }

}  // namespace

bool DynamicLossScaling(const v1::JobSpec& job) {
  const auto mode = job.optimizer().loss_scale();
  return mode == v1::OptimizerSpec::LossScale::dynamic ||
         (mode == v1::OptimizerSpec::LossScale::UNSPECIFIED && job.precision() == v1::JobSpec::Precision::fp16);
}

const std::string& ModelFamilyName(const v1::ModelSpec& s) {
  return v1::ModelSpec::Family::Value_Name(s.family() == v1::ModelSpec::Family::UNSPECIFIED ? v1::ModelSpec::Family::gpt2
                                                                                              : s.family());
}

int64_t KeyValueHeads(const v1::ModelSpec& s) { return s.n_kv_head() == 0 ? s.n_head() : s.n_kv_head(); }

int64_t FeedForwardDim(const v1::ModelSpec& s) {
  const int64_t d = s.d_model();
  if (s.d_ff() != 0) return s.d_ff();
  return s.family() == v1::ModelSpec::Family::llama ? 256 * ((8 * d / 3 + 255) / 256) : 4 * d;
}

int64_t StageParameterCount(const v1::ModelSpec& s, int stage, int num_stages) {
  const int64_t d = s.d_model(), v = s.vocab_size();
  const bool llama = s.family() == v1::ModelSpec::Family::llama;
  int64_t n = StageBlocks(s, stage, num_stages) * BlockParameterCount(s);
  if (stage == 0) n += v * d + (llama ? 0 : int64_t{s.seq_len()} * d);  // token (+ gpt2 position) embedding
  if (stage == num_stages - 1) {
    n += llama ? d : 2 * d;  // final norm
    // The head: the embedding itself on one stage with tied embeddings,
    // otherwise a matrix of its own (a copy when tied across stages).
    if (!(s.tie_embeddings() && num_stages == 1)) n += v * d;
  }
  return n;
}

int64_t TotalParameterCount(const v1::ModelSpec& spec) { return StageParameterCount(spec, 0, 1); }

int64_t EstimateStageBytes(const v1::JobSpec& job, int stage) {
  const v1::ModelSpec& s = job.model();
  const int num_stages = static_cast<int>(std::max<uint32_t>(1, job.stages()));
  const double params = static_cast<double>(StageParameterCount(s, stage, num_stages));
  // Weights, gradients, AdamW m and v (float32), and writing a checkpoint.
  int64_t per_param = 16 + kCheckpointBytesPerParameter;
  if (job.precision() != v1::JobSpec::Precision::fp32) per_param += 2;  // compute copies of the weights
  if (job.data_parallel() > 1 && job.dp().optimizer() == v1::DataParallelSpec::quantized_adam) per_param += 8;
  // diloco: the anchor, the outer momentum and two error buffers.
  if (job.data_parallel() > 1 && job.dp().optimizer() == v1::DataParallelSpec::diloco) per_param += 16;
  if (job.data_parallel() > 1 && job.dp().delayed_update()) per_param += 8;
  // In double: a validated spec may still describe a model whose bytes do not
  // fit an int64 (the result is clamped), and nothing here may overflow.
  double bytes = params * static_cast<double>(per_param) + kStageProcessBytes;

  const double tokens = static_cast<double>(job.micro_batch_size()) * s.seq_len();  // per micro-batch
  const double blocks = static_cast<double>(StageBlocks(s, stage, num_stages));
  const double elem = job.precision() == v1::JobSpec::Precision::fp32 ? 4 : 2;
  const absl::StatusOr<StepSchedule> schedule = StepScheduleFromJob(job);
  const double in_flight = static_cast<double>(
      schedule.ok() ? InFlightAt(*schedule, stage) : std::max<int64_t>(1, job.micro_batches_per_step()));
  const double block_set = tokens * static_cast<double>(KeptValuesPerTokenAndBlock(s)) * elem;  // one block, one micro-batch
  if (s.recompute()) {
    bytes += in_flight * tokens * blocks * s.d_model() * 4 + (blocks > 0 ? block_set : 0);
  } else {
    bytes += in_flight * blocks * block_set;
  }
  if (s.tie_embeddings() && num_stages > 1) {
    bytes += kTiedGradientCopies * static_cast<double>(s.vocab_size()) * s.d_model() * 4;
  }
  if (stage == num_stages - 1) bytes += kLogitsCopies * tokens * static_cast<double>(s.vocab_size()) * 4;
  if (job.compression().mode() == v1::LinkCompression::aqsgd) {
    const double resident = job.compression().has_resident_bytes()
                                ? static_cast<double>(job.compression().resident_bytes())
                                : static_cast<double>(kDefaultResidentBytes);
    bytes += resident * ((stage > 0 ? 1 : 0) + (stage < num_stages - 1 ? 1 : 0));
  }
  return bytes >= 9.0e18 ? int64_t{9'000'000'000'000'000'000} : static_cast<int64_t>(bytes);
}

absl::StatusOr<int64_t> AvailableMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  if (!in) return absl::UnavailableError("cannot read /proc/meminfo");
  std::string key, unit;
  int64_t value = 0;
  while (in >> key >> value) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return value * 1024;  // kB
  }
  return absl::UnavailableError("/proc/meminfo has no MemAvailable");
}

absl::Status CheckStageMemory(const v1::JobSpec& job, int stage, int64_t available_bytes) {
  const int64_t need = EstimateStageBytes(job, stage);
  if (need <= available_bytes) return absl::OkStatus();
  const int num_stages = static_cast<int>(std::max<uint32_t>(1, job.stages()));
  return absl::ResourceExhaustedError(absl::StrCat(
      "stage ", stage, " of ", num_stages, " needs about ", GiB(need), " (",
      StageParameterCount(job.model(), stage, num_stages), " parameters with their gradients and AdamW state, ",
      "plus activations; pipeline/job_spec.h EstimateStageBytes) but this machine has ", GiB(available_bytes),
      " available (MemAvailable); use more stages, a smaller micro_batch_size or seq_len, model.recompute, "
      "or a machine with more memory"));
}

absl::Status CheckStageMemory(const v1::JobSpec& job, int stage) {
  if (job.device() != "cpu") return absl::OkStatus();
  const absl::StatusOr<int64_t> available = AvailableMemoryBytes();
  if (!available.ok()) return absl::OkStatus();
  return CheckStageMemory(job, stage, *available);
}

}  // namespace aqswarm::pipeline
