#include "streamalloc/core/arena_ledger.hpp"

namespace streamalloc {

void arena_ledger::seed(const device_stats& first) {
  std::lock_guard<std::mutex> lock(mutex_);
  totals_ = first;
}

void arena_ledger::publish(device_stats& last, const device_stats& now, const held_back& held) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto add = [](stat_counter& total, stat_counter& seen, std::int64_t value) {
    total.current += value - seen.current;
    if (total.current > total.peak) total.peak = total.current;
    seen.current = value;
  };
  for (stat_array device_stats::*array : device_stats::k_arrays) {
    const bool counts = array == &device_stats::allocation || array == &device_stats::active;
    const bool bytes = array == &device_stats::allocated_bytes || array == &device_stats::active_bytes;
    const std::array<std::int64_t, 2>* out = counts ? &held.blocks : bytes ? &held.bytes : nullptr;
    for (int i = 0; i < k_stat_type_count; ++i) {
      std::int64_t value = (now.*array)[i].current;
      if (out != nullptr) {
        const auto type = static_cast<stat_type>(i);
        value -= type == stat_type::all ? (*out)[0] + (*out)[1] : (*out)[type == stat_type::small_pool ? 1 : 0];
      }
      add((totals_.*array)[i], (last.*array)[i], value);
    }
  }
  for (stat_counter device_stats::*counter : device_stats::k_counters) {
    add(totals_.*counter, last.*counter, (now.*counter).current);
  }
}

device_stats arena_ledger::totals() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return totals_;
}

void arena_ledger::reset_peaks() {
  std::lock_guard<std::mutex> lock(mutex_);
  totals_.for_each_counter([](stat_counter& c) { c.reset_peak(); });
}

std::int64_t arena_ledger::reserved_elsewhere(int arena) const {
  std::int64_t sum = 0;
  for (int i = 0; i < k_max_arenas; ++i) {
    if (i != arena) sum += reserved_[i].load(std::memory_order_relaxed);
  }
  return sum;
}

}  // namespace streamalloc
