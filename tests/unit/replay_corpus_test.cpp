// The trace corpus in CI: every trace in tests/data/traces (README.md there
// says what each one is) replayed on the simulated device with the default
// settings and held to the reserved-memory target of issue 16. A trace added
// to the folder is checked by this test without any change here.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <unordered_map>
#include <vector>

#include "recording_start.hpp"
#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "support/catch.hpp"
#include "trace_reader.hpp"
#include "trace_replay.hpp"

namespace {

using namespace streamalloc;
namespace fs = std::filesystem;

const std::string k_corpus_dir = STREAMALLOC_TEST_DATA_DIR "/traces";
// An H200's memory as nvidia-smi gives it, streamalloc-replay's default.
constexpr std::size_t k_h200_bytes = std::size_t{143771} << 20;

// The target for every trace: peak reserved / peak allocated at most this
// on the simulated device, with one set of default settings (issue 16).
// 1.0 is the floor.
constexpr double k_corpus_ratio_target = 1.02;
// ... and the median over the corpus at most this.
constexpr double k_corpus_median_target = 1.01;

// Traces allowed above k_corpus_ratio_target, each with its own ceiling (a
// little above what it replays at, so a regression still fails) and the
// reason. An entry is a known gap in the policy, not a tuning knob; remove
// it when the policy closes it (issue 16).
struct corpus_exception {
  const char* name;  // file name less .trace.csv[.gz]
  double ratio_limit;
  const char* reason;
};
// bert_serve left the list at 1.0157 (1.1855 before) when the repeat-stitch
// budget gave way to Note [stitch cycles] and stitching took chunks beside
// the hole (Note [beside the hole]). fsdp2_streams2 (1.0159),
// fsdp2_streams4 (1.0178), fsdp2_streams4_long (1.0163) and
// hf_generate_dynamic (1.0152) left it when stitching took the donors that
// strand the fewest free bytes first (Note [stranded bytes]).
constexpr std::array<corpus_exception, 9> k_corpus_exceptions{{
    // 1.0479 before Note [the hole's end], 1.0394 before Note [stranded bytes].
    {"hf_generate_dynamic_long", 1.035,
     "KV caches grown by one token, batch 4..24 and up to 96 new tokens: free memory ends in pieces smaller than a "
     "2 MiB chunk (1.0309)"},
    {"hf_generate_static", 1.05, "the same with static caches (1.0446; 1.0412 before Note [stranded bytes])"},
    {"hf_generate_static_wide", 1.03, "static caches, batch 1..32 and prompts up to 768 (1.0263)"},
    // 1.1123 before the block after the hole gave its idle chunks; 1.0230
    // before Note [stranded bytes].
    {"bert_serve_inflight8", 1.03,
     "eight responses held: long-lived outputs between transients leave partly used chunks at the peak (1.0271)"},
    {"t5_beam_generate", 1.03,
     "beam search in an encoder-decoder: the decoder cache and encoder outputs leave partly used chunks at the peak (1.0210)"},
    // A held-out workload: 1.0443 on its first replay, with no change made for it.
    {"sampled_generate", 1.045,
     "sampled answers with sliding-window caches: at the peak free memory lies in partly used chunks of many mapped "
     "runs (1.0387)"},
    // Held-out captures with other seeds, replayed with no change made for them.
    {"hf_generate_static_seed7", 1.05,
     "static caches made layer by layer between transients: at the peak lone 8.2 MiB caches leave 1.8 MiB of their "
     "last chunk each (1.0435)"},
    {"sampled_generate_seed5", 1.045, "the same sliding-window sampling with other requests (1.0355)"},
    // A held-out workload (fifty-ninth session), replayed with no change made for it.
    {"chunked_prefill_serve", 1.03,
     "a 0.4 GB server whose dynamic caches grow chunk by chunk: at the peak free memory lies in partly used chunks of "
     "many mapped runs (1.0255; 1.0209 before Note [stranded bytes])"},
}};

double ratio_limit_for(const std::string& name) {
  for (const corpus_exception& e : k_corpus_exceptions) {
    if (name == e.name) return e.ratio_limit;
  }
  return k_corpus_ratio_target;
}

std::string corpus_name(const fs::path& path) {
  const std::string file = path.filename().string();
  for (const std::string suffix : {".trace.csv.gz", ".trace.csv"}) {
    if (file.size() > suffix.size() && file.compare(file.size() - suffix.size(), suffix.size(), suffix) == 0) {
      return file.substr(0, file.size() - suffix.size());
    }
  }
  return std::string();
}

std::vector<fs::path> corpus_traces() {
  std::vector<fs::path> traces;
  for (const fs::directory_entry& entry : fs::directory_iterator(k_corpus_dir)) {
    if (entry.is_regular_file() && !corpus_name(entry.path()).empty()) traces.push_back(entry.path());
  }
  std::sort(traces.begin(), traces.end());
  return traces;
}

// Replays `events` on a fresh simulated device of `capacity_bytes` with
// `config` (the defaults unless given); the allocator's invariants are
// checked at the end.
replay_result replay_on_device_of(std::size_t capacity_bytes, std::vector<trace_file_event> events,
                                  const std::string& path, const allocator_config& config = allocator_config{}) {
  sim_config device;
  device.capacity_bytes = capacity_bytes;
  device.events_complete_immediately = true;
  sim_backend backend(device);
  remap_streams_to_sim(events, backend);
  caching_allocator allocator(backend, config);
  const replay_result result = replay_trace(events, allocator, path);
  allocator.validate();
  return result;
}

}  // namespace

