// Tests for trace replay: the shipped ResNet-50 trace through the caching
// allocator on the sim backend, replay's own error paths, and the
// streamalloc-replay tool's output, options (--all, --timeline, --version)
// and exit codes.
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "recording_start.hpp"
#include "requested_frees.hpp"
#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "support/catch.hpp"
#include "support/temp_dir.hpp"
#include "trace_reader.hpp"
#include "trace_replay.hpp"

namespace {

using namespace streamalloc;
namespace fs = std::filesystem;

const std::string k_shared_trace = STREAMALLOC_SHARED_DIR "/traces/resnet50_train.trace.csv.gz";
const std::string k_replay_bin = STREAMALLOC_REPLAY_BIN;
// An H200's memory as nvidia-smi gives it, streamalloc-replay's default.
constexpr std::size_t k_h200_bytes = std::size_t{143771} << 20;
// Figures from shared/traces/README.md (measured on the H200 that recorded it).
constexpr std::size_t k_resnet_peak_live_bytes = 3'192'592'912;
constexpr std::size_t k_resnet_native_peak_reserved_bytes = 4'106'223'616;

// An H200-like device; with virtual memory the allocator uses expandable
// segments (its default), without it one device allocation per segment.
sim_config sim_device(std::size_t capacity_bytes, bool virtual_memory = true) {
  sim_config device;
  device.capacity_bytes = capacity_bytes;
  device.events_complete_immediately = true;
  device.virtual_memory = virtual_memory;
  return device;
}

trace_file_event event(trace_file_action action, std::uint64_t addr, std::uint64_t size, std::uint64_t line,
                  std::uint64_t stream = 0) {
  trace_file_event e;
  e.action = action;
  e.addr = addr;
  e.size = size;
  e.stream = stream;
  e.line = line;
  return e;
}

// The peak of the sum of live sizes, by the trace's own alloc/free_completed
// pairing and nothing else.
std::size_t peak_live_bytes(const std::vector<trace_file_event>& events) {
  std::unordered_map<std::uint64_t, std::uint64_t> live;
  std::uint64_t current = 0;
  std::uint64_t peak = 0;
  for (const trace_file_event& e : events) {
    if (e.action == trace_file_action::alloc) {
      live[e.addr] = e.size;
      current += e.size;
      if (current > peak) peak = current;
    } else if (e.action == trace_file_action::free_completed) {
      current -= live.at(e.addr);
      live.erase(e.addr);
    }
  }
  return peak;
}

bool shared_trace_present() { return fs::exists(k_shared_trace); }

using streamalloc::test::temp_dir;

struct command_result {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

command_result run_replay(const std::string& arguments) {
  const std::string command = "'" + k_replay_bin + "' " + arguments + " 2>&1";
  command_result result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("popen failed for " + command);
  char chunk[4096];
  std::size_t got = 0;
  while ((got = std::fread(chunk, 1, sizeof chunk, pipe)) > 0) result.output.append(chunk, got);
  const int status = pclose(pipe);
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  return result;
}

bool replay_bin_present() { return fs::exists(k_replay_bin); }

std::string quote(const std::string& path) { return "'" + path + "'"; }

// The text after `"key": ` up to the next ',' or '}' (enough for numbers and
// strings without commas).
std::string json_value(const std::string& json, const std::string& key) {
  const std::string marker = "\"" + key + "\": ";
  const std::size_t at = json.find(marker);
  if (at == std::string::npos) return "<missing>";
  const std::size_t start = at + marker.size();
  const std::size_t end = json.find_first_of(",}", start);
  return json.substr(start, end - start);
}

const std::string k_small_trace =
    "action,addr,size,stream\n"
    "segment_alloc,4096,20971520,0\n"
    "alloc,4096,1000000,0\n"
    "alloc,1004096,3000000,7\n"
    "free_requested,4096,1000000,0\n"
    "free_completed,4096,1000000,0\n"
    "oom,0,0,0\n"
    "alloc,4096,2000000,0\n"
    "free_completed,1004096,3000000,7\n";

// Two 8 MiB blocks, the first freed, then 12 MiB: the reserved peak is the
// 12 MiB request, which stitching serves with the freed block's idle chunks
// and new ones.
const std::string k_stitching_trace =
    "action,addr,size,stream\n"
    "alloc,1000000000,8388608,0\n"
    "alloc,2000000000,8388608,0\n"
    "free_requested,1000000000,8388608,0\n"
    "free_completed,1000000000,8388608,0\n"
    "alloc,3000000000,12582912,0\n"
    "free_requested,3000000000,12582912,0\n"
    "free_completed,3000000000,12582912,0\n";

}  // namespace

static void check_resnet_replay(bool expandable) {
  if (!shared_trace_present()) {
    WARN("skipped: shared trace not found at " << k_shared_trace);
    return;
  }
  const std::vector<trace_file_event> events = load_trace(k_shared_trace);
  const std::size_t expected_peak = peak_live_bytes(events);
  CHECK(expected_peak == k_resnet_peak_live_bytes);

  sim_backend backend(sim_device(k_h200_bytes, expandable));
  caching_allocator allocator(backend, allocator_config{});
  const replay_result result = replay_trace(events, allocator, k_shared_trace);

  CHECK(result.events == events.size());
  CHECK(result.allocs == 11947);
  CHECK(result.frees == 11460);
  CHECK(result.ops == result.allocs + result.frees);
  CHECK(result.live_at_end == 487);
  CHECK(result.trace_peak_live_bytes == expected_peak);
  CHECK(result.peak_allocated_bytes == expected_peak);
  CHECK(result.peak_allocated_bytes == k_resnet_peak_live_bytes);
  CHECK(result.peak_reserved_bytes >= result.peak_allocated_bytes);
  // No worse than PyTorch's native allocator on the same trace (README: ratio 1.286, which rounds 1.28617).
  CHECK(result.frag_ratio >= 1.0);
  CHECK(result.peak_reserved_bytes <= k_resnet_native_peak_reserved_bytes);
  CHECK(result.frag_ratio <= result.native_frag_ratio);
  if (expandable) {
    // Issue target for this trace: reserved within 1% of the live peak.
    CHECK(result.frag_ratio <= 1.01);
    CHECK(result.chunk_maps > 0);
  } else {
    CHECK(result.chunk_maps == 0);
  }
  CHECK(result.segments > 0);
  CHECK(result.native_segments == 108);
  CHECK(result.native_peak_reserved_bytes == k_resnet_native_peak_reserved_bytes);
  const double native_ratio = static_cast<double>(k_resnet_native_peak_reserved_bytes) / k_resnet_peak_live_bytes;
  CHECK(std::abs(result.native_frag_ratio - native_ratio) < 1e-12);
  CHECK(result.ns_per_op > 0.0);

  // Replay leaves nothing allocated, and the allocator's books still balance.
  REQUIRE_NOTHROW(allocator.validate());
  const device_stats after = allocator.stats();
  CHECK(after.allocated_bytes[static_cast<int>(stat_type::all)].current == 0);
  CHECK(after.requested_bytes[static_cast<int>(stat_type::all)].current == 0);
}

TEST_CASE("replaying the ResNet-50 trace with plain segments matches its peak live bytes", "[replay]") {
  check_resnet_replay(false);
}

TEST_CASE("replaying the ResNet-50 trace with expandable segments stays within 1% of it", "[replay]") {
  check_resnet_replay(true);
}

// The traces captured on the H200 (tests/data/traces/README.md), replayed
// with the default settings: peak reserved / peak live bytes, and how often
// stitching had to synchronize a stream.
static replay_result replay_captured(const std::string& name, const allocator_config& config = allocator_config{}) {
  const std::string path = STREAMALLOC_TEST_DATA_DIR "/traces/" + name;
  std::vector<trace_file_event> events = load_trace(path);
  sim_backend backend(sim_device(k_h200_bytes));
  remap_streams_to_sim(events, backend);
  caching_allocator allocator(backend, config);
  replay_result result = replay_trace(events, allocator, path);
  REQUIRE_NOTHROW(allocator.validate());
  CHECK(result.peak_allocated_bytes == result.trace_peak_live_bytes);
  return result;
}

TEST_CASE("captured traces stay within 2% of their live peak", "[replay]") {
  for (const char* name :
       {"gpt2_train_varlen.trace.csv.gz", "gpt2_generate.trace.csv.gz", "resnet50_fixed_batch.trace.csv.gz"}) {
    INFO(name);
    const replay_result result = replay_captured(name);
    CHECK(result.frag_ratio <= 1.02);
    CHECK(result.frag_ratio < result.native_frag_ratio);
  }
}

TEST_CASE("a fixed-batch training loop stops stitching once it repeats itself", "[replay]") {
  const replay_result result = replay_captured("resnet50_fixed_batch.trace.csv.gz");
  // 25 identical steps: with the small pool taking requests up to 1 MiB and
  // no repeat budget this trace stitched 176 times (about 7 per step, each a
  // stream synchronization), with the budget 32. With mid-size requests in
  // the large pool it stitches twice.
  CHECK(result.stitched_blocks > 0);
  CHECK(result.stitched_blocks <= 8);
  CHECK(result.stitch_syncs <= 8);
}

TEST_CASE("a training loop whose stitches undo each other grows instead after two rounds", "[replay]") {
  // Note [stitch cycles]: with the small pool taking requests up to 1 MiB
  // (the plain-segment limit), the same 25 steps stitch the same requests
  // at the same levels every step: without a bound 176 stitches (7 a
  // step), ratio 1.0267. Each stitch may come back once; the next time the
  // loop grows.
  allocator_config config;
  config.small_request_bytes = allocator_config::k_plain_small_request_bytes;
  const replay_result result = replay_captured("resnet50_fixed_batch.trace.csv.gz", config);
  CHECK(result.stitched_blocks > 0);
  CHECK(result.stitched_blocks <= 40);
  CHECK(result.frag_ratio <= 1.025);
}

TEST_CASE("replay maps trace addresses to allocator pointers across streams", "[replay]") {
  std::vector<trace_file_event> events = {
      event(trace_file_action::segment_alloc, 4096, 20971520, 2),
      event(trace_file_action::alloc, 4096, 1000000, 3),
      event(trace_file_action::alloc, 1004096, 3000000, 4, 7),
      event(trace_file_action::free_requested, 4096, 1000000, 5),
      event(trace_file_action::free_completed, 4096, 1000000, 6),
      event(trace_file_action::other, 0, 0, 7),
      event(trace_file_action::alloc, 4096, 2000000, 8),  // the address is reused after its free
      event(trace_file_action::alloc, 9999, 0, 9),        // size 0: nullptr, nothing to free
      event(trace_file_action::free_completed, 9999, 0, 10),
      event(trace_file_action::free_completed, 1004096, 3000000, 11, 7),
  };
  sim_backend backend(sim_device(1_GiB));
  caching_allocator allocator(backend, allocator_config{});
  const replay_result result = replay_trace(events, allocator, "synthetic");
  CHECK(result.events == events.size());
  CHECK(result.allocs == 4);
  CHECK(result.frees == 2);
  CHECK(result.ops == 6);
  CHECK(result.live_at_end == 1);
  CHECK(result.trace_peak_live_bytes == 5000000);
  CHECK(result.peak_allocated_bytes == 5000000);
  CHECK(result.peak_reserved_bytes >= 5000000);
  CHECK(result.native_segments == 1);
  CHECK(result.native_peak_reserved_bytes == 20971520);
  REQUIRE_NOTHROW(allocator.validate());
  CHECK(allocator.stats().allocated_bytes[static_cast<int>(stat_type::all)].current == 0);
}

TEST_CASE("trace streams become the simulated device's streams, so blocks move between them", "[replay]") {
  // Stream values as a recorded program has them: CUDA stream pointers the
  // simulated device never made. A block freed on one is reused by the
  // other through an event, not a second segment.
  std::vector<trace_file_event> events = {
      event(trace_file_action::alloc, 4096, 64u << 20, 2, 0x5581'0000'1000),
      event(trace_file_action::free_completed, 4096, 64u << 20, 3, 0x5581'0000'1000),
      event(trace_file_action::alloc, 4096, 64u << 20, 4, 0x5581'0000'2000),
      event(trace_file_action::free_completed, 4096, 64u << 20, 5, 0x5581'0000'2000),
      event(trace_file_action::alloc, 8192, 1024, 6),
  };
  sim_backend backend(sim_device(1_GiB));
  remap_streams_to_sim(events, backend);
  CHECK(events[0].stream == events[1].stream);
  CHECK(events[2].stream != events[0].stream);
  CHECK(events[2].stream != 0);
  CHECK(events[4].stream == 0);
  caching_allocator allocator(backend, allocator_config{});
  const replay_result result = replay_trace(events, allocator, "two streams");
  CHECK(result.cross_stream_reuses == 1);
  CHECK(result.peak_reserved_bytes < 2 * (64u << 20));
  REQUIRE_NOTHROW(allocator.validate());
}

TEST_CASE("replay rejects inconsistent traces before touching the allocator", "[replay]") {
  sim_backend backend(sim_device(1_GiB));
  caching_allocator allocator(backend, allocator_config{});

  SECTION("alloc at a live address") {
    const std::vector<trace_file_event> events = {
        event(trace_file_action::alloc, 4096, 512, 2),
        event(trace_file_action::alloc, 4096, 512, 3),
    };
    REQUIRE_THROWS_WITH(replay_trace(events, allocator, "t.csv"),
                        "t.csv:3: alloc at address 4096, which is already live");
  }
  SECTION("free_completed of an unknown address") {
    const std::vector<trace_file_event> events = {
        event(trace_file_action::alloc, 4096, 512, 2),
        event(trace_file_action::free_completed, 8192, 512, 5),
    };
    REQUIRE_THROWS_WITH(replay_trace(events, allocator, "t.csv"),
                        "t.csv:5: free_completed of address 8192, which is not live");
  }
  SECTION("free_completed twice") {
    const std::vector<trace_file_event> events = {
        event(trace_file_action::alloc, 4096, 512, 2),
        event(trace_file_action::free_completed, 4096, 512, 3),
        event(trace_file_action::free_completed, 4096, 512, 4),
    };
    REQUIRE_THROWS_AS(replay_trace(events, allocator, "t.csv"), trace_error);
  }
  CHECK(allocator.stats().num_device_alloc == 0);
  CHECK(allocator.stats().allocation[static_cast<int>(stat_type::all)].allocated == 0);
}

TEST_CASE("a trace recorded mid-run replays the blocks it frees unallocated as allocated first", "[replay]") {
  // Recording began while 4096 (1 MB, stream 7) and 8192 (2 MB) were live,
  // in a segment of 20 MiB that is freed once they are.
  std::vector<trace_file_event> events = {
      event(trace_file_action::alloc, 65536, 3000000, 2),
      event(trace_file_action::free_requested, 4096, 1000000, 3, 7),
      event(trace_file_action::free_completed, 4096, 1000000, 4, 7),
      event(trace_file_action::alloc, 4096, 512, 5),  // the address again, now a block of the trace
      event(trace_file_action::free_completed, 8192, 2000000, 6),
      event(trace_file_action::segment_free, 0, 20971520, 7),
      event(trace_file_action::free_completed, 4096, 512, 8),
      event(trace_file_action::segment_alloc, 1_GiB, 4194304, 9),
  };
  const allocations_before_recording added = add_allocations_before_recording(&events);
  CHECK(added.blocks == 2);
  CHECK(added.bytes == 3000000);
  REQUIRE(events.size() == 10);
  CHECK(events[0].action == trace_file_action::alloc);
  CHECK(events[0].before_recording);
  CHECK(events[0].addr == 4096);
  CHECK(events[0].stream == 7);
  CHECK(events[0].line == 4);  // the free that shows it
  CHECK(events[1].addr == 8192);
  CHECK(events[1].size == 2000000);
  CHECK_FALSE(events[2].before_recording);
  CHECK(add_allocations_before_recording(&events).blocks == 0);  // nothing is added twice

  sim_backend backend(sim_device(1_GiB));
  caching_allocator allocator(backend, allocator_config{});
  const replay_result result = replay_trace(events, allocator, "mid-run");
  CHECK(result.allocs == 4);
  CHECK(result.allocs_before_recording == 2);
  CHECK(result.bytes_before_recording == 3000000);
  CHECK(result.frees == 3);
  CHECK(result.live_at_end == 1);
  CHECK(result.trace_peak_live_bytes == 6000000);
  CHECK(result.peak_allocated_bytes == 6000000);
  // When its 20 MiB segment went, native still held 3,000,512 live bytes:
  // it reserved at least that much more than 20 MiB before recording began.
  CHECK(result.native_reserved_before_recording_bytes == 20971520 + 3000512);
  CHECK(result.native_peak_reserved_bytes == 20971520 + 3000512);
  REQUIRE_NOTHROW(allocator.validate());

  SECTION("a free of an address the trace already freed is still rejected") {
    std::vector<trace_file_event> twice = {
        event(trace_file_action::free_completed, 4096, 512, 2),
        event(trace_file_action::free_completed, 4096, 512, 3),
    };
    CHECK(add_allocations_before_recording(&twice).blocks == 1);
    caching_allocator fresh(backend, allocator_config{});
    REQUIRE_THROWS_WITH(replay_trace(twice, fresh, "t.csv"), "t.csv:3: free_completed of address 4096, which is not live");
  }
}

TEST_CASE("a trace without free_completed frees its blocks at their requests", "[replay]") {
  std::vector<trace_file_event> only_requests = {
      event(trace_file_action::alloc, 4096, 1000000, 2),
      event(trace_file_action::free_requested, 4096, 1000000, 3),
      event(trace_file_action::alloc, 8192, 1000000, 4),
      event(trace_file_action::free_requested, 8192, 1000000, 5),
      event(trace_file_action::alloc, 4096, 512, 6),
  };
  CHECK(free_at_requests_without_completions(&only_requests) == 2);
  CHECK(only_requests[1].action == trace_file_action::free_completed);
  CHECK(only_requests[3].action == trace_file_action::free_completed);
  CHECK(only_requests[4].action == trace_file_action::alloc);
  sim_backend backend(sim_device(1_GiB));
  caching_allocator allocator(backend, allocator_config{});
  const replay_result result = replay_trace(only_requests, allocator, "requests");
  CHECK(result.frees == 2);
  CHECK(result.trace_peak_live_bytes == 1000000);

  // One free_completed anywhere: the requests stay requests (their blocks
  // may wait for other streams).
  std::vector<trace_file_event> mixed = {
      event(trace_file_action::alloc, 4096, 512, 2),
      event(trace_file_action::free_requested, 4096, 512, 3),
      event(trace_file_action::alloc, 8192, 512, 4),
      event(trace_file_action::free_requested, 8192, 512, 5),
      event(trace_file_action::free_completed, 8192, 512, 6),
  };
  const std::vector<trace_file_event> before = mixed;
  CHECK(free_at_requests_without_completions(&mixed) == 0);
  for (std::size_t i = 0; i < mixed.size(); ++i) CHECK(mixed[i].action == before[i].action);
  std::vector<trace_file_event> no_frees = {event(trace_file_action::alloc, 4096, 512, 2)};
  CHECK(free_at_requests_without_completions(&no_frees) == 0);
}

TEST_CASE("a trace recorded from the start gives native no memory from before it", "[replay]") {
  const std::vector<trace_file_event> events = {
      event(trace_file_action::segment_alloc, 4096, 20971520, 2),
      event(trace_file_action::alloc, 4096, 1000000, 3),
      event(trace_file_action::free_completed, 4096, 1000000, 4),
      event(trace_file_action::segment_free, 4096, 20971520, 5),
  };
  sim_backend backend(sim_device(1_GiB));
  caching_allocator allocator(backend, allocator_config{});
  const replay_result result = replay_trace(events, allocator, "from the start");
  CHECK(result.allocs_before_recording == 0);
  CHECK(result.native_reserved_before_recording_bytes == 0);
  CHECK(result.native_peak_reserved_bytes == 20971520);
}

TEST_CASE("replay reports running out of memory with the trace line", "[replay]") {
  sim_backend backend(sim_device(64_MiB));
  caching_allocator allocator(backend, allocator_config{});
  const std::vector<trace_file_event> events = {
      event(trace_file_action::alloc, 4096, 1_MiB, 2),
      event(trace_file_action::alloc, 1_GiB, 1_GiB, 3),
  };
  try {
    replay_trace(events, allocator, "t.csv");
    FAIL("replay of 1 GiB on a 64 MiB device did not throw");
  } catch (const replay_out_of_memory& e) {
    CHECK(e.line() == 3);
    CHECK(e.context().requested_bytes == 1_GiB);
    CHECK(std::string(e.what()).rfind("t.csv:3: out of memory replaying an alloc of 1073741824 bytes: ", 0) == 0);
  }
  // The allocation made before the failure was given back.
  CHECK(allocator.stats().allocated_bytes[static_cast<int>(stat_type::all)].current == 0);
  REQUIRE_NOTHROW(allocator.validate());
}

TEST_CASE("streamalloc-replay --json reports the ResNet-50 trace", "[replay][tool]") {
  if (!replay_bin_present()) FAIL("streamalloc-replay not built at " << k_replay_bin);
  if (!shared_trace_present()) {
    WARN("skipped: shared trace not found at " << k_shared_trace);
    return;
  }
  const command_result run = run_replay("--json " + quote(k_shared_trace));
  INFO(run.output);
  REQUIRE(run.exit_code == 0);
  for (const char* key : {"trace", "backend", "capacity_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                          "frag_ratio", "ops", "ns_per_op", "segments", "native_peak_reserved_bytes",
                          "native_frag_ratio", "cross_stream_reuses"}) {
    INFO(key);
    CHECK(json_value(run.output, key) != "<missing>");
  }
  CHECK(json_value(run.output, "peak_allocated_bytes") == std::to_string(k_resnet_peak_live_bytes));
  CHECK(json_value(run.output, "native_peak_reserved_bytes") == std::to_string(k_resnet_native_peak_reserved_bytes));
  CHECK(json_value(run.output, "ops") == "23407");
  CHECK(json_value(run.output, "capacity_bytes") == std::to_string(k_h200_bytes));
  CHECK(json_value(run.output, "trace") == "\"" + k_shared_trace + "\"");
  CHECK(json_value(run.output, "native_frag_ratio") == "1.286172");
  CHECK(std::stoull(json_value(run.output, "peak_reserved_bytes")) <= k_resnet_native_peak_reserved_bytes);
}

TEST_CASE("streamalloc-replay options and exit codes", "[replay][tool]") {
  if (!replay_bin_present()) FAIL("streamalloc-replay not built at " << k_replay_bin);
  temp_dir dir;
  const std::string trace = quote(dir.write("small.csv", k_small_trace));

  SECTION("table output") {
    const command_result run = run_replay(trace);
    INFO(run.output);
    CHECK(run.exit_code == 0);
    CHECK(run.output.find("peak reserved") != std::string::npos);
    CHECK(run.output.find("ns/op") != std::string::npos);
  }
  SECTION("capacity suffixes") {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"80GiB", "85899345920"}, {"141G", "141000000000"}, {"512M", "512000000"},
        {"512mib", "536870912"},  {"3000000000", "3000000000"}, {"1TB", "1000000000000"},
    };
    for (const auto& [text, bytes] : cases) {
      const command_result run = run_replay("--json --capacity " + text + " " + trace);
      INFO(text << ": " << run.output);
      CHECK(run.exit_code == 0);
      CHECK(json_value(run.output, "capacity_bytes") == bytes);
    }
    const command_result equals_form = run_replay("--json --capacity=2G " + trace);
    CHECK(json_value(equals_form.output, "capacity_bytes") == "2000000000");
  }
  SECTION("the default device holds what a program held on an H200") {
    // 136 GiB live at once: more than "141G" (131.3 GiB), less than the
    // 140.4 GiB an H200 has.
    const std::string big = quote(dir.write("big.csv", "action,addr,size,stream\nalloc,4096,146028888064,0\n"
                                                       "alloc,8192,1048576,0\nfree_completed,4096,146028888064,0\n"
                                                       "free_completed,8192,1048576,0\n"));
    const command_result run = run_replay("--json " + big);
    INFO(run.output);
    CHECK(run.exit_code == 0);
    CHECK(json_value(run.output, "peak_allocated_bytes") == "146029936640");
    const command_result smaller = run_replay("--json --capacity 141G " + big);
    CHECK(smaller.exit_code == 1);
    CHECK(smaller.output.find("out of memory") != std::string::npos);
  }
  SECTION("--granularity sets the simulated device's, which vmm_chunk_mb must fit") {
    // 3 MiB live: two 2 MiB chunks by default, three 1 MiB ones at 1 MiB.
    const std::string three = quote(dir.write("three.csv", "action,addr,size,stream\nalloc,4096,3145728,0\n"
                                                           "free_completed,4096,3145728,0\n"));
    const command_result plain = run_replay("--json " + three);
    INFO(plain.output);
    CHECK(plain.exit_code == 0);
    CHECK(json_value(plain.output, "granularity_bytes") == "2097152");
    CHECK(json_value(plain.output, "peak_reserved_bytes") == "4194304");
    const command_result finer = run_replay("--json --granularity 1MiB --conf vmm_chunk_mb:1 " + three);
    INFO(finer.output);
    CHECK(finer.exit_code == 0);
    CHECK(json_value(finer.output, "granularity_bytes") == "1048576");
    CHECK(json_value(finer.output, "peak_reserved_bytes") == "3145728");
    const command_result coarser = run_replay("--granularity 4MiB " + three);
    INFO(coarser.output);
    CHECK(coarser.exit_code == 1);
    CHECK(coarser.output.find("must be a multiple of device 0's virtual-memory granularity") != std::string::npos);
  }
  SECTION("--conf applies allocator settings") {
    const command_result run = run_replay("--json --conf max_split_size_mb:64 " + trace);
    INFO(run.output);
    CHECK(run.exit_code == 0);
    CHECK(run.output.find("max_split_size_mb:64") != std::string::npos);
  }
  SECTION("usage errors exit 2") {
    for (const std::string& arguments :
         {std::string(""), "--bogus " + trace, "--capacity 12X " + trace, "--capacity 0 " + trace,
          "--capacity " + trace, "--backend tpu " + trace, "--conf no_such_key:1 " + trace, trace + " " + trace,
          "--json=yes " + trace, "--granularity 3M " + trace, "--granularity 0 " + trace}) {
      const command_result run = run_replay(arguments);
      INFO("arguments: " << arguments << "\n" << run.output);
      CHECK(run.exit_code == 2);
      CHECK(run.output.rfind("streamalloc-replay: ", 0) == 0);
    }
  }
  SECTION("--backend cuda replays on a GPU or fails clearly without one") {
    const command_result run = run_replay("--backend cuda " + trace);
    INFO(run.output);
    if (run.exit_code == 0) {
      CHECK(run.output.find("cuda") != std::string::npos);
    } else {
      // 2: this build has no CUDA backend; 1: it has one but no usable GPU.
      CHECK((run.exit_code == 1 || run.exit_code == 2));
      CHECK(run.output.find("--backend cuda") != std::string::npos);
    }
  }
  SECTION("trace errors exit 1 naming the line") {
    const std::string bad = dir.write("bad.csv", "action,addr,size,stream\nalloc,1,2,0\nalloc,1,2\n");
    const command_result run = run_replay(quote(bad));
    INFO(run.output);
    CHECK(run.exit_code == 1);
    CHECK(run.output.find(bad + ":3: expected 4 columns") != std::string::npos);

    const command_result missing = run_replay(quote(bad + ".missing"));
    CHECK(missing.exit_code == 1);
    CHECK(missing.output.find("cannot open") != std::string::npos);
  }
  SECTION("out of memory exits 1") {
    const command_result run = run_replay("--capacity 500K " + trace);
    INFO(run.output);
    CHECK(run.exit_code == 1);
    CHECK(run.output.find(":3: out of memory") != std::string::npos);
  }
  SECTION("--help") {
    const command_result run = run_replay("--help");
    CHECK(run.exit_code == 0);
    CHECK(run.output.rfind("usage: streamalloc-replay", 0) == 0);
  }
}

