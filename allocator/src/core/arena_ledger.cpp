#include "streamalloc/core/arena_ledger.hpp"

#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>
#include <tuple>
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

// `held`'s blocks and bytes, times `sign`, added to what they count in.
void add_held(arena_ledger::counts* out, const arena_ledger::held_back& held, std::int64_t sign) {
  // kept[0]: large segments, kept[1]: small ones.
  const auto add = [out, sign](std::size_t all, const std::array<std::int64_t, 2>& kept) {
    (*out)[all] += sign * (kept[0] + kept[1]);
    (*out)[all + static_cast<std::size_t>(stat_type::small_pool)] += sign * kept[1];
    (*out)[all + static_cast<std::size_t>(stat_type::large_pool)] += sign * kept[0];
  };
  add(arena_ledger::index_of(&device_stats::allocation, stat_type::all), held.blocks);
  add(arena_ledger::index_of(&device_stats::active, stat_type::all), held.blocks);
  add(arena_ledger::index_of(&device_stats::allocated_bytes, stat_type::all), held.bytes);
  add(arena_ledger::index_of(&device_stats::active_bytes, stat_type::all), held.bytes);
}

arena_ledger::held_back one_block(std::size_t size, bool small) {
  arena_ledger::held_back held;
  held.blocks[small ? 1 : 0] = 1;
  held.bytes[small ? 1 : 0] = static_cast<std::int64_t>(size);
  return held;
}

// Takes a claimed block's counts out of `out` (Note [claimed repeats]). The
// arena holds its lock, so the block stays as it is.
void leave_out(const block* claimed, arena_ledger::counts* out) {
  add_held(out, one_block(claimed->size, claimed->owner->is_small), -1);
}

// True when some count of `counts` passes its ceiling: the signs of
// ceiling - count ORed together, two counts a step, unrolled (the loop
// GCC vectorizes by itself spends half its instructions on the loop).
bool any_above(const arena_ledger::counts& counts, const arena_ledger::counts& ceilings) {
  using pair = std::int64_t __attribute__((vector_size(16)));
  static_assert(std::tuple_size<arena_ledger::counts>::value % 2 == 0, "counts go two at a time");
  pair beyond{};
#pragma GCC unroll 16
  for (std::size_t i = 0; i < counts.size(); i += 2) {
    pair count;
    pair ceiling;
    std::memcpy(&count, &counts[i], sizeof count);
    std::memcpy(&ceiling, &ceilings[i], sizeof ceiling);
    beyond |= ceiling - count;
  }
  return (beyond[0] | beyond[1]) < 0;
}

// The arena's counts less what it holds back, into `out`: straight copies
// and a fixed set of corrections, no search per counter.
void fill_counts(const device_stats& stats, const arena_ledger::held_back& held, arena_ledger::counts* out) {
  copy_currents(stats, out, std::make_index_sequence<std::size(device_stats::k_arrays)>{},
                std::make_index_sequence<std::size(device_stats::k_counters)>{});
  // No block held back means no bytes either: most sections skip the pass.
  if ((held.blocks[0] | held.blocks[1]) != 0) add_held(out, held, -1);
}

}  // namespace

arena_ledger::counts arena_ledger::current_counts(const device_stats& stats, const held_back& held) {
  counts out;
  fill_counts(stats, held, &out);
  return out;
}

void arena_ledger::claim_parked(share& s) {
  std::size_t size = 0;
  bool small = false;
  if (s.repeats == nullptr || !s.repeats->claim(&size, &small)) return;
  add_held(&s.current(), one_block(size, small), -1);  // the ceiling stays: more headroom
}

void arena_ledger::claim_all_parked_locked() const {
  for (int a = 0; a < arenas_; ++a) {
    share& s = shares_[static_cast<std::size_t>(a)];
    std::lock_guard<share> held(s);
    claim_parked(s);
  }
}

void arena_ledger::seed(const device_stats& first, repeat_slot* repeats) {
  std::lock_guard<std::mutex> lock(mutex_);
  share& s = shares_[0];
  std::lock_guard<share> held(s);
  s.repeats = repeats;
  for_each_indexed(first, [&](int i, const stat_counter& c, stat_array device_stats::*, int) {
    const auto k = static_cast<std::size_t>(i);
    peak_[k] = c.peak;
    s.current()[k] = c.current;
    s.ceiling[k] = c.peak;
  });
  arenas_ = 1;
}

void arena_ledger::join(int arena, repeat_slot* repeats) {
  std::lock_guard<std::mutex> lock(mutex_);
  {
    share& s = shares_[static_cast<std::size_t>(arena)];
    std::lock_guard<share> held(s);
    s.repeats = repeats;
  }
  if (arena + 1 > arenas_) arenas_ = arena + 1;
}

