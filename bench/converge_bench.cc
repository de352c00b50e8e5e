// `aqswarm bench converge`: time to a target validation
// loss, per DP optimizer, link compression and link shaping.
//
// Every run is a real `aqswarm pipeline` (a private copy of this executable)
// on a fresh directory, with the base job changed only in what the
// configuration and the shaping name:
//   adamw-fp32         dp.optimizer adamw, compression fp32 (the baseline)
//   qadam-aqsgd        dp.optimizer quantized_adam on 0/1 Adam's growing
//                      variance refresh (dp.varianceRefreshSteps, else 4;
//                      dp.refreshGrowth 2: refreshes 4, 8, 16, 24, 40, ... steps
//                      after the freeze; dp.warmupSteps, else
//                      a sixteenth of the job's steps), AQ-SGD fw3 bw6 links
//   diloco-hH-aqsgd    dp.optimizer diloco, dp.innerSteps H, AQ-SGD fw3 bw6
// (OPT-LINK in general: OPT adamw | qadam | diloco-hH; LINK one of
//   fp32            raw float32 links
//   directq         fixed point fw3 bw6, no state
//   aqsgd           AQ-SGD fw3 bw6, first visits raw (fp16)
//   tiledB          the tiled codec, fw B bits, bw 6 (compression.mode tiled)
//   aqsgd_tiledB    AQ-SGD fw3 bw6 with first visits tiled at B bits
//   aqsgd_fixedB    AQ-SGD fw3 bw6 with first visits in per-channel fixed point at B bits
// tiled ones optionally followed by _mt: the midtread grid (compression.tileGrid
// midtread; else midrise), then aqsgd_tiledB and aqsgd_fixedB ones by _ref: a per-token
// first-visit reference (compression.firstVisitReference), then tiled ones by
// _tok: tiles along tokens (compression.tileAlong tokens), then each but fp32
// optionally by _ent: zstd over the codes, both ways, then by _gt: gradients
// tiled (compression.bwCodec tiled), then by _fwN (not tiledB) and _bwN:
// other bits than fw3 bw6, e.g. adamw-aqsgd_tiled3_ent_bw4).
// OPT takes _-separated settings: qadam_wN (dp.warmupSteps N), qadam_wbB
// (dp.warmupBits B), diloco-hH_olrX (dp.outerLr X), diloco-hH_omY
// (dp.outerMomentum Y), qadam_lsN and qadam_lsgG (0/1 Adam's local steps:
// dp.maxLocalSteps N, dp.localStepGrowth G), qadam_bB and diloco-hH_bB (dp.bits B, 2..8: the
// momentum's or the pseudo-gradient's codes), qadam_ent and diloco-hH_ent
// (dp.entropyCoding: zstd over those codes), adamw_dpu and qadam_dpu
// (dp.delayedUpdate: the exchange runs behind the next step), any OPT _lrX
// (optimizer.lr and minLr times X: DiLoCo's inner lr) and any OPT _stepsX
// (optimizer.totalSteps and maxSteps times X: a run with its own, longer or
// shorter schedule, e.g. DiLoCo given more steps to reach the target; its
// steps, bytes and times are its own run's), e.g. qadam_w128_wb8-aqsgd,
// diloco-h16_lr1.4-aqsgd, diloco-h16_lr1.41_steps1.5-aqsgd.
// dp.bits (unless _bB), bucket size and codec are the base job's; the shaping is the
// job's `shaping` (stage links and the DP exchange alike).
//
// Measured, from the run's events.jsonl:
//   val loss at step s     the mean over pipelines of the eval events after
//                          step s (pipelines differ between diloco's outer
//                          steps; they are identical after one and always
//                          with adamw / quantized_adam)
//   steps_to_target        s + 1 for the first eval step s whose val loss is
//                          <= the target (null if none)
//   seconds_to_target      the sum over steps 0..s of the step time: stage 0's
//                          step_seconds, the max over pipelines (stage 0 runs
//                          a step's first forward and last backward, so its
//                          step spans the step; start-up is in step 0). The
//                          evaluations' own time is not counted: the events
//                          do not carry it.
//   dp_bytes_per_replica   every stage's dp.bytes of every step, summed over
//                          the stages of a pipeline, the mean over pipelines
//   link bytes             every fw_bytes + bw_bytes of the run
// Ratios are the baseline's quantity / the run's (> 1 = fewer bytes);
// all_bytes_ratio_vs_baseline counts every byte on the wire (links + DP of
// every replica). val_curve is the unshaped run's [steps, val loss].
//
// Shaped runs. Shaping changes timing, not training: a shaped run's losses
// and parameter hashes equal the unshaped run's at every step (the bench
// checks every step and fails when they do not). So a shaped run trains only
// its first N steps: at least shaped_steps, past the second occurrence (after
// step 0; the first of a kind that occurs once) of every DP step kind of the
// unshaped run up to its target step (all its steps when it does not reach
// the target: only those steps are timed) (StepDataParallel.kind:
// adamw; warmup, compressed, refresh; local, outer), rounded up to whole
// diloco outer periods (H steps). Its steps_to_target is the unshaped run's;
// seconds_to_target = its measured step times up to there, then, for every
// later step up to the target, the shaped run's mean time of steps of that
// step's kind (step 0, the start-up, left out of the means), with
// "extrapolated": true. A run whose target step is within its N steps is not
// extrapolated. AQ-SGD sends first visits (epoch 0) whole or tiled and
// deltas later: with AQ-SGD links, epoch 0's steps are a kind of their own
// ("<kind> epoch 0"), so its shaped runs train past epoch 0 and time both.
//
// A configuration whose run fails (or whose shaped run does not train as its
// unshaped run did) gets a row {"run", ..., "error": why}, its other
// shapings are skipped, the bench goes on and exits with an error at the
// end; a failed baseline stops it at once.
//
// --baseline FILE (an earlier converge bench's JSONL of the same job) takes
// that file's adamw-fp32@0/0 row as the baseline instead of running it:
// AdamW + fp32 links train bit-identically every time, so its final loss and
// bytes (the target and the ratios) are the same; times against AdamW are
// then another run's. Rows carry the job's job_sha256 (its JSON, shaping
// cleared), which the baseline row must match (rows older than the field:
// its steps and lr), and "baseline": FILE.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/file_util.h"
#include "common/sha256.h"
#include "stage/pipeline_monitor.h"
#include "common/status_macros.h"
#include "common/subprocess.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "pipeline/job_spec.h"

