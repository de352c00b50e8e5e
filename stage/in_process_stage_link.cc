#include "stage/in_process_stage_link.h"

#include <deque>

#include "absl/strings/str_cat.h"

namespace aqswarm::stage {

struct InProcessStageLink::Shared {
  std::string name;
  absl::Mutex mu;
  std::deque<v1::LinkFrame> inbox[2] ABSL_GUARDED_BY(mu);
  bool closed[2] ABSL_GUARDED_BY(mu) = {false, false};
  FrameArrivals* arrivals[2] ABSL_GUARDED_BY(mu) = {nullptr, nullptr};
  uint64_t sent[2] ABSL_GUARDED_BY(mu) = {0, 0};
};

namespace {

absl::Status Gone(const std::string& name) {
  return absl::UnavailableError(absl::StrCat(name, ": the link has ended"));
}

}  // namespace

std::pair<std::unique_ptr<InProcessStageLink>, std::unique_ptr<InProcessStageLink>> InProcessStageLink::Pair(
    const std::string& name) {
  auto shared = std::make_shared<Shared>();
  shared->name = name;
  return {std::unique_ptr<InProcessStageLink>(new InProcessStageLink(shared, 0)),
          std::unique_ptr<InProcessStageLink>(new InProcessStageLink(shared, 1))};
}

InProcessStageLink::~InProcessStageLink() { Close(); }

// Arrival counters are notified under the lock: once NotifyArrivals(nullptr)
// returns, no notification of the one it replaced is under way.
void InProcessStageLink::Close() {
  absl::MutexLock l(&shared_->mu);
  if (shared_->closed[side_]) return;
  shared_->closed[side_] = true;
  if (shared_->arrivals[1 - side_] != nullptr) shared_->arrivals[1 - side_]->Notify();
}

absl::Status InProcessStageLink::Send(v1::LinkFrame frame, absl::Duration timeout) {
  absl::MutexLock l(&shared_->mu);
  if (shared_->closed[0] || shared_->closed[1]) return Gone(shared_->name);
  shared_->sent[side_] += frame.ByteSizeLong();
  shared_->inbox[1 - side_].push_back(std::move(frame));
  if (shared_->arrivals[1 - side_] != nullptr) shared_->arrivals[1 - side_]->Notify();
  return absl::OkStatus();
}

absl::StatusOr<v1::LinkFrame> InProcessStageLink::Receive(const Match& match, absl::Duration timeout) {
  Shared& s = *shared_;
  absl::MutexLock l(&s.mu);
  auto& inbox = s.inbox[side_];
  std::deque<v1::LinkFrame>::iterator found;
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
    for (found = inbox.begin(); found != inbox.end(); ++found) {
      if (match(*found)) return true;
    }
    return s.closed[0] || s.closed[1];
  };
  if (!s.mu.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
    return absl::DeadlineExceededError(
        absl::StrCat(s.name, ": no matching frame within ", absl::FormatDuration(timeout)));
  }
  if (found == inbox.end()) return Gone(s.name);
  v1::LinkFrame f = std::move(*found);
  inbox.erase(found);
  return f;
}

absl::StatusOr<bool> InProcessStageLink::Has(const Match& match) {
  absl::MutexLock l(&shared_->mu);
  for (const v1::LinkFrame& f : shared_->inbox[side_]) {
    if (match(f)) return true;
  }
  if (shared_->closed[0] || shared_->closed[1]) return Gone(shared_->name);
  return false;
}

void InProcessStageLink::NotifyArrivals(FrameArrivals* arrivals) {
  absl::MutexLock l(&shared_->mu);
  shared_->arrivals[side_] = arrivals;
}

uint64_t InProcessStageLink::bytes_sent() const {
  absl::MutexLock l(&shared_->mu);
  return shared_->sent[side_];
}

}  // namespace aqswarm::stage