TEST_CASE("every trace of the corpus replays within the reserved-memory target", "[replay][corpus][slow]") {
  const std::vector<fs::path> traces = corpus_traces();
  // The three traces captured before the corpus grew are always there.
  REQUIRE(traces.size() >= 3);
  std::vector<double> ratios;
  for (const fs::path& path : traces) {
    const std::string name = corpus_name(path);
    INFO(name);
    replay_result result;
    REQUIRE_NOTHROW(result = replay_on_device_of(k_h200_bytes, load_trace(path.string()), path.string()));
    CAPTURE(result.frag_ratio, result.native_frag_ratio, result.stitched_blocks);
    CHECK(result.peak_allocated_bytes == result.trace_peak_live_bytes);
    CHECK(result.frag_ratio >= 1.0);
    CHECK(result.frag_ratio <= ratio_limit_for(name));
    // Never worse than what PyTorch's native allocator reserved on the same run.
    if (result.native_recorded) CHECK(result.frag_ratio <= result.native_frag_ratio);
    ratios.push_back(result.frag_ratio);
  }
  std::sort(ratios.begin(), ratios.end());
  const std::size_t middle = ratios.size() / 2;
  const double median = ratios.size() % 2 == 1 ? ratios[middle] : (ratios[middle - 1] + ratios[middle]) / 2.0;
  CAPTURE(median, ratios.back());
  CHECK(median <= k_corpus_median_target);
}

TEST_CASE("a trace replays the same on a device little larger than its peak", "[replay][corpus][slow]") {
  // Note [address space]: with ranges the size of the device, a program
  // that fills most of it found no room between its mapped runs and placed
  // its blocks otherwise than on a larger device (compile_train 1.0579
  // instead of 1.0042 with 6% to spare).
  for (const fs::path& path : corpus_traces()) {
    INFO(corpus_name(path));
    const std::vector<trace_file_event> events = load_trace(path.string());
    const replay_result roomy = replay_on_device_of(k_h200_bytes, events, path.string());
    const auto tight_bytes = static_cast<std::size_t>(1.06 * static_cast<double>(roomy.peak_allocated_bytes));
    replay_result tight;
    REQUIRE_NOTHROW(tight = replay_on_device_of(tight_bytes, events, path.string()));
    CHECK(tight.peak_reserved_bytes == roomy.peak_reserved_bytes);
  }
}

TEST_CASE("max_split_size_mb leaves a trace's reserved memory as the defaults do", "[replay][corpus][slow]") {
  // Note [max_split in expandable segments]: with torch's rule in
  // expandable segments, bert_serve reserved 95 times its live peak at
  // 64 MiB.
  const allocator_config max_split = allocator_config::parse("max_split_size_mb:64");
  for (const fs::path& path : corpus_traces()) {
    INFO(corpus_name(path));
    const std::vector<trace_file_event> events = load_trace(path.string());
    const replay_result defaults = replay_on_device_of(k_h200_bytes, events, path.string());
    const replay_result limited = replay_on_device_of(k_h200_bytes, events, path.string(), max_split);
    CHECK(limited.peak_reserved_bytes == defaults.peak_reserved_bytes);
  }
}

TEST_CASE("every trace of the corpus replays when its recording began mid-run", "[replay][corpus][slow]") {
  // A trace recorded mid-run frees blocks it never allocated; replay makes
  // them before its first event (tools/recording_start.hpp). Here each
  // trace loses its first 30% of events, as a late _record_memory_history
  // or a ring of max_entries would drop them.
  for (const fs::path& path : corpus_traces()) {
    INFO(corpus_name(path));
    const std::vector<trace_file_event> whole = load_trace(path.string());
    const auto cut = static_cast<std::ptrdiff_t>(whole.size() * 3 / 10);
    std::vector<trace_file_event> events(whole.begin() + cut, whole.end());
    const allocations_before_recording added = add_allocations_before_recording(&events);
    CHECK(added.blocks > 0);
    replay_result result;
    REQUIRE_NOTHROW(result = replay_on_device_of(k_h200_bytes, events, path.string()));
    CHECK(result.allocs_before_recording == added.blocks);
    CHECK(result.peak_allocated_bytes == result.trace_peak_live_bytes);
    CHECK(result.frag_ratio >= 1.0);
    if (result.native_recorded) CHECK(result.native_peak_reserved_bytes >= result.trace_peak_live_bytes);
  }
}