namespace aqswarm::bench {
namespace {

namespace fs = std::filesystem;

constexpr int kAqsgdFwBits = 3, kAqsgdBwBits = 6;
// quantized_adam's refresh schedule when the base job does not set one: the
// first interval, and refreshes per doubling of it (0/1 Adam's policy).
constexpr uint32_t kRefreshSteps = 4, kRefreshGrowth = 2;

struct Config {
  std::string name;
  v1::DataParallelSpec::Optimizer optimizer = v1::DataParallelSpec::adamw;
  int inner_steps = 0;  // diloco: H
  // OPT's suffixes (see the file comment); 0 / NAN = the base job's or the default.
  int warmup_steps = 0, warmup_bits = 0;  // qadam: _wN, _wbB
  double outer_lr = NAN, outer_momentum = NAN;  // diloco: _olrX, _omY
  double lr_scale = 1;                           // any: _lrX (optimizer.lr and minLr times X)
  int dp_bits = 0;                               // qadam, diloco: _bB (dp.bits)
  bool dp_entropy = false;                       // qadam, diloco: _ent (dp.entropyCoding)
  double steps_scale = 1;                        // any: _stepsX (optimizer.totalSteps and maxSteps times X)
  int local_steps = 0, local_step_growth = 0;    // qadam: _lsN, _lsgG (dp.maxLocalSteps, dp.localStepGrowth)
  bool delayed_update = false;                   // adamw, qadam: _dpu (dp.delayedUpdate)
  bool tiled_gradients = false;  // LINK _gt: compression.bwCodec tiled
  // The links (see the file comment).
  v1::LinkCompression::Mode link_mode = v1::LinkCompression::fp32;
  int fw_bits = 32, bw_bits = 32;
  int first_visit_bits = 0;  // aqsgd_tiledB, aqsgd_fixedB: B; else 0 (raw first visits)
  bool fixed_first_visits = false;  // aqsgd_fixedB
  bool entropy = false;
  bool tiles_along_tokens = false;  // _tok
  bool midtread = false;            // _mt
  bool reference = false;           // _ref: compression.firstVisitReference
};

// A trailing "_<prefix>N" (N bits, 1..8) of `link`, removed; 0 when absent.
int ConsumeBits(absl::string_view* link, absl::string_view prefix) {
  const size_t at = link->rfind(absl::StrCat("_", prefix));
  int bits = 0;
  if (at == absl::string_view::npos || !absl::SimpleAtoi(link->substr(at + 1 + prefix.size()), &bits) || bits < 1 ||
      bits > 8) {
    return 0;
  }
  link->remove_suffix(link->size() - at);
  return bits;
}

// LINK of a configuration name into `c`; false when it is not one.
bool ParseLink(absl::string_view link, Config* c) {
  const int bw = ConsumeBits(&link, "bw"), fw = ConsumeBits(&link, "fw");
  c->tiled_gradients = absl::ConsumeSuffix(&link, "_gt");
  c->entropy = absl::ConsumeSuffix(&link, "_ent");
  c->tiles_along_tokens = absl::ConsumeSuffix(&link, "_tok");
  c->reference = absl::ConsumeSuffix(&link, "_ref");
  c->midtread = absl::ConsumeSuffix(&link, "_mt");
  if (c->reference && !absl::StartsWith(link, "aqsgd_tiled") && !absl::StartsWith(link, "aqsgd_fixed")) return false;
  if ((c->tiles_along_tokens || c->midtread) && !absl::StrContains(link, "tiled")) return false;
  int bits = 0;
  if (link == "fp32") {
    return !c->entropy && !c->tiled_gradients && fw == 0 && bw == 0;
  } else if (link == "directq" || link == "aqsgd") {
    c->link_mode = link == "aqsgd" ? v1::LinkCompression::aqsgd : v1::LinkCompression::directq;
    c->fw_bits = kAqsgdFwBits;
  } else if (absl::ConsumePrefix(&link, "aqsgd_tiled") ||
             (c->fixed_first_visits = absl::ConsumePrefix(&link, "aqsgd_fixed"))) {
    if (!absl::SimpleAtoi(link, &bits) || bits < 1 || bits > 8) return false;
    c->link_mode = v1::LinkCompression::aqsgd;
    c->fw_bits = kAqsgdFwBits;
    c->first_visit_bits = bits;
  } else if (absl::ConsumePrefix(&link, "tiled")) {
    if (!absl::SimpleAtoi(link, &bits) || bits < 1 || bits > 8) return false;
    c->link_mode = v1::LinkCompression::tiled;
    c->fw_bits = bits;
  } else {
    return false;
  }
  c->bw_bits = kAqsgdBwBits;
  if (fw > 0) {
    if (c->link_mode == v1::LinkCompression::tiled) return false;  // tiledB names its forward bits
    c->fw_bits = fw;
  }
  if (bw > 0) c->bw_bits = bw;
  return true;
}

absl::StatusOr<Config> ParseConfig(absl::string_view text) {
  Config c;
  c.name = std::string(text);
  const size_t dash = text.rfind('-');
  const absl::string_view link = dash == absl::string_view::npos ? "" : text.substr(dash + 1);
  bool ok = ParseLink(link, &c);
  // OPT = a name, then _-separated settings.
  const std::vector<absl::string_view> opt = absl::StrSplit(text.substr(0, dash), '_');
  absl::string_view name = opt[0];
  if (name == "qadam") {
    c.optimizer = v1::DataParallelSpec::quantized_adam;
  } else if (absl::ConsumePrefix(&name, "diloco-h")) {
    c.optimizer = v1::DataParallelSpec::diloco;
    ok = ok && absl::SimpleAtoi(name, &c.inner_steps) && c.inner_steps >= 1;
  } else {
    ok = ok && name == "adamw";
  }
  const bool qadam = c.optimizer == v1::DataParallelSpec::quantized_adam;
  const bool diloco = c.optimizer == v1::DataParallelSpec::diloco;
  for (size_t i = 1; ok && i < opt.size(); ++i) {
    absl::string_view s = opt[i];
    if (qadam && absl::ConsumePrefix(&s, "wb")) {
      ok = absl::SimpleAtoi(s, &c.warmup_bits) && c.warmup_bits >= 2 && c.warmup_bits <= 8;
    } else if (qadam && absl::ConsumePrefix(&s, "w")) {
      ok = absl::SimpleAtoi(s, &c.warmup_steps) && c.warmup_steps >= 1;
    } else if (diloco && absl::ConsumePrefix(&s, "olr")) {
      ok = absl::SimpleAtod(s, &c.outer_lr) && c.outer_lr > 0 && c.outer_lr <= 10;
    } else if (diloco && absl::ConsumePrefix(&s, "om")) {
      ok = absl::SimpleAtod(s, &c.outer_momentum) && c.outer_momentum >= 0 && c.outer_momentum < 1;
    } else if (qadam && absl::ConsumePrefix(&s, "lsg")) {
      ok = absl::SimpleAtoi(s, &c.local_step_growth) && c.local_step_growth >= 1;
    } else if (qadam && absl::ConsumePrefix(&s, "ls")) {
      ok = absl::SimpleAtoi(s, &c.local_steps) && c.local_steps >= 2;
    } else if ((qadam || diloco) && s == "ent") {
      c.dp_entropy = true;
    } else if ((qadam || diloco) && absl::ConsumePrefix(&s, "b")) {
      ok = absl::SimpleAtoi(s, &c.dp_bits) && c.dp_bits >= 2 && c.dp_bits <= 8;
    } else if (!diloco && s == "dpu") {
      c.delayed_update = true;
    } else if (absl::ConsumePrefix(&s, "steps")) {
      ok = absl::SimpleAtod(s, &c.steps_scale) && c.steps_scale >= 0.01 && c.steps_scale <= 100;
    } else if (absl::ConsumePrefix(&s, "lr")) {
      ok = absl::SimpleAtod(s, &c.lr_scale) && c.lr_scale > 0 && c.lr_scale <= 100;
    } else {
      ok = false;
    }
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("converge: unknown configuration '", text,
                                                   "' (want OPT-LINK: OPT adamw, qadam[_wN][_wbB] or "
                                                   "diloco-hH[_olrX][_omY] with H >= 1, qadam and diloco optionally with _bB (dp.bits 2..8) and _ent, "
                                                   "each optionally with _lrX and _stepsX, "
                                                   "adamw and qadam with _dpu, qadam with _lsN (N >= 2) and _lsgG, "
                                                   "LINK fp32, directq, aqsgd, tiledB, aqsgd_tiledB or aqsgd_fixedB (B bits 1..8), tiled ones optionally "
                                                   "with _mt, _ref (aqsgd_tiledB, aqsgd_fixedB) then _tok, all but fp32 optionally with _ent, _gt, _fwN and _bwN; e.g. adamw-fp32, diloco-h32_olr1.4-aqsgd, adamw-aqsgd_tiled3_ent)"));
  }
  return c;
}

// The configurations, the baseline adamw-fp32 first (added when missing).
absl::StatusOr<std::vector<Config>> ParseConfigs(const std::string& list) {
  std::vector<Config> out = {Config{.name = "adamw-fp32"}};
  for (absl::string_view t : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    AQSWARM_ASSIGN_OR_RETURN(Config c, ParseConfig(absl::StripAsciiWhitespace(t)));
    if (std::none_of(out.begin(), out.end(), [&](const Config& x) { return x.name == c.name; })) out.push_back(c);
  }
  return out;
}

struct Shaping {
  double mbps = 0, latency_ms = 0;
  bool unshaped() const { return mbps == 0 && latency_ms == 0; }
  std::string Label() const { return absl::StrCat(mbps, "/", latency_ms); }
};

// "MBIT/MS" pairs; 0/0 (unshaped) always first.
absl::StatusOr<std::vector<Shaping>> ParseShapings(const std::string& list) {
  std::vector<Shaping> out = {Shaping{}};
  for (absl::string_view t : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    t = absl::StripAsciiWhitespace(t);
    std::vector<absl::string_view> parts = absl::StrSplit(t, '/');
    Shaping s;
    if (parts.size() != 2 || !absl::SimpleAtod(parts[0], &s.mbps) || !absl::SimpleAtod(parts[1], &s.latency_ms) ||
        !std::isfinite(s.mbps) || !std::isfinite(s.latency_ms) || s.mbps < 0 || s.latency_ms < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "converge: bad shaping '", t, "' (want MBIT/MS: bandwidth in Mbit/s and one-way latency in ms, both >= 0, "
                                        "e.g. 100/50; 0/0 = unshaped)"));
    }
    if (std::none_of(out.begin(), out.end(),
                     [&](const Shaping& x) { return x.mbps == s.mbps && x.latency_ms == s.latency_ms; })) {
      out.push_back(s);
    }
  }
  return out;
}

