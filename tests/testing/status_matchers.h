// gMock matchers for absl::Status and absl::StatusOr<T>.
//
//   EXPECT_THAT(store->Put(row), IsOk());
//   EXPECT_THAT(Parse("x"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not JSON")));
//   ASSERT_OK_AND_ASSIGN(auto store, Store::Open(dir.path()));
#ifndef AQSWARM_TESTS_TESTING_STATUS_MATCHERS_H_
#define AQSWARM_TESTS_TESTING_STATUS_MATCHERS_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"

namespace aqswarm::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  if (s.ok()) return true;
  *result_listener << "status " << s;
  return false;
}

MATCHER_P(StatusIs, code, "has status code " + absl::StatusCodeToString(code)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status " << s;
  return s.code() == code;
}

MATCHER_P2(StatusIs, code, message_matcher,
           "has status code " + absl::StatusCodeToString(code) + " and a message that " +
               ::testing::DescribeMatcher<std::string>(message_matcher)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status " << s;
  return s.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, std::string(s.message()), result_listener);
}

}  // namespace aqswarm::testing

#define AQSWARM_TESTING_CONCAT_INNER(a, b) a##b
#define AQSWARM_TESTING_CONCAT(a, b) AQSWARM_TESTING_CONCAT_INNER(a, b)
// Asserts that `rexpr` (an absl::StatusOr) is OK and moves its value into `lhs`.
#define ASSERT_OK_AND_ASSIGN(lhs, rexpr)                                                       \
  auto AQSWARM_TESTING_CONCAT(statusor_, __LINE__) = (rexpr);                                  \
  ASSERT_TRUE(AQSWARM_TESTING_CONCAT(statusor_, __LINE__).ok())                                \
      << AQSWARM_TESTING_CONCAT(statusor_, __LINE__).status();                                 \
  lhs = *std::move(AQSWARM_TESTING_CONCAT(statusor_, __LINE__))

#endif  // AQSWARM_TESTS_TESTING_STATUS_MATCHERS_H_
