// The timed loops of streamalloc-bench. Each repetition is timed as a whole
// with steady_clock (two clock reads per repetition, none per call); the
// device is synchronized between repetitions, outside the timing, so
// stream-ordered frees of one repetition cannot spill into the next.
#include "bench_patterns.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc::bench {
namespace {

using clock_type = std::chrono::steady_clock;

double nanoseconds(clock_type::duration d) {
  return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
}

// Per-repetition wall times in ns -> the measurement's two summaries.
void fill_figures(measurement* m, const std::vector<double>& rep_ns) {
  std::vector<double> per_pair;
  std::vector<double> throughput;
  const auto pairs = static_cast<double>(m->pairs_per_rep);
  for (const double ns : rep_ns) {
    per_pair.push_back(ns / pairs);
    throughput.push_back(pairs / ns * 1e3);  // pairs per ns * 1e9 / 1e6
  }
  m->reps = static_cast<int>(rep_ns.size());
  m->ns_per_pair_by_rep = per_pair;
  m->ns_per_pair = summarize(per_pair);
  m->mpairs_per_s = summarize(throughput);
}

measurement start_measurement(const char* pattern, std::string label, const bench_allocator& allocator) {
  measurement m;
  m.pattern = pattern;
  m.label = std::move(label);
  m.allocator = allocator.name();
  return m;
}

// After a failure at op `done`, works out from the ops before it which
// blocks are live and frees them, so a failed pattern leaves the allocator
// empty when it can.
void free_live_after_failure(bench_allocator& allocator, bench_stream stream, const mixed_sequence& sequence,
                             const std::vector<void*>& slots, std::size_t done) {
  std::vector<bool> live(sequence.slots, false);
  for (std::size_t i = 0; i < done && i < sequence.ops.size(); ++i) {
    live[sequence.ops[i].slot] = sequence.ops[i].bytes != 0;
  }
  for (std::uint32_t slot = 0; slot < sequence.slots; ++slot) {
    if (!live[slot]) continue;
    try {
      allocator.free(slots[slot], stream);
    } catch (const std::exception&) {
      // The allocator is already failing; end_pattern reports what is left.
    }
  }
}

// Runs `sequence` once; returns its wall time. On failure frees what is
// live and rethrows.
double run_sequence_once(bench_allocator& allocator, bench_stream stream, const mixed_sequence& sequence,
                         std::vector<void*>& slots) {
  const std::size_t n = sequence.ops.size();
  const mixed_op* ops = sequence.ops.data();
  void** slot = slots.data();
  std::size_t i = 0;
  try {
    const auto start = clock_type::now();
    for (; i < n; ++i) {
      if (ops[i].bytes != 0) {
        slot[ops[i].slot] = allocator.allocate(ops[i].bytes, stream);
      } else {
        allocator.free(slot[ops[i].slot], stream);
      }
    }
    return nanoseconds(clock_type::now() - start);
  } catch (...) {
    free_live_after_failure(allocator, stream, sequence, slots, i);
    throw;
  }
}

}  // namespace

std::string size_label(std::size_t bytes) {
  for (const auto& [unit, name] : {std::pair<std::size_t, const char*>{1_GiB, " GiB"}, {1_MiB, " MiB"}, {1_KiB, " KiB"}}) {
    if (bytes >= unit && bytes % unit == 0) return std::to_string(bytes / unit) + name;
  }
  return bytes < 1_KiB ? std::to_string(bytes) + " B" : format_bytes(bytes);
}

run_plan run_plan::for_allocator(const bench_allocator& allocator) const {
  if (!allocator.slow()) return *this;
  run_plan slow = *this;
  const auto divisor = static_cast<std::size_t>(slow_divisor);
  slow.pairs_per_rep = std::max<std::size_t>(pairs_per_rep / divisor, 10);
  slow.thread_pairs_per_rep = std::max<std::size_t>(thread_pairs_per_rep / divisor, 10);
  slow.reps = std::min(reps, slow_max_reps);
  return slow;
}

summary summarize(std::vector<double> values) {
  summary s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  s.min = values.front();
  s.max = values.back();
  s.median = n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
  const auto rank = [&](double fraction) {
    const auto r = static_cast<std::size_t>(std::ceil(fraction * static_cast<double>(n)));
    return values[std::min(n, std::max<std::size_t>(r, 1)) - 1];
  };
  s.p10 = rank(0.10);
  s.p90 = rank(0.90);
  return s;
}

