// libFuzzer target: safetensors files (pipeline/safetensors.h), the format
// of stage checkpoints fetched from other peers and of imported weights.
// SafetensorsFile::Parse validates the header (length, JSON, dtypes, shapes,
// offsets); every float tensor of a file that parses is then converted.
// pipeline/safetensors.cc is torch-free but lives in the torch library
// aqswarm_pipeline, so this target compiles that one file itself.
// Input: the file's bytes. Seeds: fuzz/corpus/safetensors.
#include <cstddef>
#include <cstdint>
#include <string>

#include "pipeline/safetensors.h"

using aqswarm::pipeline::SafetensorsFile;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = SafetensorsFile::Parse(std::string(reinterpret_cast<const char*>(data), size));
  if (!file.ok()) return 0;
  for (const SafetensorsFile::Entry& e : (*file)->entries()) {
    (void)e.numel();
    if (e.is_float()) (void)(*file)->ToFloat32(e);
    (void)(*file)->Find(e.name);
  }
  return 0;
}
