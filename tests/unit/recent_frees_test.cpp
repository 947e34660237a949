// Note [recent frees] on the simulated device: a same-size request takes
// the block freed last, but only where best fit would have handed out the
// same block; readers of stats and snapshots see the merged free memory;
// keeping pauses while kept blocks do not come back.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/recent_frees.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/contains.hpp"
#include "support/sim_fixture.hpp"

namespace {

using namespace streamalloc;
using namespace streamalloc::test;

std::int64_t recent_reuses(const caching_allocator& alloc) { return alloc.stats().num_recent_reuses; }

// The message of the usage_error `action` throws ("" if none).
template <typename Action>
std::string error_of(Action&& action) {
  try {
    action();
  } catch (const usage_error& e) {
    return e.what();
  }
  return {};
}

struct device_kind {
  const char* name;
  sim_config device;
};

std::vector<device_kind> device_kinds() { return {{"expandable segments", vmm_device()}, {"plain segments", plain_device()}}; }

// Two allocators fed the same requests and frees; after each free, stats()
// returns the second one's recent frees to their pools, so it places as
// an allocator without them. Every allocation requires the same address
// from both. `next(n)` draws 0..n-1 from a seeded generator.
struct paired_allocators {
  struct live_pair {
    void* kept;
    void* returned;
    std::size_t bytes;
    bool second_stream;
  };

  paired_allocators(const sim_config& device, std::uint64_t seed) : kept(device), returned(device), state(seed) {}

  std::uint64_t next(std::uint64_t n) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (state >> 33) % n;
  }
  void allocate(std::size_t bytes, bool second_stream, int step) {
    void* a = kept.alloc.allocate(bytes, second_stream ? kept.s2 : kept.s1);
    void* b = returned.alloc.allocate(bytes, second_stream ? returned.s2 : returned.s1);
    INFO("step " << step << ", " << bytes << " B");
    REQUIRE(a == b);
    live.push_back({a, b, bytes, second_stream});
  }
  void free_at(std::size_t i) {
    kept.alloc.free(live[i].kept);
    returned.alloc.free(live[i].returned);
    (void)returned.alloc.stats();
    live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
  }

  // Both report the same counters, cumulative ones too: the kept one's
  // recent frees and reuses are counted when stats() returns them. (The
  // inactive-split counters miss the merges and splits that reuses skip:
  // the cumulative ones, and the peak a free reaches before its reuse
  // splits the block again, so the kept one's peak is at most the other's.)
  void check_same_counters() {
    const device_stats a = kept.alloc.stats();
    const device_stats b = returned.alloc.stats();
    const struct {
      const char* name;
      const stat_array& kept;
      const stat_array& returned;
    } arrays[] = {{"allocation", a.allocation, b.allocation},
                  {"allocated_bytes", a.allocated_bytes, b.allocated_bytes},
                  {"active", a.active, b.active},
                  {"active_bytes", a.active_bytes, b.active_bytes},
                  {"requested_bytes", a.requested_bytes, b.requested_bytes},
                  {"segment", a.segment, b.segment},
                  {"reserved_bytes", a.reserved_bytes, b.reserved_bytes},
                  {"inactive_split", a.inactive_split, b.inactive_split}};
    for (const auto& array : arrays) {
      for (int type = 0; type < k_stat_type_count; ++type) {
        INFO(array.name << "[" << type << "]");
        const stat_counter& x = array.kept[static_cast<std::size_t>(type)];
        const stat_counter& y = array.returned[static_cast<std::size_t>(type)];
        CHECK(x.current == y.current);
        if (std::string(array.name) != "inactive_split") {
          CHECK(x.peak == y.peak);
          CHECK(x.allocated == y.allocated);
          CHECK(x.freed == y.freed);
        } else {
          CHECK(x.peak <= y.peak);
        }
      }
    }
  }

  sim_fixture kept;
  sim_fixture returned;
  std::vector<live_pair> live;
  std::uint64_t state;
};

}  // namespace

