// libFuzzer target: the StateChunk stream of a StateTransfer fetch, through
// peer::StateChunkChecker (peer/state_chunk_checker.h: the rules a joiner
// applies to each chunk). Each record is a serialized v1::StateChunk; the
// stream must end in a status, never a crash, and a state the checker
// accepts must be exactly total_bytes long, within max_bytes, with the
// checksum its last chunk carried (aborts otherwise).
// Input: [max_bytes selector u8] then records (u16 length + chunk bytes).
// Seeds: fuzz/corpus/state_chunks (chunked the way StateTransferServer does).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/checksum.h"
#include "fuzz/fuzz_input.h"
#include "peer/state_chunk_checker.h"
#include "fuzz/quiet_protobuf.h"

using namespace aqswarm;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  const uint64_t max_bytes = uint64_t{1} << (in.U8() % 40);
  peer::StateChunkChecker check(max_bytes);
  std::string state;  // what a caller passes on
  uint64_t last_checksum = 0;
  while (!in.empty()) {
    const std::string_view bytes = in.Record();
    v1::StateChunk c;
    if (!c.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) break;
    if (!check.Add(c).ok()) break;
    state += c.data();
    last_checksum = c.checksum();
  }
  const bool accepted = check.Finish().ok();
  if (accepted && (state.size() != check.total_bytes() || state.size() > max_bytes ||
                   Checksum64(state.data(), state.size()) != last_checksum)) {
    std::abort();
  }
  if (!accepted && *check.refusal() == '\0') std::abort();  // every refusal has a metric label
  return 0;
}
