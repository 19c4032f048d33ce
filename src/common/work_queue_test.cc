#include "common/work_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <stdexcept>
#include <vector>

namespace nbos {
namespace {

using namespace std::chrono_literals;

TEST(KeyedWorkQueue, TasksOfOneKeyRunInOrderOneAtATime) {
  KeyedWorkQueue queue(4, "test");
  std::vector<int> order;  // touched by key "a"'s tasks only, one at a time
  std::atomic<int> running{0};
  bool overlapped = false;
  for (int i = 0; i < 200; ++i) {
    queue.Post("a", [&, i] {
      if (running.fetch_add(1) != 0) overlapped = true;
      order.push_back(i);
      running.fetch_sub(1);
    });
  }
  queue.Stop();
  EXPECT_FALSE(overlapped);
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(order[i], i);
}

TEST(KeyedWorkQueue, ABlockedKeyDoesNotHoldUpAnother) {
  KeyedWorkQueue queue(2, "test");
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  queue.Post("stuck", [released] { released.wait(); });
  std::promise<void> ran;
  queue.Post("other", [&] { ran.set_value(); });
  EXPECT_EQ(ran.get_future().wait_for(10s), std::future_status::ready);
  release.set_value();
}

TEST(KeyedWorkQueue, StopRunsWhatWasPostedAndLaterPostsRunInline) {
  KeyedWorkQueue queue(1, "test");
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i) queue.Post(std::to_string(i % 5), [&] { ++ran; });
  queue.Stop();
  EXPECT_EQ(ran.load(), 50);
  queue.Post("late", [&] { ++ran; });
  EXPECT_EQ(ran.load(), 51);
}

TEST(KeyedWorkQueue, AnExceptionIsCaughtAndCounted) {
  KeyedWorkQueue queue(1, "test");
  queue.Post("a", [] { throw std::runtime_error("boom"); });
  std::atomic<bool> after{false};
  queue.Post("a", [&] { after = true; });
  queue.Stop();
  EXPECT_TRUE(after.load());
  EXPECT_EQ(queue.exceptions_caught(), 1u);
}

}  // namespace
}  // namespace nbos