// The base job under configuration `c`, validated.
absl::StatusOr<v1::JobSpec> ConfigJob(const v1::JobSpec& base, const Config& c) {
  v1::JobSpec job = base;
  job.set_name(absl::StrCat(base.name(), "-", c.name));
  v1::LinkCompression* comp = job.mutable_compression();
  comp->set_mode(c.link_mode);
  if (c.link_mode != v1::LinkCompression::fp32) {
    comp->set_fw_bits(c.fw_bits);
    comp->set_bw_bits(c.bw_bits);
  }
  if (c.first_visit_bits > 0) {
    comp->set_first_visit(c.fixed_first_visits ? v1::LinkCompression::FirstVisit::fixed_point
                                               : v1::LinkCompression::FirstVisit::tiled);
    comp->set_first_visit_bits(c.first_visit_bits);
  }
  comp->set_entropy_coding(c.entropy);
  if (c.tiles_along_tokens) comp->set_tile_along(v1::LinkCompression::TileAlong::tokens);
  comp->set_tile_grid(c.midtread ? v1::LinkCompression::TileGrid::midtread : v1::LinkCompression::TileGrid::midrise);
  comp->set_first_visit_reference(c.reference);
  if (c.tiled_gradients) comp->set_bw_codec(v1::LinkCompression::BwCodec::tiled);
  if (c.lr_scale != 1) {
    job.mutable_optimizer()->set_lr(base.optimizer().lr() * c.lr_scale);
    job.mutable_optimizer()->set_min_lr(base.optimizer().min_lr() * c.lr_scale);
  }
  if (c.steps_scale != 1) {
    const auto scaled = [&](uint32_t n) { return static_cast<uint32_t>(std::max(1.0, std::round(n * c.steps_scale))); };
    job.mutable_optimizer()->set_total_steps(scaled(base.optimizer().total_steps()));
    if (base.max_steps() > 0) job.set_max_steps(scaled(base.max_steps()));
  }
  v1::DataParallelSpec* dp = job.mutable_dp();
  const v1::DataParallelSpec& b = base.dp();
  // What belongs to one optimizer only is the configuration's to set.
  dp->set_optimizer(c.optimizer);
  dp->set_delayed_update(c.delayed_update);
  for (auto clear : {&v1::DataParallelSpec::clear_refresh_growth, &v1::DataParallelSpec::clear_max_local_steps,
                     &v1::DataParallelSpec::clear_local_step_growth, &v1::DataParallelSpec::clear_inner_steps,
                     &v1::DataParallelSpec::clear_outer_lr, &v1::DataParallelSpec::clear_outer_momentum,
                     &v1::DataParallelSpec::clear_fragments, &v1::DataParallelSpec::clear_variance_refresh_steps,
                     &v1::DataParallelSpec::clear_warmup_steps, &v1::DataParallelSpec::clear_warmup_bits}) {
    (dp->*clear)();
  }
  if (c.dp_bits > 0) dp->set_bits(static_cast<uint32_t>(c.dp_bits));
  dp->set_entropy_coding(c.dp_entropy);
  if (c.optimizer == v1::DataParallelSpec::quantized_adam) {
    const uint32_t steps = job.max_steps() > 0 ? job.max_steps() : job.optimizer().total_steps();
    dp->set_warmup_steps(c.warmup_steps > 0   ? static_cast<uint32_t>(c.warmup_steps)
                         : b.warmup_steps() > 0 ? b.warmup_steps()
                                                : std::max<uint32_t>(1, steps / 16));
    dp->set_warmup_bits(c.warmup_bits > 0 ? static_cast<uint32_t>(c.warmup_bits) : b.warmup_bits());
    dp->set_variance_refresh_steps(b.has_variance_refresh_steps() && b.variance_refresh_steps() > 0
                                       ? b.variance_refresh_steps()
                                       : kRefreshSteps);
    dp->set_refresh_growth(kRefreshGrowth);
    if (c.local_steps > 0) dp->set_max_local_steps(static_cast<uint32_t>(c.local_steps));
    if (c.local_step_growth > 0) dp->set_local_step_growth(static_cast<uint32_t>(c.local_step_growth));
  }
  if (c.optimizer == v1::DataParallelSpec::diloco) {
    dp->set_inner_steps(c.inner_steps);
    if (!std::isnan(c.outer_lr)) {
      dp->set_outer_lr(c.outer_lr);
    } else if (b.has_outer_lr()) {
      dp->set_outer_lr(b.outer_lr());
    }
    if (!std::isnan(c.outer_momentum)) {
      dp->set_outer_momentum(c.outer_momentum);
    } else if (b.has_outer_momentum()) {
      dp->set_outer_momentum(b.outer_momentum());
    }
  }
  if (c.optimizer == v1::DataParallelSpec::adamw) {
    dp->clear_layerwise_every_steps();
    dp->clear_layerwise_min_bits();
    dp->clear_layerwise_max_bits();
    dp->set_codec(v1::DataParallelSpec::minmax);
  }
  pipeline::ApplyJobDefaults(&job);
  if (absl::Status s = pipeline::ValidateJobSpec(job); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("converge: configuration ", c.name, ": ", s.message()));
  }
  return job;
}

