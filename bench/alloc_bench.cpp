// streamalloc-bench: times allocate+free pairs of every allocator in one
// process and one run (streamalloc's C++ API, torch's native caching
// allocator, cudaMallocAsync, cudaMalloc) over the same patterns, and prints
// them side by side. --smoke runs streamalloc on the simulated device in
// seconds (the bench_smoke CI test).
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench_allocator.hpp"
#include "bench_patterns.hpp"
#include "bench_report.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"
#include "streamalloc/version.hpp"

namespace {

using namespace streamalloc;
using namespace streamalloc::bench;

constexpr const char* k_program = "streamalloc-bench";
constexpr int k_exit_failure = 1;  // no device, or an allocator or pattern failed
constexpr int k_exit_usage = 2;

constexpr std::size_t k_mixed_min_bytes = 256;
constexpr std::size_t k_mixed_max_bytes = 16_MiB;
constexpr std::uint32_t k_mixed_max_live = 4096;
constexpr std::size_t k_mixed_steps = 80'000;  // about 42k pairs: the live count reaches 4096 halfway
constexpr std::uint32_t k_thread_max_live = 64;  // per thread, so 16 threads hold a few GiB at most
constexpr std::size_t k_smoke_mixed_steps = 2'000;

const char* const k_patterns[] = {"same", "mixed", "threads", "cross"};

class usage_failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct options {
  bool smoke = false;
  std::string device;  // cuda | sim; empty: cuda when built with it
  std::vector<std::string> allocators;  // empty: every one the device has
  std::vector<std::string> patterns = {"same", "mixed", "threads", "cross"};
  std::vector<std::size_t> sizes = {256, 64_KiB, 4_MiB, 64_MiB};
  std::vector<std::size_t> cross_sizes = {256, 64_KiB, 4_MiB, 64_MiB};  // the same-size sizes
  std::vector<int> threads = {8, 16};
  bool threads_given = false;
  std::string thread_streams = "own";
  std::uint64_t seed = 20261129;
  std::string conf;
  std::string json;
  int premade_arenas = 1;
  run_plan plan;
  std::size_t mixed_steps = k_mixed_steps;
  std::vector<std::string> overrides;  // counts set on the command line, for the report
  bool help = false;
  bool version = false;
};

void print_help() {
  std::printf(
      "usage: %s [options]\n"
      "\n"
      "Times allocate+free pairs of several allocators in one process, over the same\n"
      "patterns, and prints markdown tables (median and p10/p90 over repetitions).\n"
      "\n"
      "allocators (default: every one the device supports):\n"
      "  streamalloc    streamalloc's device_allocator, direct C++ API\n"
      "  torch_native   PyTorch's native caching allocator (c10 raw_alloc_with_stream /\n"
      "                 raw_delete); built with STREAMALLOC_TORCH; needs\n"
      "                 PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF unset\n"
      "  cuda_async     cudaMallocAsync/cudaFreeAsync, default pool, release threshold max\n"
      "  cuda_malloc    cudaMalloc/cudaFree (slow: 1/100 of the iterations)\n"
      "\n"
      "patterns (default: all):\n"
      "  same     same-size pairs, one size at a time (--sizes), default stream\n"
      "  mixed    log-uniform sizes 256 B..16 MiB, up to 4096 live, random frees\n"
      "  threads  N threads at once (--threads), each its own mixed sequence (<= 64 live)\n"
      "  cross    alloc+free on stream A then on stream B, alternating (--cross-sizes)\n"
      "\n"
      "options:\n"
      "  --smoke               simulated device, streamalloc only, tiny counts (CI)\n"
      "  --device cuda|sim     device to run on (default cuda when built with CUDA)\n"
      "  --allocators LIST     comma-separated allocator names\n"
      "  --patterns LIST       comma-separated pattern names\n"
      "  --sizes LIST          same-size pattern sizes (default 256,64KiB,4MiB,64MiB)\n"
      "  --cross-sizes LIST    cross-stream sizes (default 256,64KiB,4MiB,64MiB)\n"
      "  --threads LIST        thread counts (default 8,16)\n"
      "  --thread-streams own|shared   a stream per thread (default) or one for all\n"
      "  --reps N              timed repetitions (default 15)\n"
      "  --warmup N            untimed repetitions before them (default 1)\n"
      "  --pairs N             pairs per repetition, same-size and cross (default 20000)\n"
      "  --thread-pairs N      pairs per thread per repetition (default 10000)\n"
      "  --mixed-steps N       steps of the mixed sequence (default 80000)\n"
      "  --seed N              seed of the mixed sequences (default 20261129)\n"
      "  --conf TEXT           streamalloc settings on top of STREAMALLOC_CONF\n"
      "  --premade-arenas N    streamalloc: make N arenas before the patterns (the calling\n"
      "                        thread moved to the last and back), as threads that once\n"
      "                        contended would; one thread then times that path (default 1)\n"
      "  --json FILE           also write the results as JSON\n"
      "  --version             print the version and exit\n"
      "  -h, --help            this help\n"
      "\n"
      "Sizes take B, KiB, MiB, GiB suffixes. Exit status: 0 all ran, 1 no device or an\n"
      "allocator or pattern failed (the tables still print), 2 bad command line.\n",
      k_program);
}

std::vector<std::string> split_list(const std::string& text, const std::string& option) {
  std::vector<std::string> out;
  std::string item;
  for (const char c : text + ",") {
    if (c != ',') {
      item += c;
      continue;
    }
    if (item.empty()) throw usage_failure(option + " '" + text + "': empty item");
    out.push_back(item);
    item.clear();
  }
  return out;
}

std::uint64_t parse_count(const std::string& text, const std::string& option) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos || text.size() > 18) {
    throw usage_failure(option + " '" + text + "': expected a whole number");
  }
  return std::stoull(text);
}

