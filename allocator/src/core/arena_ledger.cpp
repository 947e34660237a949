#include "streamalloc/core/arena_ledger.hpp"

#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>

namespace streamalloc {

namespace {

// The counters of `stats` in the ledger's order, through `visit(index, counter)`.
template <typename stats_type, typename fn>
void for_each_indexed(stats_type& stats, fn&& visit) {
  int index = 0;
  for (stat_array device_stats::*array : device_stats::k_arrays) {
    for (int t = 0; t < k_stat_type_count; ++t) visit(index++, (stats.*array)[t], array, t);
  }
  for (stat_counter device_stats::*counter : device_stats::k_counters) visit(index++, stats.*counter, nullptr, 0);
}

// The current values in the ledger's order, the members named at compile
// time (expanded, not looped over member pointers).
template <std::size_t... a, std::size_t... c>
void copy_currents(const device_stats& stats, arena_ledger::counts* out, std::index_sequence<a...>,
                   std::index_sequence<c...>) {
  constexpr std::size_t types = k_stat_type_count;
  static_assert(types == 3, "one copy per stat_type below");
  ((((*out)[a * types] = (stats.*device_stats::k_arrays[a])[0].current),
    ((*out)[a * types + 1] = (stats.*device_stats::k_arrays[a])[1].current),
    ((*out)[a * types + 2] = (stats.*device_stats::k_arrays[a])[2].current)),
   ...);
  constexpr std::size_t first = std::size(device_stats::k_arrays) * types;
  (((*out)[first + c] = (stats.*device_stats::k_counters[c]).current), ...);
}

}  // namespace

// Called at the end of every critical section of an arena: straight copies
// and a fixed set of corrections, no search per counter.
arena_ledger::counts arena_ledger::current_counts(const device_stats& stats, const held_back& held) {
  counts out;
  copy_currents(stats, &out, std::make_index_sequence<std::size(device_stats::k_arrays)>{},
                std::make_index_sequence<std::size(device_stats::k_counters)>{});
  // kept[0]: large segments, kept[1]: small ones.
  const auto hold = [&out](std::size_t all, const std::array<std::int64_t, 2>& kept) {
    out[all] -= kept[0] + kept[1];
    out[all + static_cast<std::size_t>(stat_type::small_pool)] -= kept[1];
    out[all + static_cast<std::size_t>(stat_type::large_pool)] -= kept[0];
  };
  constexpr std::size_t allocation = index_of(&device_stats::allocation, stat_type::all);
  constexpr std::size_t active = index_of(&device_stats::active, stat_type::all);
  constexpr std::size_t allocated_bytes = index_of(&device_stats::allocated_bytes, stat_type::all);
  constexpr std::size_t active_bytes = index_of(&device_stats::active_bytes, stat_type::all);
  hold(allocation, held.blocks);
  hold(active, held.blocks);
  hold(allocated_bytes, held.bytes);
  hold(active_bytes, held.bytes);
  return out;
}

void arena_ledger::seed(const device_stats& first) {
  std::lock_guard<std::mutex> lock(mutex_);
  share& s = shares_[0];
  std::lock_guard<share> held(s);
  for_each_indexed(first, [&](int i, const stat_counter& c, stat_array device_stats::*, int) {
    const auto k = static_cast<std::size_t>(i);
    peak_[k] = c.peak;
    s.current[k] = c.current;
    s.headroom[k] = c.peak - c.current;
  });
  arenas_ = 1;
}

void arena_ledger::join(int arena) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (arena + 1 > arenas_) arenas_ = arena + 1;
}

