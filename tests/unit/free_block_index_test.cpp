// free_block_index: best fit by size class and by tree, the (stream, size,
// address) walks and the unordered one, and a randomized run against a
// std::set of the same keys (best fit, and best fit besides the best fit).
#include "streamalloc/core/free_block_index.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <iterator>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "streamalloc/core/block.hpp"
#include "streamalloc/core/node_recycler.hpp"
#include "streamalloc/util/bytes.hpp"
#include "support/catch.hpp"

using namespace streamalloc;

namespace {

constexpr std::size_t k_class_bytes = 512;
// The first size kept in the tree with 512-byte classes (32 MiB).
constexpr std::size_t k_tree_bytes = free_block_index::k_classes * k_class_bytes;

// Blocks for the index to hold; a deque keeps their addresses stable.
class block_store {
 public:
  block* make(stream_handle stream, std::size_t size, std::uintptr_t address) {
    block& b = blocks_.emplace_back();
    b.stream = stream;
    b.size = size;
    b.address = address;
    return &b;
  }

 private:
  std::deque<block> blocks_;
};

using key = std::tuple<stream_handle, std::size_t, std::uintptr_t>;
key key_of(const block* b) { return {b->stream, b->size, b->address}; }

std::vector<key> walk_all(const free_block_index& index, std::size_t min_bytes = 0) {
  std::vector<key> out;
  index.for_each([&](const block* b) { out.push_back(key_of(b)); }, min_bytes);
  return out;
}

// The blocks for_each_unordered visits, sorted as for_each would give them.
std::vector<key> walk_unordered(const free_block_index& index, std::size_t min_bytes = 0) {
  std::vector<key> out;
  index.for_each_unordered([&](const block* b) { out.push_back(key_of(b)); }, min_bytes);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("free_block_index: best fit is the smallest size that holds the request, lowest address first",
          "[free_block_index]") {
  node_recycler recycler;
  free_block_index index(k_class_bytes, &recycler);
  block_store store;
  block* mid_high = store.make(7, 64_KiB, 0x90000);
  block* mid_low = store.make(7, 64_KiB, 0x10000);
  block* small = store.make(7, 1_KiB, 0x5000);
  block* big = store.make(7, 2_MiB, 0x200000);
  block* other_stream = store.make(3, 8_KiB, 0x8000);
  for (block* b : {mid_high, mid_low, small, big, other_stream}) index.insert(b);
  CHECK(index.size() == 5);
  CHECK(index.first_violation().empty());

  CHECK(index.best_fit(7, 512) == small);
  CHECK(index.best_fit(7, 1_KiB) == small);
  CHECK(index.best_fit(7, 1_KiB + 512) == mid_low);
  CHECK(index.best_fit(7, 64_KiB) == mid_low);
  CHECK(index.best_fit(7, 64_KiB + 1) == big);
  CHECK(index.best_fit(7, 2_MiB + 512) == nullptr);
  CHECK(index.best_fit(3, 4_KiB) == other_stream);
  CHECK(index.best_fit(3, 8_KiB + 512) == nullptr);
  CHECK(index.best_fit(99, 512) == nullptr);

  index.erase(mid_low);
  CHECK(index.best_fit(7, 64_KiB) == mid_high);
  index.insert(mid_low);
  CHECK(index.best_fit(7, 64_KiB) == mid_low);
  index.erase(mid_high);  // not the class's first block
  CHECK(index.best_fit(7, 64_KiB) == mid_low);
  CHECK(index.first_violation().empty());
}

TEST_CASE("free_block_index: blocks above the classes are in the tree, found across the boundary",
          "[free_block_index]") {
  node_recycler recycler;
  free_block_index index(k_class_bytes, &recycler);
  block_store store;
  block* last_class = store.make(0, k_tree_bytes - k_class_bytes, 0x100000000);
  block* first_tree = store.make(0, k_tree_bytes, 0x200000000);
  block* huge_high = store.make(0, 1_GiB, 0x900000000);
  block* huge_low = store.make(0, 1_GiB, 0x400000000);
  for (block* b : {huge_high, first_tree, huge_low, last_class}) index.insert(b);
  CHECK(index.first_violation().empty());

  CHECK(index.best_fit(0, 1_MiB) == last_class);
  CHECK(index.best_fit(0, k_tree_bytes - k_class_bytes) == last_class);
  CHECK(index.best_fit(0, k_tree_bytes - k_class_bytes + 1) == first_tree);
  CHECK(index.best_fit(0, k_tree_bytes + 1) == huge_low);
  CHECK(index.best_fit(1, 512) == nullptr);
  CHECK(index.best_fit(0, 2_GiB) == nullptr);
  CHECK(index.best_fit(0, static_cast<std::size_t>(-1)) == nullptr);
  index.erase(last_class);
  CHECK(index.best_fit(0, 512) == first_tree);
  index.erase(huge_low);
  CHECK(index.best_fit(0, k_tree_bytes + 1) == huge_high);
  CHECK(index.first_violation().empty());
}

TEST_CASE("free_block_index: walks go in (stream, size, address) order and filter", "[free_block_index]") {
  node_recycler recycler;
  free_block_index index(k_class_bytes, &recycler);
  block_store store;
  // Stream 5 only in the tree, stream 2 only in classes, stream 9 in both.
  const std::vector<key> keys = {{9, 4_KiB, 0x3000},       {9, 4_KiB, 0x1000},  {9, 4_KiB, 0x2000},
                                 {2, 1_MiB, 0x40000},      {2, 512, 0x500},     {9, 64_MiB, 0x8000000},
                                 {5, 40_MiB, 0x10000000},  {9, 1_KiB, 0x9000},  {9, 64_MiB, 0x4000000}};
  for (const auto& [stream, size, address] : keys) index.insert(store.make(stream, size, address));

  std::vector<key> sorted(keys.begin(), keys.end());
  std::sort(sorted.begin(), sorted.end());
  CHECK(walk_all(index) == sorted);

  std::vector<key> large;
  for (const key& k : sorted) {
    if (std::get<1>(k) >= 4_KiB) large.push_back(k);
  }
  CHECK(walk_all(index, 4_KiB) == large);
  CHECK(walk_unordered(index) == sorted);
  CHECK(walk_unordered(index, 4_KiB) == large);

  std::vector<stream_handle> streams;
  index.for_each_stream([&](stream_handle s) { streams.push_back(s); });
  CHECK(streams == std::vector<stream_handle>{2, 5, 9});
  CHECK_FALSE(index.one_stream());

  // Each stream's best fit for 2 KiB: stream 2's 1 MiB block (classes),
  // stream 5's 40 MiB (tree only), stream 9's first 4 KiB block (classes,
  // though it has tree blocks too); for 48 MiB only the tree's.
  std::vector<key> fits;
  const auto fits_besides = [&](std::size_t bytes, stream_handle skip) {
    fits.clear();
    index.for_each_best_fit(bytes, skip, [&](stream_handle, const block* b) { fits.push_back(key_of(b)); });
    return fits;
  };
  CHECK(fits_besides(2_KiB, 0) == std::vector<key>{{2, 1_MiB, 0x40000}, {5, 40_MiB, 0x10000000}, {9, 4_KiB, 0x1000}});
  CHECK(fits_besides(2_KiB, 5) == std::vector<key>{{2, 1_MiB, 0x40000}, {9, 4_KiB, 0x1000}});
  CHECK(fits_besides(2_KiB, 9) == std::vector<key>{{2, 1_MiB, 0x40000}, {5, 40_MiB, 0x10000000}});
  CHECK(fits_besides(48_MiB, 0) == std::vector<key>{{9, 64_MiB, 0x4000000}});
  CHECK(fits_besides(48_MiB, 9).empty());

  // The first block of stream 9 from 2 KiB on that is not at 0x1000 nor
  // 0x2000: past two equal sizes, in address order.
  const block* found = index.first_fit_if(9, 2_KiB, [](const block* b) { return b->address > 0x2000; });
  REQUIRE(found != nullptr);
  CHECK(key_of(found) == key{9, 4_KiB, 0x3000});
  found = index.first_fit_if(9, 2_KiB, [](const block* b) { return b->size > 4_KiB; });
  REQUIRE(found != nullptr);
  CHECK(key_of(found) == key{9, 64_MiB, 0x4000000});
  CHECK(index.first_fit_if(9, 512, [](const block*) { return false; }) == nullptr);
}

TEST_CASE("free_block_index: one_stream tells one stream from none and from several", "[free_block_index]") {
  node_recycler recycler;
  free_block_index index(k_class_bytes, &recycler);
  block_store store;
  CHECK_FALSE(index.one_stream());
  block* small = store.make(4, 4_KiB, 0x1000);
  block* large = store.make(4, 64_MiB, 0x4000000);
  index.insert(small);
  CHECK(index.one_stream());
  index.insert(large);
  CHECK(index.one_stream());
  index.erase(small);
  CHECK(index.one_stream());  // the tree alone
  block* other_in_tree = store.make(7, 40_MiB, 0x10000000);
  index.insert(other_in_tree);
  CHECK_FALSE(index.one_stream());
  index.erase(other_in_tree);
  block* other_in_classes = store.make(1, 512, 0x500);
  index.insert(other_in_classes);
  CHECK_FALSE(index.one_stream());
  index.erase(other_in_classes);
  index.erase(large);
  CHECK_FALSE(index.one_stream());  // empty, though stream 4's and 1's bins stay
}

TEST_CASE("free_block_index: a narrower class width and sizes off it", "[free_block_index]") {
  node_recycler recycler;
  block_store store;
  SECTION("256-byte classes keep 256-byte steps apart") {
    free_block_index index(256, &recycler);
    block* a = store.make(0, 768, 0x1000);
    block* b = store.make(0, 512, 0x2000);
    index.insert(a);
    index.insert(b);
    CHECK(index.best_fit(0, 256) == b);
    CHECK(index.best_fit(0, 513) == a);
    CHECK(index.first_violation().empty());
  }
  SECTION("a size that is not a multiple is never found for more than it holds, and is reported") {
    free_block_index index(k_class_bytes, &recycler);
    block* odd = store.make(0, 1000, 0x1000);
    index.insert(odd);
    CHECK(index.best_fit(0, 512) == odd);
    CHECK(index.best_fit(0, 1001) == nullptr);
    CHECK(index.first_violation() == "a block size is not a multiple of the class width");
  }
}

TEST_CASE("free_block_index: first_violation names a block changed behind the index's back", "[free_block_index]") {
  node_recycler recycler;
  free_block_index index(k_class_bytes, &recycler);
  block_store store;
  block* a = store.make(1, 4_KiB, 0x1000);
  block* b = store.make(1, 4_KiB, 0x2000);
  block* big = store.make(1, 64_MiB, 0x8000000);
  for (block* x : {a, b, big}) index.insert(x);
  REQUIRE(index.first_violation().empty());

  SECTION("a stream") {
    b->stream = 2;
    CHECK(index.first_violation() == "a block is kept under another stream");
    b->stream = 1;
  }
  SECTION("a size") {
    a->size = 8_KiB;
    CHECK(index.first_violation() == "a block is in another size's class");
    a->size = 4_KiB;
  }
  SECTION("heap order") {
    std::swap(a->address, b->address);
    CHECK(index.first_violation() == "a class's heap is out of address order");
    std::swap(a->address, b->address);
  }
  SECTION("a tree key") {
    big->size = 128_MiB;
    CHECK(index.first_violation() == "a tree's copy of a block's key is out of date");
    big->size = 64_MiB;
  }
  CHECK(index.first_violation().empty());
}

TEST_CASE("free_block_index: randomized operations match an ordered set", "[free_block_index]") {
  // Sizes cluster on a few values (long classes, equal-size ties) and
  // spread over the classes, the boundary and the tree.
  const std::size_t common[] = {512, 4_KiB, 64_KiB, 2_MiB, k_tree_bytes - k_class_bytes, k_tree_bytes, 64_MiB};
  std::mt19937_64 rng(GENERATE(1u, 2u, 3u));
  std::uniform_int_distribution<int> pick(0, 99);
  std::uniform_int_distribution<std::size_t> common_pick(0, std::size(common) - 1);
  std::uniform_int_distribution<std::size_t> units(1, 2 * free_block_index::k_classes);
  std::uniform_int_distribution<stream_handle> stream_pick(0, 3);

  node_recycler recycler;
  free_block_index index(k_class_bytes, &recycler);
  block_store store;
  std::set<key> reference;
  std::vector<block*> held;
  std::uintptr_t next_address = 0x100000;
  const auto random_size = [&] {
    return pick(rng) < 60 ? common[common_pick(rng)] : units(rng) * k_class_bytes;
  };
  const auto expected_fit = [&](stream_handle stream, std::size_t bytes) -> key {
    auto it = reference.lower_bound({stream, bytes, 0});
    return it != reference.end() && std::get<0>(*it) == stream ? *it : key{~stream_handle{0}, 0, 0};
  };

  for (int step = 0; step < 20000; ++step) {
    const int what = pick(rng);
    if (what < 45 || held.empty()) {
      // Addresses come in a shuffled order: a later block may sort first.
      const std::uintptr_t address = (next_address += 0x1000) ^ (static_cast<std::uintptr_t>(pick(rng)) << 40);
      block* b = store.make(stream_pick(rng), random_size(), address);
      index.insert(b);
      reference.insert(key_of(b));
      held.push_back(b);
    } else if (what < 85) {
      std::uniform_int_distribution<std::size_t> which(0, held.size() - 1);
      const std::size_t i = which(rng);
      index.erase(held[i]);
      reference.erase(key_of(held[i]));
      held[i] = held.back();
      held.pop_back();
    } else {
      // Take the best fit, as the allocator does.
      const stream_handle stream = stream_pick(rng);
      block* b = index.best_fit(stream, random_size());
      if (b != nullptr) {
        index.erase(b);
        reference.erase(key_of(b));
        held.erase(std::find(held.begin(), held.end(), b));
      }
    }
    REQUIRE(index.size() == reference.size());
    {
      // Every stream's best fit in one pass: what best_fit gives each one.
      const std::size_t bytes = pick(rng) < 50 ? random_size() : random_size() - 1;
      const stream_handle skip = stream_pick(rng);
      std::vector<key> visited;
      index.for_each_best_fit(bytes, skip, [&](stream_handle stream, const block* b) {
        REQUIRE(b->stream == stream);
        visited.push_back(key_of(b));
      });
      std::vector<key> want;
      for (stream_handle stream = 0; stream <= 3; ++stream) {
        const key fit = expected_fit(stream, bytes);
        if (stream != skip && std::get<0>(fit) != ~stream_handle{0}) want.push_back(fit);
      }
      REQUIRE(visited == want);
      std::set<stream_handle> streams;
      for (const key& k : reference) streams.insert(std::get<0>(k));
      REQUIRE(index.one_stream() == (streams.size() == 1));
    }
    for (int probe = 0; probe < 4; ++probe) {
      const stream_handle stream = stream_pick(rng);
      const std::size_t bytes = pick(rng) < 50 ? random_size() : random_size() - 1;
      const block* found = index.best_fit(stream, bytes);
      const key want = expected_fit(stream, bytes);
      if (std::get<0>(want) == ~stream_handle{0}) {
        REQUIRE(found == nullptr);
      } else {
        REQUIRE(found != nullptr);
        REQUIRE(key_of(found) == want);
        // best_fit_besides the best fit: the next key of the stream.
        const block* second = index.best_fit_besides(stream, bytes, found);
        const auto next = std::next(reference.find(want));
        if (next == reference.end() || std::get<0>(*next) != stream) {
          REQUIRE(second == nullptr);
        } else {
          REQUIRE(second != nullptr);
          REQUIRE(key_of(second) == *next);
        }
      }
    }
    if (step % 500 == 0) {
      REQUIRE(index.first_violation().empty());
      REQUIRE(walk_all(index) == std::vector<key>(reference.begin(), reference.end()));
      // Deep heaps by now: every member once, whatever the heap's shape.
      REQUIRE(walk_unordered(index) == std::vector<key>(reference.begin(), reference.end()));
      REQUIRE(walk_unordered(index, 64_KiB) == walk_all(index, 64_KiB));
    }
  }
  REQUIRE(index.first_violation().empty());
  REQUIRE(walk_all(index) == std::vector<key>(reference.begin(), reference.end()));
  for (block* b : held) index.erase(b);
  CHECK(index.size() == 0);
  CHECK(index.first_violation().empty());
}