template <typename fill_fn>
bool arena_ledger::publish_under_ceilings(share& s, fill_fn&& fill) {
  std::lock_guard<share> held(s);
  counts& next = s.next();
  fill(&next);
  if (const block* claimed = s.claimed()) leave_out(claimed, &next);
  // One branch-free pass; a count under its ceiling changes nothing else,
  // and the filled buffer becomes the published one.
  if (any_above(next, s.ceiling)) return false;
  s.swap_counts();
  return true;
}

void arena_ledger::publish(int arena, const counts& now) {
  share& s = shares_[static_cast<std::size_t>(arena)];
  if (publish_under_ceilings(s, [&now](counts* out) { *out = now; })) return;
  std::lock_guard<std::mutex> lock(mutex_);
  cross_locked(arena, now);
}

void arena_ledger::publish(int arena, const device_stats& stats, const held_back& held) {
  share& s = shares_[static_cast<std::size_t>(arena)];
  if (publish_under_ceilings(s, [&](counts* out) { fill_counts(stats, held, out); })) return;
  // A crossing, rare: the arena holds its lock, so its counts are as they were.
  std::lock_guard<std::mutex> lock(mutex_);
  cross_locked(arena, current_counts(stats, held));
}

arena_ledger::counts arena_ledger::published(int arena) const {
  share& s = shares_[static_cast<std::size_t>(arena)];
  std::lock_guard<share> held(s);
  return s.current();
}

void arena_ledger::cross_locked(int arena, const counts& now) {
  share& own = shares_[static_cast<std::size_t>(arena)];
  counts missing{};
  {
    std::lock_guard<share> held(own);
    counts net = now;
    if (const block* claimed = own.claimed()) leave_out(claimed, &net);
    for (std::size_t i = 0; i < net.size(); ++i) {
      own.current()[i] = net[i];
      if (net[i] > own.ceiling[i]) {
        missing[i] = net[i] - own.ceiling[i];
        own.ceiling[i] = net[i];
      }
    }
  }
  // Blocks parked elsewhere are free already (Note [claimed repeats]).
  claim_all_parked_locked();
  for (std::size_t i = 0; i < now.size(); ++i) {
    if (missing[i] == 0) continue;
    std::int64_t gathered = 0;
    for (int a = 0; a < arenas_; ++a) {
      share& s = shares_[static_cast<std::size_t>(a)];
      std::lock_guard<share> held(s);
      gathered += s.ceiling[i] - s.current()[i];
      s.ceiling[i] = s.current()[i];
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
      s.ceiling[i] += each + (a == arena ? gathered - each * arenas_ : 0);
    }
  }
}

device_stats arena_ledger::totals() const {
  std::lock_guard<std::mutex> lock(mutex_);
  claim_all_parked_locked();
  counts sums{};
  for (int a = 0; a < arenas_; ++a) {
    share& s = shares_[static_cast<std::size_t>(a)];
    std::lock_guard<share> held(s);
    for (std::size_t i = 0; i < sums.size(); ++i) sums[i] += s.current()[i];
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
  claim_all_parked_locked();
  for (int a = 0; a < arenas_; ++a) shares_[static_cast<std::size_t>(a)].lock();
  peak_ = counts{};
  for (int a = 0; a < arenas_; ++a) {
    share& s = shares_[static_cast<std::size_t>(a)];
    for (std::size_t i = 0; i < peak_.size(); ++i) peak_[i] += s.current()[i];
    s.ceiling = s.current();
  }
  for (int a = arenas_; a-- > 0;) shares_[static_cast<std::size_t>(a)].unlock();
}

void arena_ledger::validate(const counts& arena_sums) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::size_t i = 0; i < peak_.size(); ++i) {
    std::int64_t current = 0;
    std::int64_t ceilings = 0;
    for (int a = 0; a < arenas_; ++a) {
      const share& s = shares_[static_cast<std::size_t>(a)];
      if (s.ceiling[i] < s.current()[i]) throw std::logic_error("arena_ledger: a count above its arena's ceiling");
      current += s.current()[i];
      ceilings += s.ceiling[i];
    }
    const std::string which = "arena_ledger: counter " + std::to_string(i);
    if (current != arena_sums[i]) {
      throw std::logic_error(which + " is " + std::to_string(current) + " where the arenas sum to " +
                             std::to_string(arena_sums[i]));
    }
    if (peak_[i] != ceilings) throw std::logic_error(which + ": the peak is not the sum of the ceilings");
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
