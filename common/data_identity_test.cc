#include "common/data_identity.h"

#include <gtest/gtest.h>

namespace aqswarm {
namespace {

TEST(DataIdentityTest, HashHexIsSixteenLowercaseDigits) {
  EXPECT_EQ(HashHex(0), "0000000000000000");
  EXPECT_EQ(HashHex(0xDEADBEEF01234567ull), "deadbeef01234567");
  EXPECT_TRUE(ValidateHashHex(HashHex(42), "x").ok());
  EXPECT_TRUE(ValidateHashHex("", "x").ok());
}

TEST(DataIdentityTest, MalformedHashesAreRefusedNamingTheField) {
  for (const char* bad : {"DEADBEEF01234567", "deadbeef0123456", "deadbeef012345678", "deadbeef0123456g"}) {
    absl::Status s = ValidateHashHex(bad, "data.datasetHash");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("data.datasetHash"), std::string::npos) << s;
  }
}

TEST(DataIdentityTest, MismatchNamesEachDifferingHash) {
  const DataIdentity want{"00000000000000aa", "00000000000000bb"};
  EXPECT_TRUE(CheckDataIdentity(want, want, "peer 'p'").ok());
  EXPECT_TRUE(CheckDataIdentity({}, {"00000000000000cc", ""}, "peer 'p'").ok());  // nothing wanted

  absl::Status s = CheckDataIdentity(want, {"00000000000000cc", "00000000000000bb"}, "peer 'p'");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("peer 'p'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("dataset hash 00000000000000cc differs from the job's 00000000000000aa"),
            std::string::npos) << s;
  EXPECT_EQ(s.message().find("tokenizer hash"), std::string::npos) << s;

  s = CheckDataIdentity(want, {"00000000000000aa", ""}, "peer 'p'");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("no tokenizer hash"), std::string::npos) << s;
}

}  // namespace
}  // namespace aqswarm