// What one pipeline run measured (events.jsonl).
struct Run {
  std::string dir;
  int64_t steps = 0;
  std::vector<double> step_seconds;  // per step: stage 0's, the max over pipelines
  std::vector<std::string> kinds;    // per step: pipeline 0 stage 0's dp.kind
  // (pipeline, stage, step) -> the step's loss and parameter hash.
  std::map<std::tuple<int, int, int64_t>, std::pair<double, std::string>> fingerprint;
  std::map<int64_t, double> val_loss;  // eval step -> mean over pipelines
  double dp_bytes_per_replica = 0, link_bytes = 0, fw_bytes = 0;
  double wall_seconds = 0;
};

// `first_epoch_kind`: steps of epoch 0 get their own kind ("<dp kind> epoch
// 0"), so a shaped AQ-SGD run times steps after its first epoch too.
absl::StatusOr<Run> ReadRun(const fs::path& events_path, const v1::JobSpec& job, bool first_epoch_kind) {
  AQSWARM_ASSIGN_OR_RETURN(std::unique_ptr<stage::PipelineMonitor> m,
                           stage::PipelineMonitor::Replay(job, events_path.string()));
  const int dp = static_cast<int>(job.data_parallel());
  Run r;
  double dp_bytes = 0;
  for (const std::vector<v1::StepEvent>& row : m->steps()) {
    const int64_t step = row[0].step();
    if (step != r.steps) {
      return absl::DataLossError(absl::StrCat(events_path.string(), ": step ", step, " after step ", r.steps - 1));
    }
    ++r.steps;
    double secs = 0;
    for (const v1::StepEvent& e : row) {
      r.fingerprint[{static_cast<int>(e.pipeline()), static_cast<int>(e.stage()), e.step()}] = {
          e.loss_not_finite() ? NAN : e.loss(), e.dp().param_hash()};
      dp_bytes += static_cast<double>(e.dp().bytes());
      r.link_bytes += static_cast<double>(e.fw_bytes()) + static_cast<double>(e.bw_bytes());
      r.fw_bytes += static_cast<double>(e.fw_bytes());
      if (e.stage() == 0) secs = std::max(secs, e.step_seconds());
    }
    r.step_seconds.push_back(secs);
    r.kinds.push_back(first_epoch_kind && row[0].epoch() == 0 ? row[0].dp().kind() + " epoch 0" : row[0].dp().kind());
  }
  for (const auto& [step, v] : m->evals()) {
    if (static_cast<int>(v.size()) != dp) {
      return absl::DataLossError(absl::StrCat(events_path.string(), ": eval after step ", step, " has ", v.size(),
                                              " pipelines, want ", dp));
    }
    double sum = 0;
    for (double x : v) sum += x;
    r.val_loss[step] = sum / dp;
  }
  if (r.val_loss.empty()) {
    return absl::DataLossError(absl::StrCat(events_path.string(), ": no eval events (set the job's evalEverySteps)"));
  }
  r.dp_bytes_per_replica = dp_bytes / dp;
  return r;
}

