// StateAssembler: the receiving side of a StateTransfer fetch, without gRPC
// or torch: it checks and appends the v1::StateChunk stream a peer sends
// (proto/state.proto) and hands back the state once the last chunk's
// checksum matches. Every rule is checked per chunk, before any byte is
// kept:
//   - the first chunk fixes total_bytes and step; total_bytes above the
//     caller's max_bytes is ResourceExhausted;
//   - every chunk repeats them, starts at the bytes received so far, holds
//     no more than the rest, and holds at least one byte (an empty chunk is
//     only the single chunk of an empty state): DataLoss otherwise;
//   - the chunk that completes the state carries XXH3-64 of all its bytes
//     (common/checksum.h Checksum64): DataLoss when it differs;
//   - any chunk after the last is DataLoss.
// The buffer grows as data arrives: a sender's total_bytes reserves nothing.
// After the first error the assembler stays failed with that status.
//
//   StateAssembler a(options.max_bytes);
//   while (reader->Read(&chunk)) AQSWARM_RETURN_IF_ERROR(a.Add(chunk));
//   AQSWARM_ASSIGN_OR_RETURN(std::string state, std::move(a).Finish());  // a.step(): its step
//
// Thread-compatible (one fetch's reader). Fuzzed by fuzz/state_chunks_fuzz.cc.
#ifndef AQSWARM_PEER_STATE_ASSEMBLER_H_
#define AQSWARM_PEER_STATE_ASSEMBLER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/state.pb.h"

namespace aqswarm::peer {

class StateAssembler {
 public:
  explicit StateAssembler(uint64_t max_bytes) : max_bytes_(max_bytes) {}

  // Checks and appends one chunk (see the banner for the errors).
  absl::Status Add(const v1::StateChunk& chunk);
  // True once the last chunk arrived and its checksum matched.
  bool done() const { return done_; }
  uint64_t received_bytes() const { return bytes_.size(); }
  uint64_t total_bytes() const { return total_; }
  uint64_t step() const { return step_; }
  // The whole state; the first error, or DataLoss ("ended after N of M
  // bytes") when the stream stopped early.
  absl::StatusOr<std::string> Finish() &&;

 private:
  const uint64_t max_bytes_;
  absl::Status failed_;
  bool started_ = false, done_ = false;
  uint64_t total_ = 0, step_ = 0;
  std::string bytes_;
};

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_STATE_ASSEMBLER_H_
