// Issue 7's bad inputs, one test case each: every misuse is a clear error
// (the exception type and its message are checked), and the allocations that
// were live before it keep their address, size and accounting exactly.
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "streamalloc/core/device_allocators.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/contains.hpp"
#include "support/temp_dir.hpp"
#include "support/sim_fixture.hpp"
#include "trace_reader.hpp"
#include "trace_replay.hpp"

namespace {

using namespace streamalloc;
using namespace streamalloc::test;
namespace fs = std::filesystem;

constexpr std::size_t k_size_max = std::numeric_limits<std::size_t>::max();

using streamalloc::test::contains;

// The message of the exception `action` throws as `error_type` ("" if none).
template <typename error_type, typename Action>
std::string error_of(Action&& action) {
  try {
    action();
  } catch (const error_type& e) {
    return e.what();
  }
  return {};
}

// A few live allocations of both pools and two streams, remembered so a test
// can prove a bad call left every one of them (and the stats) untouched.
// `allocator_type`: caching_allocator or device_allocator.
template <typename allocator_type>
class live_allocations {
 public:
  explicit live_allocations(allocator_type& alloc, const sim_backend& sim, stream_handle s1, stream_handle s2)
      : alloc_(alloc), sim_(sim) {
    for (const auto& [bytes, stream] : {std::pair<std::size_t, stream_handle>{4_KiB, s1},
                                        {700_KiB, s2},
                                        {3_MiB, s1},
                                        {25_MiB, s2}}) {
      void* p = alloc_.allocate(bytes, stream);
      sizes_[p] = alloc_.allocation_size(p);
    }
    // A freed neighbour makes the segment split, so a bad free next to it
    // would show up as a wrong coalesce.
    alloc_.free(alloc_.allocate(8_KiB, s1));
    rebase();
  }
  ~live_allocations() {
    for (const auto& [p, size] : sizes_) alloc_.free(p);
  }
  live_allocations(const live_allocations&) = delete;
  live_allocations& operator=(const live_allocations&) = delete;

  // Takes the current stats and device usage as the state to keep, after a
  // test's own valid calls moved them.
  void rebase() {
    stats_before_ = alloc_.stats().to_map();
    used_before_ = sim_.used_bytes();
  }

  void* any() const { return sizes_.begin()->first; }
  void* largest() const { return sizes_.rbegin()->first; }

  // Every allocation is still live with its size, the stats are unchanged
  // and still recount exactly, and the device holds what it held.
  void check_untouched() const {
    for (const auto& [p, size] : sizes_) {
      CAPTURE(p);
      CHECK(alloc_.owns(p));
      CHECK(alloc_.allocation_size(p) == size);
      CHECK(sim_.is_device_memory(p, size));
    }
    const std::map<std::string, double> now = alloc_.stats().to_map();
    for (const auto& [key, value] : stats_before_) {
      auto it = now.find(key);
      CAPTURE(key);
      REQUIRE(it != now.end());
      CHECK(it->second == value);
    }
    CHECK(now.size() == stats_before_.size());
    CHECK(sim_.used_bytes() == used_before_);
    const std::string problem = consistency_problem(alloc_, sim_);
    INFO(problem);
    CHECK(problem.empty());
  }

 private:
  allocator_type& alloc_;
  const sim_backend& sim_;
  std::map<void*, std::size_t> sizes_;
  std::map<std::string, double> stats_before_;
  std::size_t used_before_ = 0;
};

struct bad_input_fixture {
  bad_input_fixture() : f(immediate_events(1_GiB)), live(f.alloc, f.sim, f.s1, f.s2) {}
  sim_fixture f;
  live_allocations<caching_allocator> live;
};

using streamalloc::test::temp_dir;

const std::string k_trace_header = "action,addr,size,stream\n";

}  // namespace

// --- frees -----------------------------------------------------------------

TEST_CASE("bad input: free of a pointer that was never allocated", "[bad_input]") {
  bad_input_fixture t;
  int on_the_host = 0;
  const std::string message = error_of<usage_error>([&] { t.f.alloc.free(&on_the_host); });
  CAPTURE(message);
  CHECK(contains(message, "was never allocated by this allocator"));
  // An address inside the device's range that no segment covers.
  void* beyond = static_cast<char*>(t.live.largest()) + 1_GiB;
  CHECK(contains(error_of<usage_error>([&] { t.f.alloc.free(beyond); }), "was never allocated"));
  t.live.check_untouched();
}

