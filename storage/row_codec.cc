#include "storage/row_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"

namespace aqswarm::storage::internal {
namespace {

void PutBe32(char* p, uint32_t v) {
  for (int i = 3; i >= 0; --i, v >>= 8) p[i] = static_cast<char>(v & 0xff);
}
void PutBe64(char* p, uint64_t v) {
  for (int i = 7; i >= 0; --i, v >>= 8) p[i] = static_cast<char>(v & 0xff);
}
uint64_t GetBe(const char* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
void PutLe32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i, v >>= 8) p[i] = static_cast<char>(v & 0xff);
}
void PutLe64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i, v >>= 8) p[i] = static_cast<char>(v & 0xff);
}
uint64_t GetLe(const char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Checksum of key ++ bytes, without concatenating.
uint64_t KeyedChecksum(std::string_view key, const char* data, size_t n) {
  Checksummer c;
  c.Update(key.data(), key.size());
  c.Update(data, n);
  return c.Digest();
}

}  // namespace

std::string EncodeKey(uint8_t kind, const LinkId& link, uint64_t sample) {
  std::string key(kKeyBytes, '\0');
  key[0] = static_cast<char>(kind);
  PutBe32(&key[1], link.pipeline);
  PutBe32(&key[5], link.boundary);
  PutBe64(&key[9], sample);
  return key;
}

std::string LinkBeginKey(uint8_t kind, const LinkId& link) { return EncodeKey(kind, link, 0).substr(0, 9); }

std::string LinkEndKey(uint8_t kind, const LinkId& link) {
  // The 9-byte prefix incremented as a big-endian number (kind never overflows).
  std::string end = LinkBeginKey(kind, link);
  for (int i = 8; i >= 0; --i) {
    if (static_cast<uint8_t>(end[i]) != 0xff) {
      end[i] = static_cast<char>(static_cast<uint8_t>(end[i]) + 1);
      break;
    }
    end[i] = '\0';
  }
  return end;
}

bool DecodeKey(std::string_view key, uint8_t* kind, LinkId* link, uint64_t* sample) {
  if (key.size() != kKeyBytes) return false;
  *kind = static_cast<uint8_t>(key[0]);
  link->pipeline = static_cast<uint32_t>(GetBe(&key[1], 4));
  link->boundary = static_cast<uint32_t>(GetBe(&key[5], 4));
  *sample = GetBe(&key[9], 8);
  return true;
}

std::string EncodeRowValue(std::string_view row_key, const LinkSpec& link,
                           absl::Span<const float> values) {
  const size_t payload_bytes = link.payload_bytes();
  std::string value(kRowHeaderBytes + payload_bytes, '\0');
  char* p = value.data();
  p[0] = static_cast<char>(kRowFormatVersion);
  p[1] = static_cast<char>(link.precision);
  PutLe32(p + 4, static_cast<uint32_t>(link.rows));
  PutLe32(p + 8, static_cast<uint32_t>(link.cols));
  PutLe64(p + 16, link.generation);
  EncodeRow(link.precision, link.rows, link.cols, values, p + kRowHeaderBytes);
  PutLe64(p + 24, Checksum64(p + kRowHeaderBytes, payload_bytes));
  PutLe64(p + 32, KeyedChecksum(row_key, p, 32));
  return value;
}

absl::Status VerifyRowValue(std::string_view row_key, std::string_view value, RowHeader* header,
                            std::string_view* payload) {
  if (value.size() < kRowHeaderBytes) {
    return absl::DataLossError(absl::StrCat("truncated row: ", value.size(), " bytes < header ",
                                            kRowHeaderBytes));
  }
  const char* p = value.data();
  if (GetLe(p + 32, 8) != KeyedChecksum(row_key, p, 32)) {
    return absl::DataLossError("row header checksum mismatch");
  }
  header->format_version = static_cast<uint8_t>(p[0]);
  if (header->format_version != kRowFormatVersion) {
    return absl::DataLossError(
        absl::StrCat("unsupported row format version ", header->format_version));
  }
  if (!IsValidRowPrecision(static_cast<uint8_t>(p[1]))) {
    return absl::DataLossError("invalid row precision");
  }
  header->precision = static_cast<RowPrecision>(p[1]);
  header->rows = static_cast<uint32_t>(GetLe(p + 4, 4));
  header->cols = static_cast<uint32_t>(GetLe(p + 8, 4));
  header->generation = GetLe(p + 16, 8);
  header->payload_checksum = GetLe(p + 24, 8);
  const size_t want = EncodedRowBytes(header->precision, header->rows, header->cols);
  if (value.size() - kRowHeaderBytes != want) {
    return absl::DataLossError(absl::StrCat("truncated row: payload ", value.size() - kRowHeaderBytes,
                                            " bytes, header says ", want));
  }
  *payload = value.substr(kRowHeaderBytes);
  if (Checksum64(payload->data(), payload->size()) != header->payload_checksum) {
    return absl::DataLossError("row payload checksum mismatch");
  }
  return absl::OkStatus();
}

bool RowMatches(const RowHeader& header, const LinkSpec& link) {
  return header.generation == link.generation && header.precision == link.precision &&
         header.rows == static_cast<uint64_t>(link.rows) &&
         header.cols == static_cast<uint64_t>(link.cols);
}

std::string EncodeIndexValue(std::string_view index_key, uint64_t seq, uint64_t row_bytes) {
  std::string v(kIndexValueBytes, '\0');
  PutLe64(&v[0], seq);
  PutLe64(&v[8], row_bytes);
  PutLe64(&v[16], KeyedChecksum(index_key, v.data(), 16));
  return v;
}

absl::Status DecodeIndexValue(std::string_view index_key, std::string_view value, uint64_t* seq,
                              uint64_t* row_bytes) {
  if (value.size() != kIndexValueBytes ||
      GetLe(value.data() + 16, 8) != KeyedChecksum(index_key, value.data(), 16)) {
    return absl::DataLossError("corrupt index entry");
  }
  *seq = GetLe(value.data(), 8);
  *row_bytes = GetLe(value.data() + 8, 8);
  return absl::OkStatus();
}

}  // namespace aqswarm::storage::internal
