// Reading and writing the safetensors format (torch-free), used for GPT-2
// weights (Hugging Face tensor names) and for stage checkpoints.
//
// Format: u64 little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value"}}
// then the data region; offsets are relative to its start.
//
// Everything in the header is validated before any tensor is touched: header
// length within the file, known dtype, offsets inside the data region and in
// order, byte length == numel * dtype size, no overflow in the shape product.
//
//   AQSWARM_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
//   const SafetensorsFile::Entry* e = file->Find("wte.weight");
//   std::vector<float> v = file->ToFloat32(*e);
#ifndef AQSWARM_PIPELINE_SAFETENSORS_H_
#define AQSWARM_PIPELINE_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace aqswarm::pipeline {

// kOther: any other dtype of the format (I64, F64, BOOL, ...): such tensors are
// listed (with dtype_name) so a file holding them still opens, but they cannot
// be converted; consumers reject them by name.
enum class StDtype { kF32, kF16, kBF16, kOther };

class SafetensorsFile {
 public:
  struct Entry {
    std::string name;
    StDtype dtype;
    std::string dtype_name;  // as in the header: "F32", "BF16", "I64", ...
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // within the data region
    int64_t numel() const;
    bool is_float() const { return dtype != StDtype::kOther; }
  };

  // Reads and validates the whole file. Files above `max_bytes` are refused.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path,
                                                               uint64_t max_bytes = 16ull << 30);
  // Same, from bytes in memory.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Parse(std::string bytes);

  const Entry* Find(const std::string& name) const;
  const std::vector<Entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Converts F32, F16 or BF16 to float32 (e.is_float() must hold).
  std::vector<float> ToFloat32(const Entry& e) const;

 private:
  std::string bytes_;
  uint64_t data_start_ = 0;
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// One float32 tensor to write.
struct StTensor {
  std::string name;
  std::vector<int64_t> shape;
  absl::Span<const float> data;
};

// Serialises float32 tensors (sorted by name, as the reference writer does).
std::string SerializeSafetensors(const std::vector<StTensor>& tensors,
                                 const std::map<std::string, std::string>& metadata);
// Writes atomically (WriteFileAtomically, common/file_util.h: a temp file,
// fsync, rename, fsync of the directory), mode 0644.
absl::Status WriteSafetensors(const std::string& path, const std::vector<StTensor>& tensors,
                              const std::map<std::string, std::string>& metadata);

}  // namespace aqswarm::pipeline

#endif  // AQSWARM_PIPELINE_SAFETENSORS_H_
