// streamalloc-replay: replays a recorded PyTorch allocation trace through
// streamalloc on a simulated device or a real GPU and prints its peak
// reserved memory and call cost next to what PyTorch's native allocator
// reserved for that run.
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
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
#include "trace_reader.hpp"
#include "trace_replay.hpp"

namespace {

using namespace streamalloc;

constexpr const char* k_program = "streamalloc-replay";
constexpr std::size_t k_default_capacity_bytes = 141'000'000'000;  // an H200's 141 GB
constexpr int k_exit_failure = 1;  // unreadable or inconsistent trace, out of memory, no GPU
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
  std::string conf;
  std::string timeline;
  bool json = false;
  bool help = false;
  std::string trace;
};

void print_help() {
  std::printf(
      "usage: %s [options] TRACE\n"
      "\n"
      "Replays an allocation trace (CSV `action,addr,size,stream`, plain or gzip'd;\n"
      "see shared/traces/README.md) through streamalloc's caching allocator and\n"
      "reports peak allocated and reserved bytes, their ratio, segments created and\n"
      "the cost of the allocate/free calls, next to the figures of PyTorch's native\n"
      "allocator recorded in the trace's segment events.\n"
      "\n"
      "options:\n"
      "  --backend NAME    device to replay on: sim (default, a simulated device)\n"
      "                    or cuda (CUDA device 0 through streamalloc's CUDA\n"
      "                    backend; trace streams become created streams, 0 the\n"
      "                    default stream)\n"
      "  --capacity BYTES  simulated device size, default 141G. Suffixes: K M G T\n"
      "                    (powers of 1000, also KB MB GB TB), KiB MiB GiB TiB.\n"
      "                    Ignored with --backend cuda\n"
      "  --timeline FILE   after the timed replay, replay again on a fresh allocator\n"
      "                    and write CSV `op,allocated_bytes,reserved_bytes` after\n"
      "                    every allocate/free (for scripts/plot_replay.py)\n"
      "  --conf TEXT       allocator settings \"key:value,...\" applied on top of\n"
      "                    the STREAMALLOC_CONF environment variable\n"
      "  --json            print one JSON object instead of a table\n"
      "  -h, --help        print this help\n"
      "\n"
      "allocator settings (--conf / STREAMALLOC_CONF):\n",
      k_program);
  for (const allocator_config::key_doc& key : allocator_config::keys()) {
    std::printf("  %-30s %s\n", key.key, key.description);
  }
  std::printf(
      "\n"
      "exit status: 0 success, 1 unreadable or inconsistent trace, out of memory or\n"
      "no usable GPU (--backend cuda), 2 bad command line or settings.\n");
}

std::size_t parse_capacity(const std::string& text) {
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == 0) throw usage_failure("--capacity '" + text + "': expected a byte count such as 141G or 80GiB");
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
    throw usage_failure("--capacity '" + text + "': unknown unit '" + text.substr(digits) +
                        "' (use K, M, G, T, KiB, MiB, GiB or TiB)");
  }
  constexpr std::size_t k_max = std::numeric_limits<std::size_t>::max();
  std::size_t count = 0;
  for (std::size_t i = 0; i < digits; ++i) {
    const auto digit = static_cast<std::size_t>(text[i] - '0');
    if (count > (k_max - digit) / 10) throw usage_failure("--capacity '" + text + "': too large");
    count = count * 10 + digit;
  }
  if (count > k_max / found->bytes) throw usage_failure("--capacity '" + text + "': too large");
  if (count == 0) throw usage_failure("--capacity '" + text + "': must be more than 0 bytes");
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
    } else if (arg == "--json") {
      if (has_value) throw usage_failure("--json takes no value");
      opts.json = true;
    } else if (arg == "--backend") {
      opts.backend = take_value();
    } else if (arg == "--capacity") {
      opts.capacity_bytes = parse_capacity(take_value());
      opts.capacity_given = true;
    } else if (arg == "--timeline") {
      opts.timeline = take_value();
      if (opts.timeline.empty()) throw usage_failure("--timeline needs a file name");
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
  if (opts.help) return opts;
  if (!trace_given) throw usage_failure("no trace given");
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

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  out += "\"";
  return out;
}