TEST_CASE("recent frees: a same-size loop takes its block back each time", "[recent_frees]") {
  for (const device_kind& kind : device_kinds()) {
    for (const std::size_t bytes : {std::size_t{256}, std::size_t{64_KiB}, std::size_t{4_MiB}}) {
      INFO(kind.name << ", " << bytes << " B");
      sim_fixture f(kind.device);
      void* first = f.alloc.allocate(bytes, f.s1);
      f.alloc.free(first);
      for (int i = 0; i < 100; ++i) {
        void* p = f.alloc.allocate(bytes, f.s1);
        REQUIRE(p == first);
        f.alloc.free(p);
        if (i % 10 == 0) CHECK_NOTHROW(f.alloc.validate());  // the recent free in place
      }
      // The block freed last is a recent free, still counted allocated;
      // current_usage leaves it out, as if it had returned.
      CHECK(f.alloc.current_usage().allocations == 0);
      CHECK(f.alloc.current_usage().allocated_bytes == 0);
      // stats() returns the recent free first: the counters are those of
      // an allocator without recent frees, the 101 pairs in the cumulative
      // ones.
      const device_stats st = f.stats();
      CHECK(st.num_recent_reuses == 100);
      CHECK(all(st.allocation) == 0);
      CHECK(all(st.active) == 0);
      for (const stat_array* counts : {&st.allocation, &st.active}) {
        CHECK(at(*counts, stat_type::all).peak == 1);
        CHECK(at(*counts, stat_type::all).allocated == 101);
        CHECK(at(*counts, stat_type::all).freed == 101);
      }
      const std::int64_t block_bytes = at(st.allocated_bytes, stat_type::all).peak;
      CHECK(block_bytes >= static_cast<std::int64_t>(bytes));
      for (const stat_array* counts : {&st.allocated_bytes, &st.active_bytes}) {
        CHECK(at(*counts, stat_type::all).allocated == 101 * block_bytes);
        CHECK(at(*counts, stat_type::all).freed == 101 * block_bytes);
      }
      CHECK(all(st.inactive_split) == 0);
      CHECK(st.largest_free_block_bytes == all(st.reserved_bytes));
      f.check_consistent();
    }
  }
}

TEST_CASE("recent frees: best fit's choice wins over the block freed last", "[recent_frees]") {
  for (const device_kind& kind : device_kinds()) {
    INFO(kind.name);
    sim_fixture f(kind.device);
    // [x][fence1][y][fence2]: x and y are 64 KiB holes of one size.
    void* x = f.alloc.allocate(64_KiB, f.s1);
    void* fence1 = f.alloc.allocate(64_KiB, f.s1);
    void* y = f.alloc.allocate(64_KiB, f.s1);
    void* fence2 = f.alloc.allocate(64_KiB, f.s1);
    REQUIRE(reinterpret_cast<std::uintptr_t>(x) < reinterpret_cast<std::uintptr_t>(y));
    f.alloc.free(x);
    void* other = f.alloc.allocate(128_KiB, f.s1);  // another size: x returns to its pool
    f.alloc.free(y);                                // y is the recent free
    void* p = f.alloc.allocate(64_KiB, f.s1);
    // Best fit takes the lowest address among equal sizes: x, not y.
    CHECK(p == x);
    CHECK(recent_reuses(f.alloc) == 0);
    f.check_consistent();
    for (void* q : {p, fence1, fence2, other}) f.alloc.free(q);
    f.check_consistent();
  }
}

TEST_CASE("recent frees: another stream's request does not take them", "[recent_frees]") {
  sim_fixture f(vmm_device());
  void* a = f.alloc.allocate(4_MiB, f.s1);
  f.alloc.free(a);
  // s2 has nothing cached: the block goes to s2 by a counted hand-off
  // (Note [cross-stream reuse]), exactly as without recent frees.
  void* b = f.alloc.allocate(4_MiB, f.s2);
  CHECK(b == a);
  CHECK(recent_reuses(f.alloc) == 0);
  CHECK(f.stats().num_cross_stream_reuses == 1);
  f.alloc.free(b);
  f.check_consistent();
}

TEST_CASE("recent frees: keeping pauses while kept blocks do not come back", "[recent_frees]") {
  sim_fixture f(vmm_device());
  // Every request a new size: nothing kept is taken back.
  for (std::size_t i = 0; i < recent_frees::k_sample_keeps; ++i) {
    f.alloc.free(f.alloc.allocate(64_KiB + 512 * i, f.s1));
  }
  CHECK(recent_reuses(f.alloc) == 0);
  // Then a same-size loop: the first frees pass by, then keeping resumes.
  const std::size_t pairs = recent_frees::k_pause_frees + 100;
  for (std::size_t i = 0; i < pairs; ++i) f.alloc.free(f.alloc.allocate(64_KiB, f.s1));
  const std::int64_t reuses = recent_reuses(f.alloc);
  CHECK(reuses > 0);
  CHECK(reuses <= static_cast<std::int64_t>(pairs - recent_frees::k_pause_frees));
  f.check_consistent();
}