void arena_ledger::publish(int arena, const counts& now) {
  share& s = shares_[static_cast<std::size_t>(arena)];
  {
    std::lock_guard<share> held(s);
    // One branch-free pass over every counter into a copy, then two block
    // copies: cheaper than a branch per counter to skip the unchanged ones,
    // and than passes that store each difference.
    counts headroom;
    std::int64_t beyond = 0;  // negative once any increase passes its share
    for (std::size_t i = 0; i < now.size(); ++i) {
      headroom[i] = s.headroom[i] - (now[i] - s.current[i]);
      beyond |= headroom[i];
    }
    if (beyond >= 0) {
      s.headroom = headroom;
      s.current = now;
      return;
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  cross_locked(arena, now);
}

void arena_ledger::cross_locked(int arena, const counts& now) {
  share& own = shares_[static_cast<std::size_t>(arena)];
  counts missing{};
  {
    std::lock_guard<share> held(own);
    for (std::size_t i = 0; i < now.size(); ++i) {
      own.headroom[i] -= now[i] - own.current[i];
      own.current[i] = now[i];
      if (own.headroom[i] < 0) {
        missing[i] = -own.headroom[i];
        own.headroom[i] = 0;
      }
    }
  }
  for (std::size_t i = 0; i < now.size(); ++i) {
    if (missing[i] == 0) continue;
    std::int64_t gathered = 0;
    for (int a = 0; a < arenas_; ++a) {
      share& s = shares_[static_cast<std::size_t>(a)];
      std::lock_guard<share> held(s);
      gathered += s.headroom[i];
      s.headroom[i] = 0;
    }
    if (gathered >= missing[i]) {
      gathered -= missing[i];
    } else {
      peak_[i] += missing[i] - gathered;
      gathered = 0;
    }
    const std::int64_t each = gathered / arenas_;
    for (int a = 0; a < arenas_; ++a) {
      share& s = shares_[static_cast<std::size_t>(a)];
      std::lock_guard<share> held(s);
      s.headroom[i] += each + (a == arena ? gathered - each * arenas_ : 0);
    }
  }
}

device_stats arena_ledger::totals() const {
  std::lock_guard<std::mutex> lock(mutex_);
  counts sums{};
  for (int a = 0; a < arenas_; ++a) {
    share& s = shares_[static_cast<std::size_t>(a)];
    std::lock_guard<share> held(s);
    for (std::size_t i = 0; i < sums.size(); ++i) sums[i] += s.current[i];
  }
  device_stats out;
  for_each_indexed(out, [&](int i, stat_counter& c, stat_array device_stats::*, int) {
    c.current = sums[static_cast<std::size_t>(i)];
    c.peak = peak_[static_cast<std::size_t>(i)];
  });
  return out;
}

void arena_ledger::reset_peaks() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int a = 0; a < arenas_; ++a) shares_[static_cast<std::size_t>(a)].lock();
  peak_ = counts{};
  for (int a = 0; a < arenas_; ++a) {
    share& s = shares_[static_cast<std::size_t>(a)];
    for (std::size_t i = 0; i < peak_.size(); ++i) peak_[i] += s.current[i];
    s.headroom = counts{};
  }
  for (int a = arenas_; a-- > 0;) shares_[static_cast<std::size_t>(a)].unlock();
}

void arena_ledger::validate(const counts& arena_sums) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < peak_.size(); ++i) {
    std::int64_t current = 0;
    std::int64_t headroom = 0;
    for (int a = 0; a < arenas_; ++a) {
      const share& s = shares_[static_cast<std::size_t>(a)];
      if (s.headroom[i] < 0) throw std::logic_error("arena_ledger: a negative share of headroom");
      current += s.current[i];
      headroom += s.headroom[i];
    }
    const std::string which = "arena_ledger: counter " + std::to_string(i);
    if (current != arena_sums[i]) {
      throw std::logic_error(which + " is " + std::to_string(current) + " where the arenas sum to " +
                             std::to_string(arena_sums[i]));
    }
    if (peak_[i] - current != headroom) throw std::logic_error(which + ": peak - current != the shares");
  }
}

std::int64_t arena_ledger::reserved_elsewhere(int arena) const {
  std::int64_t sum = 0;
  for (int i = 0; i < k_max_arenas; ++i) {
    if (i != arena) sum += reserved_[i].load(std::memory_order_relaxed);
  }
  return sum;
}

}  // namespace streamalloc
