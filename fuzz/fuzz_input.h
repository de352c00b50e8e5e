// The byte layout shared by the fuzz targets (fuzz/*_fuzz.cc) and the seed
// generator (fuzz/seed_gen.cc): a few fixed header bytes that pick the
// parser's configuration, then length-prefixed records. Reads past the end
// yield zeros / empty records, so every byte string is a valid input.
//
//   FuzzInput in(data, size);
//   const int mode = in.U8() % 3;
//   std::string_view frame = in.Record();   // u16 little-endian length, then bytes
//   std::string_view rest = in.Rest();
#ifndef AQSWARM_FUZZ_FUZZ_INPUT_H_
#define AQSWARM_FUZZ_FUZZ_INPUT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace aqswarm::fuzz {

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t U8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint16_t U16() { return static_cast<uint16_t>(U8() | (U8() << 8)); }
  uint32_t U32() { return static_cast<uint32_t>(U16()) | (static_cast<uint32_t>(U16()) << 16); }
  uint64_t U64() { return static_cast<uint64_t>(U32()) | (static_cast<uint64_t>(U32()) << 32); }
  std::string_view Bytes(size_t n) {
    if (n > size_ - pos_) n = size_ - pos_;
    std::string_view out(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return out;
  }
  std::string_view Record() { return Bytes(U16()); }
  std::string_view Rest() { return Bytes(size_ - pos_); }
  bool empty() const { return pos_ >= size_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// The writer of the same layout (seed generation).
class FuzzOutput {
 public:
  FuzzOutput& U8(uint8_t v) { out_.push_back(static_cast<char>(v)); return *this; }
  FuzzOutput& U16(uint16_t v) { return U8(v & 0xff).U8(v >> 8); }
  FuzzOutput& U32(uint32_t v) { return U16(v & 0xffff).U16(v >> 16); }
  FuzzOutput& U64(uint64_t v) { return U32(v & 0xffffffffu).U32(v >> 32); }
  FuzzOutput& Bytes(std::string_view b) { out_.append(b); return *this; }
  // A record longer than 65535 bytes cannot be written; callers keep seeds small.
  FuzzOutput& Record(std::string_view b) { return U16(static_cast<uint16_t>(b.size())).Bytes(b.substr(0, 0xffff)); }
  const std::string& str() const { return out_; }

 private:
  std::string out_;
};

}  // namespace aqswarm::fuzz

#endif  // AQSWARM_FUZZ_FUZZ_INPUT_H_
