// call_combiner: per-thread slots that the allocator's lock holder scans
// (Note [combined calls] in caching_allocator.cpp).
#include "streamalloc/core/call_combiner.hpp"

#include <future>
#include <thread>
#include <vector>

#include "support/catch.hpp"

using namespace streamalloc;

namespace {

struct test_call : combiner_call {
  int value = 0;
};

// The slot index a new thread gets.
int slot_of_new_thread() {
  int slot = -2;
  std::thread t([&] { slot = combiner_thread_slot(); });
  t.join();
  return slot;
}

}  // namespace

TEST_CASE("call combiner: live threads hold distinct slots, given back when they exit", "[threads][combined]") {
  const int first = slot_of_new_thread();
  REQUIRE(first >= 0);
  // The exited thread's slot is free again, and the lowest free one is taken.
  CHECK(slot_of_new_thread() == first);
  CHECK(combiner_slots_in_use() >= first + 1);

  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::vector<int> slots(4, -2);
  std::vector<int> again(slots.size(), -2);  // the same on every call
  std::vector<std::promise<void>> ready(slots.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    threads.emplace_back([&, i] {
      slots[i] = combiner_thread_slot();
      again[i] = combiner_thread_slot();
      ready[i].set_value();
      released.wait();
    });
  }
  for (auto& r : ready) r.get_future().wait();
  for (std::size_t i = 0; i < slots.size(); ++i) {
    CHECK(slots[i] >= 0);
    CHECK(again[i] == slots[i]);
    for (std::size_t j = 0; j < i; ++j) CHECK(slots[i] != slots[j]);
  }
  release.set_value();
  for (std::thread& t : threads) t.join();
}

TEST_CASE("call combiner: a taken call is no longer listed, and each listed call is taken once", "[combined]") {
  call_combiner<test_call> calls;
  CHECK_FALSE(calls.maybe_listed());
  CHECK_FALSE(calls.any_listed());
  test_call* own = calls.own_call();
  REQUIRE(own != nullptr);
  CHECK(calls.own_call() == own);
  own->value = 7;
  calls.list(*own);
  CHECK(calls.maybe_listed());
  CHECK(calls.any_listed());

  int taken[k_combiner_slots];
  REQUIRE(calls.take(taken) == 1);
  CHECK(&calls.at(taken[0]) == own);
  CHECK(calls.at(taken[0]).value == 7);
  CHECK_FALSE(calls.maybe_listed());
  CHECK_FALSE(calls.any_listed());  // taken, still unfinished
  CHECK(own->poll() == combiner_call::waiting);
  CHECK(calls.take(taken) == 0);  // not taken twice

  calls.finish(taken[0], combiner_call::done);
  CHECK(own->poll() == combiner_call::done);
  CHECK_FALSE(calls.any_listed());

  calls.list(*own);
  calls.forget_all();
  CHECK_FALSE(calls.maybe_listed());
  CHECK_FALSE(calls.any_listed());
  CHECK(calls.take(taken) == 0);
}
