#include "pipeline/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace aqswarm::pipeline {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// Bytes per element of a safetensors dtype; 0 for an unknown one.
size_t DtypeSize(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "BOOL" || d == "U8" || d == "I8" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

absl::Status Corrupt(const std::string& what) {
  return absl::DataLossError(absl::StrCat("safetensors: ", what));
}

}  // namespace

int64_t SafetensorsFile::Entry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path,
                                                                       uint64_t max_bytes) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("safetensors: cannot open ", path));
  const std::streamoff size = in.tellg();
  if (size < 0 || static_cast<uint64_t>(size) > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("safetensors: ", path, " is larger than ", max_bytes, " bytes"));
  }
  std::string bytes(static_cast<size_t>(size), '\0');
  in.seekg(0);
  if (!in.read(bytes.data(), size)) return absl::DataLossError(absl::StrCat("safetensors: short read of ", path));
  auto parsed = Parse(std::move(bytes));
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(), absl::StrCat(path, ": ", parsed.status().message()));
  }
  return parsed;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Parse(std::string bytes) {
  auto f = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  f->bytes_ = std::move(bytes);
  const std::string& b = f->bytes_;
  if (b.size() < 8) return Corrupt("file shorter than its 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(b[i]);
  if (n > kMaxHeaderBytes || n > b.size() - 8) {
    return Corrupt(absl::StrCat("header length ", n, " exceeds the file (", b.size(), " bytes)"));
  }
  f->data_start_ = 8 + n;
  const uint64_t data_size = b.size() - f->data_start_;
  nlohmann::json header = nlohmann::json::parse(b.begin() + 8, b.begin() + 8 + n, nullptr,
                                                /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return Corrupt("header is not a JSON object");
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) return Corrupt("__metadata__ is not an object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) return Corrupt("metadata values must be strings");
        f->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const auto& v = it.value();
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets")) {
      return Corrupt(absl::StrCat("tensor '", it.key(), "' lacks dtype/shape/data_offsets"));
    }
    Entry e;
    e.name = it.key();
    const auto& dt = v["dtype"];
    if (!dt.is_string()) return Corrupt(absl::StrCat("tensor '", e.name, "' dtype is not a string"));
    const std::string dtype = dt.get<std::string>();
    e.dtype_name = dtype;
    if (dtype == "F32") e.dtype = StDtype::kF32;
    else if (dtype == "F16") e.dtype = StDtype::kF16;
    else if (dtype == "BF16") e.dtype = StDtype::kBF16;
    else e.dtype = StDtype::kOther;
    const size_t elem_size = DtypeSize(dtype);
    if (elem_size == 0) {
      return absl::UnimplementedError(absl::StrCat("safetensors: tensor '", e.name, "' has unknown dtype ", dtype));
    }
    if (!v["shape"].is_array() || v["shape"].size() > 8) return Corrupt(absl::StrCat("tensor '", e.name, "' has a bad shape"));
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) return Corrupt(absl::StrCat("tensor '", e.name, "' has a negative or non-integer dim"));
      const uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && numel > (std::numeric_limits<uint64_t>::max() >> 4) / dim) {
        return Corrupt(absl::StrCat("tensor '", e.name, "' shape overflows"));
      }
      numel *= dim;
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return Corrupt(absl::StrCat("tensor '", e.name, "' has bad data_offsets"));
    }
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_size) {
      return Corrupt(absl::StrCat("tensor '", e.name, "' offsets [", e.begin, ", ", e.end,
                                  ") fall outside the data region of ", data_size, " bytes"));
    }
    if (e.end - e.begin != numel * elem_size) {
      return Corrupt(absl::StrCat("tensor '", e.name, "' has ", e.end - e.begin, " bytes but its shape needs ",
                                  numel * elem_size));
    }
    f->entries_.push_back(std::move(e));
  }
  // By (begin, end): an empty tensor sharing its offset with the next one
  // sorts first, so it is not taken for an overlap.
  std::sort(f->entries_.begin(), f->entries_.end(),
            [](const Entry& a, const Entry& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  for (size_t i = 1; i < f->entries_.size(); ++i) {
    if (f->entries_[i].begin < f->entries_[i - 1].end) {
      return Corrupt(absl::StrCat("tensors '", f->entries_[i - 1].name, "' and '", f->entries_[i].name, "' overlap"));
    }
  }
  return f;
}

const SafetensorsFile::Entry* SafetensorsFile::Find(const std::string& name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

std::vector<float> SafetensorsFile::ToFloat32(const Entry& e) const {
  const char* p = bytes_.data() + data_start_ + e.begin;
  const size_t n = static_cast<size_t>(e.numel());
  std::vector<float> out(n);
  switch (e.dtype) {
    case StDtype::kF32:
      std::memcpy(out.data(), p, n * 4);
      break;
    case StDtype::kF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = HalfToFloat(h);
      }
      break;
    case StDtype::kBF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = BitsToFloat(static_cast<uint32_t>(h) << 16);
      }
      break;
    case StDtype::kOther:  // callers check is_float() first
      std::fprintf(stderr, "safetensors: ToFloat32 of %s tensor %s\n", e.dtype_name.c_str(), e.name.c_str());
      std::abort();
  }
  return out;
}

std::string SerializeSafetensors(const std::vector<StTensor>& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  std::vector<const StTensor*> sorted;
  for (const auto& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->name < b->name; });
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const StTensor* t : sorted) {
    const uint64_t bytes = t->data.size() * 4;
    header[t->name] = {{"dtype", "F32"}, {"shape", t->shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');  // align the data region
  std::string out(8, '\0');
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += h;
  out.reserve(out.size() + offset);
  for (const StTensor* t : sorted) out.append(reinterpret_cast<const char*>(t->data.data()), t->data.size() * 4);
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<StTensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  const std::string bytes = SerializeSafetensors(tensors, metadata);
  return WriteFileAtomically(path, bytes, 0644);
}

}  // namespace aqswarm::pipeline
