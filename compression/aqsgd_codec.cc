#include "compression/aqsgd_codec.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/status_macros.h"
#include "compression/token_reference.h"

namespace aqswarm::compression {

absl::StatusOr<std::unique_ptr<AqsgdLinkCodec>> AqsgdLinkCodec::Create(const AqsgdLinkOptions& o) {
  AQSWARM_RETURN_IF_ERROR(ValidateCodecOptions(o.quantizer));
  if (o.first_visit.has_value()) AQSWARM_RETURN_IF_ERROR(ValidateCodecOptions(*o.first_visit));
  if (o.warmup_epochs < 0) return absl::InvalidArgumentError("warmup_epochs < 0");
  if (!IsValidRowPrecision(static_cast<uint8_t>(o.stored))) {
    return absl::InvalidArgumentError("unknown stored precision");
  }
  return std::unique_ptr<AqsgdLinkCodec>(new AqsgdLinkCodec(o));
}

uint64_t AqsgdLinkCodec::RowChecksum(RowPrecision stored, int64_t rows, int64_t cols,
                                     absl::Span<const float> m) {
  std::string bytes;
  return RowChecksum(stored, rows, cols, m, &bytes);
}

uint64_t AqsgdLinkCodec::RowChecksum(RowPrecision stored, int64_t rows, int64_t cols,
                                     absl::Span<const float> m, std::string* scratch) {
  scratch->resize(EncodedRowBytes(stored, rows, cols));
  ::aqswarm::EncodeRow(stored, rows, cols, m, scratch->data());
  return Checksum64(scratch->data(), scratch->size());
}

uint64_t AqsgdLinkCodec::Checksum(int64_t rows, int64_t cols, absl::Span<const float> m,
                                  std::optional<uint64_t> known) const {
  return known.has_value() ? *known : RowChecksum(options_.stored, rows, cols, m);
}

absl::Status AqsgdLinkCodec::CheckSize(absl::Span<const float> m, int64_t rows, int64_t cols) const {
  if (rows < 0 || cols < 0 || static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols) != m.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("AQ-SGD row ", rows, "x", cols, " does not match buffer of ", m.size()));
  }
  return absl::OkStatus();
}

absl::Status AqsgdLinkCodec::EncodeRow(const RowContext& ctx, absl::Span<const float> a,
                                       int64_t rows, int64_t cols, absl::Span<float> m,
                                       uint32_t rng_key, v1::AqsgdRow* out) {
  AQSWARM_RETURN_IF_ERROR(CheckSize(a, rows, cols));
  const int64_t shape[2] = {rows, cols};
  v1::AqsgdRow msg;
  msg.set_sample_id(ctx.sample_id);
  msg.set_stored_precision(static_cast<uint32_t>(options_.stored));
  if (options_.mode != LinkMode::kAqsgd) {
    CodecOptions q = options_.quantizer;
    if (options_.mode == LinkMode::kFp32) q.codec = v1::CODEC_RAW_F32;
    msg.set_kind(v1::AqsgdRow::KIND_DIRECT);
    AQSWARM_RETURN_IF_ERROR(Encode(q, a, shape, rng_key, msg.mutable_tensor()));
    *out = std::move(msg);
    return absl::OkStatus();
  }
  AQSWARM_RETURN_IF_ERROR(CheckSize(m, rows, cols));
  const size_t n = a.size();
  if (!ctx.seen || ctx.force_full || ctx.epoch < options_.warmup_epochs) {
    msg.set_kind(v1::AqsgdRow::KIND_FULL);
    if (options_.first_visit.has_value()) {
      // m starts from what the receiver decodes, not from a.
      const bool with_reference = !ctx.reference.empty() && !ctx.force_full;
      if (with_reference) {
        AQSWARM_RETURN_IF_ERROR(CheckSize(ctx.reference, rows, cols));
        scratch_.resize(n);
        for (size_t i = 0; i < n; ++i) scratch_[i] = a[i] - ctx.reference[i];
        msg.set_reference_checksum(TokenReference::Checksum(ctx.reference));
      }
      AQSWARM_RETURN_IF_ERROR(Encode(*options_.first_visit, with_reference ? absl::MakeConstSpan(scratch_) : a,
                                     shape, rng_key, msg.mutable_tensor()));
      scratch_.resize(n);
      AQSWARM_RETURN_IF_ERROR(Decode(msg.tensor(), absl::MakeSpan(scratch_), options_.limits));
      if (with_reference) {
        next_m_.assign(ctx.reference.begin(), ctx.reference.end());
        AddRowInPlace(options_.stored, rows, cols, absl::MakeSpan(next_m_), scratch_);
        scratch_.swap(next_m_);
      } else {
        RoundRowInPlace(options_.stored, rows, cols, absl::MakeSpan(scratch_));
      }
      AQSWARM_RETURN_IF_ERROR(CheckReceivedFinite(scratch_, "AQ-SGD first visit (stored precision)"));
      std::copy(scratch_.begin(), scratch_.end(), m.begin());
    } else {
      CodecOptions raw;
      raw.codec = options_.stored == RowPrecision::kFloat16 ? v1::CODEC_RAW_F16 : v1::CODEC_RAW_F32;
      raw.min_compress_elements = 0;
      AQSWARM_RETURN_IF_ERROR(Encode(raw, a, shape, rng_key, msg.mutable_tensor()));
      std::copy(a.begin(), a.end(), m.begin());
      RoundRowInPlace(options_.stored, rows, cols, m);
    }
    *out = std::move(msg);
    return absl::OkStatus();
  }
  scratch_.resize(n);
  for (size_t i = 0; i < n; ++i) scratch_[i] = a[i] - m[i];
  msg.set_kind(v1::AqsgdRow::KIND_DELTA);
  msg.set_base_checksum(Checksum(rows, cols, m, ctx.m_checksum));
  AQSWARM_RETURN_IF_ERROR(Encode(options_.quantizer, scratch_, shape, rng_key, msg.mutable_tensor()));
  // Apply exactly what the receiver will apply: D(c), the same Decode.
  AQSWARM_RETURN_IF_ERROR(Decode(msg.tensor(), absl::MakeSpan(scratch_), options_.limits));
  AddRowInPlace(options_.stored, rows, cols, m, scratch_);
  *out = std::move(msg);
  return absl::OkStatus();
}

