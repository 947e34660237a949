// Tests for examine_reserved_peak (tools/peak_anatomy.hpp) and the
// streamalloc-replay --peak-anatomy option built on it: the allocation that
// set the reserved peak, and reserved memory just before it split into live
// bytes, rounding and the kinds of free memory.
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "peak_anatomy.hpp"
#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "support/catch.hpp"
#include "support/temp_dir.hpp"
#include "trace_reader.hpp"
#include "trace_replay.hpp"

namespace {

using namespace streamalloc;
constexpr std::size_t k_mib = std::size_t{1} << 20;

trace_file_event event(trace_file_action action, std::uint64_t addr, std::uint64_t size, std::uint64_t line) {
  trace_file_event e;
  e.action = action;
  e.addr = addr;
  e.size = size;
  e.line = line;
  return e;
}

trace_file_event alloc(std::uint64_t addr, std::uint64_t size, std::uint64_t line) {
  return event(trace_file_action::alloc, addr, size, line);
}

trace_file_event free_of(std::uint64_t addr, std::uint64_t size, std::uint64_t line) {
  return event(trace_file_action::free_completed, addr, size, line);
}

peak_anatomy examine(const std::vector<trace_file_event>& events, const allocator_config& config) {
  sim_config device;
  device.capacity_bytes = 80ull << 30;
  device.events_complete_immediately = true;
  sim_backend backend(device);
  return examine_reserved_peak(events, [&] { return std::make_unique<caching_allocator>(backend, config); });
}

std::size_t parts(const peak_anatomy& a) {
  return a.requested_bytes + a.rounding_bytes + a.pending_free_bytes + a.idle_chunk_bytes + a.partly_used_free_bytes +
         a.plain_free_bytes;
}

// Checks that each run just after the peak splits into its parts, that the
// runs come with the most free bytes in partly used chunks first, and
// returns their bytes in all.
std::size_t check_runs_after(const peak_anatomy& a) {
  std::size_t total = 0;
  for (std::size_t i = 0; i < a.runs_after.size(); ++i) {
    const peak_run& run = a.runs_after[i];
    INFO("run " << i);
    CHECK(run.bytes == run.bytes_in_use + run.idle_chunk_bytes + run.partly_used_free_bytes);
    if (i > 0) CHECK(a.runs_after[i - 1].partly_used_free_bytes >= run.partly_used_free_bytes);
    total += run.bytes;
  }
  return total;
}

}  // namespace

TEST_CASE("peak anatomy: plain segments, the allocation that set the peak and what was free before it",
          "[replay][peak_anatomy]") {
  allocator_config config;
  config.expandable_segments = false;
  // A 1 MiB block in a 2 MiB small segment, a 30 MiB segment of its own;
  // the small block goes, then 40 MiB needs a segment of its own: the peak.
  const std::vector<trace_file_event> events = {
      alloc(0x1000, 1 * k_mib, 2), alloc(0x200000, 30 * k_mib, 3), free_of(0x1000, 1 * k_mib, 4),
      alloc(0x4000000, 40 * k_mib, 5), free_of(0x200000, 30 * k_mib, 6), free_of(0x4000000, 40 * k_mib, 7)};
  const peak_anatomy a = examine(events, config);
  REQUIRE(a.found);
  CHECK(a.repeated);
  CHECK(a.op == 3);
  CHECK(a.line == 5);
  CHECK(a.request_bytes == 40 * k_mib);
  CHECK(a.reserved_before == 32 * k_mib);
  CHECK(a.reserved_after == 72 * k_mib);
  CHECK(a.requested_bytes == 30 * k_mib);
  CHECK(a.rounding_bytes == 0);
  CHECK(a.plain_free_bytes == 2 * k_mib);
  CHECK(a.idle_chunk_bytes == 0);
  CHECK(a.mapped_runs == 0);
  CHECK(parts(a) == a.reserved_before);
  CHECK(a.runs_after.empty());  // plain segments have no mapped runs
}

