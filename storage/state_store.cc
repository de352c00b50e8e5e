#include "storage/state_store.h"

#include "absl/strings/str_cat.h"
#include "rocksdb/db.h"
#include "rocksdb/iterator.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"
#include "storage/rocksdb_util.h"

namespace aqswarm::storage {
namespace {

// The first key after every key starting with `prefix`; empty = no bound.
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    const uint8_t last = static_cast<uint8_t>(prefix.back());
    if (last != 0xff) {
      prefix.back() = static_cast<char>(last + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return prefix;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(const Options& options) {
  rocksdb::Options o;
  o.create_if_missing = true;
  o.paranoid_checks = true;
  o.keep_log_file_num = 4;
  o.max_background_jobs = 1;
  auto db = internal::OpenRocksDb(o, options.path, "state store");
  if (!db.ok()) return db.status();
  return std::unique_ptr<StateStore>(new StateStore(options, std::move(db).value()));
}

StateStore::StateStore(const Options& options, std::unique_ptr<rocksdb::DB> db)
    : options_(options), db_(std::move(db)) {}

StateStore::~StateStore() {
  if (db_ != nullptr) (void)db_->Close();
}

absl::Status StateStore::Commit(const Batch& batch) {
  rocksdb::WriteBatch wb;
  for (const Batch::Op& op : batch.ops_) {
    rocksdb::Status s;
    if (op.prefix) {
      const std::string end = PrefixEnd(op.key);
      if (end.empty()) {
        // Prefix of all 0xff (or empty): delete key by key.
        auto all = Scan(op.key);
        if (!all.ok()) return all.status();
        for (const auto& [k, v] : *all) s = wb.Delete(k);
      } else {
        s = wb.DeleteRange(db_->DefaultColumnFamily(), op.key, end);
      }
    } else if (op.is_delete) {
      s = wb.Delete(op.key);
    } else {
      s = wb.Put(op.key, op.value);
    }
    if (!s.ok()) return internal::FromRocksDb(s, "state store batch");
  }
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync;
  return internal::FromRocksDb(db_->Write(wo, &wb),
                               absl::StrCat("state store commit at '", options_.path, "'"));
}

absl::StatusOr<std::string> StateStore::GetRaw(std::string_view key) const {
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), rocksdb::Slice(key.data(), key.size()),
                               &value);
  if (s.IsNotFound()) return absl::NotFoundError(absl::StrCat("state key '", std::string(key), "' not found"));
  if (!s.ok()) return internal::FromRocksDb(s, absl::StrCat("state store get '", std::string(key), "'"));
  return value;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> StateStore::Scan(
    std::string_view prefix) const {
  std::vector<std::pair<std::string, std::string>> out;
  rocksdb::ReadOptions ro;
  const std::string end = PrefixEnd(std::string(prefix));
  rocksdb::Slice upper(end);
  if (!end.empty()) ro.iterate_upper_bound = &upper;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro));
  for (it->Seek(rocksdb::Slice(prefix.data(), prefix.size())); it->Valid(); it->Next()) {
    if (!it->key().starts_with(rocksdb::Slice(prefix.data(), prefix.size()))) break;
    out.emplace_back(it->key().ToString(), it->value().ToString());
  }
  if (!it->status().ok()) return internal::FromRocksDb(it->status(), "state store scan");
  return out;
}

absl::Status StateStore::WrongType(std::string_view key) {
  return absl::DataLossError(absl::StrCat("state key '", std::string(key), "' holds another type"));
}

absl::Status StateStore::Malformed(std::string_view key) {
  return absl::DataLossError(absl::StrCat("state key '", std::string(key), "' holds a malformed value"));
}

}  // namespace aqswarm::storage
