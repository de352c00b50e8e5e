#include "peer/state_assembler.h"

#include <string>
#include <vector>

#include "common/checksum.h"
#include "gtest/gtest.h"

namespace aqswarm::peer {
namespace {

// The chunks StateTransferServer sends for `state` (peer/state_transfer.cc).
std::vector<v1::StateChunk> Chunks(const std::string& state, size_t chunk, uint64_t step = 12) {
  std::vector<v1::StateChunk> out;
  size_t off = 0;
  do {
    const size_t len = std::min(chunk, state.size() - off);
    v1::StateChunk c;
    c.set_total_bytes(state.size());
    c.set_offset(off);
    c.set_step(step);
    c.set_data(state.substr(off, len));
    off += len;
    if (off == state.size()) c.set_checksum(Checksum64(state.data(), state.size()));
    out.push_back(c);
  } while (off < state.size());
  return out;
}

TEST(StateAssemblerTest, ReassemblesWhatTheServerSends) {
  const std::string state(1000, 'x');
  StateAssembler a(1 << 20);
  for (const auto& c : Chunks(state, 300)) ASSERT_TRUE(a.Add(c).ok());
  EXPECT_TRUE(a.done());
  EXPECT_EQ(a.step(), 12u);
  auto got = std::move(a).Finish();
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, state);
}

TEST(StateAssemblerTest, AnEmptyStateIsOneEmptyChunk) {
  StateAssembler a(16);
  for (const auto& c : Chunks("", 8)) ASSERT_TRUE(a.Add(c).ok());
  auto got = std::move(a).Finish();
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, "");
}

TEST(StateAssemblerTest, ATotalAboveTheLimitIsRefusedBeforeAnyByteIsKept) {
  StateAssembler a(100);
  const absl::Status s = a.Add(Chunks(std::string(101, 'x'), 10)[0]);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_EQ(a.received_bytes(), 0u);
}

TEST(StateAssemblerTest, GapsRepeatsStepChangesAndEmptyChunksAreDataLoss) {
  const auto chunks = Chunks(std::string(300, 'y'), 100);
  auto refused = [&](v1::StateChunk second) {
    StateAssembler a(1 << 20);
    EXPECT_TRUE(a.Add(chunks[0]).ok());
    const absl::Status s = a.Add(second);
    EXPECT_TRUE(absl::IsDataLoss(s)) << s;
    EXPECT_TRUE(absl::IsDataLoss(std::move(a).Finish().status()));  // stays failed
  };
  refused(chunks[2]);  // a gap
  refused(chunks[0]);  // a repeat
  v1::StateChunk c = chunks[1];
  c.set_step(13);
  refused(c);
  c = chunks[1];
  c.set_total_bytes(301);
  refused(c);
  c = chunks[1];
  c.clear_data();
  refused(c);  // no progress
  c = chunks[1];
  c.set_data(std::string(250, 'y'));
  refused(c);  // more than the rest
}

TEST(StateAssemblerTest, AWrongChecksumOrDataAfterTheEndIsDataLoss) {
  auto chunks = Chunks(std::string(200, 'z'), 100);
  chunks[1].set_checksum(chunks[1].checksum() ^ 1);
  StateAssembler a(1 << 20);
  ASSERT_TRUE(a.Add(chunks[0]).ok());
  EXPECT_TRUE(absl::IsDataLoss(a.Add(chunks[1])));

  StateAssembler b(1 << 20);
  for (const auto& c : Chunks("abc", 8)) ASSERT_TRUE(b.Add(c).ok());
  EXPECT_TRUE(absl::IsDataLoss(b.Add(Chunks("abc", 8)[0])));
}

TEST(StateAssemblerTest, AStreamThatStopsEarlyIsDataLoss) {
  StateAssembler a(1 << 20);
  ASSERT_TRUE(a.Add(Chunks(std::string(200, 'w'), 100)[0]).ok());
  const auto got = std::move(a).Finish();
  EXPECT_TRUE(absl::IsDataLoss(got.status()));
  EXPECT_NE(got.status().message().find("ended after 100 of 200 bytes"), std::string::npos) << got.status();
}

}  // namespace
}  // namespace aqswarm::peer