TEST_CASE("bad input: free of an interior pointer", "[bad_input]") {
  bad_input_fixture t;
  void* inside = static_cast<char*>(t.live.largest()) + 512;
  const std::string message = error_of<usage_error>([&] { t.f.alloc.free(inside); });
  CAPTURE(message);
  CHECK(contains(message, "points inside a block (offset 512"));
  CHECK(contains(error_of<usage_error>([&] { t.f.alloc.free(static_cast<char*>(t.live.any()) + 1); }),
                 "points inside a block (offset 1"));
  t.live.check_untouched();
}

TEST_CASE("bad input: double free", "[bad_input]") {
  bad_input_fixture t;
  void* p = t.f.alloc.allocate(64_KiB, t.f.s1);
  t.f.alloc.free(p);
  t.live.rebase();
  const std::string message = error_of<usage_error>([&] { t.f.alloc.free(p); });
  CAPTURE(message);
  CHECK(contains(message, "is not allocated (double free?)"));
  t.live.check_untouched();
}

TEST_CASE("bad input: double free while the first free is still pending", "[bad_input]") {
  sim_fixture f(manual_events(1_GiB));
  live_allocations live(f.alloc, f.sim, f.s1, f.s2);
  void* p = f.alloc.allocate(64_KiB, f.s1);
  f.alloc.record_stream(p, f.s3);
  f.alloc.free(p);
  live.rebase();
  CHECK(contains(error_of<usage_error>([&] { f.alloc.free(p); }), "double free"));
  CHECK(f.sim.pending_events().size() == 1);
  live.check_untouched();
  f.sim.complete_all_events();
}

TEST_CASE("bad input: free on the wrong device", "[bad_input]") {
  // Two simulated devices behind one device_allocators, as the process-wide
  // allocator has them; a pointer of device 0 is freed through device 1.
  std::vector<sim_backend*> backends(2, nullptr);
  device_allocators devices(
      2,
      [&](int device, status*) -> std::unique_ptr<device_backend> {
        sim_config c = immediate_events(1_GiB);
        c.device_index = device;
        auto backend = std::make_unique<sim_backend>(c);
        backends[static_cast<std::size_t>(device)] = backend.get();
        return backend;
      },
      allocator_config{});
  device_allocator& d0 = devices.at(0);
  device_allocator& d1 = devices.at(1);
  live_allocations live0(d0, *backends[0], 0, backends[0]->new_stream());
  live_allocations live1(d1, *backends[1], 0, backends[1]->new_stream());

  const std::string message = error_of<usage_error>([&] { d1.free(live0.any()); });
  CAPTURE(message);
  CHECK(contains(message, "on device 1"));
  CHECK(contains(message, "was never allocated by this allocator"));
  live0.check_untouched();
  live1.check_untouched();
}

// --- stream uses -----------------------------------------------------------

TEST_CASE("bad input: record_stream on an unknown pointer", "[bad_input]") {
  bad_input_fixture t;
  int on_the_host = 0;
  const std::string message = error_of<usage_error>([&] { t.f.alloc.record_stream(&on_the_host, t.f.s3); });
  CAPTURE(message);
  CHECK(contains(message, "record_stream: "));
  CHECK(contains(message, "was never allocated"));
  CHECK(contains(error_of<usage_error>([&] { t.f.alloc.record_stream(static_cast<char*>(t.live.any()) + 512, t.f.s3); }),
                 "points inside a block"));
  t.live.check_untouched();
  // No stream use was left behind: freeing a live block records no event.
  const std::size_t records = t.f.sim.counters().event_records;
  void* p = t.f.alloc.allocate(4_KiB, t.f.s1);
  t.f.alloc.free(p);
  CHECK(t.f.sim.counters().event_records == records);
}

// --- sizes -----------------------------------------------------------------

TEST_CASE("bad input: size 0 returns nullptr like torch's allocator", "[bad_input]") {
  bad_input_fixture t;
  const std::size_t segment_allocs = t.f.sim.counters().segment_allocs;
  CHECK(t.f.alloc.allocate(0, t.f.s1) == nullptr);
  // Freeing the nullptr of an empty allocation is a no-op too.
  REQUIRE_NOTHROW(t.f.alloc.free(nullptr));
  CHECK(t.f.sim.counters().segment_allocs == segment_allocs);
  t.live.check_untouched();
}

TEST_CASE("bad input: sizes near SIZE_MAX throw out_of_memory without wrapping", "[bad_input]") {
  bad_input_fixture t;
  const auto before = t.f.stats();
  for (std::size_t bytes : {k_size_max, k_size_max - 1, k_size_max - 511, k_size_max / 2 + 1, k_size_max - 2_MiB}) {
    CAPTURE(bytes);
    try {
      t.f.alloc.allocate(bytes, t.f.s1);
      FAIL("allocate(" << bytes << ") returned");
    } catch (const out_of_memory& e) {
      CHECK(e.context().requested_bytes == bytes);
      CHECK(contains(e.what(), "out of memory"));
    }
  }
  CHECK(t.f.stats().num_ooms == before.num_ooms + 5);
  // Only the OOM counter moved: the live blocks and byte stats did not.
  CHECK(all(t.f.stats().allocated_bytes) == all(before.allocated_bytes));
  CHECK(all(t.f.stats().reserved_bytes) == all(before.reserved_bytes));
  t.f.check_consistent();
  CHECK(t.f.sim.used_bytes() == static_cast<std::size_t>(all(before.reserved_bytes)));
  void* p = t.f.alloc.allocate(1_MiB, t.f.s1);
  CHECK(p != nullptr);
  t.f.alloc.free(p);
}

