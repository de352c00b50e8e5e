// StateStore: a small typed key-value store over RocksDB for the
// coordinator's own state (members, plan, progress, checkpoints). Unlike the
// message store, every commit is durable when it returns (WAL + fsync): the
// coordinator must never forget a membership or plan it has announced.
//
// Values are typed through StateKey<T> and StateCodec<T>; each stored value
// is [type tag u8][encoding], so reading a key with the wrong type fails with
// DataLoss instead of returning nonsense. Built-in codecs: bool, int64_t,
// uint64_t, double, std::string, std::vector<std::string>. Other types (e.g.
// a serialized proto) specialise StateCodec<T> or use std::string.
//
//   AQSWARM_ASSIGN_OR_RETURN(auto state, StateStore::Open({.path = dir}));
//   static const StateKey<uint64_t> kPlanVersion("plan/version");
//   StateStore::Batch batch;
//   batch.Put(kPlanVersion, 7);
//   batch.Put(StateKey<std::string>("plan/body"), serialized_plan);
//   batch.Delete("members/peer-17");
//   AQSWARM_RETURN_IF_ERROR(state->Commit(batch));        // atomic + synced
//   AQSWARM_ASSIGN_OR_RETURN(uint64_t v, state->Get(kPlanVersion));
//   AQSWARM_ASSIGN_OR_RETURN(auto members, state->Scan("members/"));
//
// Thread-safety: thread-safe. Batch is a plain value type (not thread-safe).
#ifndef AQSWARM_STORAGE_STATE_STORE_H_
#define AQSWARM_STORAGE_STATE_STORE_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rocksdb {
class DB;
}

namespace aqswarm::storage {

// Encode/Decode for one value type; `kTag` distinguishes types on disk.
// Specialise for your own types (tags >= 64 are free for users).
template <typename T>
struct StateCodec;

template <typename T>
class StateKey {
 public:
  explicit StateKey(std::string name) : name_(std::move(name)) {}
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

class StateStore {
 public:
  struct Options {
    // Directory of the store; created (with parents) if missing. Required.
    std::string path;
    // fsync the WAL on every Commit. Default: true. (false only for tests.)
    bool sync = true;
  };

  // An atomic group of puts and deletes, applied in order by Commit().
  class Batch {
   public:
    template <typename T>
    void Put(const StateKey<T>& key, const T& value) {
      ops_.push_back({false, key.name(), Tagged<T>(value)});
    }
    void PutRaw(std::string key, std::string tagged_value) {
      ops_.push_back({false, std::move(key), std::move(tagged_value)});
    }
    void Delete(std::string key) { ops_.push_back({true, std::move(key), {}}); }
    template <typename T>
    void Delete(const StateKey<T>& key) { Delete(key.name()); }
    // Deletes every key starting with `prefix`.
    void DeletePrefix(std::string prefix) { ops_.push_back({true, std::move(prefix), {}, true}); }
    bool empty() const { return ops_.empty(); }
    size_t size() const { return ops_.size(); }

   private:
    friend class StateStore;
    struct Op {
      bool is_delete = false;
      std::string key;
      std::string value;
      bool prefix = false;
    };
    std::vector<Op> ops_;
  };

  // Errors name the path: cannot create/write it, locked by another process
  // (FailedPrecondition), disk full (ResourceExhausted).
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(const Options& options);
  ~StateStore();

  // Applies `batch` atomically and durably (when Options::sync).
  absl::Status Commit(const Batch& batch);

  template <typename T>
  absl::Status Put(const StateKey<T>& key, const T& value) {
    Batch b;
    b.Put(key, value);
    return Commit(b);
  }

  // NotFound if absent; DataLoss if stored with another type or malformed.
  template <typename T>
  absl::StatusOr<T> Get(const StateKey<T>& key) const {
    absl::StatusOr<std::string> raw = GetRaw(key.name());
    if (!raw.ok()) return raw.status();
    return Untag<T>(key.name(), *raw);
  }

  // The tagged value as stored (see Tagged<T>).
  absl::StatusOr<std::string> GetRaw(std::string_view key) const;

  // All (key, tagged value) pairs whose key starts with `prefix`, in key order.
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> Scan(
      std::string_view prefix) const;