mixed_sequence make_mixed_sequence(std::uint64_t seed, std::size_t steps, std::uint32_t max_live,
                                   std::size_t min_bytes, std::size_t max_bytes) {
  if (max_live == 0 || min_bytes == 0 || min_bytes > max_bytes || max_bytes > UINT32_MAX) {
    throw std::invalid_argument("make_mixed_sequence: need 0 < min_bytes <= max_bytes < 4 GiB and max_live > 0");
  }
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(std::log(static_cast<double>(min_bytes)),
                                                  std::log(static_cast<double>(max_bytes)));
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  // Above one half so the live count climbs to max_live instead of
  // wandering around a few hundred blocks.
  constexpr double k_alloc_probability = 0.55;

  mixed_sequence out;
  out.slots = max_live;
  out.description = size_label(min_bytes) + ".." + size_label(max_bytes) + ", <= " + std::to_string(max_live) + " live";
  std::vector<std::uint32_t> live;  // slots in use
  std::vector<std::uint32_t> idle;  // slots free to take
  for (std::uint32_t s = max_live; s > 0; --s) idle.push_back(s - 1);
  const auto free_random = [&] {
    std::uniform_int_distribution<std::size_t> pick(0, live.size() - 1);
    const std::size_t i = pick(rng);
    const std::uint32_t slot = live[i];
    live[i] = live.back();
    live.pop_back();
    idle.push_back(slot);
    out.ops.push_back({0, slot});
  };
  for (std::size_t step = 0; step < steps; ++step) {
    const bool allocate = live.empty() || (!idle.empty() && coin(rng) < k_alloc_probability);
    if (allocate) {
      const std::uint32_t slot = idle.back();
      idle.pop_back();
      live.push_back(slot);
      const auto bytes = static_cast<std::uint32_t>(std::lround(std::exp(log_size(rng))));
      out.ops.push_back({std::clamp<std::uint32_t>(bytes, static_cast<std::uint32_t>(min_bytes),
                                                    static_cast<std::uint32_t>(max_bytes)),
                         slot});
      ++out.pairs;
    } else {
      free_random();
    }
  }
  while (!live.empty()) free_random();
  return out;
}

mixed_sequence truncate_mixed_sequence(const mixed_sequence& sequence, std::size_t max_ops) {
  mixed_sequence out;
  out.slots = sequence.slots;
  out.description = sequence.description;
  const std::size_t n = std::min(max_ops, sequence.ops.size());
  out.ops.assign(sequence.ops.begin(), sequence.ops.begin() + static_cast<std::ptrdiff_t>(n));
  std::vector<bool> live(sequence.slots, false);
  for (const mixed_op& op : out.ops) live[op.slot] = op.bytes != 0;
  for (std::uint32_t slot = 0; slot < sequence.slots; ++slot) {
    if (live[slot]) out.ops.push_back({0, slot});
  }
  for (const mixed_op& op : out.ops) out.pairs += op.bytes != 0 ? 1 : 0;
  return out;
}

measurement run_same_size(bench_allocator& allocator, bench_device& device, bench_stream stream, std::size_t bytes,
                          const run_plan& plan) {
  measurement m = start_measurement("same", size_label(bytes), allocator);
  m.bytes = bytes;
  m.pairs_per_rep = plan.pairs_per_rep;
  const std::size_t pairs = plan.pairs_per_rep;
  std::vector<double> rep_ns;
  for (int rep = 0; rep < plan.warmup_reps + plan.reps; ++rep) {
    if (rep == plan.warmup_reps) allocator.timing_starts();
    const auto start = clock_type::now();
    for (std::size_t i = 0; i < pairs; ++i) {
      void* ptr = allocator.allocate(bytes, stream);
      allocator.free(ptr, stream);
    }
    const double ns = nanoseconds(clock_type::now() - start);
    device.synchronize();
    if (rep >= plan.warmup_reps) rep_ns.push_back(ns);
  }
  fill_figures(&m, rep_ns);
  return m;
}

