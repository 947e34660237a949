// allocation_tags: see the header. Interned names, the per-thread and
// inherited current tag, deterministic sampling, and the sharded map from
// live address to (tag, bytes) that reports sum up.
#include "streamalloc/core/allocation_tags.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "streamalloc/util/errors.hpp"

namespace streamalloc {

// Note [allocation tags]
// Cost is the point. Off, the caller pays one relaxed load of its own flag
// per allocation and free; nothing here runs. On, an allocation pays a
// thread-local read, for sampling one relaxed fetch_add, and an insert
// into one of 64 maps under that map's own mutex (never the allocator's
// lock); a free pays one erase. Records are keyed by address alone: device
// addresses are unique within a process (unified addressing), and the
// device is kept in the record for per-device reports.
//
// Ordering with the allocator: the caller records after allocate()
// returned and erases *before* free(), so no other thread can be handed
// the same address while a stale record for it still exists.

// Note [inherited tag]
// Autograd runs a backward pass on its own threads, which never see the
// thread-local tag a user set around loss.backward(). Scopes opened from
// Python also set the registry's inherited tag; a thread without a tag of
// its own records under it. Module hooks (streamalloc.attribute) set the
// backward threads' own tag, which takes precedence.

namespace {

thread_local tag_id t_thread_tag = k_untagged;

// splitmix64's finaliser: consecutive windows get unrelated offsets.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

allocation_tags::allocation_tags() : shards_(k_shard_count) {
  names_.emplace_back(k_untagged_name);
  ids_.emplace(k_untagged_name, k_untagged);
}

// ---------------------------------------------------------------------------
// Names

tag_id allocation_tags::intern(std::string_view name) {
  if (name.empty()) throw usage_error("streamalloc: a tag name must not be empty");
  std::lock_guard<std::mutex> lock(names_mutex_);
  auto it = ids_.find(std::string(name));
  if (it != ids_.end()) return it->second;
  if (names_.size() >= k_max_tags) {
    throw usage_error("streamalloc: more than " + std::to_string(k_max_tags) +
                      " distinct tags; tags are meant to name program parts, not individual steps or tensors");
  }
  const auto id = static_cast<tag_id>(names_.size());
  names_.emplace_back(name);
  ids_.emplace(names_.back(), id);
  return id;
}

std::string allocation_tags::name_of(tag_id id) const {
  std::lock_guard<std::mutex> lock(names_mutex_);
  if (id >= names_.size()) throw usage_error("streamalloc: unknown tag id " + std::to_string(id));
  return names_[id];
}

std::size_t allocation_tags::tag_count() const {
  std::lock_guard<std::mutex> lock(names_mutex_);
  return names_.size();
}

// ---------------------------------------------------------------------------
// The current tag

tag_id allocation_tags::thread_tag() { return t_thread_tag; }

tag_id allocation_tags::set_thread_tag(tag_id id) { return std::exchange(t_thread_tag, id); }

void allocation_tags::restore_inherited_tag(tag_id expected, tag_id previous) {
  inherited_.compare_exchange_strong(expected, previous, std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------
// Recording

void allocation_tags::enable(const tagging_options& options) {
  if (options.sample_every == 0) throw usage_error("streamalloc: sample_every must be at least 1");
  std::lock_guard<std::mutex> lock(switch_mutex_);
  sample_every_.store(options.sample_every, std::memory_order_relaxed);
  always_record_bytes_.store(options.always_record_bytes, std::memory_order_relaxed);
  if (enabled_.load(std::memory_order_relaxed)) return;
  // Records that raced with the last disable() would describe memory
  // freed since without being erased.
  clear_records();
  sample_counter_.store(0, std::memory_order_relaxed);
  enabled_.store(true, std::memory_order_relaxed);
}

void allocation_tags::disable() {
  std::lock_guard<std::mutex> lock(switch_mutex_);
  enabled_.store(false, std::memory_order_relaxed);
  clear_records();
}

tagging_options allocation_tags::options() const {
  tagging_options out;
  out.sample_every = sample_every_.load(std::memory_order_relaxed);
  out.always_record_bytes = always_record_bytes_.load(std::memory_order_relaxed);
  return out;
}

std::uint32_t allocation_tags::sample(std::size_t bytes) {
  const std::uint32_t every = sample_every_.load(std::memory_order_relaxed);
  if (every <= 1 || bytes >= always_record_bytes_.load(std::memory_order_relaxed)) return 1;
  const std::uint64_t n = sample_counter_.fetch_add(1, std::memory_order_relaxed);
  const std::uint64_t window = n / every;
  return n % every == mix(window) % every ? every : 0;
}

void allocation_tags::record(std::uintptr_t address, std::size_t bytes, int device, std::uint32_t weight) {
  record(address, bytes, device, weight, current());
}

void allocation_tags::record(std::uintptr_t address, std::size_t bytes, int device, std::uint32_t weight,
                             tag_id tag) {
  if (weight == 0 || !enabled()) return;
  shard& s = shard_of(address);
  std::lock_guard<std::mutex> lock(s.mutex);
  s.entries[address] = entry{tag, weight, bytes, device};
}

void allocation_tags::erase(std::uintptr_t address) {
  shard& s = shard_of(address);
  std::lock_guard<std::mutex> lock(s.mutex);
  s.entries.erase(address);
}

void allocation_tags::clear_records() {
  for (shard& s : shards_) {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.entries.clear();
  }
}

allocation_tags::shard& allocation_tags::shard_of(std::uintptr_t address) {
  // Blocks are at least 256-byte aligned: the low bits carry nothing.
  const std::uint64_t hashed = (static_cast<std::uint64_t>(address) >> 8) * 0x9e3779b97f4a7c15ULL;
  return shards_[hashed >> 58];  // the top 6 bits: k_shard_count == 64
}

const allocation_tags::shard& allocation_tags::shard_of(std::uintptr_t address) const {
  return const_cast<allocation_tags*>(this)->shard_of(address);
}

// ---------------------------------------------------------------------------
// Reading

bool allocation_tags::tag_of(std::uintptr_t address, tag_id* out) const {
  const shard& s = shard_of(address);
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.entries.find(address);
  if (it == s.entries.end()) return false;
  *out = it->second.tag;
  return true;
}

const std::vector<std::size_t>& allocation_tags::size_bucket_bounds() {
  // Powers of 16 from 64 KiB: small tensors, the 1 MiB small-pool limit,
  // typical activations, large weights and buffers, huge ones.
  static const std::vector<std::size_t> bounds = {64_KiB, 1_MiB, 16_MiB, 256_MiB, 4_GiB};
  return bounds;
}

tag_summary allocation_tags::summary(int device) const {
  const std::vector<std::size_t>& bounds = size_bucket_bounds();
  tag_summary out;
  out.sample_every = sample_every_.load(std::memory_order_relaxed);
  out.sampled = out.sample_every > 1;
  out.by_size.resize(bounds.size() + 1);
  for (std::size_t i = 0; i < out.by_size.size(); ++i) {
    out.by_size[i].min_bytes = i == 0 ? 0 : bounds[i - 1];
    out.by_size[i].max_bytes = i < bounds.size() ? bounds[i] : std::numeric_limits<std::size_t>::max();
  }
  std::vector<tag_total> totals;
  for (const shard& s : shards_) {
    std::lock_guard<std::mutex> lock(s.mutex);
    for (const auto& [address, e] : s.entries) {
      if (device != k_all_devices_tags && e.device != device) continue;
      const std::size_t bytes = e.bytes * e.weight;
      if (totals.size() <= e.tag) totals.resize(static_cast<std::size_t>(e.tag) + 1);
      totals[e.tag].bytes += bytes;
      totals[e.tag].count += e.weight;
      const auto bucket =
          static_cast<std::size_t>(std::upper_bound(bounds.begin(), bounds.end(), e.bytes) - bounds.begin());
      out.by_size[bucket].bytes += bytes;
      out.by_size[bucket].count += e.weight;
    }
  }
  for (std::size_t id = 0; id < totals.size(); ++id) {
    if (totals[id].count == 0) continue;
    tag_total t = totals[id];
    t.tag = static_cast<tag_id>(id);
    t.name = name_of(t.tag);
    out.recorded_bytes += t.bytes;
    out.recorded_count += t.count;
    out.by_tag.push_back(std::move(t));
  }
  std::stable_sort(out.by_tag.begin(), out.by_tag.end(),
                   [](const tag_total& a, const tag_total& b) { return a.bytes > b.bytes; });
  return out;
}

}  // namespace streamalloc
