// Byte layout of message-store keys and rows (internal to storage/; tests and
// the crash/corruption tools use it to poke underneath a store).
//
// Key (17 bytes, big-endian so that one link's rows are contiguous and sorted
// by sample id):
//   [kind u8][pipeline u32][boundary u32][sample u64]
//   kind 0x01 = row, 0x02 = index entry (write order and size, for the budget).
//
// Row value, format version 1 (little-endian):
//   off size
//    0   1   format_version (= 1)
//    1   1   precision (RowPrecision)
//    2   2   reserved (0)
//    4   4   rows
//    8   4   cols
//   12   4   reserved (0)
//   16   8   link generation
//   24   8   payload checksum  = Checksum64(payload)
//   32   8   header checksum   = Checksum64(row key ++ bytes [0, 32))
//   40   ..  payload: EncodeRow(precision, rows, cols), EncodedRowBytes bytes
// The header checksum covers the key, so a row copied under the wrong key is
// detected as corrupt too.
//
// Index value (24 bytes): [write seq u64][row bytes u64][Checksum64(index key ++ 16 bytes) u64].
#ifndef AQSWARM_STORAGE_ROW_CODEC_H_
#define AQSWARM_STORAGE_ROW_CODEC_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "storage/message_store.h"

namespace aqswarm::storage::internal {

inline constexpr uint8_t kRowKind = 0x01;
inline constexpr uint8_t kIndexKind = 0x02;
inline constexpr size_t kKeyBytes = 17;
inline constexpr uint8_t kRowFormatVersion = 1;
inline constexpr size_t kRowHeaderBytes = 40;
inline constexpr size_t kIndexValueBytes = 24;

std::string EncodeKey(uint8_t kind, const LinkId& link, uint64_t sample);
// First key of `link` for `kind`, and the first key past it (for DeleteRange).
std::string LinkBeginKey(uint8_t kind, const LinkId& link);
std::string LinkEndKey(uint8_t kind, const LinkId& link);
// Parses a 17-byte key; false if malformed.
bool DecodeKey(std::string_view key, uint8_t* kind, LinkId* link, uint64_t* sample);

// Encodes a full row value (header + payload) for `row_key` into `*value`
// (resized; its capacity is reused, so a caller that keeps the string
// allocates nothing per row). `values` must have link.num_values() elements.
// This is THE finiteness check of a put: InvalidArgument naming the first
// non-finite index (and `*value` unspecified) if any value is NaN or inf.
absl::Status EncodeRowValue(std::string_view row_key, const LinkSpec& link,
                            absl::Span<const float> values, std::string* value);

// EncodeRow(link.precision, ...) into `out` (link.payload_bytes() bytes) with
// the finiteness check fused in: fp32/fp16 rows are checked and converted one
// L1-sized chunk at a time, so the row is read from memory once, not once per
// check plus once for the conversion. InvalidArgument on a non-finite value.
absl::Status EncodePayloadChecked(const LinkSpec& link, absl::Span<const float> values, char* out);

struct RowHeader {
  uint8_t format_version = 0;
  RowPrecision precision = RowPrecision::kFloat32;
  uint32_t rows = 0;
  uint32_t cols = 0;
  uint64_t generation = 0;
  uint64_t payload_checksum = 0;
};

// Verifies the header and payload checksums and lengths: DataLoss on any
// mismatch (corrupt or truncated). On OK fills `header` and `payload`.
absl::Status VerifyRowValue(std::string_view row_key, std::string_view value, RowHeader* header,
                            std::string_view* payload);

// True iff a verified row belongs to `link`'s current generation and format.
bool RowMatches(const RowHeader& header, const LinkSpec& link);

std::string EncodeIndexValue(std::string_view index_key, uint64_t seq, uint64_t row_bytes);
// DataLoss if malformed.
absl::Status DecodeIndexValue(std::string_view index_key, std::string_view value, uint64_t* seq,
                              uint64_t* row_bytes);

}  // namespace aqswarm::storage::internal

#endif  // AQSWARM_STORAGE_ROW_CODEC_H_
