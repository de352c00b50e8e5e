#include "storage/memory_message_store.h"

#include <vector>

#include "storage/row_codec.h"

namespace aqswarm::storage {

absl::StatusOr<std::unique_ptr<MemoryMessageStore>> MemoryMessageStore::Create(
    const Options& options) {
  return std::unique_ptr<MemoryMessageStore>(new MemoryMessageStore(options));
}

absl::Status MemoryMessageStore::Close() {
  MarkClosed();
  absl::MutexLock lock(&map_mu_);
  map_.clear();
  return absl::OkStatus();
}

void MemoryMessageStore::ReadRaw(absl::Span<const std::string> keys, bool /*memory_only: all is*/,
                                 RawVisitor visit) {
  std::vector<std::shared_ptr<const std::string>> values(keys.size());
  {
    absl::MutexLock lock(&map_mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = map_.find(keys[i]);
      if (it != map_.end()) values[i] = it->second;
    }
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (values[i] == nullptr) {
      visit(i, absl::NotFoundError("unseen"), {});
    } else {
      visit(i, absl::OkStatus(), *values[i]);
    }
  }
}

absl::Status MemoryMessageStore::WriteRaw(absl::Span<internal::WriteOp> ops) {
  // Build the new values before taking the lock; applying is then atomic.
  std::vector<std::shared_ptr<const std::string>> values(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!ops[i].is_delete) values[i] = std::make_shared<const std::string>(std::move(ops[i].value));
  }
  absl::MutexLock lock(&map_mu_);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].is_delete) {
      map_.erase(ops[i].key);
    } else {
      map_[ops[i].key] = std::move(values[i]);
    }
  }
  return absl::OkStatus();
}

absl::Status MemoryMessageStore::DeleteRangesRaw(
    absl::Span<const std::pair<std::string, std::string>> ranges) {
  absl::MutexLock lock(&map_mu_);
  for (const auto& [begin, end] : ranges) {
    map_.erase(map_.lower_bound(begin), map_.lower_bound(end));
  }
  return absl::OkStatus();
}

absl::Status MemoryMessageStore::MutateRowForTesting(
    const LinkId& link, uint64_t sample, absl::FunctionRef<void(std::string*)> mutate) {
  absl::MutexLock lock(&map_mu_);
  auto it = map_.find(internal::EncodeKey(internal::kRowKind, link, sample));
  if (it == map_.end()) return absl::NotFoundError("no such row");
  auto copy = std::make_shared<std::string>(*it->second);
  mutate(copy.get());
  it->second = std::move(copy);
  return absl::OkStatus();
}

}  // namespace aqswarm::storage
