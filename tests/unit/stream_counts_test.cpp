// stream_counts: counts, ranks and the order of first counting match a plain
// list of (stream, count) pairs, below k_scanned streams and past it, where
// the hash index finds the entries.
#include "streamalloc/core/stream_counts.hpp"

#include <cstddef>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "support/catch.hpp"

using namespace streamalloc;

TEST_CASE("stream_counts: counts and ranks below and past the scanned streams", "[stream_counts]") {
  std::mt19937_64 rng(GENERATE(1u, 2u));
  // Handles spread like pointers, some reused often.
  std::vector<stream_handle> handles;
  for (std::size_t i = 0; i < 3 * stream_counts::k_scanned; ++i) handles.push_back(0x7f0000000000ull + (rng() % 4096) * 64);
  std::uniform_int_distribution<std::size_t> pick(0, handles.size() - 1);
  std::uniform_int_distribution<int> delta(-3, 3);

  stream_counts counts;
  std::vector<std::pair<stream_handle, std::int64_t>> reference;  // first counted first
  const auto reference_position = [&](stream_handle s) {
    std::size_t i = 0;
    while (i < reference.size() && reference[i].first != s) ++i;
    return i;
  };
  for (int step = 0; step < 4000; ++step) {
    // The first steps use few streams, so both sides of k_scanned are run.
    const stream_handle s = step < 500 ? handles[pick(rng) % 8] : handles[pick(rng)];
    const std::int64_t d = delta(rng);
    counts.add(s, d);
    const std::size_t i = reference_position(s);
    if (i == reference.size()) {
      reference.emplace_back(s, d);
    } else {
      reference[i].second += d;
    }
    const stream_handle probe = handles[pick(rng)];
    const std::size_t at = reference_position(probe);
    REQUIRE(counts.rank(probe) == at);
    REQUIRE(counts.get(probe) == (at < reference.size() ? reference[at].second : 0));
  }
  REQUIRE(reference.size() > stream_counts::k_scanned);
  std::vector<std::pair<stream_handle, std::int64_t>> listed;
  counts.for_each([&](stream_handle s, std::int64_t c) { listed.emplace_back(s, c); });
  CHECK(listed == reference);
  CHECK(counts.rank(1) == reference.size());  // never counted
  CHECK(counts.get(1) == 0);
}
