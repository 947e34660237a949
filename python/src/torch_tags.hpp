// torch_tags: the torch layer's allocation tags (allocation_tags.hpp): the
// process-wide registry, the flag every allocation and free reads, and the
// two calls torch_allocator makes around the caching allocators.
#pragma once

#include <atomic>
#include <cstddef>

#include "streamalloc/core/allocation_tags.hpp"
#include "streamalloc/core/device_allocator.hpp"

namespace streamalloc {

namespace detail {
extern std::atomic<bool> tagging_flag;
}  // namespace detail

// Whether allocations are being tagged: the only cost tagging adds to an
// allocation or a free while it is off.
inline bool tagging_on() { return detail::tagging_flag.load(std::memory_order_relaxed); }

// The registry behind streamalloc.tag(), attribute() and report(). Never
// destroyed: tensors may be freed during process exit, after static
// destructors ran.
allocation_tags& process_allocation_tags();

// Starts recording (or changes the sampling while recording); stopping
// forgets every record.
void enable_tagging(const tagging_options& options);
void disable_tagging();

// Called with tagging on, after `allocator` (of `device`) returned `ptr`
// for `requested` bytes: records its block under the current tag when
// sampling picks it. Never throws: the allocation succeeded, and a record
// that cannot be made is dropped.
void record_allocation(device_allocator& allocator, int device, const void* ptr, std::size_t requested) noexcept;
// Called with tagging on, before `ptr` is freed (Note [allocation tags]).
void forget_allocation(const void* ptr) noexcept;

}  // namespace streamalloc