TEST_CASE("replay refuses a trace with nothing to measure", "[replay]") {
  sim_backend backend(sim_device(1_GiB));
  caching_allocator allocator(backend, allocator_config{});
  SECTION("no events after the header") {
    REQUIRE_THROWS_WITH(replay_trace({}, allocator, "t.csv"), "t.csv: no events after the header: nothing to replay");
  }
  SECTION("only segment events and allocations of 0 bytes") {
    const std::vector<trace_file_event> events = {
        event(trace_file_action::segment_alloc, 4096, 2097152, 2),
        event(trace_file_action::alloc, 4096, 0, 3),
        event(trace_file_action::free_completed, 4096, 0, 4),
    };
    REQUIRE_THROWS_WITH(replay_trace(events, allocator, "t.csv"),
                        "t.csv: no alloc event of more than 0 bytes in 3 events: nothing to measure");
  }
  CHECK(allocator.stats().num_device_alloc == 0);
}

TEST_CASE("streamalloc-replay says what each column and figure is", "[replay][tool]") {
  if (!replay_bin_present()) FAIL("streamalloc-replay not built at " << k_replay_bin);
  temp_dir dir;
  const std::string trace = quote(dir.write("small.csv", k_small_trace));

  SECTION("expandable segments: the simulated device's 2 MiB chunks") {
    const command_result run = run_replay(trace);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    CHECK(run.output.find("streamalloc (simulated device)") != std::string::npos);
    CHECK(run.output.find("PyTorch native, recorded") != std::string::npos);
    CHECK(run.output.find("1.0 is the floor") != std::string::npos);
    CHECK(run.output.find("chunks of 2 MiB") != std::string::npos);
    CHECK(run.output.find("2 MiB physical chunks it created") != std::string::npos);
    CHECK(run.output.find("1 segments") != std::string::npos);  // the trace's one segment_alloc
    CHECK(run.output.find("segment_alloc events (one cudaMalloc each)") != std::string::npos);
  }
  SECTION("plain segments and native's mapped runs") {
    const std::string mapped = quote(dir.write(
        "mapped.csv", "action,addr,size,stream\nsegment_map,4096,4194304,0\nalloc,4096,1000,0\n"
                      "free_completed,4096,1000,0\nsegment_map,4198400,2097152,0\n"));
    const command_result run = run_replay("--conf expandable_segments:False " + mapped);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    CHECK(run.output.find("1 segments ") != std::string::npos);
    CHECK(run.output.find("2 mapped runs") != std::string::npos);
    CHECK(run.output.find("one device allocation") != std::string::npos);
    CHECK(run.output.find("segment_map events") != std::string::npos);
  }
  SECTION("a trace without segment events") {
    const std::string bare =
        quote(dir.write("bare.csv", "action,addr,size,stream\nalloc,4096,1000,0\nfree_completed,4096,1000,0\n"));
    const command_result run = run_replay(bare);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    CHECK(run.output.find("not in trace") != std::string::npos);
    CHECK(run.output.find("native's figures are unknown") != std::string::npos);
    const command_result json = run_replay("--json " + bare);
    CHECK(json_value(json.output, "native_frag_ratio") == "null");
  }
}