  // Encoding helpers for Scan results and PutRaw.
  template <typename T>
  static std::string Tagged(const T& value) {
    std::string out(1, static_cast<char>(StateCodec<T>::kTag));
    StateCodec<T>::Encode(value, &out);
    return out;
  }
  template <typename T>
  static absl::StatusOr<T> Untag(std::string_view key, std::string_view tagged) {
    if (tagged.empty() || static_cast<uint8_t>(tagged[0]) != StateCodec<T>::kTag) {
      return WrongType(key);
    }
    T value;
    if (!StateCodec<T>::Decode(tagged.substr(1), &value)) return Malformed(key);
    return value;
  }

 private:
  StateStore(const Options& options, std::unique_ptr<rocksdb::DB> db);
  static absl::Status WrongType(std::string_view key);
  static absl::Status Malformed(std::string_view key);

  const Options options_;
  std::unique_ptr<rocksdb::DB> db_;
};

// ---- built-in codecs --------------------------------------------------------

namespace internal {
inline void AppendFixed64(uint64_t v, std::string* out) {
  for (int i = 0; i < 8; ++i, v >>= 8) out->push_back(static_cast<char>(v & 0xff));
}
inline bool ReadFixed64(std::string_view in, uint64_t* v) {
  if (in.size() != 8) return false;
  *v = 0;
  for (int i = 7; i >= 0; --i) *v = (*v << 8) | static_cast<uint8_t>(in[i]);
  return true;
}
}  // namespace internal

template <>
struct StateCodec<bool> {
  static constexpr uint8_t kTag = 1;
  static void Encode(bool v, std::string* out) { out->push_back(v ? 1 : 0); }
  static bool Decode(std::string_view in, bool* v) {
    if (in.size() != 1 || static_cast<uint8_t>(in[0]) > 1) return false;
    *v = in[0] == 1;
    return true;
  }
};

template <>
struct StateCodec<uint64_t> {
  static constexpr uint8_t kTag = 2;
  static void Encode(uint64_t v, std::string* out) { internal::AppendFixed64(v, out); }
  static bool Decode(std::string_view in, uint64_t* v) { return internal::ReadFixed64(in, v); }
};

template <>
struct StateCodec<int64_t> {
  static constexpr uint8_t kTag = 3;
  static void Encode(int64_t v, std::string* out) {
    internal::AppendFixed64(static_cast<uint64_t>(v), out);
  }
  static bool Decode(std::string_view in, int64_t* v) {
    uint64_t u;
    if (!internal::ReadFixed64(in, &u)) return false;
    *v = static_cast<int64_t>(u);
    return true;
  }
};

template <>
struct StateCodec<double> {
  static constexpr uint8_t kTag = 4;
  static void Encode(double v, std::string* out) {
    uint64_t u;
    std::memcpy(&u, &v, 8);
    internal::AppendFixed64(u, out);
  }
  static bool Decode(std::string_view in, double* v) {
    uint64_t u;
    if (!internal::ReadFixed64(in, &u)) return false;
    std::memcpy(v, &u, 8);
    return true;
  }
};

template <>
struct StateCodec<std::string> {
  static constexpr uint8_t kTag = 5;
  static void Encode(const std::string& v, std::string* out) { out->append(v); }
  static bool Decode(std::string_view in, std::string* v) {
    v->assign(in);
    return true;
  }
};

// Length-prefixed (u64) strings.
template <>
struct StateCodec<std::vector<std::string>> {
  static constexpr uint8_t kTag = 6;
  static void Encode(const std::vector<std::string>& v, std::string* out) {
    internal::AppendFixed64(v.size(), out);
    for (const auto& s : v) {
      internal::AppendFixed64(s.size(), out);
      out->append(s);
    }
  }
  static bool Decode(std::string_view in, std::vector<std::string>* v) {
    uint64_t n;
    if (in.size() < 8 || !internal::ReadFixed64(in.substr(0, 8), &n)) return false;
    in.remove_prefix(8);
    if (n > in.size() / 8) return false;  // each element needs >= 8 bytes
    v->clear();
    v->reserve(n);
    for (uint64_t i = 0; i < n; ++i) {
      uint64_t len;
      if (in.size() < 8 || !internal::ReadFixed64(in.substr(0, 8), &len)) return false;
      in.remove_prefix(8);
      if (len > in.size()) return false;
      v->emplace_back(in.substr(0, len));
      in.remove_prefix(len);
    }
    return in.empty();
  }
};

}  // namespace aqswarm::storage

#endif  // AQSWARM_STORAGE_STATE_STORE_H_
