// StateChunkChecker: the rules a joiner applies to the v1::StateChunk stream
// of a StateTransfer fetch (proto/state.proto), without gRPC or torch, so
// that they are unit-tested and fuzzed (fuzz/state_chunks_fuzz.cc) on their
// own. It keeps no state bytes: the caller passes each accepted chunk's data
// on (to a file, a buffer) and the checker keeps the counts and the running
// checksum. Every rule is checked before a chunk is accepted:
//   - the first chunk fixes total_bytes and step; total_bytes above
//     max_bytes is ResourceExhausted (refusal "too_large");
//   - every chunk repeats them, starts at the bytes accepted so far, holds
//     no more than the rest and at least one byte (an empty chunk is only
//     the single chunk of an empty state): DataLoss ("bad_chunk");
//   - the chunk that completes the state carries XXH3-64 of all its bytes
//     (common/checksum.h): DataLoss when it differs ("checksum");
//   - a chunk after the last is DataLoss ("bad_chunk").
// After the first error the checker stays failed with that status.
//
//   StateChunkChecker check(options.max_bytes);
//   while (reader->Read(&c)) {
//     if (absl::Status s = check.Add(c); !s.ok()) { stage::CountStateTransferRefused(check.refusal()); return s; }
//     AQSWARM_RETURN_IF_ERROR(sink(c.data()));
//   }
//   AQSWARM_RETURN_IF_ERROR(check.Finish());   // DataLoss "ended after N of M bytes" when cut short
//
// Thread-compatible (one fetch's reader).
#ifndef AQSWARM_PEER_STATE_CHUNK_CHECKER_H_
#define AQSWARM_PEER_STATE_CHUNK_CHECKER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "common/checksum.h"
#include "proto/state.pb.h"

namespace aqswarm::peer {

class StateChunkChecker {
 public:
  explicit StateChunkChecker(uint64_t max_bytes) : max_bytes_(max_bytes) {}

  // OK: the chunk's data are the next bytes of the state. See the banner
  // for the errors.
  absl::Status Add(const v1::StateChunk& chunk);
  // OK once the last chunk arrived and its checksum matched; the first
  // error, or DataLoss ("ended after N of M bytes") when the stream stopped
  // early (refusal "truncated").
  absl::Status Finish();
  // The metric label of the error ("too_large", "bad_chunk", "checksum",
  // "truncated"); "" while there is none.
  const char* refusal() const { return refusal_; }

  bool done() const { return done_; }
  uint64_t received_bytes() const { return received_; }
  uint64_t total_bytes() const { return total_; }
  uint64_t step() const { return step_; }

 private:
  absl::Status Refuse(const char* why, absl::Status s);

  const uint64_t max_bytes_;
  absl::Status failed_;
  const char* refusal_ = "";
  bool started_ = false, done_ = false;
  uint64_t total_ = 0, step_ = 0, received_ = 0;
  Checksummer sum_;
};

}  // namespace aqswarm::peer

#endif  // AQSWARM_PEER_STATE_CHUNK_CHECKER_H_
