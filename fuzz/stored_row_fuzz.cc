// libFuzzer target: message-store rows as read back from disk
// (storage/row_codec.h VerifyRowValue, RowMatches, then common/row_format.h
// DecodeRow of the payload; keys through DecodeKey, index entries through
// DecodeIndexValue). A corrupt or truncated row must be DataLoss, never a
// crash or an out-of-bounds read.
// Input: [flags u8] then records: key, row value, index value. Flag bit 0
// rewrites the row's two checksums to match (a row that is corrupt but
// consistently checksummed, so the header fields behind the checksum are
// fuzzed too); bit 1 does the same for the index value's checksum.
// Seeds: fuzz/corpus/stored_row.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/checksum.h"
#include "common/row_format.h"
#include "fuzz/fuzz_input.h"
#include "storage/row_codec.h"

using namespace aqswarm;
namespace si = aqswarm::storage::internal;

namespace {

void PutLe64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>(v >> (8 * i));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  const uint8_t flags = in.U8();
  const std::string key(in.Record());
  std::string value(in.Record());
  std::string index(in.Record());

  uint8_t kind = 0;
  storage::LinkId link;
  uint64_t sample = 0;
  (void)si::DecodeKey(key, &kind, &link, &sample);

  if ((flags & 1) && value.size() >= si::kRowHeaderBytes) {
    PutLe64(value.data() + 24, Checksum64(value.data() + si::kRowHeaderBytes, value.size() - si::kRowHeaderBytes));
    const std::string keyed = key + value.substr(0, 32);
    PutLe64(value.data() + 32, Checksum64(keyed.data(), keyed.size()));
  }
  si::RowHeader header;
  std::string_view payload;
  if (si::VerifyRowValue(key, value, &header, &payload).ok()) {
    storage::LinkSpec spec;
    spec.link = link;
    spec.generation = header.generation;
    spec.rows = header.rows;
    spec.cols = header.cols;
    spec.precision = header.precision;
    (void)si::RowMatches(header, spec);
    const uint64_t n = static_cast<uint64_t>(header.rows) * header.cols;
    if (n <= (1u << 20) && (header.rows == 0 || n / header.rows == header.cols)) {
      std::vector<float> out(n);
      (void)DecodeRow(header.precision, header.rows, header.cols, payload, absl::MakeSpan(out));
    }
  }

  if ((flags & 2) && index.size() == si::kIndexValueBytes) {
    const std::string keyed = key + index.substr(0, 16);
    PutLe64(index.data() + 16, Checksum64(keyed.data(), keyed.size()));
  }
  uint64_t seq = 0, row_bytes = 0;
  (void)si::DecodeIndexValue(key, index, &seq, &row_bytes);
  return 0;
}
