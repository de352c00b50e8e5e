// What `aqswarm pipeline` makes of its K x D stage processes' events: one
// row per step once every stage reported it, the replicas' and the tied
// copies' hashes checked, and the run written as <out_dir>/events.jsonl
// (every event verbatim), <out_dir>/metrics.csv and console lines.
//
//   PipelineMonitor m(job, out_dir);
//   for each line child i printed:  AQSWARM_RETURN_IF_ERROR(m.OnLine(i, line));
//   while (m.done() < k * d) ...;   m.PrintSummary();
//
// The benches read a finished run the same way:
//
//   AQSWARM_ASSIGN_OR_RETURN(auto run, PipelineMonitor::Replay(job, "runs/x/events.jsonl"));
//   for (const auto& row : run->steps()) ... row[p * k + s].step_seconds() ...
//
// Children are indexed pipeline-major: i = pipeline * stages + stage. No
// torch, no gRPC.
#ifndef AQSWARM_STAGE_PIPELINE_MONITOR_H_
#define AQSWARM_STAGE_PIPELINE_MONITOR_H_

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/events.pb.h"
#include "proto/job.pb.h"

namespace aqswarm::stage {

// One step of the whole grid, as the console and metrics.csv show it.
struct PipelineStepRow {
  int64_t step = 0;
  int64_t epoch = 0;
  double loss = 0;            // the pipelines' mean
  double step_seconds = 0;    // the slowest pipeline's
  double tokens_per_second = 0;
};

class PipelineMonitor {
 public:
  // Writes into `out_dir` (it must exist; "": no files); `console`: print
  // each row; `keep_steps`: keep every complete step's events (steps()).
  PipelineMonitor(const v1::JobSpec& job, const std::string& out_dir, bool console = true, bool keep_steps = false);

  // A finished run's events.jsonl, read through a monitor that writes
  // nothing and keeps every step. DataLoss for a line that is no event, a
  // step some stages did not report, or no step at all; the hash checks'
  // errors as OnLine's.
  static absl::StatusOr<std::unique_ptr<PipelineMonitor>> Replay(const v1::JobSpec& job,
                                                                 const std::string& events_path);

  // One line child `i` printed. Lines that are no event are skipped. Errors:
  // the replicas of a stage or a pipeline's tied copies diverged at a step
  // (the run is wrong: stop it).
  absl::Status OnLine(int i, const std::string& line);

  int done() const { return done_; }                       // DoneEvents so far
  // keep_steps: every complete step in order, each stage's event by child.
  const std::vector<std::vector<v1::StepEvent>>& steps() const { return kept_; }
  // Evaluations: step -> each pipeline's validation loss (its stage 0's
  // event; NaN when not finite), in pipeline order of arrival.
  const std::map<int64_t, std::vector<double>>& evals() const { return evals_; }
  int64_t rows() const { return rows_; }                   // complete steps so far
  const std::optional<PipelineStepRow>& last_row() const { return last_; }
  std::optional<double> final_val_loss() const;
  // Encoded bytes the stages of pipeline 0 sent to their replicas over the
  // run, and what a float32 all-reduce would have sent.
  double dp_run_bytes() const { return dp_run_bytes_; }
  double dp_run_raw_bytes() const { return dp_run_raw_; }
  // final val_loss, DP bytes, where the metrics are.
  void PrintSummary() const;

 private:
  absl::Status CheckHashes(int64_t step, std::map<int, v1::StepEvent>& row) const;
  void WriteRow(int64_t step, std::map<int, v1::StepEvent>& row);

  const v1::JobSpec job_;
  const int k_, d_;
  const std::string out_dir_;
  const bool console_, keep_steps_;
  std::ofstream events_, csv_;
  std::vector<std::vector<v1::StepEvent>> kept_;
  std::map<int64_t, std::vector<double>> evals_;
  std::map<int64_t, std::map<int, v1::StepEvent>> steps_;  // step -> child -> event
  std::map<int64_t, double> val_;
  std::optional<PipelineStepRow> last_;
  int64_t rows_ = 0;
  int done_ = 0;
  double dp_run_bytes_ = 0, dp_run_raw_ = 0;
};

}  // namespace aqswarm::stage

#endif  // AQSWARM_STAGE_PIPELINE_MONITOR_H_