// Runs `job` with `aqswarm pipeline` in <dir>/run (the job in <dir>/job.json,
// the launcher's output in <dir>/pipeline.out and .err).
absl::StatusOr<Run> RunJob(const std::string& exe, const v1::JobSpec& job, const fs::path& dir, int timeout_s) {
  aqswarm::RemoveTree(dir).IgnoreError();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("converge: cannot create ", dir.string()));
  std::string json;
  google::protobuf::util::JsonPrintOptions po;
  po.add_whitespace = true;
  if (auto s = google::protobuf::util::MessageToJsonString(job, &json, po); !s.ok()) {
    return absl::InternalError(absl::StrCat("converge: cannot print the job: ", s.ToString()));
  }
  const fs::path job_path = dir / "job.json";
  std::ofstream(job_path) << json;
  const auto t0 = std::chrono::steady_clock::now();
  AQSWARM_ASSIGN_OR_RETURN(
      auto child, Subprocess::Spawn({exe, "pipeline", "--job=" + job_path.string(), "--out_dir=" + (dir / "run").string()},
                                    {.capture_stdout = true, .stderr_path = (dir / "pipeline.err").string()}));
  std::ofstream log(dir / "pipeline.out");
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  for (std::string line;;) {
    absl::Status s = child->ReadLine(&line, std::max(deadline - absl::Now(), absl::Seconds(1)));
    if (absl::IsOutOfRange(s)) break;
    if (!s.ok()) {
      child->Signal(SIGTERM);
      (void)child->Wait(absl::Seconds(15));
      return absl::DeadlineExceededError(
          absl::StrCat("converge: ", job.name(), " ran past ", timeout_s, " s; see ", dir.string()));
    }
    log << line << "\n";
  }
  absl::StatusOr<int> code = child->Wait(absl::Seconds(60));
  if (!code.ok() || *code != 0) {
    std::ifstream err(dir / "pipeline.err");
    std::stringstream ss;
    ss << err.rdbuf();
    return absl::InternalError(absl::StrCat("converge: ", job.name(), ": aqswarm pipeline failed (exit ",
                                            code.ok() ? *code : -1, "): ", ss.str().substr(0, 2000)));
  }
  AQSWARM_ASSIGN_OR_RETURN(Run r, ReadRun(dir / "run" / "events.jsonl", job,
                                          job.compression().mode() == v1::LinkCompression::aqsgd));
  r.dir = dir.string();
  r.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// Steps a shaped run of `c` trains (see the file comment).
int64_t ShapedSteps(const Run& unshaped, const Config& c, int min_steps, int64_t timed_steps) {
  int64_t n = min_steps;
  std::map<std::string, std::vector<int64_t>> at;  // kind -> its steps after step 0 (of the first timed_steps)
  for (int64_t t = 1; t < std::min(timed_steps, unshaped.steps); ++t) at[unshaped.kinds[t]].push_back(t);
  for (const auto& [kind, steps] : at) n = std::max(n, steps[std::min<size_t>(1, steps.size() - 1)] + 1);
  if (c.inner_steps > 0) n = (n + c.inner_steps - 1) / c.inner_steps * c.inner_steps;
  return std::min(n, unshaped.steps);
}

// FailedPrecondition unless `shaped` trained exactly as `unshaped` did at
// every step it ran (losses, parameter hashes, step kinds, val losses).
absl::Status CheckSameTraining(const Run& shaped, const Run& unshaped, const std::string& name) {
  auto fail = [&](const std::string& what) {
    return absl::FailedPreconditionError(absl::StrCat(
        "converge: ", name, ": ", what,
        ": training under this shaping is not bit-identical to the unshaped run, so its time to target cannot be "
        "taken from the unshaped run's steps (runs in ", shaped.dir, " and ", unshaped.dir, ")"));
  };
  if (shaped.steps > unshaped.steps) return fail(absl::StrCat(shaped.steps, " steps, unshaped ", unshaped.steps));
  for (const auto& [key, v] : shaped.fingerprint) {
    const auto& [p, s, step] = key;
    auto it = unshaped.fingerprint.find(key);
    const bool same = it != unshaped.fingerprint.end() && it->second.second == v.second &&
                      (it->second.first == v.first || (std::isnan(it->second.first) && std::isnan(v.first)));
    if (!same) {
      return fail(absl::StrFormat("step %d pipeline %d stage %d: loss %.17g, parameters %s; unshaped %s", step, p, s,
                                  v.first, v.second,
                                  it == unshaped.fingerprint.end()
                                      ? std::string("has no such step")
                                      : absl::StrFormat("loss %.17g, parameters %s", it->second.first,
                                                        it->second.second)));
    }
  }
  for (int64_t t = 0; t < shaped.steps; ++t) {
    if (shaped.kinds[t] != unshaped.kinds[t]) {
      return fail(absl::StrCat("step ", t, " exchanged '", shaped.kinds[t], "', unshaped '", unshaped.kinds[t], "'"));
    }
  }
  for (const auto& [step, v] : shaped.val_loss) {
    auto it = unshaped.val_loss.find(step);
    if (it != unshaped.val_loss.end() && it->second != v && !(std::isnan(v) && std::isnan(it->second))) {
      return fail(absl::StrFormat("val loss after step %d: %.17g, unshaped %.17g", step, v, it->second));
    }
  }
  return absl::OkStatus();
}

struct Timing {
  std::optional<int64_t> steps_to_target;
  std::optional<double> seconds_to_target;
  bool extrapolated = false;
};

