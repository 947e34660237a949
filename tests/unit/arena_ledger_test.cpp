// arena_ledger: Note [peak headroom]. Random walks of the counts of four
// arenas, published in turn, must give the peak of their sum exactly, with
// the invariant (the peak is the sum of the ceilings) after every publish; and
// threads publishing at once must end with the same books.
#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "streamalloc/core/arena_ledger.hpp"
#include "support/catch.hpp"

using namespace streamalloc;

namespace {

using counts = arena_ledger::counts;

counts sum_of(const std::vector<counts>& parts) {
  counts out{};
  for (const counts& c : parts) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] += c[i];
  }
  return out;
}

}  // namespace

TEST_CASE("arena_ledger: peaks are of the sum, whatever the order of publishes", "[arenas]") {
  std::mt19937_64 rng(20261206);
  for (int round = 0; round < 20; ++round) {
    arena_ledger ledger;
    constexpr int k_arenas = arena_ledger::k_max_arenas;
    device_stats first;
    const std::size_t i_alloc = arena_ledger::index_of(&device_stats::allocated_bytes, stat_type::all);
    first.allocated_bytes[0].current = 100;
    first.allocated_bytes[0].peak = 250;
    std::vector<counts> now(k_arenas, counts{});
    ledger.seed(first);
    now[0] = ledger.published(0);
    for (int a = 1; a < k_arenas; ++a) ledger.join(a);
    counts expected_peak{};
    expected_peak[i_alloc] = 250;
    for (int step = 0; step < 2000; ++step) {
      const int a = static_cast<int>(rng() % k_arenas);
      // A few counters move, up or down, never below zero.
      for (int k = 0; k < 3; ++k) {
        const std::size_t i = rng() % now[0].size();
        const std::int64_t delta = static_cast<std::int64_t>(rng() % 200) - 90;
        now[static_cast<std::size_t>(a)][i] = std::max<std::int64_t>(0, now[static_cast<std::size_t>(a)][i] + delta);
      }
      ledger.publish(a, now[static_cast<std::size_t>(a)]);
      REQUIRE(ledger.published(a) == now[static_cast<std::size_t>(a)]);
      const counts sums = sum_of(now);
      for (std::size_t i = 0; i < sums.size(); ++i) expected_peak[i] = std::max(expected_peak[i], sums[i]);
      ledger.validate(sums);
    }
    const device_stats totals = ledger.totals();
    REQUIRE(totals.allocated_bytes[0].peak == expected_peak[i_alloc]);
    REQUIRE(totals.allocated_bytes[0].current == sum_of(now)[i_alloc]);
    REQUIRE(totals.mapped_chunks.peak == expected_peak.back());
    ledger.reset_peaks();
    REQUIRE(ledger.totals().allocated_bytes[0].peak == sum_of(now)[i_alloc]);
    ledger.validate(sum_of(now));
  }
}

TEST_CASE("arena_ledger: threads publishing at once keep the books", "[arenas][threads]") {
  arena_ledger ledger;
  constexpr int k_arenas = arena_ledger::k_max_arenas;
  ledger.seed(device_stats{});
  for (int a = 1; a < k_arenas; ++a) ledger.join(a);
  std::vector<counts> final_counts(k_arenas, counts{});
  std::vector<std::int64_t> most(k_arenas, 0);
  std::vector<std::thread> threads;
  for (int a = 0; a < k_arenas; ++a) {
    threads.emplace_back([&, a] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(a) + 1);
      counts now{};
      for (int step = 0; step < 20000; ++step) {
        now[0] = static_cast<std::int64_t>(rng() % 1000);
        most[static_cast<std::size_t>(a)] = std::max(most[static_cast<std::size_t>(a)], now[0]);
        ledger.publish(a, now);
      }
      now[0] = 10;
      ledger.publish(a, now);
      final_counts[static_cast<std::size_t>(a)] = now;
    });
  }
  for (std::thread& t : threads) t.join();
  ledger.validate(sum_of(final_counts));
  const device_stats totals = ledger.totals();
  REQUIRE(totals.allocation[0].current == 10 * k_arenas);
  // At least one arena's own highest; at most every arena's at once.
  std::int64_t sum_of_most = 0;
  std::int64_t one_most = 0;
  for (const std::int64_t m : most) {
    sum_of_most += m;
    one_most = std::max(one_most, m);
  }
  REQUIRE(totals.allocation[0].peak >= one_most);
  REQUIRE(totals.allocation[0].peak <= sum_of_most);
}