TEST_CASE("streamalloc-replay --version prints the project version", "[replay][tool]") {
  if (!replay_bin_present()) FAIL("streamalloc-replay not built at " << k_replay_bin);
  const command_result run = run_replay("--version");
  CHECK(run.exit_code == 0);
  CHECK(run.output == std::string("streamalloc-replay ") + STREAMALLOC_VERSION + "\n");
  temp_dir dir;
  const std::string trace = quote(dir.write("small.csv", k_small_trace));
  CHECK(json_value(run_replay("--json " + trace).output, "version") == std::string("\"") + STREAMALLOC_VERSION + "\"");
  CHECK(run_replay("--version=1").exit_code == 2);
}

TEST_CASE("streamalloc-replay --timeline fails before replaying when the file cannot be written", "[replay][tool]") {
  if (!replay_bin_present()) FAIL("streamalloc-replay not built at " << k_replay_bin);
  temp_dir dir;
  const std::string trace = quote(dir.write("small.csv", k_small_trace));

  SECTION("a folder that does not exist") {
    const std::string target = (dir.path() / "no_such_dir" / "timeline.csv").string();
    const command_result run = run_replay("--timeline " + quote(target) + " " + trace);
    INFO(run.output);
    CHECK(run.exit_code == 1);
    CHECK(run.output == "streamalloc-replay: --timeline " + target +
                            ": cannot open for writing: No such file or directory\n");
  }
  SECTION("a folder in place of the file") {
    const command_result run = run_replay("--timeline " + quote(dir.path().string()) + " " + trace);
    INFO(run.output);
    CHECK(run.exit_code == 1);
    CHECK(run.output.find("Is a directory") != std::string::npos);
    CHECK(run.output.find("peak reserved") == std::string::npos);  // nothing was replayed
  }
  SECTION("a writable file gets the timeline") {
    const std::string target = (dir.path() / "timeline.csv").string();
    const command_result run = run_replay("--timeline " + quote(target) + " " + trace);
    INFO(run.output);
    CHECK(run.exit_code == 0);
    const std::string written = temp_dir::read_bytes(target);
    CHECK(written.rfind("op,allocated_bytes,reserved_bytes\n0,1000000,", 0) == 0);
    // 3 allocs and 2 frees: a header and five rows.
    CHECK(std::count(written.begin(), written.end(), '\n') == 6);
  }
  SECTION("a replay that fails leaves no timeline behind, and no file it did not create is removed") {
    const std::string target = (dir.path() / "timeline.csv").string();
    const command_result run = run_replay("--capacity 500K --timeline " + quote(target) + " " + trace);
    INFO(run.output);
    CHECK(run.exit_code == 1);
    CHECK_FALSE(fs::exists(target));

    const std::string existing = dir.write("existing.csv", "old content\n");
    const command_result again = run_replay("--capacity 500K --timeline " + quote(existing) + " " + trace);
    CHECK(again.exit_code == 1);
    CHECK(fs::exists(existing));
  }
  SECTION("a write that fails is reported with the system's reason") {
    if (!fs::exists("/dev/full")) {
      WARN("skipped: no /dev/full on this system");
      return;
    }
    const command_result run = run_replay("--timeline /dev/full " + trace);
    INFO(run.output);
    CHECK(run.exit_code == 1);
    CHECK(run.output.find("streamalloc-replay: --timeline /dev/full: error writing: No space left on device") !=
          std::string::npos);
    CHECK(fs::exists("/dev/full"));
  }
}

