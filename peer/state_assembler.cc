#include "peer/state_assembler.h"

#include "absl/strings/str_cat.h"
#include "common/checksum.h"

namespace aqswarm::peer {

absl::Status StateAssembler::Add(const v1::StateChunk& c) {
  if (!failed_.ok()) return failed_;
  if (done_) return failed_ = absl::DataLossError("state transfer: data after the last chunk");
  if (!started_) {
    if (c.total_bytes() > max_bytes_) {
      return failed_ = absl::ResourceExhaustedError(
                 absl::StrCat("state transfer: ", c.total_bytes(), " bytes exceed the limit of ", max_bytes_));
    }
    total_ = c.total_bytes();
    step_ = c.step();
    started_ = true;
  }
  const uint64_t have = bytes_.size();
  const bool empty_state = total_ == 0 && have == 0;
  if (c.total_bytes() != total_ || c.step() != step_ || c.offset() != have || c.data().size() > total_ - have ||
      (c.data().empty() && !empty_state)) {
    return failed_ = absl::DataLossError(absl::StrCat("state transfer: chunk at offset ", c.offset(), " (",
                                                      c.data().size(), " bytes, total ", c.total_bytes(), ", step ",
                                                      c.step(), ") does not continue the ", have, " of ", total_,
                                                      " bytes received at step ", step_));
  }
  bytes_ += c.data();
  if (bytes_.size() == total_) {
    if (c.checksum() != Checksum64(bytes_.data(), bytes_.size())) {
      return failed_ = absl::DataLossError("state transfer: checksum of the received state does not match");
    }
    done_ = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> StateAssembler::Finish() && {
  if (!failed_.ok()) return failed_;
  if (!done_) {
    return absl::DataLossError(
        absl::StrCat("state transfer: ended after ", bytes_.size(), " of ", total_, " bytes"));
  }
  return std::move(bytes_);
}

}  // namespace aqswarm::peer