std::size_t parse_size(const std::string& text, const std::string& option) {
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  std::string unit;
  for (std::size_t i = digits; i < text.size(); ++i) unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
  std::size_t scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  if (unit == "k" || unit == "kib") scale = 1_KiB;
  if (unit == "m" || unit == "mib") scale = 1_MiB;
  if (unit == "g" || unit == "gib") scale = 1_GiB;
  if (digits == 0 || digits > 12 || scale == 0) {
    throw usage_failure(option + " '" + text + "': expected a size such as 256, 64KiB or 4MiB");
  }
  const std::size_t bytes = std::stoull(text.substr(0, digits)) * scale;
  if (bytes == 0 || bytes > 64_GiB) throw usage_failure(option + " '" + text + "': must be 1 B..64 GiB");
  return bytes;
}

void require_known(const std::vector<std::string>& items, const std::vector<std::string>& known, const char* what) {
  for (const std::string& item : items) {
    bool found = false;
    for (const std::string& k : known) found = found || k == item;
    if (!found) {
      std::string list;
      for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
      throw usage_failure("unknown " + std::string(what) + " '" + item + "' (known: " + list + ")");
    }
  }
}

options parse_options(int argc, char** argv) {
  options opts;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    const std::size_t equals = arg.find('=');
    if (arg.rfind("--", 0) == 0 && equals != std::string::npos) {
      value = arg.substr(equals + 1);
      arg.resize(equals);
      has_value = true;
    }
    const auto take = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) throw usage_failure(arg + " needs a value");
      return argv[++i];
    };
    const auto count_option = [&](const char* name) {
      const std::uint64_t n = parse_count(take(), arg);
      if (n == 0) throw usage_failure(arg + " must be at least 1");
      opts.overrides.push_back(std::string(name) + "=" + std::to_string(n));
      return n;
    };
    if (arg == "-h" || arg == "--help") {
      opts.help = true;
    } else if (arg == "--version") {
      opts.version = true;
    } else if (arg == "--smoke") {
      opts.smoke = true;
    } else if (arg == "--device") {
      opts.device = take();
      if (opts.device != "cuda" && opts.device != "sim") throw usage_failure("--device must be cuda or sim");
    } else if (arg == "--allocators") {
      opts.allocators = split_list(take(), arg);
    } else if (arg == "--patterns") {
      opts.patterns = split_list(take(), arg);
      require_known(opts.patterns, {std::begin(k_patterns), std::end(k_patterns)}, "pattern");
    } else if (arg == "--sizes" || arg == "--cross-sizes") {
      std::vector<std::size_t>& target = arg == "--sizes" ? opts.sizes : opts.cross_sizes;
      target.clear();
      for (const std::string& item : split_list(take(), arg)) target.push_back(parse_size(item, arg));
    } else if (arg == "--threads") {
      opts.threads.clear();
      opts.threads_given = true;
      for (const std::string& item : split_list(take(), arg)) {
        const std::uint64_t n = parse_count(item, arg);
        if (n == 0 || n > 1024) throw usage_failure("--threads: counts must be 1..1024");
        opts.threads.push_back(static_cast<int>(n));
      }
    } else if (arg == "--thread-streams") {
      opts.thread_streams = take();
      if (opts.thread_streams != "own" && opts.thread_streams != "shared") {
        throw usage_failure("--thread-streams must be own or shared");
      }
    } else if (arg == "--reps") {
      opts.plan.reps = static_cast<int>(std::min<std::uint64_t>(count_option("reps"), 100'000));
    } else if (arg == "--warmup") {
      const std::uint64_t n = parse_count(take(), arg);
      opts.plan.warmup_reps = static_cast<int>(std::min<std::uint64_t>(n, 1'000));
      opts.overrides.push_back("warmup=" + std::to_string(n));
    } else if (arg == "--pairs") {
      opts.plan.pairs_per_rep = count_option("pairs");
    } else if (arg == "--thread-pairs") {
      opts.plan.thread_pairs_per_rep = count_option("thread-pairs");
    } else if (arg == "--mixed-steps") {
      opts.mixed_steps = count_option("mixed-steps");
    } else if (arg == "--seed") {
      opts.seed = parse_count(take(), arg);
    } else if (arg == "--conf") {
      opts.conf = take();
    } else if (arg == "--premade-arenas") {
      const std::uint64_t n = parse_count(take(), arg);
      if (n == 0 || n > allocator_config::k_max_arenas) {
        throw usage_failure("--premade-arenas must be 1.." + std::to_string(allocator_config::k_max_arenas));
      }
      opts.premade_arenas = static_cast<int>(n);
    } else if (arg == "--json") {
      opts.json = take();
    } else {
      throw usage_failure("unknown argument '" + arg + "'");
    }
  }
  return opts;
}

// Tiny counts for CI; explicit count options given with --smoke still win.
void apply_smoke(options* opts) {
  run_plan smoke;
  smoke.reps = 3;
  smoke.warmup_reps = 1;
  smoke.pairs_per_rep = 500;
  smoke.thread_pairs_per_rep = 200;
  const auto overridden = [&](const std::string& name) {
    for (const std::string& o : opts->overrides) {
      if (o.rfind(name + "=", 0) == 0) return true;
    }
    return false;
  };
  if (!overridden("reps")) opts->plan.reps = smoke.reps;
  if (!overridden("warmup")) opts->plan.warmup_reps = smoke.warmup_reps;
  if (!overridden("pairs")) opts->plan.pairs_per_rep = smoke.pairs_per_rep;
  if (!overridden("thread-pairs")) opts->plan.thread_pairs_per_rep = smoke.thread_pairs_per_rep;
  if (!overridden("mixed-steps")) opts->mixed_steps = k_smoke_mixed_steps;
  if (!opts->threads_given) opts->threads = {2, 4};
}

struct candidate {
  std::string name;
  std::function<std::unique_ptr<bench_allocator>()> make;
};

// The allocators `device` can run, in column order.
std::vector<candidate> candidates(bench_device& device, const allocator_config& config) {
  std::vector<candidate> out;
  out.push_back({"streamalloc", [&device, config] { return make_streamalloc_adaptor(device, config); }});
  if (device.simulated()) return out;
#ifdef STREAMALLOC_BENCH_HAVE_TORCH
  out.push_back({"torch_native", [&device] { return make_torch_native_adaptor(device); }});
#endif
#ifdef STREAMALLOC_BENCH_HAVE_CUDA
  out.push_back({"cuda_async", [&device] { return make_cuda_async_adaptor(device); }});
  out.push_back({"cuda_malloc", [&device] { return make_cuda_malloc_adaptor(device); }});
#endif
  return out;
}

std::vector<std::string> every_allocator_name() {
  return {"streamalloc", "torch_native", "cuda_async", "cuda_malloc"};
}

std::unique_ptr<bench_device> open_device(const options& opts, std::string* error) {
  if (opts.device == "sim") return make_sim_device();
#ifdef STREAMALLOC_BENCH_HAVE_CUDA
  return make_cuda_device(error);
#else
  *error = "this build has no CUDA backend (the CUDA toolkit was not found or STREAMALLOC_CUDA is OFF)";
  return nullptr;
#endif
}

struct entry {
  std::unique_ptr<bench_allocator> allocator;
  bool broken = false;  // a pattern failed: later patterns skip it
};

class bench_run {
 public:
  bench_run(std::vector<entry>& entries, const run_plan& plan, run_info& info)
      : entries_(entries), plan_(plan), info_(info) {}

  // Runs `body` for every working allocator, then end_pattern; a failure
  // becomes an error cell and a note, and retires that allocator.
  void each(const std::function<measurement(bench_allocator&, const run_plan&)>& body, const std::string& pattern,
            const std::string& label) {
    for (entry& e : entries_) {
      if (e.broken) continue;
      bench_allocator& a = *e.allocator;
      measurement m;
      try {
        m = body(a, plan_.for_allocator(a));
      } catch (const std::exception& ex) {
        m.pattern = pattern;
        m.label = label;
        m.allocator = a.name();
        m.error = ex.what();
      }
      try {
        a.end_pattern();
        if (const std::string work = a.device_work(); !work.empty() && m.error.empty()) {
          info_.notes.push_back(std::string(a.name()) + " in " + pattern + " " + label + ": " + work);
        }
      } catch (const std::exception& ex) {
        if (m.error.empty()) m.error = ex.what();
      }
      if (!m.error.empty()) {
        e.broken = true;
        failed_ = true;
        info_.notes.push_back(std::string(a.name()) + " failed in " + pattern + " " + label + ": " + m.error +
                              " (skipped for the remaining patterns)");
        std::fprintf(stderr, "%s: %s failed in %s %s: %s\n", k_program, a.name(), pattern.c_str(), label.c_str(),
                     m.error.c_str());
      }
      results_.push_back(std::move(m));
    }
  }

  std::vector<measurement>& results() { return results_; }
  bool failed() const { return failed_; }

 private:
  std::vector<entry>& entries_;
  const run_plan& plan_;
  run_info& info_;
  std::vector<measurement> results_;
  bool failed_ = false;
};

int run(options opts) {
  if (opts.smoke) {
    if (opts.device == "cuda") throw usage_failure("--smoke runs on the simulated device; drop --device cuda");
    opts.device = "sim";
    apply_smoke(&opts);
  }
  allocator_config config;
  try {
    config = allocator_config::from_environment().with(opts.conf);
  } catch (const config_error& e) {
    throw usage_failure(std::string("streamalloc settings: ") + e.what());
  }
  if (!opts.allocators.empty()) require_known(opts.allocators, every_allocator_name(), "allocator");
  if (static_cast<std::size_t>(opts.premade_arenas) > config.arenas) {
    throw usage_failure("--premade-arenas " + std::to_string(opts.premade_arenas) + " needs the arenas setting at " +
                        std::to_string(opts.premade_arenas) + " or more (it is " + std::to_string(config.arenas) + ")");
  }

  std::string device_error;
  std::unique_ptr<bench_device> device = open_device(opts, &device_error);
  if (device == nullptr) {
    std::fprintf(stderr, "%s: no GPU to run on: %s\nUse --smoke or --device sim for the simulated device.\n",
                 k_program, device_error.c_str());
    return k_exit_failure;
  }

  run_info info;
  info.device = device->description();
  info.mode = opts.smoke ? "smoke" : "full";
  for (const std::string& o : opts.overrides) info.mode += " " + o;
  info.thread_streams = opts.thread_streams;
  info.seed = opts.seed;
  info.plan = opts.plan;
  bool failed = false;

  std::vector<entry> entries;
  for (candidate& c : candidates(*device, config)) {
    bool wanted = opts.allocators.empty();
    for (const std::string& name : opts.allocators) wanted = wanted || name == c.name;
    if (!wanted) continue;
    try {
      std::unique_ptr<bench_allocator> made = c.make();
      if (made->premake_arenas(opts.premade_arenas)) {
        info.notes.push_back(c.name + ": " + std::to_string(opts.premade_arenas) +
                             " arenas made before the patterns (--premade-arenas)");
      }
      entries.push_back({std::move(made), false});
      info.allocators.push_back(c.name);
      info.settings.emplace_back(c.name, entries.back().allocator->settings());
    } catch (const std::exception& e) {
      failed = true;
      info.notes.push_back(c.name + " not measured: " + e.what());
      std::fprintf(stderr, "%s: %s not measured: %s\n", k_program, c.name.c_str(), e.what());
    }
  }
  for (const std::string& name : opts.allocators) {
    bool available = false;
    for (const std::string& n : info.allocators) available = available || n == name;
    if (!available && (device->simulated() || name == "torch_native")) {
      failed = true;
      info.notes.push_back(name + " is not available " +
                           (device->simulated() ? std::string("on the simulated device")
                                                : std::string("in this build (configure with -DSTREAMALLOC_TORCH=ON)")));
    }
  }
  if (entries.empty()) {
    std::fprintf(stderr, "%s: no allocator to measure\n", k_program);
    print_tables(info, {});
    return k_exit_failure;
  }

  const auto has_pattern = [&](const char* name) {
    for (const std::string& p : opts.patterns) {
      if (p == name) return true;
    }
    return false;
  };
  const bench_stream default_stream = 0;
  bench_run bench(entries, opts.plan, info);

  if (has_pattern("same")) {
    for (const std::size_t bytes : opts.sizes) {
      bench.each([&](bench_allocator& a, const run_plan& plan) { return run_same_size(a, *device, default_stream, bytes, plan); },
                 "same", size_label(bytes));
    }
  }
  if (has_pattern("mixed")) {
    const mixed_sequence sequence =
        make_mixed_sequence(opts.seed, opts.mixed_steps, k_mixed_max_live, k_mixed_min_bytes, k_mixed_max_bytes);
    bench.each([&](bench_allocator& a, const run_plan& plan) { return run_mixed(a, *device, default_stream, sequence, plan); },
               "mixed", sequence.description);
  }
  if (has_pattern("threads")) {
    int most = 0;
    for (const int n : opts.threads) most = std::max(most, n);
    std::vector<bench_stream> own_streams;
    for (int t = 0; t < most; ++t) own_streams.push_back(device->create_stream());
    const bench_stream shared_stream = device->create_stream();
    std::vector<mixed_sequence> sequences;
    for (int t = 0; t < most; ++t) {
      // About two steps per pair: each block allocated is freed again.
      sequences.push_back(make_mixed_sequence(opts.seed + 1 + static_cast<std::uint64_t>(t),
                                              opts.plan.thread_pairs_per_rep * 2, k_thread_max_live,
                                              k_mixed_min_bytes, k_mixed_max_bytes));
    }
    info.thread_workload = sequences.front().description;
    for (const int n : opts.threads) {
      const auto count = static_cast<std::size_t>(n);
      std::vector<bench_stream> streams =
          opts.thread_streams == "own" ? std::vector<bench_stream>(own_streams.begin(), own_streams.begin() + n)
                                       : std::vector<bench_stream>(count, shared_stream);
      const std::vector<mixed_sequence> mine(sequences.begin(), sequences.begin() + n);
      bench.each([&](bench_allocator& a, const run_plan& plan) { return run_threads(a, *device, streams, mine, plan); },
                 "threads", std::to_string(n) + " threads");
    }
  }
  if (has_pattern("cross")) {
    const bench_stream a_stream = device->create_stream();
    const bench_stream b_stream = device->create_stream();
    for (const std::size_t bytes : opts.cross_sizes) {
      bench.each(
          [&](bench_allocator& a, const run_plan& plan) { return run_cross_stream(a, *device, a_stream, b_stream, bytes, plan); },
          "cross", size_label(bytes));
    }
  }

  print_tables(info, bench.results());
  if (!opts.json.empty()) write_json(opts.json, info, bench.results());
  return failed || bench.failed() ? k_exit_failure : 0;
}

}  // namespace

int main(int argc, char** argv) {
  options opts;
  try {
    opts = parse_options(argc, argv);
    if (opts.help) {
      print_help();
      return 0;
    }
    if (opts.version) {
      std::printf("%s %s\n", k_program, STREAMALLOC_VERSION);
      return 0;
    }
    return run(std::move(opts));
  } catch (const usage_failure& e) {
    std::fprintf(stderr, "%s: %s\nTry '%s --help'.\n", k_program, e.what(), k_program);
    return k_exit_usage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", k_program, e.what());
    return k_exit_failure;
  }
}