// Steps and seconds to `target` of a run of `measured` (the run under its
// shaping: its first measured.steps steps) of the training `unshaped` shows.
absl::StatusOr<Timing> ToTarget(const Run& measured, const Run& unshaped, double target) {
  Timing t;
  for (const auto& [step, v] : unshaped.val_loss) {
    if (v <= target) {
      t.steps_to_target = step + 1;
      break;
    }
  }
  if (!t.steps_to_target) return t;
  const int64_t n = *t.steps_to_target;
  double secs = 0;
  for (int64_t s = 0; s < std::min(n, measured.steps); ++s) secs += measured.step_seconds[s];
  if (n > measured.steps) {
    std::map<std::string, std::pair<double, int>> by_kind;  // kind -> (sum, count), step 0 left out
    for (int64_t s = 1; s < measured.steps; ++s) {
      auto& [sum, count] = by_kind[measured.kinds[s]];
      sum += measured.step_seconds[s];
      ++count;
    }
    for (int64_t s = measured.steps; s < n; ++s) {
      auto it = by_kind.find(unshaped.kinds[s]);
      if (it == by_kind.end()) {
        return absl::InternalError(absl::StrCat("converge: step ", s, " exchanges '", unshaped.kinds[s],
                                                "', a kind the shaped run's ", measured.steps,
                                                " steps never timed (raise --shaped_steps)"));
      }
      secs += it->second.first / it->second.second;
    }
    t.extrapolated = true;
  }
  t.seconds_to_target = secs;
  return t;
}

nlohmann::json Num(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

const char* OptimizerName(v1::DataParallelSpec::Optimizer o) {
  switch (o) {
    case v1::DataParallelSpec::quantized_adam:
      return "quantized_adam";
    case v1::DataParallelSpec::diloco:
      return "diloco";
    default:
      return "adamw";
  }
}

// What the rows compare against: the baseline's final val loss (the
// default target's base) and its byte totals.
struct Baseline {
  double final_val = NAN, dp_bytes = NAN, link_bytes = NAN, fw_bytes = NAN;
};

// The job's identity in rows: SHA-256 of its JSON with the shaping cleared
// (every configuration and shaping of one bench has the same).
std::string JobSha256(const v1::JobSpec& base) {
  std::string json;
  google::protobuf::util::JsonPrintOptions opts;
  (void)google::protobuf::util::MessageToJsonString(base, &json, opts);
  return Sha256Hex(json);
}

// The unshaped adamw-fp32 row of `path` (an earlier converge bench's JSONL),
// checked against this job: the same job_sha256, or, in rows older than that
// field, the same steps and lr.
absl::StatusOr<Baseline> ReadBaseline(const std::string& path, const v1::JobSpec& base, const std::string& job_sha) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("converge: --baseline '", path, "': cannot read it"));
  const uint32_t steps = base.max_steps() > 0 ? base.max_steps() : base.optimizer().total_steps();
  int line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    const nlohmann::json row = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!row.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("converge: --baseline '", path, "' line ", line_no, ": not a JSON object"));
    }
    auto num = [&](const char* key) {
      return row.contains(key) && row[key].is_number() ? row[key].get<double>() : NAN;
    };
    const bool baseline_row = row.contains("config") && row["config"] == "adamw-fp32";
    if (!baseline_row || num("bandwidth_mbps") != 0 || num("latency_ms") != 0) continue;
    const std::string at = absl::StrCat("converge: --baseline '", path, "' line ", line_no, " (adamw-fp32@0/0): ");
    if (row.contains("error")) return absl::InvalidArgumentError(absl::StrCat(at, "a failed run"));
    if (row.contains("job_sha256")) {
      if (row["job_sha256"] != job_sha) {
        return absl::InvalidArgumentError(absl::StrCat(at, "another job (job_sha256 ", row["job_sha256"].dump(),
                                                       ", this job's \"", job_sha, "\")"));
      }
    } else if (num("job_steps") != steps || num("lr") != base.optimizer().lr()) {
      return absl::InvalidArgumentError(absl::StrCat(at, "another job (", num("job_steps"), " steps at lr ", num("lr"),
                                                     "; this job: ", steps, " at ", base.optimizer().lr(), ")"));
    }
    Baseline b{num("final_val_loss"), num("dp_bytes_per_replica"), num("link_bytes"), num("fw_bytes")};
    for (double v : {b.final_val, b.dp_bytes, b.link_bytes, b.fw_bytes}) {
      if (!(v > 0) || !std::isfinite(v)) {
        return absl::InvalidArgumentError(
            absl::StrCat(at, "want final_val_loss, dp_bytes_per_replica, link_bytes and fw_bytes > 0"));
      }
    }
    return b;
  }
  return absl::InvalidArgumentError(absl::StrCat("converge: --baseline '", path, "': no adamw-fp32@0/0 row"));
}

void PrintBanner(const v1::JobSpec& base, const ConvergeBenchOptions& o, std::ostream& err) {
  err << absl::StrFormat(
      "aqswarm bench converge: job %s (%s d_model %d, %d layers, seq %d; %d stages x %d pipelines; micro-batch %d x "
      "%d; %d steps, eval every %d)\n",
      o.job, pipeline::ModelFamilyName(base.model()), base.model().d_model(), base.model().n_layer(), base.model().seq_len(),
      base.stages(), base.data_parallel(), base.micro_batch_size(), base.micro_batches_per_step(), base.max_steps(),
      base.eval_every_steps());
  err << "  target: " << (o.target_val_loss > 0 ? absl::StrCat(o.target_val_loss)
                                                 : absl::StrCat("adamw-fp32's final val loss x (1 + ", o.target_slack,
                                                                ")"))
      << "; steps_to_target: first eval step at or below it (+1); seconds_to_target: stage 0's step_seconds summed\n"
         "  (max over pipelines; start-up in step 0; evaluation time not counted).\n"
         "  Shaped runs train only their first N steps (>= --shaped_steps, past the 2nd step of every DP step kind,\n"
         "  whole diloco periods), must match the unshaped run's losses and parameter hashes at every step (checked),\n"
         "  and extrapolate the steps after N at their own mean time per step of the same kind (\"extrapolated\").\n";
}

}  // namespace

