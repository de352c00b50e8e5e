#include "stage/exchange_mailbox.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "stage/stage_metrics.h"

namespace aqswarm::stage {

ExchangeMailbox::ExchangeMailbox(std::string group, int rank, int size, uint64_t max_buffered_bytes,
                                 uint64_t step_window)
    : group_(std::move(group)),
      rank_(rank),
      size_(size),
      max_buffered_bytes_(max_buffered_bytes),
      step_window_(step_window) {}

void ExchangeMailbox::Prune() {
  if (!anchored_ || current_step_ <= step_window_) return;
  const uint64_t oldest = current_step_ - step_window_;
  for (auto it = chunks_.begin(); it != chunks_.end();) {
    if (std::get<1>(it->first) < oldest) {
      CountRejectedMessage(RejectReason::kDpStepOutOfWindow);
      buffered_bytes_ -= std::min<uint64_t>(buffered_bytes_, it->second.ByteSizeLong());
      it = chunks_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = seen_.begin(); it != seen_.end();) {
    it = std::get<1>(*it) < oldest ? seen_.erase(it) : std::next(it);
  }
}

absl::Status ExchangeMailbox::Deliver(v1::ExchangeChunk chunk) {
  if (chunk.group() != group_) {
    CountRejectedMessage(RejectReason::kDpWrongGroup);
    return absl::PermissionDeniedError(absl::StrCat("chunk for group '", chunk.group(), "', this is '", group_, "'"));
  }
  if (chunk.from_rank() >= static_cast<uint32_t>(size_) || chunk.from_rank() == static_cast<uint32_t>(rank_) ||
      chunk.chunk() >= static_cast<uint32_t>(size_) ||
      (chunk.phase() != v1::ExchangeChunk::SCATTER && chunk.phase() != v1::ExchangeChunk::GATHER)) {
    CountRejectedMessage(RejectReason::kDpChunkInvalid);
    return absl::InvalidArgumentError("chunk with an impossible rank, chunk index or phase");
  }
  const uint64_t bytes = chunk.ByteSizeLong();
  absl::MutexLock l(&mu_);
  const uint64_t step = chunk.step();
  const uint64_t distance = step > current_step_ ? step - current_step_ : current_step_ - step;
  if (anchored_ && distance > step_window_) {
    CountRejectedMessage(RejectReason::kDpStepOutOfWindow);
    return absl::OutOfRangeError(absl::StrCat("chunk of step ", step, " outside this replica's window of ",
                                              step_window_, " steps around step ", current_step_));
  }
  const Key k(chunk.from_rank(), step, chunk.round(), chunk.phase(), chunk.bucket(), chunk.chunk());
  if (seen_.count(k) > 0) {
    CountRejectedMessage(RejectReason::kDpDuplicateChunk);
    return absl::AlreadyExistsError(absl::StrCat("replica ", chunk.from_rank(), " already delivered this chunk of step ",
                                                 step, "; the first one stands"));
  }
  if (buffered_bytes_ + bytes > max_buffered_bytes_ || seen_.size() >= kMaxKeys) {
    CountRejectedMessage(RejectReason::kDpMailboxFull);
    return absl::ResourceExhaustedError("exchange mailbox full");
  }
  seen_.insert(k);
  buffered_bytes_ += bytes;
  chunks_.emplace(k, std::move(chunk));
  return absl::OkStatus();
}

absl::StatusOr<v1::ExchangeChunk> ExchangeMailbox::Take(int from, uint64_t step, uint32_t round,
                                                        v1::ExchangeChunk::Phase phase, uint32_t bucket,
                                                        uint32_t chunk, absl::Duration timeout,
                                                        const std::function<absl::Status()>& check) {
  const Key k(from, step, round, phase, bucket, chunk);
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock l(&mu_);
  if (step != kUnanchoredStep && (!anchored_ || step > current_step_)) {
    anchored_ = true;
    current_step_ = step;
    Prune();
  }
  while (true) {
    auto it = chunks_.find(k);
    if (it != chunks_.end()) {
      v1::ExchangeChunk c = std::move(it->second);
      chunks_.erase(it);
      buffered_bytes_ -= std::min<uint64_t>(buffered_bytes_, c.ByteSizeLong());
      return c;
    }
    if (!failed_.ok()) return failed_;
    if (check) {
      absl::Status s = check();
      if (!s.ok()) return s;
    }
    // Wake on a delivery or a failure, or every 200 ms to poll `check`.
    const absl::Time wake = std::min(deadline, absl::Now() + absl::Milliseconds(200));
    auto ready = [this, &k]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return chunks_.count(k) > 0 || !failed_.ok(); };
    if (!mu_.AwaitWithDeadline(absl::Condition(&ready), wake) && absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("replica ", from, " sent nothing for step ", step, " within ",
                                                      absl::FormatDuration(timeout)));
    }
  }
}

void ExchangeMailbox::Fail(absl::Status status) {
  absl::MutexLock l(&mu_);
  if (failed_.ok()) failed_ = std::move(status);
}

}  // namespace aqswarm::stage
