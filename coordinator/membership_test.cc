#include "coordinator/membership.h"

#include <limits>

#include "coordinator/coordinator_testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace aqswarm::coordinator {
namespace {

using ::aqswarm::coordinator::testing::JoinAs;
using ::aqswarm::coordinator::testing::TestSecret;
using ::aqswarm::coordinator::testing::TokenFor;
using ::testing::HasSubstr;

class MembershipTest : public ::testing::Test {
 protected:
  MembershipOptions Options() {
    MembershipOptions o;
    o.swarm_id = testing::kTestSwarm;
    o.join_secret = TestSecret();
    o.lease = absl::Seconds(10);
    return o;
  }
  rpc::FakeClock clock_;
};

TEST_F(MembershipTest, AdmitsAValidTokenWithAFreshSessionAndLease) {
  Membership members(Options(), &clock_);
  auto m = members.Admit(JoinAs(clock_, "peer-a"), 7);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->id, 7u);
  EXPECT_EQ(m->name, "peer-a");
  EXPECT_EQ(m->session_token.size(), 32u);
  EXPECT_EQ(m->lease_expiry, clock_.Now() + absl::Seconds(10));
  EXPECT_EQ(members.size(), 0u) << "Admit must not add";
  auto m2 = members.Admit(JoinAs(clock_, "peer-a"), 8);
  ASSERT_TRUE(m2.ok());
  EXPECT_NE(m->session_token, m2->session_token);
}

TEST_F(MembershipTest, TokenRejections) {
  Membership members(Options(), &clock_);
  JoinParams p = JoinAs(clock_, "peer-a");

  p.join_token = TokenFor(clock_, "peer-a", std::string(32, 'x'));  // another swarm's secret
  EXPECT_TRUE(absl::IsUnauthenticated(members.Admit(p, 1).status())) << members.Admit(p, 1).status();

  p.join_token = TokenFor(clock_, "peer-a", TestSecret(), testing::kTestSwarm, /*ttl_s=*/5);
  clock_.Advance(absl::Seconds(6));
  auto expired = members.Admit(p, 1).status();
  EXPECT_TRUE(absl::IsUnauthenticated(expired)) << expired;
  EXPECT_THAT(std::string(expired.message()), HasSubstr("expired"));

  p.join_token = TokenFor(clock_, "peer-a", TestSecret(), "other-swarm");
  EXPECT_TRUE(absl::IsPermissionDenied(members.Admit(p, 1).status()));

  p.join_token = TokenFor(clock_, "peer-b");  // bound to another peer
  auto other = members.Admit(p, 1).status();
  EXPECT_TRUE(absl::IsPermissionDenied(other)) << other;
  EXPECT_THAT(std::string(other.message()), HasSubstr("peer-b"));

  p.join_token = "aqj1.garbage";
  EXPECT_TRUE(absl::IsUnauthenticated(members.Admit(p, 1).status()));
  p.join_token = "";
  EXPECT_TRUE(absl::IsUnauthenticated(members.Admit(p, 1).status()));

  p.join_token = TokenFor(clock_, "*");  // any-peer token
  EXPECT_TRUE(members.Admit(p, 1).ok());
}

TEST_F(MembershipTest, LeasesExpireByTheClockAndHeartbeatsRenew) {
  Membership members(Options(), &clock_);
  members.Add(*members.Admit(JoinAs(clock_, "a"), 1));
  clock_.Advance(absl::Seconds(5));
  members.Add(*members.Admit(JoinAs(clock_, "b"), 2));
  clock_.Advance(absl::Seconds(4));
  EXPECT_TRUE(members.Expired().empty());
  EXPECT_EQ(members.Renew(1), clock_.Now() + absl::Seconds(10));
  clock_.Advance(absl::Seconds(6));  // b: 15 s > 10 s; a renewed 6 s ago
  EXPECT_EQ(members.Expired(), std::vector<uint64_t>{2});
  members.Remove(2);
  EXPECT_EQ(members.FindByName("b"), nullptr);
  clock_.Advance(absl::Seconds(100));
  members.ExtendAllLeases(absl::Seconds(30));
  EXPECT_TRUE(members.Expired().empty());
  EXPECT_EQ(members.Find(1)->lease_expiry, clock_.Now() + absl::Seconds(30));
}

TEST_F(MembershipTest, AuthenticateChecksIdThenSession) {
  Membership members(Options(), &clock_);
  Member m = *members.Admit(JoinAs(clock_, "a"), 1);
  members.Add(m);
  EXPECT_TRUE(members.Authenticate(1, m.session_token).ok());
  EXPECT_TRUE(absl::IsNotFound(members.Authenticate(2, m.session_token).status()));
  EXPECT_TRUE(absl::IsUnauthenticated(members.Authenticate(1, "0123").status()));
  EXPECT_TRUE(absl::IsUnauthenticated(members.Authenticate(1, "").status()));
}

TEST_F(MembershipTest, SwarmFullIsFailedPrecondition) {
  MembershipOptions o = Options();
  o.max_members = 1;
  Membership members(o, &clock_);
  members.Add(*members.Admit(JoinAs(clock_, "a"), 1));
  EXPECT_TRUE(absl::IsFailedPrecondition(members.Admit(JoinAs(clock_, "b"), 2).status()));
  EXPECT_TRUE(members.Admit(JoinAs(clock_, "a"), 2).ok()) << "a rejoin does not need a new place";
}