TEST_CASE("streamalloc-replay skips unknown actions with a warning and rejects empty traces", "[replay][tool]") {
  if (!replay_bin_present()) FAIL("streamalloc-replay not built at " << k_replay_bin);
  temp_dir dir;
  SECTION("an action the format does not name") {
    const std::string odd = dir.write("unknown.csv", "action,addr,size,stream\nalloc,4096,512,0\n"
                                                     "segment_resize,4096,512,0\nfree_completed,4096,512,0\n"
                                                     "segment_resize,,,\n");
    const command_result run = run_replay(quote(odd));
    INFO(run.output);
    CHECK(run.exit_code == 0);
    CHECK(run.output.find("streamalloc-replay: warning: " + odd +
                          ": skipped 2 lines of actions the trace format does not name: segment_resize (2, first "
                          "on line 3)") != std::string::npos);
    CHECK(run.output.find("4 events: 1 allocs, 1 frees") != std::string::npos);
    CHECK(run.output.find("skipped   2 lines of actions the trace format does not name (segment_resize)") !=
          std::string::npos);
    const command_result json = run_replay("--json " + quote(odd));
    CHECK(json.exit_code == 0);
    CHECK(json.output.find("\"skipped_actions\": {\"segment_resize\": 2}") != std::string::npos);
  }
  SECTION("columns in another order, and one more") {
    const std::string path = dir.write("columns.csv", "stream,action,size,addr,time_us\n0,alloc,1048576,4096,1\n"
                                                      "0,free_completed,1048576,4096,2\n");
    const command_result run = run_replay("--json " + quote(path));
    INFO(run.output);
    CHECK(run.exit_code == 0);
    CHECK(json_value(run.output, "trace_peak_live_bytes") == "1048576");
    CHECK(run.output.find("\"skipped_actions\": {}") != std::string::npos);
  }
  SECTION("oom and snapshot are known and not replayed") {
    const std::string ok = dir.write("known.csv", "action,addr,size,stream\nalloc,4096,512,0\noom,0,0,0\n"
                                                  "snapshot,0,0,0\nfree_completed,4096,512,0\n");
    const command_result run = run_replay("--json " + quote(ok));
    INFO(run.output);
    CHECK(run.exit_code == 0);
    CHECK(json_value(run.output, "events") == "4");
    CHECK(json_value(run.output, "ops") == "2");
  }
  SECTION("a header and nothing else") {
    const std::string header_only = dir.write("header_only.csv", "action,addr,size,stream\n");
    for (const std::string& path : {header_only, dir.write_gzip("header_only.csv.gz", "action,addr,size,stream\n")}) {
      const command_result run = run_replay(quote(path));
      INFO(run.output);
      CHECK(run.exit_code == 1);
      CHECK(run.output == "streamalloc-replay: " + path + ": no events after the header: nothing to replay\n");
      CHECK(run.output.find("0.0000") == std::string::npos);
    }
  }
  SECTION("an empty file") {
    const std::string empty = dir.write("empty.csv", "");
    const command_result run = run_replay(quote(empty));
    INFO(run.output);
    CHECK(run.exit_code == 1);
    CHECK(run.output.find(empty + ":1: empty trace") != std::string::npos);
  }
  SECTION("a trace recorded mid-run") {
    const std::string mid_run = dir.write("mid_run.csv", "action,addr,size,stream\nalloc,8192,2097152,0\n"
                                                         "free_completed,4096,1048576,0\nfree_completed,8192,2097152,0\n");
    const command_result run = run_replay(quote(mid_run));
    INFO(run.output);
    CHECK(run.exit_code == 0);
    CHECK(run.output.find("recorded mid-run: 1 block (1.00 MiB) freed without an alloc in the trace") !=
          std::string::npos);
    const command_result json = run_replay("--json " + quote(mid_run));
    CHECK(json_value(json.output, "allocs_before_recording") == "1");
    CHECK(json_value(json.output, "peak_allocated_bytes") == "3145728");
    // On a GPU (gpu-check's unit step) the CUDA backend replays it the same way.
    const command_result gpu = run_replay("--json --backend cuda " + quote(mid_run));
    if (gpu.exit_code == 0) {
      CHECK(json_value(gpu.output, "allocs_before_recording") == "1");
      CHECK(json_value(gpu.output, "peak_allocated_bytes") == "3145728");
    } else {
      CHECK((gpu.exit_code == 1 || gpu.exit_code == 2));  // no CUDA backend, or no usable GPU
    }
    // The block from before recording set the reserved peak; the anatomy says so.
    const std::string early_peak = dir.write("early_peak.csv", "action,addr,size,stream\nfree_completed,4096,50000000,0\n"
                                                               "alloc,8192,1000,0\n");
    const command_result anatomy = run_replay("--peak-anatomy " + quote(early_peak));
    INFO(anatomy.output);
    CHECK(anatomy.output.find("allocate/free call 0 (made before recording began, freed at trace line 2)") !=
          std::string::npos);
    CHECK(json_value(run_replay("--json --peak-anatomy " + quote(early_peak)).output, "before_recording") == "true");
  }
  SECTION("frees recorded only as requests, in hexadecimal") {
    const std::string requests = dir.write("requests.csv", "action,addr,size,stream\nalloc,0x1000,2097152,0x7f00\n"
                                                           "free_requested,0x1000,2097152,0x7f00\n"
                                                           "alloc,0x2000,2097152,0x7f00\n");
    const command_result run = run_replay(quote(requests));
    INFO(run.output);
    CHECK(run.exit_code == 0);
    CHECK(run.output.find("streamalloc-replay: warning: " + requests +
                          ": no free_completed line; 1 free_requested replayed as frees") != std::string::npos);
    CHECK(run.output.find("frees     at free_requested (the trace has no free_completed line): 1") !=
          std::string::npos);
    const command_result json = run_replay("--json " + quote(requests));
    CHECK(json_value(json.output, "frees_at_requests") == "1");
    CHECK(json_value(json.output, "peak_allocated_bytes") == "2097152");
    // With both kinds of free, a request is not a free: 8192 stays live.
    const std::string both = dir.write("both.csv", "action,addr,size,stream\nalloc,4096,512,0\n"
                                                   "free_requested,4096,512,0\nfree_completed,4096,512,0\n"
                                                   "alloc,8192,512,0\nfree_requested,8192,512,0\n");
    const command_result both_json = run_replay("--json " + quote(both));
    CHECK(json_value(both_json.output, "frees_at_requests") == "0");
    CHECK(json_value(both_json.output, "live_at_end") == "1");
  }
  SECTION("segment events only") {
    const std::string segments = dir.write("segments.csv", "action,addr,size,stream\nsegment_alloc,4096,2097152,0\n");
    const command_result run = run_replay("--json " + quote(segments));
    INFO(run.output);
    CHECK(run.exit_code == 1);
    CHECK(run.output.find("no alloc event of more than 0 bytes") != std::string::npos);
  }
}