TEST_CASE("recent frees: a kept block is freed memory to every pointer lookup", "[recent_frees]") {
  sim_fixture f(vmm_device());
  void* p = f.alloc.allocate(64_KiB, f.s1);
  f.alloc.free(p);  // kept, its pointer map entry with it
  CHECK(contains(error_of([&] { f.alloc.free(p); }), "is not allocated (double free?)"));
  CHECK(contains(error_of([&] { f.alloc.record_stream(p, f.s2); }), "record_stream: "));
  CHECK(contains(error_of([&] { (void)f.alloc.allocation_size(p); }), "is not allocated"));
  CHECK_FALSE(f.alloc.owns(p));
  // Taken back (none of these lookups returned it), it is allocated again.
  CHECK(f.alloc.allocate(64_KiB, f.s1) == p);
  CHECK(recent_reuses(f.alloc) == 1);
  CHECK(f.alloc.owns(p));
  CHECK(f.alloc.allocation_size(p) == 64_KiB);
  f.alloc.free(p);
  f.check_consistent();
}

TEST_CASE("recent frees: placement is that of an allocator whose frees all return at once", "[recent_frees]") {
  // The same seeded sequence on two allocators; after each free, stats()
  // returns the second one's recent frees to their pools. Mid-size
  // requests (Note [mid-size requests]) see a stream whose memory is all
  // recent frees as holding none.
  for (const device_kind& kind : device_kinds()) {
    INFO(kind.name);
    paired_allocators pair(kind.device, 20261201);
    const std::size_t sizes[] = {256, 64_KiB, 512_KiB, 768_KiB, 4_MiB};
    for (int step = 0; step < 4000; ++step) {
      if (!pair.live.empty() && (pair.live.size() >= 6 || pair.next(2) == 0)) {
        pair.free_at(pair.next(pair.live.size()));
        continue;
      }
      const std::size_t bytes = sizes[pair.next(std::size(sizes))];
      pair.allocate(bytes, pair.next(4) == 0, step);
    }
    CHECK(recent_reuses(pair.kept.alloc) > 0);
    pair.kept.check_consistent();
    pair.check_same_counters();
  }
}

TEST_CASE("recent frees: loops that free and ask again place as best fit does", "[recent_frees]") {
  // Note [repeated reuse]: mostly loops (free the block allocated last, ask
  // for its size again on its stream), between them other requests and
  // frees on two streams; the same sequence on an allocator whose recent
  // frees return after every free hands out the same addresses.
  for (const device_kind& kind : device_kinds()) {
    INFO(kind.name);
    paired_allocators pair(kind.device, 20261202);
    const std::size_t sizes[] = {512, 64_KiB, 1_MiB, 3_MiB, 6_MiB};
    const std::int64_t reuses_before = recent_reuses(pair.kept.alloc);
    const std::uint64_t sections_before = pair.kept.alloc.critical_sections();
    std::uint64_t calls = 0;
    for (int step = 0; step < 6000; ++step) {
      const std::uint64_t op = pair.next(10);
      if (op < 6 && !pair.live.empty()) {  // the loop
        const paired_allocators::live_pair last = pair.live.back();
        pair.free_at(pair.live.size() - 1);
        pair.allocate(last.bytes, last.second_stream, step);
        calls += 2;
      } else if (op < 8 || pair.live.size() < 2) {
        if (pair.live.size() < 12) {
          pair.allocate(sizes[pair.next(std::size(sizes))], pair.next(4) == 0, step);
          ++calls;
        }
      } else {
        pair.free_at(pair.next(pair.live.size()));
        ++calls;
      }
    }
    CHECK(recent_reuses(pair.kept.alloc) - reuses_before > 1000);
    // Note [repeats without the lock]: loops that went on ran without one.
    CHECK(pair.kept.alloc.critical_sections() - sections_before + 500 < calls);
    pair.kept.check_consistent();
    pair.check_same_counters();
  }
}

TEST_CASE("recent frees: a stream holding only recent frees holds no memory for a mid-size request", "[recent_frees]") {
  sim_fixture kept(vmm_device());
  sim_fixture returned(vmm_device());
  void* a = kept.alloc.allocate(4_MiB, kept.s1);
  void* b = returned.alloc.allocate(4_MiB, returned.s1);
  REQUIRE(a == b);
  kept.alloc.free(a);  // kept: s1's only memory is a recent free
  returned.alloc.free(b);
  (void)returned.alloc.stats();
  // Note [mid-size requests]: s1 holds nothing, so it opens a small chunk
  // instead of cutting the large free block.
  void* p = kept.alloc.allocate(512_KiB, kept.s1);
  void* q = returned.alloc.allocate(512_KiB, returned.s1);
  CHECK(p == q);
  CHECK(p != a);
  kept.alloc.free(p);
  kept.check_consistent();
}