void print_json(const options& opts, const allocator_config& config, const replay_result& r) {
  const bool native = r.native_segments > 0;
  std::printf("{\"trace\": %s, \"backend\": %s, \"capacity_bytes\": %zu, \"config\": %s,\n",
              json_string(opts.trace).c_str(), json_string(opts.backend).c_str(), opts.capacity_bytes,
              json_string(config.to_string()).c_str());
  std::printf(" \"events\": %llu, \"ops\": %llu, \"allocs\": %llu, \"frees\": %llu, \"live_at_end\": %llu,\n",
              static_cast<unsigned long long>(r.events), static_cast<unsigned long long>(r.ops),
              static_cast<unsigned long long>(r.allocs), static_cast<unsigned long long>(r.frees),
              static_cast<unsigned long long>(r.live_at_end));
  std::printf(" \"peak_allocated_bytes\": %zu, \"trace_peak_live_bytes\": %zu, \"peak_reserved_bytes\": %zu,\n",
              r.peak_allocated_bytes, r.trace_peak_live_bytes, r.peak_reserved_bytes);
  std::printf(" \"frag_ratio\": %.6f, \"segments\": %lld, \"total_ns\": %llu, \"ns_per_op\": %.2f,\n", r.frag_ratio,
              static_cast<long long>(r.segments), static_cast<unsigned long long>(r.total_ns), r.ns_per_op);
  std::printf(" \"chunk_maps\": %lld, \"chunk_unmaps\": %lld, \"stitched_blocks\": %lld, \"stitch_syncs\": %lld,\n",
              static_cast<long long>(r.chunk_maps), static_cast<long long>(r.chunk_unmaps),
              static_cast<long long>(r.stitched_blocks), static_cast<long long>(r.stitch_syncs));
  std::printf(" \"native_segments\": %llu, \"native_peak_reserved_bytes\": %zu, \"native_frag_ratio\": ",
              static_cast<unsigned long long>(r.native_segments), r.native_peak_reserved_bytes);
  if (native) {
    std::printf("%.6f}\n", r.native_frag_ratio);
  } else {
    std::printf("null}\n");
  }
}

std::string bytes_cell(std::size_t bytes) { return std::to_string(bytes) + " (" + format_bytes(bytes) + ")"; }

