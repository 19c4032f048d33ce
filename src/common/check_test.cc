#include "common/check.h"

#include <gtest/gtest.h>

#include "common/status.h"

namespace nbos {
namespace {

TEST(CheckDeathTest, AFailedCheckAbortsInEveryBuildAndSaysWhere) {
  EXPECT_DEATH(NBOS_CHECK(1 + 1 == 3, "arithmetic broke"),
               "check failed at .*check_test.cc:[0-9]+: 1 \\+ 1 == 3: arithmetic broke");
  NBOS_CHECK(true);  // a passing check does nothing
}

TEST(CheckDeathTest, AResultReadWithoutAValueAborts) {
  Result<int> r = NotFound("nothing here");
  EXPECT_DEATH((void)r.value(), "read a Result that holds an error: NOT_FOUND: nothing here");
}

}  // namespace
}  // namespace nbos
