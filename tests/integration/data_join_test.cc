// Data identity at the door, with real processes: each peer runs in its own
// directory holding its own copy of the job's corpus (a relative path). Two
// peers with the same copy train; a third whose copy differs by one byte is
// refused at join, and the error names the hashes.
#include "tests/integration/swarm_fixture.h"

namespace aqswarm {
namespace {

TEST_F(SwarmTest, APeerWhoseCopyOfTheDataDiffersByOneByteIsRefusedAtJoin) {
  std::vector<fs::path> speeches;
  for (const auto& e : fs::directory_iterator(fs::path(kData) / "sotu")) speeches.push_back(e.path());
  std::sort(speeches.begin(), speeches.end());
  speeches.resize(6);
  for (const char* p : {"p1", "p2", "p3"}) {
    const fs::path corpus = dir_ / absl::StrCat("home-", p) / "corpus";
    fs::create_directories(corpus);
    for (const fs::path& f : speeches) fs::copy_file(f, corpus / f.filename());
  }
  {
    const fs::path changed = dir_ / "home-p3" / "corpus" / speeches[2].filename();
    std::fstream f(changed, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('#');  // one byte
  }
  corpus_ = "corpus";
  WriteJob(3, R"("dataParallel":1)");
  StartCoordinator();
  const std::string token = Token();
  StartPeer("p1", token, (dir_ / "home-p1").string());
  StartPeer("p2", token, (dir_ / "home-p2").string());
  ASSERT_TRUE(WaitFor([](const auto& st) { return st.grid_complete() && st.step() >= 2; }, absl::Seconds(180)))
      << "two peers with the same data did not train" << Logs();
  const std::string fixed = status_.job().data().dataset_hash();
  EXPECT_EQ(fixed.size(), 16u) << "the first peer's data hashes fix the job's";
  EXPECT_EQ(status_.job().data().tokenizer_hash().size(), 16u);

  StartPeer("p3", token, (dir_ / "home-p3").string());
  absl::StatusOr<int> code = peers_.at("p3")->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << "the peer with other data was not turned away";
  EXPECT_NE(*code, 0);
  std::ifstream err(dir_ / "p3.err");
  const std::string why(std::istreambuf_iterator<char>(err), {});
  EXPECT_THAT(why, ::testing::HasSubstr(absl::StrCat("differs from the job's ", fixed))) << why;
  EXPECT_THAT(why, ::testing::HasSubstr("dataset hash")) << why;
  EXPECT_THAT(why, ::testing::Not(::testing::HasSubstr("tokenizer hash"))) << why;
  const v1::StatusResponse st = Status();
  EXPECT_EQ(st.peers_size(), 2);
  for (const auto& p : st.peers()) EXPECT_NE(p.peer_name(), "p3");
  TerminatePeersExcept("p3");
}

}  // namespace
}  // namespace aqswarm
