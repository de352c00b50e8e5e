#include "peer/exchange_mailbox.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "peer/peer_metrics.h"

namespace aqswarm::peer {

ExchangeMailbox::ExchangeMailbox(std::string group, int rank, int size, uint64_t max_buffered_bytes)
    : group_(std::move(group)), rank_(rank), size_(size), max_buffered_bytes_(max_buffered_bytes) {}

absl::Status ExchangeMailbox::Deliver(v1::ExchangeChunk chunk) {
  if (chunk.group() != group_) {
    CountRejectedMessage("dp_wrong_group");
    return absl::PermissionDeniedError(absl::StrCat("chunk for group '", chunk.group(), "', this is '", group_, "'"));
  }
  if (chunk.from_rank() >= static_cast<uint32_t>(size_) || chunk.from_rank() == static_cast<uint32_t>(rank_) ||
      chunk.chunk() >= static_cast<uint32_t>(size_) ||
      (chunk.phase() != v1::ExchangeChunk::SCATTER && chunk.phase() != v1::ExchangeChunk::GATHER)) {
    CountRejectedMessage("dp_chunk_invalid");
    return absl::InvalidArgumentError("chunk with an impossible rank, chunk index or phase");
  }
  const uint64_t bytes = chunk.ByteSizeLong();
  absl::MutexLock l(&mu_);
  if (buffered_bytes_ + bytes > max_buffered_bytes_) {
    CountRejectedMessage("dp_mailbox_full");
    return absl::ResourceExhaustedError("exchange mailbox full");
  }
  const Key k(chunk.from_rank(), chunk.step(), chunk.round(), chunk.phase(), chunk.bucket(), chunk.chunk());
  auto [it, inserted] = chunks_.try_emplace(k);
  if (!inserted) buffered_bytes_ -= std::min<uint64_t>(buffered_bytes_, it->second.ByteSizeLong());
  buffered_bytes_ += bytes;
  it->second = std::move(chunk);
  return absl::OkStatus();
}

absl::StatusOr<v1::ExchangeChunk> ExchangeMailbox::Take(int from, uint64_t step, uint32_t round,
                                                        v1::ExchangeChunk::Phase phase, uint32_t bucket,
                                                        uint32_t chunk, absl::Duration timeout,
                                                        const std::function<absl::Status()>& check) {
  const Key k(from, step, round, phase, bucket, chunk);
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock l(&mu_);
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

}  // namespace aqswarm::peer