TEST_CASE("bad input: a size above device capacity throws out_of_memory", "[bad_input]") {
  bad_input_fixture t;
  const auto before = t.f.stats();
  try {
    t.f.alloc.allocate(2_GiB, t.f.s2);
    FAIL("allocate above capacity returned");
  } catch (const out_of_memory& e) {
    CHECK(e.context().requested_bytes == 2_GiB);
    CHECK(e.context().device_total_bytes == 1_GiB);
    CHECK(e.context().allocated_bytes == static_cast<std::size_t>(all(before.allocated_bytes)));
  }
  // The OOM ladder released the unused cached segments while trying; every
  // live allocation is still there and the stats recount.
  t.f.check_consistent();
  CHECK(all(t.f.stats().allocated_bytes) == all(before.allocated_bytes));
  CHECK(all(t.f.stats().allocation) == all(before.allocation));
  void* p = t.f.alloc.allocate(100_MiB, t.f.s2);
  CHECK(p != nullptr);
  t.f.alloc.free(p);
  t.f.check_consistent();
}

// --- devices ---------------------------------------------------------------

TEST_CASE("bad input: allocation on a device index that does not exist", "[bad_input]") {
  sim_backend* backend0 = nullptr;
  device_allocators devices(
      1,
      [&](int device, status*) -> std::unique_ptr<device_backend> {
        sim_config c = immediate_events(1_GiB);
        c.device_index = device;
        auto backend = std::make_unique<sim_backend>(c);
        backend0 = backend.get();
        return backend;
      },
      allocator_config{});
  device_allocator& d0 = devices.at(0);
  live_allocations live(d0, *backend0, 0, backend0->new_stream());
  for (int bad : {1, 7, -1, std::numeric_limits<int>::max(), std::numeric_limits<int>::min()}) {
    CAPTURE(bad);
    const std::string message = error_of<usage_error>([&] { devices.at(bad); });
    CAPTURE(message);
    CHECK(contains(message, std::to_string(bad)));
    CHECK(devices.find(bad) == nullptr);
  }
  CHECK(&devices.at(0) == &d0);
  live.check_untouched();
}

// --- STREAMALLOC_CONF -------------------------------------------------------

namespace {

// Parsing `text` fails with config_error whose message has every `part`,
// and a config parsed before is untouched by the failed with().
void check_config_rejected(const std::string& text, const std::vector<std::string>& parts) {
  CAPTURE(text);
  const std::string message = error_of<config_error>([&] { allocator_config::parse(text); });
  CAPTURE(message);
  REQUIRE(!message.empty());
  CHECK(contains(message, "STREAMALLOC_CONF"));
  for (const std::string& part : parts) CHECK(contains(message, part));
  const allocator_config base = allocator_config::parse("max_split_size_mb:200,memory_fraction:0.5");
  const std::string base_text = base.to_string();
  REQUIRE_THROWS_AS(base.with(text), config_error);
  CHECK(base.to_string() == base_text);
}

}  // namespace

TEST_CASE("bad input: STREAMALLOC_CONF with an unknown key", "[bad_input][config]") {
  check_config_rejected("max_split_size_mb:200,no_such_key:3", {"unknown key 'no_such_key'", "valid keys"});
}

TEST_CASE("bad input: STREAMALLOC_CONF with a bad number", "[bad_input][config]") {
  check_config_rejected("max_split_size_mb:12abc", {"max_split_size_mb", "12abc"});
  check_config_rejected("memory_fraction:half", {"memory_fraction", "half"});
  check_config_rejected("roundup_power2_divisions:0x4", {"roundup_power2_divisions"});
}

TEST_CASE("bad input: STREAMALLOC_CONF with a negative value", "[bad_input][config]") {
  check_config_rejected("max_split_size_mb:-20", {"max_split_size_mb", "-20"});
  check_config_rejected("memory_fraction:-0.5", {"memory_fraction"});
}

