// allocation_tags: which part of a program holds each live allocation. A
// tag is an interned name ("optimizer", "blocks.3.mlp"); while tagging is
// on, every allocation recorded remembers the tag current on the
// allocating thread and its bytes until it is freed. Pure bookkeeping (no
// CUDA, no allocator lock): the torch layer records after allocate()
// returns and erases before free(). See Note [allocation tags] in the .cpp.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "streamalloc/util/bytes.hpp"

namespace streamalloc {

using tag_id = std::uint32_t;
// Allocations made while no tag was current.
constexpr tag_id k_untagged = 0;
constexpr const char* k_untagged_name = "untagged";

struct tagging_options {
  // 1 records every allocation; N > 1 records one allocation in N (below
  // always_record_bytes) and counts it N times: totals become estimates.
  std::uint32_t sample_every = 1;
  // Allocations at least this large are always recorded, at weight 1: the
  // few big tensors that dominate memory stay exact under sampling.
  std::size_t always_record_bytes = 1_MiB;
};

// Live bytes of one tag (weighted: estimates under sampling).
struct tag_total {
  tag_id tag = k_untagged;
  std::string name;
  std::size_t bytes = 0;
  std::size_t count = 0;  // allocations
};

// Live bytes of allocations with min_bytes <= size < max_bytes.
struct size_bucket_total {
  std::size_t min_bytes = 0;
  std::size_t max_bytes = 0;  // SIZE_MAX for the last bucket
  std::size_t bytes = 0;
  std::size_t count = 0;
};

struct tag_summary {
  std::vector<tag_total> by_tag;            // tags holding memory, most bytes first
  std::vector<size_bucket_total> by_size;   // every bucket, smallest sizes first
  std::size_t recorded_bytes = 0;           // sum over by_tag
  std::size_t recorded_count = 0;
  bool sampled = false;                     // sample_every > 1: the figures are estimates
  std::uint32_t sample_every = 1;
};

class allocation_tags {
 public:
  allocation_tags();
  allocation_tags(const allocation_tags&) = delete;
  allocation_tags& operator=(const allocation_tags&) = delete;

  // --- names ---
  // The id of `name`, the same for the registry's lifetime; "untagged" is
  // k_untagged. Throws usage_error for an empty name or past k_max_tags.
  tag_id intern(std::string_view name);
  // Throws usage_error for an id intern() never returned.
  std::string name_of(tag_id id) const;
  std::size_t tag_count() const;
  static constexpr std::size_t k_max_tags = 1u << 20;

  // --- the current tag ---
  // A thread's own tag (k_untagged: none). One per thread, shared by every
  // registry of the process: in practice there is one, the torch layer's.
  static tag_id thread_tag();
  // Sets the calling thread's tag; returns the one it replaces.
  static tag_id set_thread_tag(tag_id id);
  // The tag inherited by threads without one of their own, such as the
  // threads autograd runs a backward pass on (Note [inherited tag]).
  tag_id inherited_tag() const { return inherited_.load(std::memory_order_relaxed); }
  tag_id set_inherited_tag(tag_id id) { return inherited_.exchange(id, std::memory_order_relaxed); }
  // Puts `previous` back only if the inherited tag is still `expected`
  // (scopes of several threads may close out of order).
  void restore_inherited_tag(tag_id expected, tag_id previous);
  // What a recording on this thread uses: its own tag, else the inherited one.
  tag_id current() const {
    const tag_id own = thread_tag();
    return own != k_untagged ? own : inherited_tag();
  }

  // Sets the calling thread's tag for the scope's lifetime.
  class scope {
   public:
    explicit scope(tag_id id) : previous_(set_thread_tag(id)) {}
    ~scope() { set_thread_tag(previous_); }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;

   private:
    tag_id previous_;
  };

  // --- recording ---
  // Turns recording on, or changes the sampling while it is on. Turning it
  // on starts from no records. Throws usage_error for sample_every 0.
  void enable(const tagging_options& options);
  // Stops recording and forgets every record.
  void disable();
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  tagging_options options() const;

  // The weight to record an allocation of `bytes` with: 0 to skip it
  // (sampling), else 1 or sample_every. Deterministic: exactly one of every
  // sample_every consecutive small allocations, at an offset that varies
  // from window to window so a loop with a fixed pattern does not always
  // hit the same tensors.
  std::uint32_t sample(std::size_t bytes);
  // Records the live allocation at `address` of `bytes` (its block size) on
  // `device`, under current() or `tag`. A record already at that address is
  // replaced. Ignored while tagging is off.
  void record(std::uintptr_t address, std::size_t bytes, int device, std::uint32_t weight);
  void record(std::uintptr_t address, std::size_t bytes, int device, std::uint32_t weight, tag_id tag);
  // Forgets the allocation at `address`; one never recorded is ignored.
  void erase(std::uintptr_t address);

  // --- reading ---
  // The tag of the recorded allocation at `address`; false when none.
  bool tag_of(std::uintptr_t address, tag_id* out) const;
  // Live bytes of `device` (k_all_devices_tags: every device) by tag and
  // by size bucket.
  static constexpr int k_all_devices_tags = -1;
  tag_summary summary(int device) const;
  // Bucket boundaries of summary().by_size (the lower bounds after 0).
  static const std::vector<std::size_t>& size_bucket_bounds();

 private:
  struct entry {
    tag_id tag = k_untagged;
    std::uint32_t weight = 1;
    std::size_t bytes = 0;
    int device = 0;
  };
  // One of k_shard_count maps, each behind its own mutex, so threads that
  // allocate at once rarely wait for each other.
  struct alignas(64) shard {
    mutable std::mutex mutex;
    std::unordered_map<std::uintptr_t, entry> entries;
  };
  static constexpr std::size_t k_shard_count = 64;

  shard& shard_of(std::uintptr_t address);
  const shard& shard_of(std::uintptr_t address) const;
  void clear_records();

  mutable std::mutex names_mutex_;
  std::deque<std::string> names_;  // index = tag id
  std::unordered_map<std::string, tag_id> ids_;

  std::atomic<bool> enabled_{false};
  std::atomic<std::uint32_t> sample_every_{1};
  std::atomic<std::size_t> always_record_bytes_{1_MiB};
  std::atomic<std::uint64_t> sample_counter_{0};
  std::atomic<tag_id> inherited_{k_untagged};
  std::mutex switch_mutex_;  // serializes enable() and disable()
  std::vector<shard> shards_;
};

}  // namespace streamalloc