void print_table(const options& opts, const allocator_config& config, const replay_result& r) {
  const bool native = r.native_segments > 0;
  const std::string not_recorded = "not in trace";
  std::printf("trace     %s\n", opts.trace.c_str());
  std::printf("          %llu events: %llu allocs, %llu frees, %llu never freed\n",
              static_cast<unsigned long long>(r.events), static_cast<unsigned long long>(r.allocs),
              static_cast<unsigned long long>(r.frees), static_cast<unsigned long long>(r.live_at_end));
  std::printf("device    %s, capacity %s\n", opts.backend.c_str(), bytes_cell(opts.capacity_bytes).c_str());
  std::printf("config    %s\n\n", config.to_string().c_str());

  std::printf("%-16s %-28s %s\n", "", "streamalloc", "native (recorded)");
  std::printf("%-16s %-28s %s\n", "peak allocated", bytes_cell(r.peak_allocated_bytes).c_str(),
              bytes_cell(r.trace_peak_live_bytes).c_str());
  std::printf("%-16s %-28s %s\n", "peak reserved", bytes_cell(r.peak_reserved_bytes).c_str(),
              native ? bytes_cell(r.native_peak_reserved_bytes).c_str() : not_recorded.c_str());
  char ours[32];
  char theirs[32];
  std::snprintf(ours, sizeof ours, "%.4f", r.frag_ratio);
  std::snprintf(theirs, sizeof theirs, "%.4f", r.native_frag_ratio);
  std::printf("%-16s %-28s %s\n", "reserved/alloc", ours, native ? theirs : not_recorded.c_str());
  std::printf("%-16s %-28lld %s\n", "segments", static_cast<long long>(r.segments),
              native ? std::to_string(r.native_segments).c_str() : not_recorded.c_str());
  if (r.chunk_maps > 0) {
    std::printf("%-16s %lld maps, %lld unmaps; %lld stitched blocks after %lld stream syncs\n", "chunks",
                static_cast<long long>(r.chunk_maps), static_cast<long long>(r.chunk_unmaps),
                static_cast<long long>(r.stitched_blocks), static_cast<long long>(r.stitch_syncs));
  }
  std::printf("\nallocate+free   %llu calls in %.3f ms: %.1f ns/op\n", static_cast<unsigned long long>(r.ops),
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
// to created streams and opts->capacity_bytes becomes the GPU's memory size.
replay_device open_device(options* opts, std::vector<trace_file_event>& events) {
  replay_device device;
  if (opts->backend == "sim") {
    sim_config sim;
    sim.capacity_bytes = opts->capacity_bytes;
    sim.events_complete_immediately = true;
    device.backend = std::make_unique<sim_backend>(sim);
    return device;
  }
#ifdef STREAMALLOC_HAVE_CUDA
  status error;
  device.backend = make_cuda_backend(0, &error);
  if (device.backend == nullptr) throw device_failure("--backend cuda: " + error.message());
  if (opts->capacity_given) std::fprintf(stderr, "%s: --capacity is ignored with --backend cuda\n", k_program);
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

// Replays `events` again, untimed, on a fresh allocator and writes the
// allocated (live requested) and reserved bytes after every allocate and
// free, numbered as the alloc/free_completed events of the trace.
void write_timeline(const std::vector<trace_file_event>& events, caching_allocator& allocator, const std::string& path) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write the timeline to " + path);
  out << "op,allocated_bytes,reserved_bytes\n";
  constexpr int k_all = static_cast<int>(stat_type::all);
  std::unordered_map<std::uint64_t, void*> live;  // trace address -> allocator pointer
  std::uint64_t op = 0;
  const auto record = [&] {
    const device_stats stats = allocator.stats();
    out << op++ << ',' << stats.requested_bytes[k_all].current << ',' << stats.reserved_bytes[k_all].current << '\n';
  };
  const auto free_all = [&] {
    for (const auto& entry : live) {
      if (entry.second != nullptr) allocator.free(entry.second);
    }
    live.clear();
  };
  try {
    for (const trace_file_event& e : events) {
      if (e.action == trace_file_action::alloc) {
        live.emplace(e.addr, allocator.allocate(e.size, static_cast<stream_handle>(e.stream)));
        record();
      } else if (e.action == trace_file_action::free_completed) {
        // replay_trace has already checked that every free is of a live address.
        const auto it = live.find(e.addr);
        void* ptr = it->second;
        live.erase(it);
        if (ptr != nullptr) allocator.free(ptr);
        record();
      }
    }
  } catch (...) {
    free_all();
    throw;
  }
  free_all();
  out.flush();
  if (!out) throw std::runtime_error("error writing the timeline to " + path);
}

int fail(int code, const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", k_program, message.c_str());
  return code;
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

  try {
    std::vector<trace_file_event> events = load_trace(opts.trace);
    const replay_device device = open_device(&opts, events);
    replay_result result;
    {
      caching_allocator allocator(*device.backend, config);
      result = replay_trace(events, allocator, opts.trace);
    }
    if (opts.json) {
      print_json(opts, config, result);
    } else {
      print_table(opts, config, result);
    }
    if (!opts.timeline.empty()) {
      caching_allocator fresh(*device.backend, config);
      write_timeline(events, fresh, opts.timeline);
    }
  } catch (const trace_error& e) {
    return fail(k_exit_failure, e.what());
  } catch (const replay_out_of_memory& e) {
    return fail(k_exit_failure, e.what());
  } catch (const std::exception& e) {
    return fail(k_exit_failure, std::string("replay failed: ") + e.what());
  }
  return 0;
}