TEST_CASE("streamalloc-replay --all replays every trace in a folder", "[replay][tool]") {
  if (!replay_bin_present()) FAIL("streamalloc-replay not built at " << k_replay_bin);
  temp_dir dir;
  const std::string bare = "action,addr,size,stream\nalloc,4096,3000000,0\nfree_completed,4096,3000000,0\n";
  dir.write("b_small.trace.csv", k_small_trace);
  dir.write_gzip("a_bare.trace.csv.gz", bare);
  dir.write("notes.txt", "not a trace");
  dir.write("other.csv", "not a trace either");
  fs::create_directory(dir.path() / "nested.trace.csv");
  const std::string folder = quote(dir.path().string());

  SECTION("one table, median and worst") {
    const command_result run = run_replay("--all " + folder);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    CHECK(run.output.find(": 2 traces") != std::string::npos);
    const std::size_t a = run.output.find("\na_bare ");
    const std::size_t b = run.output.find("\nb_small ");
    CHECK(a != std::string::npos);
    CHECK(b != std::string::npos);
    CHECK(a < b);  // sorted by name
    CHECK(run.output.find("notes") == std::string::npos);
    // A CSV file under another name is looked at, and left out when its
    // header is not a trace's, with a warning.
    CHECK(run.output.find("\nother ") == std::string::npos);
    CHECK(run.output.find("streamalloc-replay: warning: --all " + dir.path().string() +
                          ": not replayed, not a trace: " + (dir.path() / "other.csv").string() +
                          ":1: expected header") != std::string::npos);
    CHECK(run.output.find("nested") == std::string::npos);
    CHECK(run.output.find("median ratio ") != std::string::npos);
    CHECK(run.output.find("(native ") != std::string::npos);  // one trace has native figures
    CHECK(run.output.find("worst ") != std::string::npos);
    CHECK(run.output.find("1.0 is the floor") != std::string::npos);
  }
  SECTION("JSON: one object per trace and the summary") {
    const command_result run = run_replay("--json --all " + folder);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    CHECK(json_value(run.output, "replayed") == "2");
    CHECK(json_value(run.output, "failed") == "0");
    CHECK(json_value(run.output, "median_frag_ratio") != "<missing>");
    CHECK(json_value(run.output, "median_frag_ratio") != "null");
    CHECK(json_value(run.output, "worst_trace").front() == '"');
    CHECK(run.output.find("\"name\": \"a_bare\"") != std::string::npos);
    CHECK(run.output.find("\"name\": \"b_small\"") != std::string::npos);
  }
  SECTION("a trace in a file named *.csv or *.csv.gz is replayed too") {
    dir.write_gzip("c_plain.csv.gz", bare);
    dir.write("d_plain.csv", k_small_trace);
    const command_result run = run_replay("--all " + folder);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    CHECK(run.output.find(": 4 traces") != std::string::npos);
    CHECK(run.output.find("\nc_plain ") != std::string::npos);
    CHECK(run.output.find("\nd_plain ") != std::string::npos);
  }
  SECTION("a trace recorded mid-run: named, its native figures marked as lower bounds") {
    dir.write("c_mid_run.trace.csv", "action,addr,size,stream\nsegment_free,4096,20971520,0\n"
                                     "alloc,8192,1000000,0\nfree_completed,4096,3000000,0\n");
    const command_result run = run_replay("--all " + folder);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    // 24,971,520 reserved (20 MiB freed with 4 MB still live) over 4 MB.
    CHECK(run.output.find(">=6.2429") != std::string::npos);
    CHECK(run.output.find("1 trace recorded mid-run") != std::string::npos);
    CHECK(run.output.find("  c_mid_run (1)\n") != std::string::npos);
    CHECK(run.output.find("lower bounds aside") != std::string::npos);
    const command_result json = run_replay("--json --all " + folder);
    CHECK(json_value(json.output, "native_lower_bounds") == "1");
    CHECK(json_value(json.output, "recorded_mid_run") == "1");
  }
  SECTION("a bad trace is reported, the others still replayed, exit 1") {
    dir.write("c_bad.trace.csv", "action,addr,size,stream\nalloc,4096,512,0\nalloc,1x,2,3\n");
    const command_result run = run_replay("--all " + folder);
    INFO(run.output);
    CHECK(run.exit_code == 1);
    CHECK(run.output.find("c_bad") != std::string::npos);
    CHECK(run.output.find("FAILED: ") != std::string::npos);
    CHECK(run.output.find(":3: addr '1x' is not an unsigned whole number") != std::string::npos);
    CHECK(run.output.find("over 2 traces replayed") != std::string::npos);
    CHECK(run.output.find("1 of 3 traces could not be replayed") != std::string::npos);
    const command_result json = run_replay("--json --all " + folder);
    CHECK(json.exit_code == 1);
    CHECK(json_value(json.output, "failed") == "1");
  }
  SECTION("usage and folder errors") {
    const temp_dir empty;
    const command_result none = run_replay("--all " + quote(empty.path().string()));
    CHECK(none.exit_code == 1);
    CHECK(none.output.find("no trace files (*.csv or *.csv.gz) in the folder") != std::string::npos);
    const command_result missing = run_replay("--all " + quote((dir.path() / "missing").string()));
    CHECK(missing.exit_code == 1);
    CHECK(missing.output.find("No such file or directory") != std::string::npos);
    CHECK(run_replay("--all " + folder + " " + quote((dir.path() / "b_small.trace.csv").string())).exit_code == 2);
    CHECK(run_replay("--all " + folder + " --timeline x.csv").exit_code == 2);
    CHECK(run_replay("--all").exit_code == 2);
  }
}