TEST_CASE("peak anatomy: expandable segments, idle chunks and free bytes beside a live block",
          "[replay][peak_anatomy]") {
  allocator_config config;  // expandable segments and stitching, the defaults
  config.stitching = false;  // the peak request grows, so what was free stays in place to be counted
  // 4 MiB then 3 MiB in one mapped run of four 2 MiB chunks, the 4 MiB
  // block freed: two idle chunks before the live block and 1 MiB free in
  // its last chunk. Then 10 MiB, which reserved memory must grow for.
  const std::vector<trace_file_event> events = {
      alloc(0x1000000, 4 * k_mib, 2), alloc(0x2000000, 3 * k_mib, 3), free_of(0x1000000, 4 * k_mib, 4),
      alloc(0x3000000, 10 * k_mib + 100, 5), free_of(0x2000000, 3 * k_mib, 6), free_of(0x3000000, 10 * k_mib + 100, 7)};
  const peak_anatomy a = examine(events, config);
  REQUIRE(a.found);
  CHECK(a.repeated);
  CHECK(a.op == 3);
  CHECK(a.request_bytes == 10 * k_mib + 100);
  CHECK(a.reserved_before == 8 * k_mib);
  CHECK(a.reserved_after > a.reserved_before);
  CHECK(a.requested_bytes == 3 * k_mib);
  CHECK(a.idle_chunk_bytes == 4 * k_mib);
  CHECK(a.partly_used_free_bytes == 1 * k_mib);
  CHECK(a.plain_free_bytes == 0);
  CHECK(a.mapped_runs == 1);
  CHECK(parts(a) == a.reserved_before);
  // The 10 MiB request extended the run (no stitching): the two live
  // blocks, the idle chunks where the 4 MiB block was, and the free part
  // of the new block's last chunk.
  REQUIRE(a.runs_after.size() == 1);
  const peak_run& run = a.runs_after.front();
  CHECK(run.bytes == a.reserved_after);
  CHECK_FALSE(run.small);
  CHECK(run.blocks_in_use == 2);
  CHECK(run.idle_chunk_bytes == 4 * k_mib);
  CHECK(run.partly_used_free_bytes > 0);
  CHECK(run.partly_used_free_bytes < 2 * k_mib);
  CHECK(check_runs_after(a) == a.reserved_after);
}

TEST_CASE("peak anatomy: a trace that reserves nothing has no peak", "[replay][peak_anatomy]") {
  const std::vector<trace_file_event> events = {alloc(0x1000, 0, 2)};
  CHECK_FALSE(examine(events, allocator_config{}).found);
}

TEST_CASE("peak anatomy: every corpus trace splits reserved memory into its parts", "[replay][peak_anatomy][slow]") {
  for (const auto& entry : std::filesystem::directory_iterator(STREAMALLOC_TEST_DATA_DIR "/traces")) {
    const std::string path = entry.path().string();
    if (path.find(".trace.csv") == std::string::npos) continue;
    INFO(path);
    std::vector<trace_file_event> events = load_trace(path);
    sim_config device;
    device.capacity_bytes = std::size_t{143771} << 20;  // an H200
    device.events_complete_immediately = true;
    sim_backend backend(device);
    remap_streams_to_sim(events, backend);
    const peak_anatomy a = examine_reserved_peak(
        events, [&] { return std::make_unique<caching_allocator>(backend, allocator_config{}); });
    REQUIRE(a.found);
    CHECK(a.repeated);
    CHECK(parts(a) == a.reserved_before);
    CHECK(a.reserved_before < a.reserved_after);
    // With the defaults every reserved byte is in a mapped run.
    CHECK(check_runs_after(a) == a.reserved_after);
    // The same peak as the measured replay.
    caching_allocator allocator(backend, allocator_config{});
    const replay_result r = replay_trace(events, allocator, path);
    CHECK(a.reserved_after == r.peak_reserved_bytes);
  }
}
