#include "peer/state_chunk_checker.h"

#include "absl/strings/str_cat.h"

namespace aqswarm::peer {

absl::Status StateChunkChecker::Refuse(const char* why, absl::Status s) {
  refusal_ = why;
  failed_ = s;
  return s;
}

absl::Status StateChunkChecker::Add(const v1::StateChunk& c) {
  if (!failed_.ok()) return failed_;
  if (done_) return Refuse("bad_chunk", absl::DataLossError("state transfer: data after the last chunk"));
  if (!started_) {
    if (c.total_bytes() > max_bytes_) {
      return Refuse("too_large", absl::ResourceExhaustedError(absl::StrCat("state transfer: the sender declares ",
                                                                           c.total_bytes(), " bytes, over the limit of ",
                                                                           max_bytes_)));
    }
    total_ = c.total_bytes();
    step_ = c.step();
    started_ = true;
  }
  const bool empty_state = total_ == 0 && received_ == 0;
  if (c.total_bytes() != total_ || c.step() != step_ || c.offset() != received_ ||
      c.data().size() > total_ - received_ || (c.data().empty() && !empty_state)) {
    return Refuse("bad_chunk",
                  absl::DataLossError(absl::StrCat("state transfer: chunk at offset ", c.offset(), " (",
                                                   c.data().size(), " bytes, total ", c.total_bytes(), ", step ",
                                                   c.step(), ") does not continue the ", received_,
                                                   " bytes received of ", total_, " (step ", step_, ")")));
  }
  sum_.Update(c.data().data(), c.data().size());
  received_ += c.data().size();
  if (received_ == total_) {
    if (c.checksum() != sum_.Digest()) {
      return Refuse("checksum", absl::DataLossError("state transfer: checksum of the received state does not match"));
    }
    done_ = true;
  }
  return absl::OkStatus();
}

absl::Status StateChunkChecker::Finish() {
  if (!failed_.ok()) return failed_;
  if (!done_) {
    return Refuse("truncated", absl::DataLossError(absl::StrCat("state transfer: ended after ", received_, " of ",
                                                                total_, " bytes")));
  }
  return absl::OkStatus();
}

}  // namespace aqswarm::peer