namespace {

// `events` with every request size multiplied by `factor` and the native
// allocator's segment events dropped, as scripts/scale_traces.py writes it.
std::vector<trace_file_event> scaled(const std::vector<trace_file_event>& events, double factor) {
  std::vector<trace_file_event> out;
  out.reserve(events.size());
  for (trace_file_event e : events) {
    switch (e.action) {
      case trace_file_action::segment_alloc:
      case trace_file_action::segment_free:
      case trace_file_action::segment_map:
      case trace_file_action::segment_unmap:
        continue;
      default:
        break;
    }
    if (e.size > 0) {
      e.size = std::max<std::uint64_t>(1, static_cast<std::uint64_t>(static_cast<double>(e.size) * factor));
    }
    out.push_back(e);
  }
  return out;
}

// What the BERT servers scaled below replay at, at most: 1.0118-1.0230
// now; four of the six replayed at 1.0548-1.1318 when a refused stitch
// grew by its whole request.
constexpr double k_scaled_serving_limit = 1.03;

}  // namespace

TEST_CASE("the BERT servers replay within the target with every request size scaled", "[replay][corpus][slow]") {
  // Note [stitch cycles]: the growth that breaks cycles stays within its
  // share of the allocation peak. Before, a refused stitch of a large
  // request near the peak mapped the whole request anew while idle chunks
  // sat cached: bert_serve x1.1 1.1318, x2.0 1.0582, bert_serve_inflight8
  // x1.25 1.0815.
  for (const std::string name : {"bert_serve", "bert_serve_inflight8"}) {
    const std::string path = k_corpus_dir + "/" + name + ".trace.csv.gz";
    const std::vector<trace_file_event> events = load_trace(path);
    for (const double factor : {1.1, 1.25, 2.0}) {
      INFO(name << " x" << factor);
      const replay_result result = replay_on_device_of(k_h200_bytes, scaled(events, factor), path);
      CAPTURE(result.frag_ratio, result.stitched_blocks);
      CHECK(result.frag_ratio <= k_scaled_serving_limit);
    }
  }
}

namespace {

// Replays `events` on a fresh simulated device whose streams get their
// handles in the order `order` lists the trace's streams.
replay_result replay_with_stream_order(std::vector<trace_file_event> events, const std::vector<std::uint64_t>& order,
                                       const std::string& path) {
  sim_config device;
  device.capacity_bytes = k_h200_bytes;
  device.events_complete_immediately = true;
  sim_backend backend(device);
  std::unordered_map<std::uint64_t, stream_handle> handles;
  for (const std::uint64_t stream : order) handles.emplace(stream, backend.new_stream());
  for (trace_file_event& e : events) {
    if (e.stream != 0) e.stream = handles.at(e.stream);
  }
  caching_allocator allocator(backend, allocator_config{});
  return replay_trace(events, allocator, path);
}

}  // namespace

TEST_CASE("a trace replays the same whatever values its stream handles take", "[replay][corpus][slow]") {
  // The runtime picks stream handles (addresses), so a program's memory
  // must not depend on how they compare: each multi-stream trace of the
  // corpus is replayed with its side streams numbered in the order of
  // first use and in the reverse order.
  int multi_stream = 0;
  for (const fs::path& path : corpus_traces()) {
    const std::vector<trace_file_event> events = load_trace(path.string());
    std::vector<std::uint64_t> first_use;
    for (const trace_file_event& e : events) {
      if (e.stream != 0 && std::find(first_use.begin(), first_use.end(), e.stream) == first_use.end()) {
        first_use.push_back(e.stream);
      }
    }
    if (first_use.size() < 2) continue;
    ++multi_stream;
    INFO(corpus_name(path));
    const replay_result in_order = replay_with_stream_order(events, first_use, path.string());
    const replay_result reversed =
        replay_with_stream_order(events, {first_use.rbegin(), first_use.rend()}, path.string());
    CHECK(reversed.peak_reserved_bytes == in_order.peak_reserved_bytes);
    CHECK(reversed.stitched_blocks == in_order.stitched_blocks);
    CHECK(reversed.cross_stream_reuses == in_order.cross_stream_reuses);
    CHECK(reversed.chunk_maps == in_order.chunk_maps);
  }
  // The corpus has such traces (FSDP2-style, a server, activation offload).
  CHECK(multi_stream >= 2);
}
