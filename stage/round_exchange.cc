#include "stage/round_exchange.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "stage/stage_metrics.h"

namespace aqswarm::stage {

RoundReplicaExchange::RoundReplicaExchange(const RoundExchangeOptions& options, std::unique_ptr<RoundTransport> transport)
    : options_(options),
      transport_(std::move(transport)),
      rank_(transport_->rank()),
      size_(transport_->size()),
      mailbox_(options.group, rank_, size_, options.max_buffered_bytes),
      queues_(size_) {}

absl::StatusOr<std::unique_ptr<RoundReplicaExchange>> RoundReplicaExchange::Start(
    const RoundExchangeOptions& options, std::unique_ptr<RoundTransport> transport) {
  if (transport == nullptr) return absl::InvalidArgumentError("no transport");
  if (transport->size() < 1 || transport->rank() < 0 || transport->rank() >= transport->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica rank ", transport->rank(), " outside [0, ", transport->size(), ")"));
  }
  if (options.max_idle <= absl::ZeroDuration() || options.timeout <= absl::ZeroDuration() ||
      options.max_chunk_bytes <= 0) {
    return absl::InvalidArgumentError("timeout, max_idle and max_chunk_bytes must be positive");
  }
  std::unique_ptr<RoundReplicaExchange> ex(new RoundReplicaExchange(options, std::move(transport)));
  ex->thread_ = std::thread([p = ex.get()] { p->Loop(); });
  return ex;
}

void RoundReplicaExchange::Close() {
  absl::MutexLock l(&mu_);
  closing_ = true;
}

RoundReplicaExchange::~RoundReplicaExchange() {
  Close();
  thread_.join();
}

absl::Status RoundReplicaExchange::Send(int to, const v1::ExchangeChunk& chunk) {
  if (to < 0 || to >= size_ || to == rank_) {
    return absl::InvalidArgumentError(absl::StrCat("cannot send to replica ", to));
  }
  v1::ExchangeChunk c = chunk;
  c.set_group(options_.group);
  std::string bytes = c.SerializeAsString();
  absl::MutexLock l(&mu_);
  auto room = [this, to]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queues_[to].size() < 256 || !failed_.ok(); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&room), options_.timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("replica ", to, " is not draining chunks"));
  }
  if (!failed_.ok()) return failed_;
  queues_[to].push_back(std::move(bytes));
  return absl::OkStatus();
}

absl::StatusOr<v1::ExchangeChunk> RoundReplicaExchange::Receive(int from, uint64_t step, uint32_t round,
                                                               v1::ExchangeChunk::Phase phase, uint32_t bucket,
                                                               uint32_t chunk) {
  return mailbox_.Take(from, step, round, phase, bucket, chunk, options_.timeout, {});
}

uint64_t RoundReplicaExchange::bytes_sent() const {
  absl::MutexLock l(&mu_);
  return bytes_sent_;
}

uint64_t RoundReplicaExchange::rounds() const {
  absl::MutexLock l(&mu_);
  return rounds_;
}

void RoundReplicaExchange::Loop() {
  absl::Duration idle = absl::ZeroDuration();
  absl::Time close_deadline = absl::InfiniteFuture();
  bool closing_sent = false;
  while (true) {
    bool all_closed = false, moved = false;
    absl::Status s = RunRound(&all_closed, &moved);
    if (s.ok() && !all_closed) {
      absl::MutexLock l(&mu_);
      if (closing_ && close_deadline == absl::InfiniteFuture()) close_deadline = absl::Now() + options_.timeout;
      closing_sent = closing_;
      if (absl::Now() > close_deadline) {
        s = absl::DeadlineExceededError(absl::StrCat("replicas still exchanging ", absl::FormatDuration(options_.timeout),
                                                     " after this one closed"));
      }
    }
    if (!s.ok()) {
      {
        absl::MutexLock l(&mu_);
        failed_ = s;
        for (auto& q : queues_) q.clear();
      }
      mailbox_.Fail(s);
      transport_->Finish(false);
      return;
    }
    if (all_closed) {
      transport_->Finish(true);
      return;
    }
    if (moved) {
      idle = absl::ZeroDuration();
      continue;
    }
    // Nothing moved: wait for a Send (or this replica closing) or the backoff.
    idle = std::min(options_.max_idle, std::max(idle * 2, absl::Microseconds(50)));
    absl::MutexLock l(&mu_);
    auto work = [this, closing_sent]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (closing_ != closing_sent) return true;
      for (const auto& q : queues_) {
        if (!q.empty()) return true;
      }
      return false;
    };
    mu_.AwaitWithTimeout(absl::Condition(&work), idle);
  }
}