absl::StatusOr<ReceiveResult> AqsgdLinkCodec::DecodeRow(const v1::AqsgdRow& msg, int64_t rows,
                                                        int64_t cols, absl::Span<float> m,
                                                        std::optional<uint64_t> m_checksum,
                                                        absl::Span<const float> reference) {
  AQSWARM_RETURN_IF_ERROR(CheckSize(m, rows, cols));
  if (msg.stored_precision() != static_cast<uint32_t>(options_.stored)) {
    return absl::InvalidArgumentError(absl::StrCat("AQ-SGD row stored precision ",
                                                   msg.stored_precision(), " != link's ",
                                                   static_cast<int>(options_.stored)));
  }
  const size_t n = m.size();
  if (msg.has_reference_checksum() && msg.kind() != v1::AqsgdRow::KIND_FULL) {
    return absl::InvalidArgumentError("AQ-SGD row: a reference checksum on a row that is not FULL");
  }
  switch (msg.kind()) {
    case v1::AqsgdRow::KIND_DIRECT:
      AQSWARM_RETURN_IF_ERROR(Decode(msg.tensor(), m, options_.limits));
      return ReceiveResult::kApplied;
    case v1::AqsgdRow::KIND_FULL:
      if (options_.mode != LinkMode::kAqsgd) break;
      if (msg.has_reference_checksum()) {
        if (reference.empty()) return ReceiveResult::kResendNeeded;
        AQSWARM_RETURN_IF_ERROR(CheckSize(reference, rows, cols));
        if (TokenReference::Checksum(reference) != msg.reference_checksum()) return ReceiveResult::kResendNeeded;
      }
      scratch_.resize(n);
      AQSWARM_RETURN_IF_ERROR(Decode(msg.tensor(), absl::MakeSpan(scratch_), options_.limits));
      // Rounding to the stored precision may overflow (fp16): check the new m.
      if (msg.has_reference_checksum()) {
        next_m_.assign(reference.begin(), reference.end());
        AddRowInPlace(options_.stored, rows, cols, absl::MakeSpan(next_m_), scratch_);
        scratch_.swap(next_m_);
      } else {
        RoundRowInPlace(options_.stored, rows, cols, absl::MakeSpan(scratch_));
      }
      AQSWARM_RETURN_IF_ERROR(CheckReceivedFinite(scratch_, "AQ-SGD FULL row (stored precision)"));
      std::copy(scratch_.begin(), scratch_.end(), m.begin());
      return ReceiveResult::kApplied;
    case v1::AqsgdRow::KIND_DELTA:
      if (options_.mode != LinkMode::kAqsgd) break;
      if (Checksum(rows, cols, m, m_checksum) != msg.base_checksum()) return ReceiveResult::kResendNeeded;
      scratch_.resize(n);
      AQSWARM_RETURN_IF_ERROR(Decode(msg.tensor(), absl::MakeSpan(scratch_), options_.limits));
      // m + delta may overflow: the sum is checked before it replaces m.
      next_m_.assign(m.begin(), m.end());
      AddRowInPlace(options_.stored, rows, cols, absl::MakeSpan(next_m_), scratch_);
      AQSWARM_RETURN_IF_ERROR(CheckReceivedFinite(next_m_, "AQ-SGD DELTA row (m + delta)"));
      std::copy(next_m_.begin(), next_m_.end(), m.begin());
      return ReceiveResult::kApplied;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("AQ-SGD row kind ", static_cast<int>(msg.kind()),
                                                 " not valid for this link mode"));
}

}  // namespace aqswarm::compression