TEST(ValidateJoinParamsTest, NamesAddressesAndNumbers) {
  rpc::FakeClock clock;
  JoinParams good = JoinAs(clock, "peer-a");
  EXPECT_TRUE(ValidateJoinParams(good).ok());
  auto invalid = [](const JoinParams& p) { return absl::IsInvalidArgument(ValidateJoinParams(p)); };
  JoinParams p = good;
  p.peer_name = "";
  EXPECT_TRUE(invalid(p));
  p.peer_name = "bad name";
  EXPECT_TRUE(invalid(p));
  p.peer_name = std::string(129, 'a');
  EXPECT_TRUE(invalid(p));
  p = good;
  p.seconds_per_layer = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(invalid(p));
  p.seconds_per_layer = -1;
  EXPECT_TRUE(invalid(p));
  p = good;
  p.memory_bytes = ~uint64_t{0};
  EXPECT_TRUE(invalid(p));
  for (const char* bad : {"", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "host:-1", "a b:5", ":5",
                          "[::1]", "[::1]5", "[zz]:5", "host:5x"}) {
    p = good;
    p.stage_link_address = bad;
    EXPECT_TRUE(invalid(p)) << bad;
  }
  for (const char* ok : {"127.0.0.1:1", "peer-a.lan:65535", "[::1]:5000", "[fe80::1]:80"}) {
    p = good;
    p.stage_link_address = ok;
    EXPECT_TRUE(ValidateJoinParams(p).ok()) << ok;
  }
  p = good;
  p.gradient_exchange_address = "";
  EXPECT_TRUE(ValidateJoinParams(p).ok()) << "the gradient exchange address is optional";
  p.gradient_exchange_address = "x";
  EXPECT_THAT(std::string(ValidateJoinParams(p).message()), HasSubstr("gradient_exchange_address"));
}

TEST(ValidateProgressTest, RejectsAbsurdNumbers) {
  EXPECT_TRUE(ValidateProgress({10, 3.2, 1000}).ok());
  EXPECT_FALSE(ValidateProgress({-1, 3.2, 1000}).ok());
  EXPECT_FALSE(ValidateProgress({1, std::numeric_limits<double>::infinity(), 1}).ok());
  EXPECT_FALSE(ValidateProgress({1, 1, -5}).ok());
  EXPECT_FALSE(ValidateProgress({1, 1, 1e300}).ok());
}

}  // namespace
}  // namespace aqswarm::coordinator

namespace aqswarm::coordinator {
namespace {

// Held states come as {step, sha256} records, or as the parallel lists of
// steps and hashes older peers and state dirs wrote: both read the same.
TEST(HeldStatesTest, RecordsAndTheOlderParallelListsReadTheSame) {
  const std::string h4(64, '4'), h8(64, '8');
  google::protobuf::RepeatedPtrField<v1::StageCheckpoints> records, legacy;
  v1::StageCheckpoints& r = *records.Add();
  r.set_stage(1);
  r.add_states()->set_step(4);
  r.mutable_states(0)->set_sha256(h4);
  r.add_states()->set_step(8);
  r.mutable_states(1)->set_sha256(h8);
  v1::StageCheckpoints& l = *legacy.Add();
  l.set_stage(1);
  l.add_legacy_steps(4);
  l.add_legacy_steps(8);
  l.add_legacy_sha256(h4);
  l.add_legacy_sha256(h8);
  const HeldStates want = {{1, {{4, h4}, {8, h8}}}};
  EXPECT_EQ(*HeldStatesFromProto(records), want);
  EXPECT_EQ(*HeldStatesFromProto(legacy), want);
  EXPECT_EQ(FindHeld(want, 1, 8)->sha256, h8);
  EXPECT_EQ(FindHeld(want, 1, 6), nullptr);
  EXPECT_EQ(FindHeld(want, 0, 4), nullptr);
  // Written back, always as records.
  google::protobuf::RepeatedPtrField<v1::StageCheckpoints> out;
  AddHeldTo(want, &out);
  ASSERT_EQ(out.size(), 1);
  EXPECT_EQ(out[0].states_size(), 2);
  EXPECT_EQ(out[0].legacy_steps_size(), 0);
  // Steps without hashes, from a peer that did not report them.
  l.clear_legacy_sha256();
  EXPECT_EQ(*HeldStatesFromProto(legacy), (HeldStates{{1, {4, 8}}}));
}

TEST(HeldStatesTest, MalformedListsAreRefused) {
  google::protobuf::RepeatedPtrField<v1::StageCheckpoints> held;
  v1::StageCheckpoints& c = *held.Add();
  c.set_stage(0);
  c.add_legacy_steps(4);
  c.add_legacy_sha256(std::string(64, 'a'));
  c.add_legacy_sha256(std::string(64, 'b'));
  EXPECT_THAT(HeldStatesFromProto(held).status().message(), HasSubstr("1 steps but 2 sha256"));
  c.clear_legacy_sha256();
  c.add_states()->set_step(4);
  EXPECT_THAT(HeldStatesFromProto(held).status().message(), HasSubstr("lists its states twice"));
  c.clear_legacy_steps();
  *held.Add() = c;
  EXPECT_THAT(HeldStatesFromProto(held).status().message(), HasSubstr("listed twice"));
  EXPECT_THAT(ValidateHeldStates({{0, {{4, "xyz"}}}}, 1).message(), HasSubstr("64 lowercase hex"));
  EXPECT_THAT(ValidateHeldStates({{0, {8, 4}}}, 1).message(), HasSubstr("strictly ascending"));
  EXPECT_THAT(ValidateHeldStates({{3, {4}}}, 2).message(), HasSubstr("the job has 2 stages"));
}

}  // namespace
}  // namespace aqswarm::coordinator