measurement run_mixed(bench_allocator& allocator, bench_device& device, bench_stream stream,
                      const mixed_sequence& sequence, const run_plan& plan) {
  measurement m = start_measurement("mixed", sequence.description, allocator);
  // A slow allocator runs a prefix of the same sequence, as many ops as the
  // plan's pair count scales down.
  const bool scaled = allocator.slow();
  const mixed_sequence prefix =
      scaled ? truncate_mixed_sequence(sequence, sequence.ops.size() / static_cast<std::size_t>(plan.slow_divisor))
             : mixed_sequence{};
  const mixed_sequence& run = scaled ? prefix : sequence;
  m.pairs_per_rep = run.pairs;
  std::vector<void*> slots(run.slots, nullptr);
  std::vector<double> rep_ns;
  for (int rep = 0; rep < plan.warmup_reps + plan.reps; ++rep) {
    if (rep == plan.warmup_reps) allocator.timing_starts();
    const double ns = run_sequence_once(allocator, stream, run, slots);
    device.synchronize();
    if (rep >= plan.warmup_reps) rep_ns.push_back(ns);
  }
  fill_figures(&m, rep_ns);
  return m;
}

measurement run_threads(bench_allocator& allocator, bench_device& device, const std::vector<bench_stream>& streams,
                        const std::vector<mixed_sequence>& sequences, const run_plan& plan) {
  const std::size_t n = streams.size();
  if (sequences.size() != n || n == 0) throw std::invalid_argument("run_threads: one sequence per thread needed");
  measurement m = start_measurement("threads", std::to_string(n) + " threads", allocator);
  m.threads = static_cast<int>(n);
  std::vector<mixed_sequence> runs;
  for (const mixed_sequence& s : sequences) {
    runs.push_back(allocator.slow() ? truncate_mixed_sequence(s, s.ops.size() / static_cast<std::size_t>(plan.slow_divisor))
                                    : s);
    m.pairs_per_rep += runs.back().pairs;
  }

  std::vector<double> rep_ns;
  for (int rep = 0; rep < plan.warmup_reps + plan.reps; ++rep) {
    if (rep == plan.warmup_reps) allocator.timing_starts();
    std::atomic<std::size_t> ready{0};
    std::atomic<bool> go{false};
    std::vector<clock_type::time_point> starts(n);
    std::vector<clock_type::time_point> ends(n);
    std::vector<std::string> errors(n);
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (std::size_t t = 0; t < n; ++t) {
      threads.emplace_back([&, t] {
        std::vector<void*> slots(runs[t].slots, nullptr);
        ready.fetch_add(1);
        // Spin rather than block so every thread leaves the gate at once.
        while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
        starts[t] = clock_type::now();
        try {
          run_sequence_once(allocator, streams[t], runs[t], slots);
        } catch (const std::exception& e) {
          errors[t] = e.what();
        }
        ends[t] = clock_type::now();
      });
    }
    while (ready.load() != n) std::this_thread::yield();
    go.store(true, std::memory_order_release);
    for (std::thread& thread : threads) thread.join();
    for (const std::string& error : errors) {
      if (!error.empty()) throw std::runtime_error("a benchmark thread failed: " + error);
    }
    const double ns = nanoseconds(*std::max_element(ends.begin(), ends.end()) -
                                  *std::min_element(starts.begin(), starts.end()));
    device.synchronize();
    if (rep >= plan.warmup_reps) rep_ns.push_back(ns);
  }
  fill_figures(&m, rep_ns);
  return m;
}

measurement run_cross_stream(bench_allocator& allocator, bench_device& device, bench_stream a, bench_stream b,
                             std::size_t bytes, const run_plan& plan) {
  measurement m = start_measurement("cross", size_label(bytes), allocator);
  m.bytes = bytes;
  const std::size_t iterations = std::max<std::size_t>(plan.pairs_per_rep / 2, 1);
  m.pairs_per_rep = iterations * 2;
  std::vector<double> rep_ns;
  for (int rep = 0; rep < plan.warmup_reps + plan.reps; ++rep) {
    if (rep == plan.warmup_reps) allocator.timing_starts();
    const auto start = clock_type::now();
    for (std::size_t i = 0; i < iterations; ++i) {
      void* on_a = allocator.allocate(bytes, a);
      allocator.free(on_a, a);
      void* on_b = allocator.allocate(bytes, b);
      allocator.free(on_b, b);
    }
    const double ns = nanoseconds(clock_type::now() - start);
    device.synchronize();
    if (rep >= plan.warmup_reps) rep_ns.push_back(ns);
  }
  fill_figures(&m, rep_ns);
  return m;
}

}  // namespace streamalloc::bench