// [slow]: every corpus trace through the tool, seconds on the default build
// but about two minutes under ASan (Debug), which CI runs without [slow].
TEST_CASE("streamalloc-replay --all on the repository's traces", "[replay][tool][slow]") {
  if (!replay_bin_present()) FAIL("streamalloc-replay not built at " << k_replay_bin);
  const std::string folder = STREAMALLOC_TEST_DATA_DIR "/traces";
  const command_result run = run_replay("--all " + quote(folder));
  INFO(run.output);
  CHECK(run.exit_code == 0);
  std::size_t rows = 0;
  for (const fs::directory_entry& entry : fs::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    const std::size_t at = name.find(".trace.csv");
    if (at == std::string::npos) continue;
    ++rows;
    CHECK(run.output.find("\n" + name.substr(0, at) + " ") != std::string::npos);
  }
  CHECK(rows >= 3);
  CHECK(run.output.find(": " + std::to_string(rows) + " traces") != std::string::npos);
  CHECK(run.output.find("over " + std::to_string(rows) + " traces replayed") != std::string::npos);
}

TEST_CASE("streamalloc-replay --peak-anatomy tells where reserved memory stood at its peak", "[replay][tool]") {
  if (!replay_bin_present()) FAIL("streamalloc-replay not built at " << k_replay_bin);
  temp_dir dir;
  const std::string trace = quote(dir.write("small.csv", k_small_trace));

  SECTION("text, after the table") {
    const command_result run = run_replay("--peak-anatomy " + trace);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    CHECK(run.output.find("reserved peak: allocate/free call ") != std::string::npos);
    CHECK(run.output.find("(+") != std::string::npos);  // the increase, which rounded sizes can hide
    for (const char* line : {"live allocations (requested bytes)", "idle chunks (stitching can move them)",
                             "free bytes in chunks that hold a live block", "free bytes of plain segments"}) {
      INFO(line);
      CHECK(run.output.find(line) != std::string::npos);
    }
    CHECK(run.output.find("Just after it, ") != std::string::npos);
    CHECK(run.output.find(" run of ") != std::string::npos);
    CHECK(run.output.find("warning") == std::string::npos);
  }
  SECTION("JSON") {
    const command_result run = run_replay("--json --peak-anatomy " + trace);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    CHECK(run.output.find("\"peak_anatomy\": {") != std::string::npos);
    CHECK(json_value(run.output, "repeated") == "true");
    CHECK(json_value(run.output, "reserved_after") == json_value(run.output, "peak_reserved_bytes"));
    CHECK(run.output.find("\"runs_after\": [{") != std::string::npos);
    CHECK(json_value(run.output, "blocks_in_use") != "<missing>");
  }
  SECTION("what the peak allocation did") {
    const std::string stitching = quote(dir.write("stitching.csv", k_stitching_trace));
    const command_result text = run_replay("--peak-anatomy " + stitching);
    INFO(text.output);
    REQUIRE(text.exit_code == 0);
    CHECK(text.output.find("The allocation mapped 6 chunks (4 unmapped from idle chunks first, after 1 stream sync),\n"
                           "made 2 device allocations and 0 device frees; idle chunks just after it: 0 B.") !=
          std::string::npos);
    const command_result run = run_replay("--json --peak-anatomy " + stitching);
    INFO(run.output);
    REQUIRE(run.exit_code == 0);
    const auto number = [&](const char* key) { return std::stoll(json_value(run.output, key)); };
    // Reserved memory counts mapped chunks; the chunks it created are the
    // ones it mapped beyond those it moved.
    const long long chunk = 2 * 1024 * 1024;
    CHECK(number("reserved_after") - number("reserved_before") ==
          (number("call_chunk_maps") - number("call_chunk_unmaps")) * chunk);
    CHECK(number("call_device_allocs") == number("call_chunk_maps") - number("call_chunk_unmaps"));
    CHECK(number("call_chunk_unmaps") == number("idle_chunk_bytes") / chunk);
    CHECK(number("call_stitch_syncs") == 1);
    CHECK(number("idle_chunk_bytes_after") == 0);
  }
  SECTION("without it, no anatomy") {
    const command_result run = run_replay("--json " + trace);
    CHECK(run.output.find("peak_anatomy") == std::string::npos);
  }
  SECTION("one trace only") {
    const command_result run = run_replay("--peak-anatomy --all " + quote(dir.path().string()));
    CHECK(run.exit_code == 2);
    CHECK(run.output.find("--peak-anatomy takes one trace; not with --all") != std::string::npos);
  }
  SECTION("no value") {
    const command_result run = run_replay("--peak-anatomy=1 " + trace);
    CHECK(run.exit_code == 2);
  }
}
