// MemoryMessageStore: the in-memory MessageStore backend, for tests, small
// models and the benchmark's in-memory column. Same row format, checksums,
// generation rules, budget and counters as RocksDbMessageStore (both are
// RowStoreBase); only the raw key-value map differs. Nothing survives the
// object.
//
//   AQSWARM_ASSIGN_OR_RETURN(auto store,
//       MemoryMessageStore::Create({.capacity_bytes = 1 << 30}));
//
// Thread-safety: thread-safe (see message_store.h).
#ifndef AQSWARM_STORAGE_MEMORY_MESSAGE_STORE_H_
#define AQSWARM_STORAGE_MEMORY_MESSAGE_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "storage/row_store_base.h"

namespace aqswarm::storage {

class MemoryMessageStore final : public internal::RowStoreBase {
 public:
  struct Options {
    // Budget in bytes of live rows (key + 40-byte header + payload); a put
    // that would exceed it evicts oldest-written rows first. 0 = unlimited.
    // Default: 0.
    uint64_t capacity_bytes = 0;
  };

  static absl::StatusOr<std::unique_ptr<MemoryMessageStore>> Create(const Options& options);

  absl::Status Close() override;

  // Test hook: edits the stored bytes of a row in place (corruption tests).
  // NotFound if the row does not exist.
  absl::Status MutateRowForTesting(const LinkId& link, uint64_t sample,
                                   absl::FunctionRef<void(std::string*)> mutate);

 private:
  explicit MemoryMessageStore(const Options& options) : RowStoreBase(options.capacity_bytes) {}

  void ReadRaw(absl::Span<const std::string> keys, bool memory_only, RawVisitor visit) override;
  absl::Status WriteRaw(absl::Span<internal::WriteOp> ops) override;
  absl::Status DeleteRangesRaw(
      absl::Span<const std::pair<std::string, std::string>> ranges) override;

  absl::Mutex map_mu_;
  // Values are immutable once stored, so readers decode outside the lock.
  std::map<std::string, std::shared_ptr<const std::string>> map_ ABSL_GUARDED_BY(map_mu_);
};

}  // namespace aqswarm::storage

#endif  // AQSWARM_STORAGE_MEMORY_MESSAGE_STORE_H_
