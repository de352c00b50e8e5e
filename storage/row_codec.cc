#include "storage/row_codec.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/half.h"

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

namespace {

// True iff no value is NaN or +-inf. (bits & exponent mask) + 2^23 reaches
// bit 31 exactly when the exponent is all ones; the fixed 16-wide inner loop
// lets the compiler vectorise it at -O2.
bool ChunkFinite(const float* v, size_t n) {
  constexpr uint32_t kExp = 0x7f800000u, kOne = 0x00800000u;
  uint32_t acc[16] = {};
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    uint32_t bits[16];
    std::memcpy(bits, v + i, sizeof(bits));
    for (int j = 0; j < 16; ++j) acc[j] |= (bits[j] & kExp) + kOne;
  }
  uint32_t bad = 0;
  for (int j = 0; j < 16; ++j) bad |= acc[j];
  for (; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, v + i, 4);
    bad |= (b & kExp) + kOne;
  }
  return (bad & 0x80000000u) == 0;
}

// 16 KiB of float32: stays in L1 between the check and the conversion.
constexpr size_t kEncodeChunk = 4096;

#if defined(__x86_64__)
bool HasF16c() {
  // F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports
  // does not know "f16c".
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0 && __builtin_cpu_supports("avx");
  }();
  return has;
}

// fp16 encode and finiteness check in one pass: false if any value is NaN or
// inf (`out` then unspecified). For finite input F16C rounds exactly like the
// portable FloatToHalf (common/half.cc relies on the same; half_test checks
// it), so rows are bit-identical whichever path wrote them.
__attribute__((target("f16c,avx"))) bool FiniteToHalfF16c(const float* in, size_t n, char* out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 max = _mm256_set1_ps(FLT_MAX);
  __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(in + i);
    // |x| <= FLT_MAX is false for +-inf and (ordered compare) NaN.
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_and_ps(x, abs_mask), max, _CMP_LE_OQ));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  if (_mm256_movemask_ps(ok) != 0xff) return false;
  for (; i < n; ++i) {
    if (!std::isfinite(in[i])) return false;
    const uint16_t h = FloatToHalf(in[i]);
    std::memcpy(out + 2 * i, &h, 2);
  }
  return true;
}
#endif

}  // namespace

absl::Status EncodePayloadChecked(const LinkSpec& link, absl::Span<const float> values, char* out) {
  const size_t n = values.size();
  if (link.precision == RowPrecision::kInt8) {
    // Per-column scales need the whole row: check, then encode.
    if (!ChunkFinite(values.data(), n)) return ValidateFinite(values);
    EncodeRow(link.precision, link.rows, link.cols, values, out);
    return absl::OkStatus();
  }
#if defined(__x86_64__)
  if (link.precision == RowPrecision::kFloat16 && HasF16c()) {
    if (!FiniteToHalfF16c(values.data(), n, out)) return ValidateFinite(values);
    return absl::OkStatus();
  }
#endif
  // fp32 / fp16 encode element-wise: a chunk is a 1 x len row.
  const size_t elem = link.precision == RowPrecision::kFloat32 ? 4 : 2;
  for (size_t i = 0; i < n; i += kEncodeChunk) {
    const size_t len = std::min(kEncodeChunk, n - i);
    if (!ChunkFinite(values.data() + i, len)) return ValidateFinite(values);
    EncodeRow(link.precision, 1, static_cast<int64_t>(len), values.subspan(i, len),
              out + i * elem);
  }
  return absl::OkStatus();
}

absl::Status EncodeRowValue(std::string_view row_key, const LinkSpec& link,
                            absl::Span<const float> values, std::string* value) {
  const size_t payload_bytes = link.payload_bytes();
  // resize() keeps the capacity; only the header's reserved bytes need zeros.
  value->resize(kRowHeaderBytes + payload_bytes);
  char* p = value->data();
  std::memset(p, 0, kRowHeaderBytes);
  if (absl::Status s = EncodePayloadChecked(link, values, p + kRowHeaderBytes); !s.ok()) return s;
  p[0] = static_cast<char>(kRowFormatVersion);
  p[1] = static_cast<char>(link.precision);
  PutLe32(p + 4, static_cast<uint32_t>(link.rows));
  PutLe32(p + 8, static_cast<uint32_t>(link.cols));
  PutLe64(p + 16, link.generation);
  PutLe64(p + 24, Checksum64(p + kRowHeaderBytes, payload_bytes));
  PutLe64(p + 32, KeyedChecksum(row_key, p, 32));
  return absl::OkStatus();
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
