// libFuzzer target: the coordinator's durable state as a restarted
// coordinator loads it (coordinator::CoordinatorState::Load over the
// RocksDB StateStore). Each input replaces the whole store's contents with
// its records, then Load runs as at `aqswarm coordinator --state_dir` start:
// a corrupt record must be DataLoss naming its key, never a crash.
// Input: records in pairs, key then tagged value (storage/state_store.h:
// [type tag u8][encoding]); written raw, so keys, tags and encodings are all
// fuzzed. Seeds: fuzz/corpus/coordinator_state (fuzz/seed_gen.cc dumps a
// state committed through CoordinatorState::Change).
// The state stays open across inputs (a RocksDB open per input would run
// ~15 inputs a second); its store is reached through the private member
// pointer below (an explicit instantiation may name private members), so
// the target writes raw records into the very store Load reads.
#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "coordinator/coordinator_state.h"
#include "fuzz/fuzz_input.h"
#include "storage/state_store.h"
#include "fuzz/quiet_protobuf.h"

using namespace aqswarm;

namespace {

using StoreMember = std::unique_ptr<storage::StateStore> coordinator::CoordinatorState::*;
StoreMember StateStoreOf();
template <StoreMember M>
struct StoreAccess {
  friend StoreMember StateStoreOf() { return M; }
};
template struct StoreAccess<&coordinator::CoordinatorState::store_>;

// A fresh state directory every kInputsPerStore inputs: deleted keys stay
// as RocksDB tombstones that every later scan walks, so one store slows
// down input after input.
constexpr int kInputsPerStore = 1000;

// Raw statics, never destroyed: closing a RocksDB from a static destructor
// at exit runs after RocksDB's own statics are gone (a SEGV in its logger).
coordinator::CoordinatorState* g_state = nullptr;
std::string* g_dir = nullptr;
int g_uses = 0;

void RemoveDir() {
  if (g_dir != nullptr && !g_dir->empty()) std::filesystem::remove_all(*g_dir);
}

coordinator::CoordinatorState& State() {
  if (g_state == nullptr || ++g_uses >= kInputsPerStore) {
    if (g_dir == nullptr) {
      g_dir = new std::string;
      atexit(RemoveDir);  // the files only: the open store is left to the OS
    }
    delete g_state;  // closes the previous store
    g_state = nullptr;
    RemoveDir();
    const char* tmp = getenv("TMPDIR");
    *g_dir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/aqswarm-fuzz-state-XXXXXX";
    if (mkdtemp(g_dir->data()) == nullptr) abort();
    auto s = coordinator::CoordinatorState::Open({*g_dir, /*sync=*/false});
    if (!s.ok()) abort();  // the harness's own directory: not the input's fault
    g_state = s->release();
    g_uses = 0;
  }
  return *g_state;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  coordinator::CoordinatorState& state = State();
  storage::StateStore& store = *(state.*StateStoreOf());
  storage::StateStore::Batch batch;
  batch.DeletePrefix("");
  for (int i = 0; !in.empty() && i < 64; ++i) {
    std::string key(in.Record());
    std::string value(in.Record());
    if (key.empty()) continue;
    batch.PutRaw(std::move(key), std::move(value));
  }
  if (!store.Commit(batch).ok()) abort();
  (void)state.Load();
  return 0;
}
