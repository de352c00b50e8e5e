#include "stage/pipeline_monitor.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "proto/event_json.h"

namespace aqswarm::stage {

PipelineMonitor::PipelineMonitor(const v1::JobSpec& job, const std::string& out_dir, bool console, bool keep_steps)
    : job_(job),
      k_(static_cast<int>(job.stages())),
      d_(static_cast<int>(job.data_parallel())),
      out_dir_(out_dir),
      console_(console),
      keep_steps_(keep_steps) {
  if (out_dir.empty()) return;
  events_.open(std::filesystem::path(out_dir) / "events.jsonl");
  csv_.open(std::filesystem::path(out_dir) / "metrics.csv");
  csv_ << "step,epoch,loss,val_loss,step_seconds,tokens_per_second";
  for (int l = 0; l + 1 < k_; ++l) csv_ << ",fw_bytes_link" << l << ",bw_bytes_link" << l;
  if (d_ > 1) {
    for (int s = 0; s < k_; ++s) csv_ << ",dp_bytes_stage" << s;
  }
  csv_ << "\n";
}

absl::Status PipelineMonitor::OnLine(int i, const std::string& line) {
  absl::StatusOr<v1::StageEvent> ev = events::ParseStageEvent(line);
  if (!ev.ok()) return absl::OkStatus();
  events_ << line << "\n";
  if (ev->has_done()) ++done_;
  if (ev->has_eval() && i % k_ == 0) {
    evals_[ev->eval().step()].push_back(ev->eval().val_loss_not_finite() ? NAN : ev->eval().val_loss());
  }
  if (ev->has_eval() && i == 0) {
    val_[ev->eval().step()] = ev->eval().val_loss();
    if (console_) {
      std::printf("  eval  step %5lld  val_loss %.4f\n", static_cast<long long>(ev->eval().step()),
                  ev->eval().val_loss());
    }
  }
  if (!ev->has_step()) return absl::OkStatus();
  const int64_t step = ev->step().step();
  auto& row = steps_[step];
  row[i] = ev->step();
  if (static_cast<int>(row.size()) < k_ * d_) return absl::OkStatus();
  absl::Status s = CheckHashes(step, row);
  WriteRow(step, row);
  if (keep_steps_) {
    std::vector<v1::StepEvent>& kept = kept_.emplace_back();
    for (auto& [child, e] : row) kept.push_back(std::move(e));
  }
  steps_.erase(step);
  return s;
}

absl::StatusOr<std::unique_ptr<PipelineMonitor>> PipelineMonitor::Replay(const v1::JobSpec& job,
                                                                        const std::string& events_path) {
  std::ifstream in(events_path);
  if (!in) return absl::DataLossError(absl::StrCat("no ", events_path));
  auto m = std::make_unique<PipelineMonitor>(job, "", /*console=*/false, /*keep_steps=*/true);
  for (std::string l; std::getline(in, l);) {
    absl::StatusOr<v1::StageEvent> ev = events::ParseStageEvent(l);
    if (!ev.ok()) return absl::DataLossError(absl::StrCat(events_path, ": ", ev.status().message()));
    uint32_t stage = 0, pipeline = 0;
    if (ev->has_step()) stage = ev->step().stage(), pipeline = ev->step().pipeline();
    if (ev->has_eval()) stage = ev->eval().stage(), pipeline = ev->eval().pipeline();
    if (stage >= static_cast<uint32_t>(m->k_) || pipeline >= static_cast<uint32_t>(m->d_)) {
      return absl::DataLossError(absl::StrCat(events_path, ": an event of stage ", stage, " pipeline ", pipeline,
                                              " outside the job's ", m->k_, "x", m->d_, " grid"));
    }
    AQSWARM_RETURN_IF_ERROR(m->OnLine(static_cast<int>(pipeline) * m->k_ + static_cast<int>(stage), l));
  }
  if (!m->steps_.empty()) {
    const auto& [step, row] = *m->steps_.begin();
    return absl::DataLossError(absl::StrCat(events_path, ": step ", step, " has ", row.size(),
                                            " stage lines, want ", m->k_ * m->d_));
  }
  if (m->kept_.empty()) return absl::DataLossError(absl::StrCat(events_path, ": no step events"));
  return m;
}

// Every replica of a stage holds bit-identical weights (diloco: its anchors,
// identical at every step), except after quantized_adam's local steps
// (dp.max_local_steps), which move each replica on its own until the next
// sync; every pipeline's first and last stage hold the same tied matrix.
absl::Status PipelineMonitor::CheckHashes(int64_t step, std::map<int, v1::StepEvent>& row) const {
  const bool qadam = job_.dp().optimizer() == v1::DataParallelSpec::quantized_adam;
  for (int s = 0; s < k_ && d_ > 1; ++s) {
    if (qadam && row[s].dp().kind() == "local") continue;
    for (int p = 1; p < d_; ++p) {
      if (row[p * k_ + s].dp().param_hash() != row[s].dp().param_hash()) {
        return absl::DataLossError(absl::StrCat("replicas of stage ", s, " diverged at step ", step));
      }
    }
  }
  for (int p = 0; p < d_ && k_ > 1; ++p) {
    if (row[p * k_].tied_hash() != row[p * k_ + k_ - 1].tied_hash()) {
      return absl::DataLossError(absl::StrCat("the tied embedding copies of pipeline ", p, " diverged at step ", step));
    }
  }
  return absl::OkStatus();
}

void PipelineMonitor::WriteRow(int64_t step, std::map<int, v1::StepEvent>& row) {
  PipelineStepRow r;
  r.step = step;
  r.epoch = row[0].epoch();
  double tokens = 0, fw_total = 0, raw_total = 0;
  for (int p = 0; p < d_; ++p) {
    const v1::StepEvent& s0 = row[p * k_];
    r.loss += s0.loss() / d_;
    r.step_seconds = std::max(r.step_seconds, s0.step_seconds());
    tokens += s0.tokens();
  }
  r.tokens_per_second = tokens / std::max(r.step_seconds, 1e-9);
  std::string links;
  csv_ << step << "," << r.epoch << "," << r.loss << ",," << r.step_seconds << "," << r.tokens_per_second;
  for (int l = 0; l + 1 < k_; ++l) {
    const double fw = row[l].fw_bytes(), bw = row[l + 1].bw_bytes();
    csv_ << "," << fw << "," << bw;
    absl::StrAppendFormat(&links, "  link%d %.2f/%.2f MB", l, fw / 1e6, bw / 1e6);
    fw_total += row[l].sender().payload_bytes();
    raw_total += row[l].sender().raw_bytes();
  }
  if (d_ > 1) {
    double dp = 0;
    for (int s = 0; s < k_; ++s) {
      csv_ << "," << row[s].dp().bytes();
      dp += row[s].dp().bytes();
      dp_run_raw_ += row[s].dp().raw_bytes();
    }
    dp_run_bytes_ += dp;
    absl::StrAppendFormat(&links, "  dp %.2f MB/replica", dp / 1e6);
  }
  csv_ << "\n";
  if (csv_.is_open()) csv_.flush();
  if (events_.is_open()) events_.flush();
  last_ = r;
  ++rows_;
  if (!console_) return;
  std::printf("step %5lld  epoch %lld  loss %.4f%s  %8.0f tok/s  %.2f s%s%s%s%s\n", static_cast<long long>(step),
              static_cast<long long>(r.epoch), r.loss, std::isfinite(r.loss) ? "" : " (not finite)",
              r.tokens_per_second, r.step_seconds, links.c_str(),
              raw_total > 0 ? absl::StrFormat("  fw ratio %.1fx", raw_total / std::max(fw_total, 1.0)).c_str() : "",
              d_ > 1 ? "  replicas identical" : "", row[0].tied_hash().empty() ? "" : "  tied copies identical");
  std::fflush(stdout);
}

std::optional<double> PipelineMonitor::final_val_loss() const {
  if (val_.empty()) return std::nullopt;
  return val_.rbegin()->second;
}

void PipelineMonitor::PrintSummary() const {
  if (const auto v = final_val_loss()) std::printf("final val_loss %.4f\n", *v);
  if (d_ > 1) {
    std::printf("data parallelism: %.2f MB sent per replica over the run (a float32 all-reduce: %.2f MB, %.1fx)\n",
                dp_run_bytes_ / 1e6, dp_run_raw_ / 1e6, dp_run_raw_ / std::max(dp_run_bytes_, 1.0));
  }
  if (!out_dir_.empty()) {
    std::printf("metrics: %s\n", (std::filesystem::path(out_dir_) / "metrics.csv").string().c_str());
  }
  std::fflush(stdout);
}

}  // namespace aqswarm::stage
