#include "peer/state_chunk_checker.h"

#include <string>
#include <vector>

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

TEST(StateChunkCheckerTest, AcceptsWhatTheServerSends) {
  std::string state(1000, '\0');
  for (size_t i = 0; i < state.size(); ++i) state[i] = static_cast<char>(i * 7);
  StateChunkChecker check(1 << 20);
  std::string got;
  for (const auto& c : Chunks(state, 300)) {
    ASSERT_TRUE(check.Add(c).ok());
    got += c.data();
  }
  EXPECT_TRUE(check.done());
  EXPECT_EQ(check.step(), 12u);
  EXPECT_TRUE(check.Finish().ok());
  EXPECT_EQ(got, state);
  EXPECT_STREQ(check.refusal(), "");
}

TEST(StateChunkCheckerTest, AnEmptyStateIsOneEmptyChunk) {
  StateChunkChecker check(16);
  for (const auto& c : Chunks("", 8)) ASSERT_TRUE(check.Add(c).ok());
  EXPECT_TRUE(check.Finish().ok());
}

TEST(StateChunkCheckerTest, ATotalAboveTheLimitIsRefusedBeforeAnyByteIsAccepted) {
  StateChunkChecker check(100);
  const absl::Status s = check.Add(Chunks(std::string(101, 'x'), 10)[0]);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_STREQ(check.refusal(), "too_large");
  EXPECT_EQ(check.received_bytes(), 0u);
}

TEST(StateChunkCheckerTest, GapsRepeatsChangesAndEmptyOrOversizedChunksAreDataLoss) {
  const auto chunks = Chunks(std::string(300, 'y'), 100);
  auto refused = [&](const v1::StateChunk& second, const char* what) {
    StateChunkChecker check(1 << 20);
    EXPECT_TRUE(check.Add(chunks[0]).ok());
    const absl::Status s = check.Add(second);
    EXPECT_TRUE(absl::IsDataLoss(s)) << what << ": " << s;
    EXPECT_STREQ(check.refusal(), "bad_chunk") << what;
    EXPECT_EQ(check.received_bytes(), 100u) << what;
    EXPECT_TRUE(absl::IsDataLoss(check.Finish())) << what;  // stays failed
    EXPECT_STREQ(check.refusal(), "bad_chunk") << what;
  };
  refused(chunks[2], "a gap");
  refused(chunks[0], "a repeat");
  v1::StateChunk c = chunks[1];
  c.set_step(13);
  refused(c, "another step");
  c = chunks[1];
  c.set_total_bytes(301);
  refused(c, "another total");
  c = chunks[1];
  c.clear_data();
  refused(c, "no progress");
  c = chunks[1];
  c.set_data(std::string(250, 'y'));
  refused(c, "more than the rest");
}

TEST(StateChunkCheckerTest, AWrongChecksumOrDataAfterTheEndIsDataLoss) {
  auto chunks = Chunks(std::string(200, 'z'), 100);
  chunks[1].set_checksum(chunks[1].checksum() ^ 1);
  StateChunkChecker check(1 << 20);
  ASSERT_TRUE(check.Add(chunks[0]).ok());
  EXPECT_TRUE(absl::IsDataLoss(check.Add(chunks[1])));
  EXPECT_STREQ(check.refusal(), "checksum");

  StateChunkChecker after(1 << 20);
  for (const auto& c : Chunks("abc", 8)) ASSERT_TRUE(after.Add(c).ok());
  EXPECT_TRUE(absl::IsDataLoss(after.Add(Chunks("abc", 8)[0])));
  EXPECT_STREQ(after.refusal(), "bad_chunk");
}

TEST(StateChunkCheckerTest, AStreamThatStopsEarlyIsDataLoss) {
  StateChunkChecker check(1 << 20);
  ASSERT_TRUE(check.Add(Chunks(std::string(200, 'w'), 100)[0]).ok());
  const absl::Status s = check.Finish();
  EXPECT_TRUE(absl::IsDataLoss(s));
  EXPECT_NE(s.message().find("ended after 100 of 200 bytes"), std::string::npos) << s;
  EXPECT_STREQ(check.refusal(), "truncated");
}

}  // namespace
}  // namespace aqswarm::peer
