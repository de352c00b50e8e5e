// Test helper: the K StageWorkers of one job in one process, driven as the
// step protocol drives them (forwards in micro-batch order through the
// stages, backwards in increasing micro-batch order, the tied-embedding
// exchange, the global norm), without links.
//
//   WorkerPipeline p(job);
//   StepResult r = p.Run(step, [](int mb, int step, int n) { return Batch{...}; });
//   for (auto& w : p.w) w->Step(step, r.grad_sq);
#ifndef AQSWARM_PIPELINE_WORKER_PIPELINE_TEST_UTIL_H_
#define AQSWARM_PIPELINE_WORKER_PIPELINE_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "pipeline/stage_worker.h"

namespace aqswarm::pipeline::testing {

// Token ids and next-token targets of one micro-batch (n = B x T each).
struct Batch {
  std::vector<int32_t> tokens, targets;
};
using BatchFn = std::function<Batch(int mb, int step, int n)>;

struct StepResult {
  double loss = 0;         // mean over the micro-batches
  double grad_sq = 0;      // the whole model's squared gradient norm
  size_t tied_rows = 0;    // rows of stage 0's tied gradient (tied across stages)
};

struct WorkerPipeline {
  std::vector<std::unique_ptr<StageWorker>> w;
  v1::JobSpec job;

  explicit WorkerPipeline(const v1::JobSpec& j) : job(j) {
    for (int s = 0; s < static_cast<int>(job.stages()); ++s) {
      auto r = StageWorker::Create(job, s);
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) return;
      w.push_back(std::move(*r));
    }
  }
  bool ok() const { return static_cast<int>(w.size()) == static_cast<int>(job.stages()); }

  // Forwards and backwards of one step and, with tied embeddings across
  // stages, the exchange of the two copies' gradients (both taken before
  // either end adds the other's).
  StepResult Run(int step, const BatchFn& batch) {
    const int k = static_cast<int>(w.size()), m = job.micro_batches_per_step(), b = job.micro_batch_size(),
              t = job.model().seq_len();
    StepResult r;
    for (int mb = 0; mb < m; ++mb) {
      const Batch data = batch(mb, step, b * t);
      std::vector<float> act, next;
      double loss = 0;
      if (k == 1) {
        EXPECT_TRUE(w[0]->ForwardLoss(mb, {}, data.tokens, data.targets, b, &loss).ok());
      } else {
        EXPECT_TRUE(w[0]->ForwardTokens(mb, data.tokens, b, &act).ok());
        for (int s = 1; s < k - 1; ++s) {
          EXPECT_TRUE(w[s]->ForwardHidden(mb, act, b, &next).ok());
          act.swap(next);
        }
        EXPECT_TRUE(w[k - 1]->ForwardLoss(mb, act, {}, data.targets, b, &loss).ok());
      }
      r.loss += loss;
    }
    r.loss /= m;
    for (int mb = 0; mb < m; ++mb) {
      std::vector<float> g, gin;
      for (int s = k - 1; s >= 0; --s) {
        EXPECT_TRUE(w[s]->Backward(mb, g, s > 0 ? &gin : nullptr).ok());
        g.swap(gin);
      }
    }
    if (k > 1 && job.model().tie_embeddings()) {
      std::vector<uint32_t> rows0, rows_last;
      std::vector<float> g0, g_last;
      EXPECT_TRUE(w[0]->TiedGradient(&rows0, &g0).ok());
      EXPECT_TRUE(w[k - 1]->TiedGradient(&rows_last, &g_last).ok());
      EXPECT_TRUE(rows_last.empty());
      EXPECT_TRUE(w[0]->AddTiedGradient(rows_last, g_last).ok());
      EXPECT_TRUE(w[k - 1]->AddTiedGradient(rows0, g0).ok());
      r.tied_rows = rows0.size();
    }
    for (auto& x : w) r.grad_sq += x->GradSquaredNorm();
    return r;
  }

  // Run + Step (AdamW) for `steps` steps; returns the step losses.
  std::vector<double> Train(int steps, const BatchFn& batch, std::vector<double>* grad_sq = nullptr) {
    std::vector<double> losses;
    if (!ok()) return losses;
    for (int step = 0; step < steps; ++step) {
      const StepResult r = Run(step, batch);
      for (auto& x : w) EXPECT_TRUE(x->Step(step, r.grad_sq).ok());
      losses.push_back(r.loss);
      if (grad_sq != nullptr) grad_sq->push_back(r.grad_sq);
    }
    return losses;
  }
};

}  // namespace aqswarm::pipeline::testing

#endif  // AQSWARM_PIPELINE_WORKER_PIPELINE_TEST_UTIL_H_
