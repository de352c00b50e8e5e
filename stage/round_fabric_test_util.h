// The in-process RoundTransport the round exchange's tests run on (a
// stand-in for NCCL): stage/round_exchange_test.cc and the ReplicaExchange
// conformance suite (stage/replica_exchange_conformance_test.cc).
#ifndef AQSWARM_STAGE_ROUND_FABRIC_TEST_UTIL_H_
#define AQSWARM_STAGE_ROUND_FABRIC_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "stage/round_exchange.h"

namespace aqswarm::stage::testing {

// An in-process stand-in for NCCL with the same contract: AllGather is a
// collective over all ranks (a generation barrier), Exchange is matched per
// pair in FIFO order, and both give up after `timeout` (a rank that never
// comes makes the others fail, like an aborted communicator).
//
//   Fabric fabric(/*size=*/2, absl::Seconds(5));
//   auto ex = RoundReplicaExchange::Start(options, std::make_unique<FabricTransport>(&fabric, 0, 2));
//   fabric.Kill(1);   // rank 1's process died: its calls fail, the others time out
//
// Thread-safe; outlives every transport on it.
class Fabric {
 public:
  Fabric(int size, absl::Duration timeout) : size_(size), timeout_(timeout) {}

  // Rank `rank` vanishes: its own calls fail at once from now on (its rounds
  // end), and it never joins another collective, so the other ranks' next
  // collective gives up after the timeout.
  void Kill(int rank) {
    absl::MutexLock l(&mu_);
    dead_.insert(rank);
  }

  absl::Status AllGather(int rank, absl::Span<const int64_t> row, absl::Span<int64_t> table) {
    absl::MutexLock l(&mu_);
    if (dead_.count(rank) > 0) return absl::UnavailableError(absl::StrCat("replica ", rank, " is gone"));
    const uint64_t gen = gather_gen_;
    rows_[rank].assign(row.begin(), row.end());
    if (++arrived_ == size_) {
      arrived_ = 0;
      done_rows_ = rows_;
      ++gather_gen_;
    } else {
      auto done = [this, gen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return gather_gen_ != gen; };
      if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout_)) {
        return absl::DeadlineExceededError(absl::StrCat("all-gather: a replica did not join within ", absl::FormatDuration(timeout_)));
      }
    }
    for (int r = 0; r < size_; ++r) std::copy(done_rows_[r].begin(), done_rows_[r].end(), table.begin() + r * row.size());
    return absl::OkStatus();
  }

  absl::Status Exchange(int rank, const std::vector<absl::string_view>& sends, absl::Span<const int64_t> recv_bytes,
                        std::vector<std::string>* received) {
    absl::MutexLock l(&mu_);
    if (dead_.count(rank) > 0) return absl::UnavailableError(absl::StrCat("replica ", rank, " is gone"));
    for (int j = 0; j < size_; ++j) {
      if (!sends[j].empty()) pairs_[{rank, j}].emplace_back(sends[j]);
    }
    for (int j = 0; j < size_; ++j) {
      if (recv_bytes[j] == 0) continue;
      auto& q = pairs_[{j, rank}];
      auto arrived = [&q]() { return !q.empty(); };
      if (!mu_.AwaitWithTimeout(absl::Condition(&arrived), timeout_)) {
        return absl::DeadlineExceededError(absl::StrCat("receive from replica ", j, " timed out"));
      }
      if (static_cast<int64_t>(q.front().size()) != recv_bytes[j]) return absl::DataLossError("size mismatch");
      (*received)[j] = std::move(q.front());
      q.pop_front();
    }
    return absl::OkStatus();
  }

 private:
  const int size_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  std::map<int, std::vector<int64_t>> rows_ ABSL_GUARDED_BY(mu_), done_rows_ ABSL_GUARDED_BY(mu_);
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t gather_gen_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::pair<int, int>, std::deque<std::string>> pairs_ ABSL_GUARDED_BY(mu_);
  std::set<int> dead_ ABSL_GUARDED_BY(mu_);
};

// One rank's RoundTransport on a Fabric. `corrupt_row_` makes it announce an
// impossible chunk; `finished_clean_` receives Finish's argument.
class FabricTransport final : public RoundTransport {
 public:
  FabricTransport(Fabric* f, int rank, int size) : f_(f), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllGather(absl::Span<const int64_t> row, absl::Span<int64_t> table) override {
    if (corrupt_row_) {
      std::vector<int64_t> bad(row.begin(), row.end());
      bad[(rank_ + 1) % size_] = int64_t{1} << 40;  // announce a 1 TiB chunk
      return f_->AllGather(rank_, bad, table);
    }
    return f_->AllGather(rank_, row, table);
  }
  absl::Status Exchange(const std::vector<absl::string_view>& sends, absl::Span<const int64_t> recv_bytes,
                        std::vector<std::string>* received) override {
    return f_->Exchange(rank_, sends, recv_bytes, received);
  }
  void Finish(bool clean) override { *finished_clean_ = clean; }

  bool corrupt_row_ = false;
  bool* finished_clean_ = &ignored_;

 private:
  Fabric* f_;
  int rank_, size_;
  bool ignored_ = false;
};

}  // namespace aqswarm::stage::testing

#endif  // AQSWARM_STAGE_ROUND_FABRIC_TEST_UTIL_H_
