// Renders streamalloc-bench results: markdown tables for people (and for
// bench/RESULTS.md) and a JSON document for scripts.
#include "bench_report.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>

#include "streamalloc/util/json_writer.hpp"

namespace streamalloc::bench {
namespace {

constexpr const char* k_reference = "torch_native";
constexpr const char* k_ours = "streamalloc";
// Digits after the point in the JSON: nanoseconds to 1/1000 ns; million
// pairs a second to a pair a second (slow allocators make a few thousand).
constexpr int k_ns_decimals = 3;
constexpr int k_mpairs_decimals = 6;

std::string format(const char* spec, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, spec, value);
  return buffer;
}

// Nanoseconds below 10 us as ns with one decimal, above as microseconds.
std::string duration(double ns) { return ns < 10'000 ? format("%.1f ns", ns) : format("%.1f us", ns / 1e3); }
std::string duration_plain(double ns) { return ns < 10'000 ? format("%.1f", ns) : format("%.1fk", ns / 1e3); }

bool throughput_pattern(const std::string& pattern) { return pattern == "threads"; }

std::string title(const std::string& pattern) {
  if (pattern == "same") return "Same-size pairs";
  if (pattern == "mixed") return "Mixed sizes";
  if (pattern == "threads") return "Concurrent threads";
  return "Cross-stream";
}

std::string cell(const measurement& m) {
  if (!m.error.empty()) return "failed";
  if (throughput_pattern(m.pattern)) {
    return format("%.2f", m.mpairs_per_s.median) + " [" + format("%.2f", m.mpairs_per_s.p10) + ", " +
           format("%.2f", m.mpairs_per_s.p90) + "]";
  }
  return duration(m.ns_per_pair.median) + " [" + duration_plain(m.ns_per_pair.p10) + ", " +
         duration_plain(m.ns_per_pair.p90) + "]";
}

// How many times faster streamalloc is than torch's native allocator.
std::string speedup(const measurement& ours, const measurement& reference) {
  if (!ours.error.empty() || !reference.error.empty()) return "-";
  const double ratio = throughput_pattern(ours.pattern) ? ours.mpairs_per_s.median / reference.mpairs_per_s.median
                                                        : reference.ns_per_pair.median / ours.ns_per_pair.median;
  return format("%.2fx", ratio);
}

std::string heading(const std::string& pattern, const run_info& info) {
  const std::string stream_text = info.thread_streams == "own" ? "each thread on its own stream" : "all threads on one shared stream";
  if (pattern == "same") {
    return "Same-size pairs: allocate + free of one size, repeated on the default stream. "
           "Median time per pair [p10, p90] over repetitions.";
  }
  if (pattern == "mixed") {
    return "Mixed sizes (log-uniform), random frees, one thread, default stream; one seeded sequence for every "
           "allocator. Median time per pair (one allocate + its free) [p10, p90].";
  }
  if (pattern == "threads") {
    return "Threads allocating concurrently, " + stream_text +
           "; each thread runs its own seeded mixed sequence (" + info.thread_workload +
           "). Aggregate million pairs per second, median [p10, p90]; higher is better.";
  }
  return "Cross-stream: allocate + free on stream A, then allocate + free on stream B, alternating (each free "
         "ordered on its block's stream). Median time per pair [p10, p90].";
}

void json_summary(json_writer& w, const summary& s, int decimals) {
  w.begin_object();
  w.key("median").value(s.median, decimals).key("p10").value(s.p10, decimals);
  w.key("p90").value(s.p90, decimals).key("min").value(s.min, decimals).key("max").value(s.max, decimals);
  w.end_object();
}

}  // namespace

void print_tables(const run_info& info, const std::vector<measurement>& results) {
  std::printf("## streamalloc-bench on %s\n\n", info.device.c_str());
  std::printf("Mode %s: %d timed repetitions after %d warm-up; %zu pairs a repetition (same-size, cross-stream), "
              "%zu pairs a thread (threads); slow allocators run 1/%d of the pairs and at most %d repetitions. "
              "Seed %llu.\n",
              info.mode.c_str(), info.plan.reps, info.plan.warmup_reps, info.plan.pairs_per_rep,
              info.plan.thread_pairs_per_rep, info.plan.slow_divisor, info.plan.slow_max_reps,
              static_cast<unsigned long long>(info.seed));
  for (const auto& [name, settings] : info.settings) {
    if (!settings.empty()) std::printf("- %s: %s\n", name.c_str(), settings.c_str());
  }
  const bool compare = std::find(info.allocators.begin(), info.allocators.end(), k_reference) != info.allocators.end() &&
                       std::find(info.allocators.begin(), info.allocators.end(), k_ours) != info.allocators.end();

  std::vector<std::string> patterns;
  for (const measurement& m : results) {
    if (std::find(patterns.begin(), patterns.end(), m.pattern) == patterns.end()) patterns.push_back(m.pattern);
  }
  for (const std::string& pattern : patterns) {
    std::printf("\n### %s\n\n%s\n\n| case |", title(pattern).c_str(), heading(pattern, info).c_str());
    for (const std::string& name : info.allocators) std::printf(" %s |", name.c_str());
    if (compare) std::printf(" streamalloc speed-up vs torch_native |");
    std::printf("\n|---|");
    for (std::size_t i = 0; i < info.allocators.size() + (compare ? 1 : 0); ++i) std::printf("---|");
    std::printf("\n");

    std::vector<std::string> labels;
    std::map<std::pair<std::string, std::string>, const measurement*> by_cell;  // (label, allocator)
    for (const measurement& m : results) {
      if (m.pattern != pattern) continue;
      if (std::find(labels.begin(), labels.end(), m.label) == labels.end()) labels.push_back(m.label);
      by_cell[{m.label, m.allocator}] = &m;
    }
    for (const std::string& label : labels) {
      std::printf("| %s |", label.c_str());
      for (const std::string& name : info.allocators) {
        const auto it = by_cell.find({label, name});
        std::printf(" %s |", it == by_cell.end() ? "-" : cell(*it->second).c_str());
      }
      if (compare) {
        const auto ours = by_cell.find({label, k_ours});
        const auto reference = by_cell.find({label, k_reference});
        const bool both = ours != by_cell.end() && reference != by_cell.end();
        std::printf(" %s |", both ? speedup(*ours->second, *reference->second).c_str() : "-");
      }
      std::printf("\n");
    }
  }
  if (!info.notes.empty()) {
    std::printf("\nNotes:\n");
    for (const std::string& note : info.notes) std::printf("- %s\n", note.c_str());
  }
  std::fflush(stdout);
}

void write_json(const std::string& path, const run_info& info, const std::vector<measurement>& results) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  json_writer w;
  w.begin_object();
  w.key("tool").value("streamalloc-bench").key("device").value(info.device).key("mode").value(info.mode);
  w.key("thread_streams").value(info.thread_streams).key("thread_workload").value(info.thread_workload);
  w.key("seed").value(static_cast<unsigned long long>(info.seed));
  w.newline().key("plan").begin_object();
  w.key("reps").value(info.plan.reps).key("warmup_reps").value(info.plan.warmup_reps);
  w.key("pairs_per_rep").value(info.plan.pairs_per_rep).key("thread_pairs_per_rep").value(info.plan.thread_pairs_per_rep);
  w.key("slow_divisor").value(info.plan.slow_divisor).key("slow_max_reps").value(info.plan.slow_max_reps);
  w.end_object();
  w.newline().key("allocators").begin_object();
  for (const auto& [name, settings] : info.settings) w.key(name).value(settings);
  w.end_object();
  w.newline().key("notes").begin_array();
  for (const std::string& note : info.notes) w.value(note);
  w.end_array();
  w.newline().key("results").begin_array();
  for (const measurement& m : results) {
    w.newline().begin_object();
    w.key("pattern").value(m.pattern).key("case").value(m.label).key("allocator").value(m.allocator);
    w.key("bytes").value(m.bytes).key("threads").value(m.threads).key("reps").value(m.reps);
    w.key("pairs_per_rep").value(m.pairs_per_rep);
    if (m.error.empty()) {
      w.key("ns_per_pair");
      json_summary(w, m.ns_per_pair, k_ns_decimals);
      // In order, so a slow first repetition (growth, stitching) shows.
      w.key("ns_per_pair_by_rep").begin_array();
      for (const double ns : m.ns_per_pair_by_rep) w.value(ns, k_ns_decimals);
      w.end_array();
      w.key("mpairs_per_s");
      json_summary(w, m.mpairs_per_s, k_mpairs_decimals);
    } else {
      w.key("error").value(m.error);
    }
    w.end_object();
  }
  w.newline().end_array();
  w.end_object();
  out << w.str() << '\n';
  out.flush();
  if (!out) throw std::runtime_error("error writing " + path);
}

}  // namespace streamalloc::bench