absl::Status RoundReplicaExchange::RunRound(bool* all_closed, bool* moved) {
  const int d = size_;
  const int w = d + 1;  // row width: a size per destination, then the closing flag
  std::vector<int64_t> row(w, 0);
  std::vector<absl::string_view> sends(d);
  {
    absl::MutexLock l(&mu_);
    for (int j = 0; j < d; ++j) {
      if (queues_[j].empty()) continue;
      sends[j] = queues_[j].front();  // deque elements stay put while others push_back
      row[j] = static_cast<int64_t>(sends[j].size());
    }
    row[d] = closing_ ? 1 : 0;
  }
  std::vector<int64_t> table(static_cast<size_t>(d) * w);
  AQSWARM_RETURN_IF_ERROR(transport_->AllGather(row, absl::MakeSpan(table)));
  // The table came over the wire: check it before acting on it.
  *all_closed = true;
  std::vector<int64_t> incoming(d, 0);
  for (int r = 0; r < d; ++r) {
    const int64_t flag = table[r * w + d];
    if (flag != 0 && flag != 1) return absl::DataLossError(absl::StrCat("replica ", r, " sent a round table with closing flag ", flag));
    if (flag == 0) *all_closed = false;
    for (int j = 0; j < d; ++j) {
      const int64_t n = table[r * w + j];
      if (n < 0 || n > options_.max_chunk_bytes || (n > 0 && r == j)) {
        return absl::DataLossError(absl::StrCat("replica ", r, " announced a chunk of ", n, " bytes to replica ", j));
      }
      if (n > 0) *all_closed = false;
    }
    incoming[r] = table[r * w + rank_];
  }
  for (int j = 0; j < d; ++j) {
    if (table[rank_ * w + j] != row[j]) return absl::DataLossError("the round table does not hold this replica's own row");
  }
  if (*all_closed) return absl::OkStatus();
  bool any = false;
  for (int j = 0; j < d; ++j) any = any || row[j] > 0 || incoming[j] > 0;
  {
    absl::MutexLock l(&mu_);
    ++rounds_;
  }
  if (!any) return absl::OkStatus();
  std::vector<std::string> received(d);
  AQSWARM_RETURN_IF_ERROR(transport_->Exchange(sends, incoming, &received));
  {
    absl::MutexLock l(&mu_);
    for (int j = 0; j < d; ++j) {
      if (row[j] == 0) continue;
      bytes_sent_ += row[j];
      queues_[j].pop_front();
    }
  }
  for (int j = 0; j < d; ++j) {
    if (incoming[j] == 0) continue;
    v1::ExchangeChunk c;
    if (received[j].size() != static_cast<size_t>(incoming[j]) || !c.ParseFromString(received[j])) {
      CountRejectedMessage(RejectReason::kDpChunkInvalid);
      continue;
    }
    if (c.from_rank() != static_cast<uint32_t>(j)) {
      CountRejectedMessage(RejectReason::kDpChunkInvalid);
      continue;
    }
    mailbox_.Deliver(std::move(c)).IgnoreError();  // refusals are counted by reason there
  }
  *moved = true;
  return absl::OkStatus();
}

}  // namespace aqswarm::stage