TEST_CASE("bad input: STREAMALLOC_CONF with a value out of range", "[bad_input][config]") {
  check_config_rejected("memory_fraction:1.5", {"memory_fraction"});
  check_config_rejected("garbage_collection_threshold:1.0", {"garbage_collection_threshold"});
  check_config_rejected("max_split_size_mb:99999999999999999999999", {"max_split_size_mb"});
}

TEST_CASE("bad input: STREAMALLOC_CONF with a duplicated key", "[bad_input][config]") {
  check_config_rejected("max_split_size_mb:200,memory_fraction:0.5,max_split_size_mb:300",
                        {"key max_split_size_mb appears more than once"});
}

TEST_CASE("bad input: a malformed STREAMALLOC_CONF leaves a live allocator untouched", "[bad_input][config]") {
  bad_input_fixture t;
  const std::string before = t.f.alloc.config().to_string();
  REQUIRE_THROWS_AS(t.f.alloc.config().with("max_split_size_mb:oops"), config_error);
  CHECK(t.f.alloc.config().to_string() == before);
  t.live.check_untouched();
}

// --- traces for the replay tool ----------------------------------------------

TEST_CASE("bad input: a truncated gzip trace", "[bad_input][trace]") {
  temp_dir dir;
  std::string text = k_trace_header;
  for (int i = 0; i < 3000; ++i) {
    text += "alloc," + std::to_string(1'000'000 + 4096 * i) + ",4096,0\n";
  }
  const std::string whole = dir.write_gzip("whole.csv.gz", text);
  std::ifstream in(whole, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE(bytes.size() > 100);
  const std::string cut = dir.write("cut.csv.gz", bytes.substr(0, bytes.size() * 2 / 3));

  const std::string message = error_of<trace_error>([&] { load_trace(cut); });
  CAPTURE(message);
  CHECK(contains(message, cut + ":"));
  CHECK(contains(message, "truncated gzip stream"));
  // Only the gzip header survives: still an error, never a crash or a hang.
  const std::string header_only = dir.write("header_only.csv.gz", bytes.substr(0, 10));
  CHECK_FALSE(error_of<trace_error>([&] { load_trace(header_only); }).empty());
}

TEST_CASE("bad input: a trace line with bad columns", "[bad_input][trace]") {
  temp_dir dir;
  const struct {
    const char* line;
    const char* why;
  } cases[] = {
      {"alloc,4096,512\n", "too few columns"},
      {"alloc,4096,512,0,9\n", "too many columns"},
      {"alloc,0x1000g,512,0\n", "a hex address with a letter past f"},
      {"alloc,4096,-512,0\n", "a negative size"},
      {"alloc,4096,99999999999999999999999,0\n", "a size that overflows"},
      {"alloc,4096,512,\n", "an empty stream"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.why);
    const std::string path = dir.write("bad.csv", k_trace_header + "alloc,8192,512,0\n" + c.line);
    const std::string message = error_of<trace_error>([&] { load_trace(path); });
    CAPTURE(message);
    // The message names the file and the bad line (line 3).
    CHECK(contains(message, path + ":3: "));
  }
}

TEST_CASE("bad input: a trace that frees an unknown address", "[bad_input][trace]") {
  temp_dir dir;
  const std::string path =
      dir.write("unknown_free.csv", k_trace_header + "alloc,4096,512,0\nfree_completed,8192,512,0\n");
  const std::vector<trace_file_event> events = load_trace(path);
  sim_fixture f(immediate_events(1_GiB));
  live_allocations live(f.alloc, f.sim, f.s1, f.s2);
  const std::string message = error_of<trace_error>([&] { replay_trace(events, f.alloc, path); });
  CAPTURE(message);
  CHECK(contains(message, path + ":3: free_completed of address 8192, which is not live"));
  live.check_untouched();
}

// --- private pools -----------------------------------------------------------

TEST_CASE("bad input: release_pool while its capture is still underway", "[bad_input]") {
  // Found by fuzz_allocator_ops: the released pool was re-created by the
  // next captured allocation with its segment in the default pool's free
  // set. A released pool must serve nothing new.
  bad_input_fixture t;
  const stream_handle captured = t.f.s3;
  t.f.alloc.begin_allocate_to_pool(1, [captured](stream_handle s) { return s == captured; });
  t.f.alloc.release_pool(1);
  t.live.rebase();
  void* p = t.f.alloc.allocate(4_KiB, captured);
  REQUIRE(p != nullptr);
  t.f.check_consistent();
  const allocator_snapshot snap = t.f.snapshot();
  const segment_info* seg = find_segment(snap, addr(p));
  REQUIRE(seg != nullptr);
  CHECK(seg->pool == 0);
  t.f.alloc.end_allocate_to_pool(1);
  REQUIRE_THROWS_AS(t.f.alloc.release_pool(1), usage_error);
  t.f.alloc.free(p);
  t.f.check_consistent();
}