absl::Status RunConvergeBench(const ConvergeBenchOptions& o, std::ostream& out) {
  if (o.job.empty()) return absl::InvalidArgumentError("converge: --job is required (the base job, JSON)");
  if (!(o.target_slack >= 0) || !std::isfinite(o.target_slack) || !(o.target_val_loss >= 0) ||
      !std::isfinite(o.target_val_loss)) {
    return absl::InvalidArgumentError(absl::StrCat("converge: --target_val_loss (", o.target_val_loss,
                                                   ") and --target_slack (", o.target_slack, ") must be >= 0"));
  }
  if (o.shaped_steps < 1 || o.run_timeout_s < 1) {
    return absl::InvalidArgumentError(absl::StrCat("converge: --shaped_steps (", o.shaped_steps,
                                                   ") and the run timeout (", o.run_timeout_s, " s) must be >= 1"));
  }
  AQSWARM_ASSIGN_OR_RETURN(const std::vector<Config> configs, ParseConfigs(o.configs));
  AQSWARM_ASSIGN_OR_RETURN(const std::vector<Shaping> shapings, ParseShapings(o.shapings));
  absl::StatusOr<v1::JobSpec> base = pipeline::LoadJobSpec(o.job);
  if (!base.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("converge: job '", o.job, "': ", base.status().message()));
  }
  if (base->stages() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("converge: job '", o.job, "' has ", base->stages(), " stages x ", base->data_parallel(),
                     " pipelines; the bench compares link compression: want stages >= 2"));
  }
  for (const Config& c : configs) {
    if (c.optimizer != v1::DataParallelSpec::adamw && base->data_parallel() < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("converge: configuration ", c.name, " compares DP optimizers, but job '", o.job, "' has ",
                       base->stages(), " stages x ", base->data_parallel(), " pipelines: want dataParallel >= 2"));
    }
  }
  if (base->eval_every_steps() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("converge: job '", o.job, "' has evalEverySteps 0: the target is a validation loss"));
  }
  base->mutable_shaping()->Clear();
  const std::string job_sha = JobSha256(*base);
  std::optional<Baseline> given;  // --baseline's row: the baseline does not run
  if (!o.baseline.empty()) {
    AQSWARM_ASSIGN_OR_RETURN(given, ReadBaseline(o.baseline, *base, job_sha));
  }
  std::vector<v1::JobSpec> jobs;  // checked before anything runs
  for (const Config& c : configs) {
    AQSWARM_ASSIGN_OR_RETURN(v1::JobSpec j, ConfigJob(*base, c));
    jobs.push_back(std::move(j));
  }
  for (const Shaping& sh : shapings) {
    v1::JobSpec j = *base;
    j.mutable_shaping()->set_bandwidth_mbps(sh.mbps);
    j.mutable_shaping()->set_latency_ms(sh.latency_ms);
    if (absl::Status s = pipeline::ValidateJobSpec(j); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("converge: shaping ", sh.Label(), ": ", s.message()));
    }
  }

  const bool keep = !o.out_dir.empty();
  fs::path root = o.out_dir;
  std::error_code ec;
  if (keep) {
    fs::create_directories(root, ec);
    if (ec) return absl::PermissionDeniedError(absl::StrCat("converge: cannot create ", root.string()));
  } else {
    AQSWARM_ASSIGN_OR_RETURN(std::string tmp, MakeTempDir("", "aqswarm-converge-"));
    root = tmp;
  }
  // A private copy of this executable: the build directory may be relinked
  // while the bench runs.
  const std::string exe = (root / "aqswarm-converge-exe").string();
  fs::copy_file(SelfExecutable(), exe, fs::copy_options::overwrite_existing, ec);
  if (ec) return absl::InternalError(absl::StrCat("converge: cannot copy ", SelfExecutable(), ": ", ec.message()));

  PrintBanner(*base, o, std::cerr);
  const auto start = std::chrono::steady_clock::now();
  double target = o.target_val_loss;
  Baseline base_row;  // --baseline's row, or the baseline run's (configs[0])
  const auto set_baseline = [&](const Baseline& b) {
    base_row = b;
    if (!(target > 0)) target = b.final_val * (1 + o.target_slack);
  };
  if (given.has_value()) {
    set_baseline(*given);
    std::cerr << "  baseline: adamw-fp32@0/0 of " << o.baseline << " (final val loss " << given->final_val
              << "), not run again\n";
  }
  const double d = base->data_parallel();
  const size_t first = given.has_value() ? 1 : 0;  // configs[0] is the baseline
  const int total = static_cast<int>((configs.size() - first) * shapings.size());
  int done = 0;
  std::vector<std::string> failed;  // "run: why" of configurations that failed (a row each)
  for (size_t i = first; i < configs.size(); ++i) {
    const Config& c = configs[i];
    const v1::JobSpec& job = jobs[i];
    Run unshaped;
    for (const Shaping& sh : shapings) {
      const std::string name = absl::StrCat(c.name, "@", sh.Label());
      std::string dir_name = name;
      std::replace(dir_name.begin(), dir_name.end(), '/', '_');
      v1::JobSpec j = job;
      if (!sh.unshaped()) {
        j.mutable_shaping()->set_bandwidth_mbps(sh.mbps);
        j.mutable_shaping()->set_latency_ms(sh.latency_ms);
        // Only the steps up to the target are timed (all of them when the
        // unshaped run does not reach it).
        AQSWARM_ASSIGN_OR_RETURN(const Timing reach, ToTarget(unshaped, unshaped, target));
        j.set_max_steps(static_cast<uint32_t>(
            ShapedSteps(unshaped, c, o.shaped_steps, reach.steps_to_target.value_or(unshaped.steps))));
      }
      absl::StatusOr<Run> run = RunJob(exe, j, root / dir_name, o.run_timeout_s);
      absl::Status checked = run.ok() && !sh.unshaped() ? CheckSameTraining(*run, unshaped, name) : run.status();
      if (!checked.ok()) {
        // Without the baseline nothing else can be measured; any other
        // configuration's failure is a row, and its other shapings are skipped.
        if (i == 0) {
          std::cerr << "converge: runs kept in " << root.string() << "\n";
          return checked;
        }
        out << nlohmann::json({{"bench", "converge"}, {"run", name}, {"config", c.name},
                               {"dp_optimizer", OptimizerName(c.optimizer)}, {"inner_steps", c.inner_steps},
                               {"bandwidth_mbps", sh.mbps}, {"latency_ms", sh.latency_ms},
                               {"error", std::string(checked.message())}})
                   .dump()
            << "\n";
        out.flush();
        std::cerr << "converge [" << ++done << "/" << total << "] " << name << " FAILED: " << checked << "\n";
        failed.push_back(absl::StrCat(name, ": ", checked.message()));
        done += static_cast<int>(shapings.size()) - (&sh - shapings.data()) - 1;
        break;
      }
      if (sh.unshaped()) {
        unshaped = *run;
        if (i == 0) {
          set_baseline({unshaped.val_loss.rbegin()->second, unshaped.dp_bytes_per_replica, unshaped.link_bytes,
                        unshaped.fw_bytes});
        }
      }
      AQSWARM_ASSIGN_OR_RETURN(const Timing t, ToTarget(*run, unshaped, target));
      double per_step = 0;
      for (int64_t s = 1; s < run->steps; ++s) per_step += run->step_seconds[s];
      per_step = run->steps > 1 ? per_step / (run->steps - 1) : run->step_seconds[0];
      double measured = 0;
      for (double s : run->step_seconds) measured += s;
      const double final_val = unshaped.val_loss.rbegin()->second;
      const bool fp32_links = job.compression().mode() == v1::LinkCompression::fp32;
      const bool diloco = c.optimizer == v1::DataParallelSpec::diloco;
      // Tokens each forward link carried over the run (every link carries
      // every token of its pipeline once a step).
      const double link_tokens = static_cast<double>(unshaped.steps) * job.data_parallel() * (job.stages() - 1) *
                                 job.micro_batch_size() * job.micro_batches_per_step() * job.model().seq_len();
      nlohmann::json curve = nlohmann::json::array();  // [steps trained, val loss] of the unshaped run
      for (const auto& [step, v] : unshaped.val_loss) curve.push_back({step + 1, Num(v)});
      nlohmann::json row = {
          {"bench", "converge"},
          {"run", name},
          {"config", c.name},
          {"dp_optimizer", OptimizerName(c.optimizer)},
          {"inner_steps", c.inner_steps},
          {"lr", job.optimizer().lr()},
          {"delayed_update", job.dp().delayed_update()},
          {"warmup_steps", static_cast<int>(job.dp().warmup_steps())},
          {"warmup_bits", c.optimizer == v1::DataParallelSpec::quantized_adam
                              ? static_cast<int>(job.dp().warmup_bits() ? job.dp().warmup_bits() : 32)
                              : 0},
          {"dp_entropy_coding", job.dp().entropy_coding()},
          {"max_local_steps", static_cast<int>(job.dp().max_local_steps())},
          {"local_step_growth", static_cast<int>(job.dp().local_step_growth())},
          {"outer_lr", diloco ? Num(job.dp().outer_lr()) : nlohmann::json(nullptr)},
          {"outer_momentum", diloco ? Num(job.dp().outer_momentum()) : nlohmann::json(nullptr)},
          {"bw_codec", fp32_links ? "raw"
                       : c.tiled_gradients || c.link_mode == v1::LinkCompression::tiled ? "tiled"
                                                                                         : "fixed_point"},
          {"dp_bits", c.optimizer == v1::DataParallelSpec::adamw ? 32 : static_cast<int>(job.dp().bits())},
          {"link_mode", v1::LinkCompression::Mode_Name(c.link_mode)},
          {"first_visit_bits", c.first_visit_bits},
          {"first_visit", c.first_visit_bits == 0 ? "raw" : c.fixed_first_visits ? "fixed_point" : "tiled"},
          {"entropy_coding", c.entropy},
          {"tile_along", c.tiles_along_tokens ? "tokens" : "channels"},
          {"tile_grid", c.midtread ? "midtread" : "midrise"},
          {"first_visit_reference", c.reference},
          {"fw_bits", fp32_links ? 32 : static_cast<int>(job.compression().fw_bits())},
          {"bw_bits", fp32_links ? 32 : static_cast<int>(job.compression().bw_bits())},
          {"bandwidth_mbps", sh.mbps},
          {"latency_ms", sh.latency_ms},
          {"steps", run->steps},
          {"job_steps", unshaped.steps},
          {"target_val_loss", Num(target)},
          {"steps_to_target", t.steps_to_target ? nlohmann::json(*t.steps_to_target) : nlohmann::json(nullptr)},
          {"seconds_to_target", t.seconds_to_target ? Num(*t.seconds_to_target) : nlohmann::json(nullptr)},
          {"extrapolated", t.extrapolated},
          {"seconds_measured", measured},
          {"seconds_per_step", per_step},
          {"final_val_loss", Num(final_val)},
          {"val_loss_vs_baseline", Num((final_val - base_row.final_val) / base_row.final_val)},
          {"dp_bytes_per_replica", unshaped.dp_bytes_per_replica},
          {"dp_bytes_ratio_vs_adamw", Num(base_row.dp_bytes / unshaped.dp_bytes_per_replica)},
          {"link_bytes", unshaped.link_bytes},
          {"link_bytes_ratio_vs_fp32", Num(base_row.link_bytes / unshaped.link_bytes)},
          {"fw_bytes", unshaped.fw_bytes},
          {"fw_bytes_ratio_vs_fp32", Num(base_row.fw_bytes / unshaped.fw_bytes)},
          {"fw_bytes_per_token_per_link", Num(unshaped.fw_bytes / link_tokens)},
          {"bw_bytes_per_token_per_link", Num((unshaped.link_bytes - unshaped.fw_bytes) / link_tokens)},
          {"all_bytes_ratio_vs_baseline",
           Num((base_row.link_bytes + base_row.dp_bytes * d) / (unshaped.link_bytes + unshaped.dp_bytes_per_replica * d))},
          {"val_curve", curve},
          {"training_checked_steps", sh.unshaped() ? 0 : run->steps},
          {"wall_seconds", run->wall_seconds},
      };
      if (keep) row["run_dir"] = run->dir;
      row["job_sha256"] = job_sha;
      if (given.has_value()) row["baseline"] = o.baseline;
      out << row.dump() << "\n";
      out.flush();
      std::cerr << absl::StrFormat("converge [%d/%d] %-22s %5d steps %8.1f s  to target: %s%s\n", ++done, total, name,
                                   run->steps, run->wall_seconds,
                                   t.seconds_to_target ? absl::StrFormat("%.1f s at step %d", *t.seconds_to_target,
                                                                         *t.steps_to_target)
                                                       : std::string("not reached"),
                                   t.extrapolated ? " (extrapolated)" : "");
    }
  }
  std::cerr << absl::StrFormat("converge: %.0f s in all; runs %s\n",
                               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                               keep ? "in " + root.string() : std::string("removed"));
  if (!failed.empty()) {
    std::cerr << "converge: runs kept in " << root.string() << "\n";
    return absl::InternalError(absl::StrCat("converge: ", failed.size(), " configuration(s) failed (an \"error\" row "
                                            "each): ", absl::StrJoin(failed, "; ")));
  }
  if (!keep) aqswarm::RemoveTree(root).IgnoreError();
  return absl::OkStatus();
}

}  // namespace aqswarm::bench
