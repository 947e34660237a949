// streamalloc-replay: replays a recorded PyTorch allocation trace (or every
// trace in a folder, --all) through streamalloc on a simulated device or a
// real GPU and prints its peak reserved memory and call cost next to what
// PyTorch's native allocator reserved for that run.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#ifdef STREAMALLOC_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "streamalloc/backend/cuda_backend.hpp"
#endif
#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "streamalloc/util/errors.hpp"
#include "streamalloc/util/json_writer.hpp"
#include "peak_anatomy.hpp"
#include "recording_start.hpp"
#include "replay_calls.hpp"
#include "requested_frees.hpp"
#include "trace_reader.hpp"
#include "trace_replay.hpp"

namespace {

using namespace streamalloc;

constexpr const char* k_program = "streamalloc-replay";
#ifndef STREAMALLOC_VERSION
#error "STREAMALLOC_VERSION (the CMake project version) must be defined"
#endif
constexpr const char* k_version = STREAMALLOC_VERSION;
// An H200's memory as nvidia-smi and torch's total_memory give it (143771
// MiB; its datasheet's "141 GB" is rounded): a trace a program made on one
// fits.
constexpr std::size_t k_default_capacity_bytes = std::size_t{143771} << 20;
// The virtual-memory granularity of current NVIDIA GPUs.
constexpr std::size_t k_default_granularity_bytes = std::size_t{2} << 20;
// Unreadable or inconsistent trace, out of memory, no GPU, unwritable
// --timeline file; with --all, any trace that could not be replayed.
constexpr int k_exit_failure = 1;
constexpr int k_exit_usage = 2;

// A bad command line; main prints it with a pointer to --help.
class usage_failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct options {
  std::string backend = "sim";
  std::size_t capacity_bytes = k_default_capacity_bytes;
  bool capacity_given = false;
  std::size_t granularity_bytes = k_default_granularity_bytes;
  bool granularity_given = false;
  std::string conf;
  std::string timeline;
  bool peak_anatomy = false;
  bool json = false;
  bool help = false;
  bool version = false;
  std::string trace;
  std::string all_dir;  // --all: replay every trace in this folder
};

void print_help() {
  std::printf(
      "usage: %s [options] TRACE\n"
      "       %s [options] --all DIR\n"
      "\n"
      "Replays an allocation trace (CSV `action,addr,size,stream`, plain or gzip'd;\n"
      "see shared/traces/README.md) through streamalloc's caching allocator and\n"
      "reports peak allocated and reserved bytes, their ratio, device allocations\n"
      "and the cost of the allocate/free calls. The right-hand column is PyTorch's\n"
      "native allocator as recorded in the trace's segment events (not replayed).\n"
      "Peak reserved / peak allocated is 1.0 at best: every reserved byte in use\n"
      "at the peak. The header may name its four columns in any order and others\n"
      "beside them (ignored); lines of actions the format does not name are\n"
      "skipped with a warning that names them. Numbers are decimal, or\n"
      "hexadecimal after 0x. A trace without free_completed lines frees each\n"
      "block at its free_requested (with a warning).\n"
      "\n"
      "options:\n"
      "  --all DIR         replay every *.trace.csv and *.trace.csv.gz in DIR (not\n"
      "                    its subfolders), and each other *.csv and *.csv.gz whose\n"
      "                    header is a trace's, each on a fresh device, and print\n"
      "                    one table with the median and worst ratio\n"
      "  --backend NAME    device to replay on: sim (default, a simulated device)\n"
      "                    or cuda (CUDA device 0 through streamalloc's CUDA\n"
      "                    backend; trace streams become created streams, 0 the\n"
      "                    default stream)\n"
      "  --capacity BYTES  simulated device size, default 143771MiB (an H200's\n"
      "                    memory as nvidia-smi gives it). Suffixes: K M G T\n"
      "                    (powers of 1000, also KB MB GB TB), KiB MiB GiB TiB.\n"
      "                    Ignored with --backend cuda\n"
      "  --granularity BYTES  the simulated device's virtual-memory granularity,\n"
      "                    default 2MiB (current GPUs'): a power of two that\n"
      "                    vmm_chunk_mb must be a multiple of, to see what another\n"
      "                    chunk size would give (e.g. 1MiB with --conf\n"
      "                    vmm_chunk_mb:1). Suffixes as for --capacity. Ignored\n"
      "                    with --backend cuda\n"
      "  --timeline FILE   after the timed replay, replay again on a fresh allocator\n"
      "                    and write CSV `op,allocated_bytes,reserved_bytes` after\n"
      "                    every allocate/free (for scripts/plot_replay.py). FILE is\n"
      "                    opened before the replay starts. Not with --all\n"
      "  --peak-anatomy    after the timed replay, replay twice more on fresh\n"
      "                    allocators and tell where reserved memory stood just\n"
      "                    before the allocation that set its peak: live bytes,\n"
      "                    rounding, idle chunks stitching can move, free bytes in\n"
      "                    chunks that also hold a live block; what that\n"
      "                    allocation did (chunks mapped, moved by stitching,\n"
      "                    new from the device); then the mapped runs just\n"
      "                    after it, those with the most such bytes first. Not\n"
      "                    with --all\n"
      "  --conf TEXT       allocator settings \"key:value,...\" applied on top of\n"
      "                    the STREAMALLOC_CONF environment variable\n"
      "  --json            print one JSON object instead of a table\n"
      "  --version         print the version and exit\n"
      "  -h, --help        print this help\n"
      "\n"
      "allocator settings (--conf / STREAMALLOC_CONF):\n",
      k_program, k_program);
  for (const allocator_config::key_doc& key : allocator_config::keys()) {
    std::printf("  %-30s %s\n", key.key, key.description);
  }
  std::printf(
      "\n"
      "exit status: 0 success, 1 unreadable, empty or inconsistent trace (with --all:\n"
      "any trace), out of memory, no usable GPU (--backend cuda) or a --timeline file\n"
      "that cannot be written, 2 bad command line or settings.\n");
}

// A byte count with an optional unit, for `option`.
std::size_t parse_bytes(const std::string& option, const std::string& text) {
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == 0) throw usage_failure(option + " '" + text + "': expected a byte count such as 141G or 80GiB");
  std::string suffix;
  for (std::size_t i = digits; i < text.size(); ++i) {
    suffix += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
  }
  struct unit {
    const char* suffix;
    std::size_t bytes;
  };
  static constexpr unit k_units[] = {
      {"", 1},
      {"b", 1},
      {"k", 1'000},
      {"kb", 1'000},
      {"kib", std::size_t{1} << 10},
      {"m", 1'000'000},
      {"mb", 1'000'000},
      {"mib", std::size_t{1} << 20},
      {"g", 1'000'000'000},
      {"gb", 1'000'000'000},
      {"gib", std::size_t{1} << 30},
      {"t", 1'000'000'000'000},
      {"tb", 1'000'000'000'000},
      {"tib", std::size_t{1} << 40},
  };
  const unit* found = nullptr;
  for (const unit& u : k_units) {
    if (suffix == u.suffix) found = &u;
  }
  if (found == nullptr) {
    throw usage_failure(option + " '" + text + "': unknown unit '" + text.substr(digits) +
                        "' (use K, M, G, T, KiB, MiB, GiB or TiB)");
  }
  constexpr std::size_t k_max = std::numeric_limits<std::size_t>::max();
  std::size_t count = 0;
  for (std::size_t i = 0; i < digits; ++i) {
    const auto digit = static_cast<std::size_t>(text[i] - '0');
    if (count > (k_max - digit) / 10) throw usage_failure(option + " '" + text + "': too large");
    count = count * 10 + digit;
  }
  if (count > k_max / found->bytes) throw usage_failure(option + " '" + text + "': too large");
  if (count == 0) throw usage_failure(option + " '" + text + "': must be more than 0 bytes");
  return count * found->bytes;
}

options parse_options(int argc, char** argv) {
  options opts;
  bool trace_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    if (arg.rfind("--", 0) == 0) {
      const std::size_t equals = arg.find('=');
      if (equals != std::string::npos) {
        value = arg.substr(equals + 1);
        arg.resize(equals);
        has_value = true;
      }
    }
    const auto take_value = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) throw usage_failure(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      opts.help = true;
    } else if (arg == "--version") {
      if (has_value) throw usage_failure("--version takes no value");
      opts.version = true;
    } else if (arg == "--all") {
      opts.all_dir = take_value();
      if (opts.all_dir.empty()) throw usage_failure("--all needs a folder");
    } else if (arg == "--json") {
      if (has_value) throw usage_failure("--json takes no value");
      opts.json = true;
    } else if (arg == "--backend") {
      opts.backend = take_value();
    } else if (arg == "--capacity") {
      opts.capacity_bytes = parse_bytes(arg, take_value());
      opts.capacity_given = true;
    } else if (arg == "--granularity") {
      const std::string text = take_value();
      opts.granularity_bytes = parse_bytes(arg, text);
      if ((opts.granularity_bytes & (opts.granularity_bytes - 1)) != 0) {
        throw usage_failure(arg + " '" + text + "': must be a power of two");
      }
      opts.granularity_given = true;
    } else if (arg == "--timeline") {
      opts.timeline = take_value();
      if (opts.timeline.empty()) throw usage_failure("--timeline needs a file name");
    } else if (arg == "--peak-anatomy") {
      if (has_value) throw usage_failure("--peak-anatomy takes no value");
      opts.peak_anatomy = true;
    } else if (arg == "--conf") {
      opts.conf = take_value();
    } else if (arg.size() > 1 && arg[0] == '-') {
      throw usage_failure("unknown option '" + arg + "'");
    } else if (trace_given) {
      throw usage_failure("more than one trace given ('" + opts.trace + "' and '" + arg + "')");
    } else {
      opts.trace = arg;
      trace_given = true;
    }
  }
  if (opts.help || opts.version) return opts;
  if (!opts.all_dir.empty()) {
    if (trace_given) throw usage_failure("give a trace or --all DIR, not both");
    if (!opts.timeline.empty()) throw usage_failure("--timeline takes one trace; not with --all");
    if (opts.peak_anatomy) throw usage_failure("--peak-anatomy takes one trace; not with --all");
  } else if (!trace_given) {
    throw usage_failure("no trace given (or --all DIR)");
  }
#ifdef STREAMALLOC_HAVE_CUDA
  if (opts.backend != "sim" && opts.backend != "cuda") {
    throw usage_failure("unknown backend '" + opts.backend + "' (available: sim, cuda)");
  }
#else
  if (opts.backend == "cuda") {
    throw usage_failure("--backend cuda: cuda backend not built / not available (built without the CUDA toolkit); use --backend sim");
  }
  if (opts.backend != "sim") throw usage_failure("unknown backend '" + opts.backend + "' (available: sim)");
#endif
  return opts;
}

// How the device a replay ran on is named in headings.
std::string device_label(const std::string& backend) {
  return backend == "sim" ? "simulated device" : "CUDA device 0";
}

// Native's figures are only a lower bound when its memory from before the
// recording had to be guessed.
bool native_lower_bound(const replay_result& r) { return r.native_reserved_before_recording_bytes > 0; }

// One trace's figures as members of the current JSON object.
void json_members(json_writer& w, const replay_result& r) {
  const bool native = r.native_recorded;
  w.key("events").value(r.events).key("ops").value(r.ops).key("allocs").value(r.allocs);
  w.key("frees").value(r.frees).key("live_at_end").value(r.live_at_end);
  w.key("allocs_before_recording").value(r.allocs_before_recording);
  w.key("bytes_before_recording").value(r.bytes_before_recording);
  w.key("peak_allocated_bytes").value(r.peak_allocated_bytes);
  w.key("trace_peak_live_bytes").value(r.trace_peak_live_bytes);
  w.key("peak_reserved_bytes").value(r.peak_reserved_bytes);
  w.key("frag_ratio").value(r.frag_ratio, 6).key("segments").value(static_cast<long long>(r.segments));
  w.key("total_ns").value(r.total_ns).key("ns_per_op").value(r.ns_per_op, 2);
  w.key("chunk_maps").value(static_cast<long long>(r.chunk_maps));
  w.key("chunk_unmaps").value(static_cast<long long>(r.chunk_unmaps));
  w.key("stitched_blocks").value(static_cast<long long>(r.stitched_blocks));
  w.key("stitch_syncs").value(static_cast<long long>(r.stitch_syncs));
  w.key("cross_stream_reuses").value(static_cast<long long>(r.cross_stream_reuses));
  w.key("native_segments").value(r.native_segments);
  w.key("native_segment_allocs").value(r.native_segment_allocs);
  w.key("native_segment_maps").value(r.native_segment_maps);
  w.key("native_peak_reserved_bytes").value(r.native_peak_reserved_bytes);
  w.key("native_reserved_before_recording_bytes").value(r.native_reserved_before_recording_bytes);
  w.key("native_frag_ratio");
  if (native) {
    w.value(r.native_frag_ratio, 6);
  } else {
    w.null();
  }
  w.key("skipped_actions").begin_object();
  for (const skipped_action& a : r.skipped_actions) w.key(a.name).value(a.lines);
  w.end_object();
  w.key("frees_at_requests").value(r.frees_at_requests);
}

// --peak-anatomy as a member of the current JSON object (null: nothing reserved).
void json_anatomy(json_writer& w, const peak_anatomy& a) {
  w.key("peak_anatomy");
  if (!a.found) {
    w.null();
    return;
  }
  w.begin_object();
  w.key("op").value(a.op).key("line").value(a.line).key("before_recording").value(a.before_recording);
  w.key("request_bytes").value(a.request_bytes);
  w.key("stream").value(a.stream).key("reserved_before").value(a.reserved_before);
  w.key("reserved_after").value(a.reserved_after).key("requested_bytes").value(a.requested_bytes);
  w.key("rounding_bytes").value(a.rounding_bytes).key("pending_free_bytes").value(a.pending_free_bytes);
  w.key("idle_chunk_bytes").value(a.idle_chunk_bytes).key("partly_used_free_bytes").value(a.partly_used_free_bytes);
  w.key("plain_free_bytes").value(a.plain_free_bytes).key("mapped_runs").value(a.mapped_runs);
  w.key("repeated").value(a.repeated);
  w.key("call_chunk_maps").value(a.call_chunk_maps).key("call_chunk_unmaps").value(a.call_chunk_unmaps);
  w.key("call_stitch_syncs").value(a.call_stitch_syncs);
  w.key("call_device_allocs").value(a.call_device_allocs).key("call_device_frees").value(a.call_device_frees);
  w.key("idle_chunk_bytes_after").value(idle_chunk_bytes_after(a));
  w.key("runs_after").begin_array();
  for (const peak_run& run : a.runs_after) {
    w.begin_object();
    w.key("bytes").value(run.bytes).key("small").value(run.small);
    w.key("blocks_in_use").value(run.blocks_in_use).key("bytes_in_use").value(run.bytes_in_use);
    w.key("idle_chunk_bytes").value(run.idle_chunk_bytes);
    w.key("partly_used_free_bytes").value(run.partly_used_free_bytes);
    w.end_object();
  }
  w.end_array();
  w.end_object();
}

void print_json(const options& opts, const allocator_config& config, const replay_result& r,
                const peak_anatomy* anatomy) {
  json_writer w;
  w.begin_object();
  w.key("tool").value(k_program).key("version").value(k_version);
  w.key("trace").value(opts.trace).key("backend").value(opts.backend);
  w.key("capacity_bytes").value(opts.capacity_bytes).key("granularity_bytes").value(opts.granularity_bytes);
  w.key("config").value(config.to_string());
  json_members(w, r);
  if (anatomy != nullptr) json_anatomy(w, *anatomy);
  w.end_object();
  std::printf("%s\n", w.str().c_str());
}

// "2 lines of actions the trace format does not name".
std::string skipped_lines_text(const std::vector<skipped_action>& skipped) {
  std::uint64_t lines = 0;
  for (const skipped_action& a : skipped) lines += a.lines;
  return std::to_string(lines) + (lines == 1 ? " line" : " lines") + " of actions the trace format does not name";
}

// The skipped actions' names, with counts and first lines when `detail`.
std::string skipped_names(const std::vector<skipped_action>& skipped, bool detail) {
  std::string names;
  for (const skipped_action& a : skipped) {
    names += (names.empty() ? "" : ", ") + a.name;
    if (detail) names += " (" + std::to_string(a.lines) + ", first on line " + std::to_string(a.first_line) + ")";
  }
  return names;
}

std::string bytes_cell(std::size_t bytes) { return std::to_string(bytes) + " (" + format_bytes(bytes) + ")"; }

// "2 MiB" for whole mebibytes, else format_bytes.
std::string chunk_size_text(std::size_t bytes) {
  if (bytes >= (std::size_t{1} << 20) && bytes % (std::size_t{1} << 20) == 0) {
    return std::to_string(bytes >> 20) + " MiB";
  }
  return format_bytes(bytes);
}

// What streamalloc's device allocations were: with expandable segments the
// physical chunks it created, else its segments.
bool replayed_expandable(const replay_result& r) { return r.chunk_maps > 0; }

std::string our_device_allocations(const replay_result& r, const allocator_config& config) {
  if (replayed_expandable(r)) return std::to_string(r.segments) + " chunks of " + chunk_size_text(config.vmm_chunk_bytes);
  return std::to_string(r.segments) + " segments";
}

std::string native_device_allocations(const replay_result& r) {
  std::string text;
  if (r.native_segment_allocs > 0) text = std::to_string(r.native_segment_allocs) + " segments";
  if (r.native_segment_maps > 0) {
    if (!text.empty()) text += " + ";
    text += std::to_string(r.native_segment_maps) + " mapped runs";
  }
  if (text.empty()) text = "none made";
  return text;
}

// The mapped runs just after the peak allocation, those that waste the
// most in partly used chunks first; the rest summed.
void print_runs_after(const std::vector<peak_run>& runs) {
  if (runs.empty()) return;
  constexpr std::size_t k_listed = 8;
  const std::size_t listed = std::min(runs.size(), k_listed);
  if (runs.size() == 1) {
    std::printf("Just after it, 1 mapped run:\n");
  } else if (listed == runs.size()) {
    std::printf("Just after it, %zu mapped runs, the most free bytes in partly used chunks first:\n", runs.size());
  } else {
    std::printf("Just after it, %zu mapped runs; the %zu with the most free bytes in partly used chunks:\n",
                runs.size(), listed);
  }
  for (std::size_t i = 0; i < listed; ++i) {
    const peak_run& run = runs[i];
    std::printf("  %s run of %s: %zu block%s in use (%s), %s free in partly used chunks", run.small ? "small" : "large",
                format_bytes(run.bytes).c_str(), run.blocks_in_use, run.blocks_in_use == 1 ? "" : "s",
                format_bytes(run.bytes_in_use).c_str(), format_bytes(run.partly_used_free_bytes).c_str());
    if (run.idle_chunk_bytes > 0) std::printf(", %s idle", format_bytes(run.idle_chunk_bytes).c_str());
    std::printf("\n");
  }
  if (runs.size() > listed) {
    std::size_t rest = 0;
    for (std::size_t i = listed; i < runs.size(); ++i) rest += runs[i].partly_used_free_bytes;
    std::printf("  the other %zu runs: %s free in partly used chunks\n", runs.size() - listed,
                format_bytes(rest).c_str());
  }
}

// What the peak allocation did. Idle chunks it neither used in place nor
// moved are ones stitching left: beside the hole it mapped into (Note
// [beside the hole]), or all of them when it grew within stitch_slack or
// as a stitch cycle (Note [stitch cycles]).
void print_call(const peak_anatomy& a) {
  const auto plural = [](std::size_t n) { return n == 1 ? "" : "s"; };
  std::printf("The allocation mapped %zu chunk%s (%zu unmapped from idle chunks first, after %zu stream sync%s),\n"
              "made %zu device allocation%s and %zu device free%s; idle chunks just after it: %s.\n",
              a.call_chunk_maps, plural(a.call_chunk_maps), a.call_chunk_unmaps, a.call_stitch_syncs,
              plural(a.call_stitch_syncs), a.call_device_allocs, plural(a.call_device_allocs), a.call_device_frees,
              plural(a.call_device_frees), format_bytes(idle_chunk_bytes_after(a)).c_str());
}

// --peak-anatomy in text, after the table.
void print_anatomy(const peak_anatomy& a) {
  if (!a.found) {
    std::printf("\npeak anatomy: nothing was reserved\n");
    return;
  }
  std::printf("\nreserved peak: allocate/free call %llu (%s %llu) allocated %s on stream %llu\n"
              "and took reserved memory from %s to %s (+%s). Just before it:\n",
              static_cast<unsigned long long>(a.op),
              a.before_recording ? "made before recording began, freed at trace line" : "trace line",
              static_cast<unsigned long long>(a.line),
              format_bytes(a.request_bytes).c_str(), static_cast<unsigned long long>(a.stream),
              format_bytes(a.reserved_before).c_str(), format_bytes(a.reserved_after).c_str(),
              format_bytes(a.reserved_after - a.reserved_before).c_str());
  constexpr const char* k_line = "  %-44s %s\n";
  std::printf(k_line, "live allocations (requested bytes)", format_bytes(a.requested_bytes).c_str());
  std::printf(k_line, "their blocks beyond the request (rounding)", format_bytes(a.rounding_bytes).c_str());
  std::printf(k_line, "freed, waiting for stream events", format_bytes(a.pending_free_bytes).c_str());
  std::printf(k_line, "idle chunks (stitching can move them)", format_bytes(a.idle_chunk_bytes).c_str());
  std::printf(k_line, "free bytes in chunks that hold a live block", format_bytes(a.partly_used_free_bytes).c_str());
  std::printf(k_line, "free bytes of plain segments", format_bytes(a.plain_free_bytes).c_str());
  std::printf("  (%zu mapped runs of expandable segments)\n", a.mapped_runs);
  print_call(a);
  print_runs_after(a.runs_after);
  if (!a.repeated) {
    std::printf("  warning: the second replay did not reach the same peak at that call; these\n"
                "  figures describe another layout\n");
  }
}

void print_table(const options& opts, const allocator_config& config, const replay_result& r) {
  const bool native = r.native_recorded;
  const std::string not_recorded = "not in trace";
  const std::string ours_heading = "streamalloc (" + device_label(opts.backend) + ")";
  std::printf("trace     %s\n", opts.trace.c_str());
  std::printf("          %llu events: %llu allocs, %llu frees, %llu never freed\n",
              static_cast<unsigned long long>(r.events), static_cast<unsigned long long>(r.allocs),
              static_cast<unsigned long long>(r.frees), static_cast<unsigned long long>(r.live_at_end));
  if (r.allocs_before_recording > 0) {
    std::printf("          recorded mid-run: %llu block%s (%s) freed without an alloc in the trace,\n"
                "          replayed as allocated before its first event\n",
                static_cast<unsigned long long>(r.allocs_before_recording), r.allocs_before_recording == 1 ? "" : "s",
                format_bytes(r.bytes_before_recording).c_str());
  }
  if (!r.skipped_actions.empty()) {
    std::printf("skipped   %s (%s)\n", skipped_lines_text(r.skipped_actions).c_str(),
                skipped_names(r.skipped_actions, false).c_str());
  }
  if (r.frees_at_requests > 0) {
    std::printf("frees     at free_requested (the trace has no free_completed line): %llu\n",
                static_cast<unsigned long long>(r.frees_at_requests));
  }
  std::printf("device    %s (%s), capacity %s, granularity %s\n", opts.backend.c_str(),
              device_label(opts.backend).c_str(), bytes_cell(opts.capacity_bytes).c_str(),
              bytes_cell(opts.granularity_bytes).c_str());
  std::printf("config    %s\n\n", config.to_string().c_str());

  constexpr const char* k_row = "%-19s %-32s %s\n";
  std::printf(k_row, "", ours_heading.c_str(), "PyTorch native, recorded");
  std::printf(k_row, "peak allocated", bytes_cell(r.peak_allocated_bytes).c_str(),
              bytes_cell(r.trace_peak_live_bytes).c_str());
  std::printf(k_row, "peak reserved", bytes_cell(r.peak_reserved_bytes).c_str(),
              native ? bytes_cell(r.native_peak_reserved_bytes).c_str() : not_recorded.c_str());
  char ours[32];
  char theirs[32];
  std::snprintf(ours, sizeof ours, "%.4f", r.frag_ratio);
  std::snprintf(theirs, sizeof theirs, "%s%.4f", native_lower_bound(r) ? ">=" : "", r.native_frag_ratio);
  std::printf(k_row, "reserved/allocated", ours, native ? theirs : not_recorded.c_str());
  std::printf(k_row, "device allocations", our_device_allocations(r, config).c_str(),
              native ? native_device_allocations(r).c_str() : not_recorded.c_str());
  if (replayed_expandable(r)) {
    std::printf("%-19s %lld maps, %lld unmaps; %lld stitched blocks after %lld stream syncs\n", "chunks",
                static_cast<long long>(r.chunk_maps), static_cast<long long>(r.chunk_unmaps),
                static_cast<long long>(r.stitched_blocks), static_cast<long long>(r.stitch_syncs));
  }

  std::printf("\nreserved/allocated is peak reserved / peak allocated: 1.0 is the floor (every\n"
              "reserved byte in use at the peak); lower is better. Peak allocated is the\n"
              "largest sum of live requested sizes, the same trace for both columns.\n");
  std::printf("device allocations: ");
  if (replayed_expandable(r)) {
    std::printf("streamalloc's are the %s physical chunks it created for\n"
                "expandable segments (cuMemCreate on a GPU), each counted once however often\n"
                "it is mapped again",
                chunk_size_text(config.vmm_chunk_bytes).c_str());
  } else {
    std::printf("streamalloc's are its segments, one device allocation\n"
                "(cudaMalloc on a GPU) each");
  }
  if (native) {
    std::printf(";\nnative's are ");
    if (r.native_segments == 0) std::printf("none: the trace only gives segments back");
    if (r.native_segment_allocs > 0) std::printf("the trace's segment_alloc events (one cudaMalloc each)");
    if (r.native_segment_allocs > 0 && r.native_segment_maps > 0) std::printf(" and ");
    if (r.native_segment_maps > 0) {
      std::printf("its segment_map events (one run of pages mapped at once,\nexpandable_segments:True)");
    }
    std::printf(".\n");
    if (r.native_reserved_before_recording_bytes > 0) {
      std::printf("native's peak reserved counts %s reserved before recording began: the\n"
                  "least that holds every live byte the trace shows, so native's is a lower bound.\n",
                  format_bytes(r.native_reserved_before_recording_bytes).c_str());
    }
  } else {
    std::printf(". The trace has no segment events, so native's figures are unknown.\n");
  }
  std::printf("\nallocate+free      %llu calls in %.3f ms: %.1f ns/op\n", static_cast<unsigned long long>(r.ops),
              static_cast<double>(r.total_ns) / 1e6, r.ns_per_op);
}

#ifdef STREAMALLOC_HAVE_CUDA
// Trace streams on the GPU: every nonzero stream handle of the trace becomes
// a stream created here (0 stays the default stream), so pools and events
// are keyed on real streams as they were in the recorded program.
class cuda_trace_streams {
 public:
  explicit cuda_trace_streams(std::vector<trace_file_event>& events) {
    for (trace_file_event& e : events) {
      if (e.stream == 0) continue;
      auto it = streams_.find(e.stream);
      if (it == streams_.end()) {
        cudaStream_t stream = nullptr;
        const cudaError_t error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        if (error != cudaSuccess) {
          throw std::runtime_error(std::string("cudaStreamCreateWithFlags failed: ") + cudaGetErrorName(error) + ": " +
                                   cudaGetErrorString(error));
        }
        it = streams_.emplace(e.stream, stream).first;
      }
      e.stream = reinterpret_cast<std::uintptr_t>(it->second);
    }
  }
  ~cuda_trace_streams() {
    (void)cudaDeviceSynchronize();
    for (const auto& entry : streams_) (void)cudaStreamDestroy(entry.second);
  }
  cuda_trace_streams(const cuda_trace_streams&) = delete;
  cuda_trace_streams& operator=(const cuda_trace_streams&) = delete;

 private:
  std::unordered_map<std::uint64_t, cudaStream_t> streams_;
};
#endif

// The device a replay runs on and what must outlive its allocators.
struct replay_device {
  std::unique_ptr<device_backend> backend;
#ifdef STREAMALLOC_HAVE_CUDA
  std::unique_ptr<cuda_trace_streams> streams;  // destroyed before the backend
#endif
};

// Opens the device of --backend. On a GPU the trace's streams are remapped
// to created streams, and opts->capacity_bytes and granularity_bytes become
// the GPU's memory size and virtual-memory granularity.
replay_device open_device(options* opts, std::vector<trace_file_event>& events) {
  replay_device device;
  if (opts->backend == "sim") {
    sim_config sim;
    sim.capacity_bytes = opts->capacity_bytes;
    sim.vm_granularity_bytes = opts->granularity_bytes;
    sim.events_complete_immediately = true;
    auto backend = std::make_unique<sim_backend>(sim);
    remap_streams_to_sim(events, *backend);
    device.backend = std::move(backend);
    return device;
  }
#ifdef STREAMALLOC_HAVE_CUDA
  status error;
  device.backend = make_cuda_backend(0, &error);
  if (device.backend == nullptr) throw device_failure("--backend cuda: " + error.message());
  if (opts->capacity_given) std::fprintf(stderr, "%s: --capacity is ignored with --backend cuda\n", k_program);
  if (opts->granularity_given) std::fprintf(stderr, "%s: --granularity is ignored with --backend cuda\n", k_program);
  opts->granularity_bytes = device.backend->vm_granularity();
  device_memory_info info;
  const status st = device.backend->memory_info(&info);
  if (!st) throw device_failure("--backend cuda: " + st.message());
  opts->capacity_bytes = info.total_bytes;
  device.streams = std::make_unique<cuda_trace_streams>(events);
#else
  (void)events;
#endif
  return device;
}

// The --timeline file, opened before anything is replayed so a path that
// cannot be written fails at once with the system's reason. A file this
// tool created is removed again unless commit() is reached, so no
// half-written timeline is left; a file that was there before (or a device
// such as /dev/stdout) is never removed.
class timeline_file {
 public:
  explicit timeline_file(const std::string& path) : path_(path) {
    std::error_code ignored;
    created_ = !std::filesystem::exists(std::filesystem::symlink_status(path, ignored));
    errno = 0;
    file_ = std::fopen(path.c_str(), "w");
    const int errnum = errno;
    if (file_ == nullptr) throw timeline_failure(path, "cannot open for writing", errnum);
  }
  ~timeline_file() {
    if (file_ == nullptr) return;
    std::fclose(file_);
    discard();
  }
  timeline_file(const timeline_file&) = delete;
  timeline_file& operator=(const timeline_file&) = delete;

  std::FILE* get() const { return file_; }

  // Closes the file; throws timeline_failure when any write failed.
  void commit() {
    const bool write_error = std::ferror(file_) != 0;
    const int write_errnum = errno;  // set by the failed write, if one failed
    std::FILE* file = file_;
    file_ = nullptr;
    errno = 0;
    const bool close_error = std::fclose(file) != 0;
    const int errnum = write_error ? write_errnum : errno;
    if (write_error || close_error) {
      discard();
      throw timeline_failure(path_, "error writing", errnum);
    }
  }

  class timeline_failure : public std::runtime_error {
   public:
    timeline_failure(const std::string& path, const std::string& what, int errnum)
        : std::runtime_error("--timeline " + path + ": " + what + ": " + std::strerror(errnum)) {}
  };

 private:
  void discard() const {
    if (created_) std::remove(path_.c_str());
  }

  std::string path_;
  std::FILE* file_ = nullptr;
  bool created_ = false;  // the file did not exist before
};

// Replays `events` again, untimed, on a fresh allocator and writes the
// allocated (live requested) and reserved bytes after every allocate and
// free, numbered as the alloc/free_completed events of the trace.
void write_timeline(const std::vector<trace_file_event>& events, caching_allocator& allocator, timeline_file& out) {
  std::FILE* file = out.get();
  std::fputs("op,allocated_bytes,reserved_bytes\n", file);
  constexpr int k_all = static_cast<int>(stat_type::all);
  replay_calls(
      events, allocator, [](std::uint64_t, const trace_file_event&) { return true; },
      [&](std::uint64_t op) {
        const device_stats stats = allocator.stats();
        std::fprintf(file, "%llu,%lld,%lld\n", static_cast<unsigned long long>(op),
                     static_cast<long long>(stats.requested_bytes[k_all].current),
                     static_cast<long long>(stats.reserved_bytes[k_all].current));
      });
  out.commit();
}

int fail(int code, const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", k_program, message.c_str());
  return code;
}

// One trace of --all: its figures, or why it could not be replayed.
struct trace_outcome {
  std::string path;
  std::string name;  // file name less .trace.csv[.gz]
  replay_result result;
  std::string error;  // empty: replayed
};

// The trace at `path`, with the allocations made before its recording
// began, and *result's skipped_actions and frees_at_requests; a warning
// names the lines skipped, and the frees replayed at their requests.
std::vector<trace_file_event> load_for_replay(const std::string& path, replay_result* result) {
  std::vector<trace_file_event> events = load_trace(path, &result->skipped_actions);
  const std::vector<skipped_action>& skipped = result->skipped_actions;
  if (!skipped.empty()) {
    std::fprintf(stderr, "%s: warning: %s: skipped %s: %s\n", k_program, path.c_str(),
                 skipped_lines_text(skipped).c_str(), skipped_names(skipped, true).c_str());
  }
  result->frees_at_requests = free_at_requests_without_completions(&events);
  if (result->frees_at_requests > 0) {
    std::fprintf(stderr, "%s: warning: %s: no free_completed line; %llu free_requested replayed as frees\n",
                 k_program, path.c_str(), static_cast<unsigned long long>(result->frees_at_requests));
  }
  add_allocations_before_recording(&events);
  return events;
}

// What load_for_replay found, into the result of the replay that followed.
void keep_loading_figures(replay_result& loaded, replay_result* result) {
  result->skipped_actions = std::move(loaded.skipped_actions);
  result->frees_at_requests = loaded.frees_at_requests;
}

// Loads and replays `path` on a fresh device; *shown takes the device's size
// and granularity (the GPU's with --backend cuda).
replay_result replay_one(options opts, const std::string& path, const allocator_config& config, options* shown) {
  replay_result loaded;
  std::vector<trace_file_event> events = load_for_replay(path, &loaded);
  const replay_device device = open_device(&opts, events);
  shown->capacity_bytes = opts.capacity_bytes;
  shown->granularity_bytes = opts.granularity_bytes;
  caching_allocator allocator(*device.backend, config);
  replay_result result = replay_trace(events, allocator, path);
  keep_loading_figures(loaded, &result);
  return result;
}

constexpr const char* k_trace_suffixes[] = {".trace.csv.gz", ".trace.csv"};
// Files that may hold a trace under another name: replayed when their
// header is a trace's.
constexpr const char* k_csv_suffixes[] = {".csv.gz", ".csv"};

// `file_name` less the first of `suffixes` it ends in; empty if none.
template <std::size_t n>
std::string name_less_suffix(const std::string& file_name, const char* const (&suffixes)[n]) {
  for (const char* suffix : suffixes) {
    const std::size_t length = std::strlen(suffix);
    if (file_name.size() > length && file_name.compare(file_name.size() - length, length, suffix) == 0) {
      return file_name.substr(0, file_name.size() - length);
    }
  }
  return std::string();
}

// Every trace file directly in `dir`, sorted by name: each *.trace.csv and
// *.trace.csv.gz, and each other *.csv or *.csv.gz whose header is a
// trace's (a warning names the others). Throws std::runtime_error (with the
// system's reason) when `dir` cannot be read.
std::vector<trace_outcome> find_traces(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code error;
  fs::directory_iterator it(dir, error);
  if (error) throw std::runtime_error("--all " + dir + ": cannot read the folder: " + error.message());
  std::vector<trace_outcome> traces;
  for (; it != fs::directory_iterator(); it.increment(error)) {
    if (error) throw std::runtime_error("--all " + dir + ": " + error.message());
    const std::string file_name = it->path().filename().string();
    std::string name = name_less_suffix(file_name, k_trace_suffixes);
    const bool named_trace = !name.empty();
    if (!named_trace) name = name_less_suffix(file_name, k_csv_suffixes);
    if (name.empty()) continue;
    std::error_code type_error;
    if (it->is_directory(type_error)) continue;
    trace_outcome trace;
    trace.path = it->path().string();
    trace.name = name;
    if (!named_trace) {
      try {
        trace_reader header_only(trace.path);
      } catch (const trace_error& e) {
        std::fprintf(stderr, "%s: warning: --all %s: not replayed, not a trace: %s\n", k_program, dir.c_str(),
                     e.what());
        continue;
      }
    }
    traces.push_back(std::move(trace));
  }
  if (error) throw std::runtime_error("--all " + dir + ": " + error.message());
  std::sort(traces.begin(), traces.end(),
            [](const trace_outcome& a, const trace_outcome& b) { return a.path < b.path; });
  return traces;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2.0;
}

// The corpus figures: median and worst of the replayed traces' ratios.
struct corpus_summary {
  std::size_t replayed = 0;
  std::size_t failed = 0;
  double median_ratio = 0.0;
  double worst_ratio = 0.0;
  std::string worst_trace;
  std::size_t native_count = 0;  // replayed traces with native figures, lower bounds aside
  double median_native_ratio = 0.0;
  std::size_t native_lower_bounds = 0;  // traces recorded mid-run: native's figures are lower bounds
  std::vector<std::string> recorded_mid_run;  // "name (blocks)"
};

corpus_summary summarize(const std::vector<trace_outcome>& traces) {
  corpus_summary s;
  std::vector<double> ratios;
  std::vector<double> native_ratios;
  for (const trace_outcome& t : traces) {
    if (!t.error.empty()) {
      ++s.failed;
      continue;
    }
    ++s.replayed;
    ratios.push_back(t.result.frag_ratio);
    if (t.result.frag_ratio > s.worst_ratio) {
      s.worst_ratio = t.result.frag_ratio;
      s.worst_trace = t.name;
    }
    if (t.result.native_recorded) {
      if (native_lower_bound(t.result)) {
        ++s.native_lower_bounds;
      } else {
        native_ratios.push_back(t.result.native_frag_ratio);
      }
    }
    if (t.result.allocs_before_recording > 0) {
      s.recorded_mid_run.push_back(t.name + " (" + std::to_string(t.result.allocs_before_recording) + ")");
    }
  }
  s.median_ratio = median(ratios);
  s.native_count = native_ratios.size();
  s.median_native_ratio = median(native_ratios);
  return s;
}

void print_all_table(const options& opts, const allocator_config& config, const std::vector<trace_outcome>& traces,
                     const corpus_summary& s) {
  std::printf("folder    %s: %zu traces\n", opts.all_dir.c_str(), traces.size());
  std::printf("device    %s (%s), capacity %s, granularity %s, a fresh one for each trace\n",
              opts.backend.c_str(), device_label(opts.backend).c_str(), bytes_cell(opts.capacity_bytes).c_str(),
              bytes_cell(opts.granularity_bytes).c_str());
  std::printf("config    %s\n\n", config.to_string().c_str());

  std::size_t name_width = 5;
  for (const trace_outcome& t : traces) name_width = std::max(name_width, t.name.size());
  const int width = static_cast<int>(name_width);
  std::printf("%-*s %9s %14s %14s %7s %8s %8s\n", width, "trace", "events", "peak alloc", "peak reserved", "ratio",
              "native", "stitches");
  for (const trace_outcome& t : traces) {
    if (!t.error.empty()) {
      std::printf("%-*s FAILED: %s\n", width, t.name.c_str(), t.error.c_str());
      continue;
    }
    const replay_result& r = t.result;
    char native[16] = "-";
    if (r.native_recorded) {
      std::snprintf(native, sizeof native, "%s%.4f", native_lower_bound(r) ? ">=" : "", r.native_frag_ratio);
    }
    std::printf("%-*s %9llu %14s %14s %7.4f %8s %8lld\n", width, t.name.c_str(),
                static_cast<unsigned long long>(r.events), format_bytes(r.peak_allocated_bytes).c_str(),
                format_bytes(r.peak_reserved_bytes).c_str(), r.frag_ratio, native,
                static_cast<long long>(r.stitched_blocks));
  }
  std::printf("\n");
  if (s.replayed > 0) {
    std::printf("median ratio %.4f", s.median_ratio);
    if (s.native_count > 0) {
      std::printf(" (native %.4f over %zu traces%s)", s.median_native_ratio, s.native_count,
                  s.native_lower_bounds > 0 ? ", lower bounds aside" : "");
    }
    std::printf(", worst %.4f (%s), over %zu traces replayed\n", s.worst_ratio, s.worst_trace.c_str(), s.replayed);
  }
  if (s.failed > 0) std::printf("%zu of %zu traces could not be replayed\n", s.failed, traces.size());
  if (!s.recorded_mid_run.empty()) {
    std::printf("\n%zu trace%s recorded mid-run; the blocks each frees without an alloc (how many in\n"
                "parentheses) were replayed as allocated before its first event:\n",
                s.recorded_mid_run.size(), s.recorded_mid_run.size() == 1 ? "" : "s");
    std::size_t column = 0;
    for (std::size_t i = 0; i < s.recorded_mid_run.size(); ++i) {
      const std::string item = s.recorded_mid_run[i] + (i + 1 < s.recorded_mid_run.size() ? "," : "");
      if (column > 0 && column + 1 + item.size() > 78) {
        std::printf("\n");
        column = 0;
      }
      std::printf("%s%s", column > 0 ? " " : "  ", item.c_str());
      column += (column > 0 ? 1 : 2) + item.size();
    }
    std::printf("\n");
  }
  std::printf("\nratio: streamalloc's peak reserved / peak allocated, replayed on the %s;\n"
              "1.0 is the floor (every reserved byte in use at the peak). native: the same for\n"
              "PyTorch's native allocator as recorded in the trace's segment events ('-' when\n"
              "it has none; '>=' a lower bound, for a trace recorded mid-run). stitches:\n"
              "allocations served by stitched chunks (expandable segments), each after a\n"
              "stream synchronization.\n",
              device_label(opts.backend).c_str());
}

void print_all_json(const options& opts, const allocator_config& config, const std::vector<trace_outcome>& traces,
                    const corpus_summary& s) {
  json_writer w;
  w.begin_object();
  w.key("tool").value(k_program).key("version").value(k_version);
  w.key("dir").value(opts.all_dir).key("backend").value(opts.backend);
  w.key("capacity_bytes").value(opts.capacity_bytes).key("granularity_bytes").value(opts.granularity_bytes);
  w.key("config").value(config.to_string());
  w.newline().key("traces").begin_array();
  for (const trace_outcome& t : traces) {
    w.newline().begin_object();
    w.key("trace").value(t.path).key("name").value(t.name);
    if (t.error.empty()) {
      json_members(w, t.result);
    } else {
      w.key("error").value(t.error);
    }
    w.end_object();
  }
  w.newline().end_array();
  w.newline().key("replayed").value(s.replayed).key("failed").value(s.failed);
  w.key("median_frag_ratio");
  if (s.replayed > 0) {
    w.value(s.median_ratio, 6).key("worst_frag_ratio").value(s.worst_ratio, 6).key("worst_trace").value(s.worst_trace);
  } else {
    w.null().key("worst_frag_ratio").null().key("worst_trace").null();
  }
  w.key("median_native_frag_ratio");
  if (s.native_count > 0) {
    w.value(s.median_native_ratio, 6);
  } else {
    w.null();
  }
  w.key("native_lower_bounds").value(s.native_lower_bounds);
  w.key("recorded_mid_run").value(s.recorded_mid_run.size());
  w.end_object();
  std::printf("%s\n", w.str().c_str());
}

int replay_all(const options& opts, const allocator_config& config) {
  std::vector<trace_outcome> traces;
  try {
    traces = find_traces(opts.all_dir);
  } catch (const std::exception& e) {
    return fail(k_exit_failure, e.what());
  }
  if (traces.empty()) {
    return fail(k_exit_failure, "--all " + opts.all_dir + ": no trace files (*.csv or *.csv.gz) in the folder");
  }
  options shown = opts;  // with --backend cuda, the GPU's size and granularity in the heading
  for (trace_outcome& t : traces) {
    try {
      t.result = replay_one(opts, t.path, config, &shown);
    } catch (const std::exception& e) {
      t.error = e.what();
    }
  }
  const corpus_summary summary = summarize(traces);
  if (opts.json) {
    print_all_json(shown, config, traces, summary);
  } else {
    print_all_table(shown, config, traces, summary);
  }
  for (const trace_outcome& t : traces) {
    if (!t.error.empty()) std::fprintf(stderr, "%s: %s\n", k_program, t.error.c_str());
  }
  return summary.failed == 0 ? 0 : k_exit_failure;
}

}  // namespace

int main(int argc, char** argv) {
  options opts;
  try {
    opts = parse_options(argc, argv);
  } catch (const usage_failure& e) {
    std::fprintf(stderr, "%s: %s\nTry '%s --help'.\n", k_program, e.what(), k_program);
    return k_exit_usage;
  }
  if (opts.help) {
    print_help();
    return 0;
  }
  if (opts.version) {
    std::printf("%s %s\n", k_program, k_version);
    return 0;
  }

  allocator_config environment;
  try {
    environment = allocator_config::from_environment();
  } catch (const config_error& e) {
    return fail(k_exit_usage, e.what());
  }
  allocator_config config;
  try {
    config = environment.with(opts.conf);
  } catch (const config_error& e) {
    // The parser names STREAMALLOC_CONF in its messages; here the text came from --conf.
    std::string reason = e.what();
    const std::string env_prefix = "STREAMALLOC_CONF: ";
    if (reason.rfind(env_prefix, 0) == 0) reason.erase(0, env_prefix.size());
    return fail(k_exit_usage, "--conf '" + opts.conf + "': " + reason);
  }

  if (!opts.all_dir.empty()) return replay_all(opts, config);

  std::unique_ptr<timeline_file> timeline;
  try {
    if (!opts.timeline.empty()) timeline = std::make_unique<timeline_file>(opts.timeline);
  } catch (const std::exception& e) {
    return fail(k_exit_failure, e.what());
  }

  try {
    replay_result loaded;
    std::vector<trace_file_event> events = load_for_replay(opts.trace, &loaded);
    const replay_device device = open_device(&opts, events);
    replay_result result;
    {
      caching_allocator allocator(*device.backend, config);
      result = replay_trace(events, allocator, opts.trace);
    }
    keep_loading_figures(loaded, &result);
    std::unique_ptr<peak_anatomy> anatomy;
    if (opts.peak_anatomy) {
      anatomy = std::make_unique<peak_anatomy>(examine_reserved_peak(
          events, [&] { return std::make_unique<caching_allocator>(*device.backend, config); }));
    }
    if (opts.json) {
      print_json(opts, config, result, anatomy.get());
    } else {
      print_table(opts, config, result);
      if (anatomy) print_anatomy(*anatomy);
    }
    if (timeline) {
      caching_allocator fresh(*device.backend, config);
      write_timeline(events, fresh, *timeline);
    }
  } catch (const trace_error& e) {
    return fail(k_exit_failure, e.what());
  } catch (const replay_out_of_memory& e) {
    return fail(k_exit_failure, e.what());
  } catch (const timeline_file::timeline_failure& e) {
    return fail(k_exit_failure, e.what());
  } catch (const std::exception& e) {
    return fail(k_exit_failure, std::string("replay failed: ") + e.what());
  }
  return 0;
}
