// libFuzzer target: the StateChunk stream of a StateTransfer fetch, through
// peer::StateAssembler (peer/state_assembler.h: the chunk-sequence rules of
// a joiner fetching a stage's state). Each record is a serialized
// v1::StateChunk; the stream must end in a status, never a crash, and a
// state it accepts must be exactly total_bytes long with the checksum of
// the last chunk (aborts otherwise).
// Input: [max_bytes selector u8] then records (u16 length + chunk bytes).
// Seeds: fuzz/corpus/state_chunks (chunked the way StateTransferServer does).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/checksum.h"
#include "fuzz/fuzz_input.h"
#include "peer/state_assembler.h"
#include "fuzz/quiet_protobuf.h"

using namespace aqswarm;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::FuzzInput in(data, size);
  const uint64_t max_bytes = uint64_t{1} << (in.U8() % 40);
  peer::StateAssembler a(max_bytes);
  uint64_t last_checksum = 0;
  while (!in.empty()) {
    const std::string_view bytes = in.Record();
    v1::StateChunk c;
    if (!c.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) break;
    if (!a.Add(c).ok()) break;
    last_checksum = c.checksum();
  }
  const uint64_t total = a.total_bytes();
  absl::StatusOr<std::string> state = std::move(a).Finish();
  if (state.ok() && (state->size() != total || total > max_bytes ||
                     Checksum64(state->data(), state->size()) != last_checksum)) {
    std::abort();
  }
  return 0;
}
