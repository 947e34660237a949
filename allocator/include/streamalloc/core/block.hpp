// Blocks and segments: the allocator's unit of bookkeeping.
//
// Glossary (these words mean the same everywhere in the project):
// - segment: one contiguous range obtained from the device backend.
// - block: a contiguous piece of a segment; the blocks of a segment tile it
//   exactly, linked in address order (prev/next).
// - split: cutting a free block in two so a request takes the front part;
//   the remainder stays free.  Coalesce: merging a freed block with free
//   neighbours of the same stream.  Both are done by split_at and
//   absorb_next (block_list.hpp), for every list of blocks.
// - pool: the free blocks available for reuse, kept per (memory pool,
//   small/large, stream) in a free_block_index (free_block_index.hpp).
// - size class: the free blocks of one stream and one exact size (below
//   32 MiB by default) in a pool, found by a bit scan (Note [size classes]).
// - best fit: the free block of the requesting stream with the smallest
//   size that holds the request; among equal sizes the lowest address.
// - stream use: a stream other than the allocating stream that touched the
//   block (record_stream).  The allocating stream is the block's stream.
// - pending free: a block the program freed while stream uses may still be
//   running; it returns to its pool once their events complete.
// - expandable segment: a reserved address range whose chunks are mapped
//   and unmapped one by one (Note [expandable segments]); its blocks tile
//   the whole range and each is either mapped or unmapped. The range and
//   its chunks are an expandable_range (expandable_range.hpp).
// - chunk: the unit of physical memory mapped into an expandable segment.
//   An idle chunk lies wholly inside free mapped memory: one free block,
//   or adjacent free blocks of several streams (Note [free runs]).
// - stitching: unmapping idle chunks from free holes and mapping them
//   where a request needs memory (Note [stitching]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <vector>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/core/expandable_range.hpp"
#include "streamalloc/core/node_recycler.hpp"
#include "streamalloc/core/snapshot.hpp"

namespace streamalloc {

struct segment;
struct block;
class free_block_index;

// A free block's place in its size class (free_block_index.hpp), which is a
// pairing heap ordered by address: the block's first child, its next
// sibling, and its previous sibling or, for a first child, its parent.
struct heap_links {
  block* child = nullptr;
  block* next = nullptr;
  block* prev = nullptr;
};

// A free block above the size classes, as the tree of a free_block_index
// holds it: the key is copied into the node so a search never loads the
// blocks it passes.
struct tree_entry {
  stream_handle stream;
  std::size_t size;
  std::uintptr_t address;
  block* b;
};
// (stream, size, address) order: lower_bound({stream, size, 0}) is the best fit.
struct tree_order {
  bool operator()(const tree_entry& a, const tree_entry& b) const {
    if (a.stream != b.stream) return a.stream < b.stream;
    return a.size != b.size ? a.size < b.size : a.address < b.address;
  }
};
using free_block_tree = std::set<tree_entry, tree_order, recycling_allocator<tree_entry>>;

// Aligned to a cache line, its fields in two groups (Note [block layout]).
struct alignas(64) block {
  // --- first cache line: neighbours and heap walks ---
  std::uintptr_t address = 0;
  std::size_t size = 0;
  block* prev = nullptr;  // address neighbours inside the segment
  block* next = nullptr;
  bool allocated = false;
  // false: a free, chunk-aligned stretch of an expandable segment with no
  // memory behind it, kept in its pool's unmapped set (stream 0).
  bool mapped = true;
  bool counted_inactive_split = false;  // contributes to inactive_split stats
  // Freed but kept whole among the allocator's recent frees (Note [recent
  // frees]): inactive, yet not free to its neighbours, until it is taken
  // back or returned to its pool.
  bool recent = false;
  int pending_events = 0;  // > 0: pending free
  // Where the block sits in its pool's free_block_index while free, so
  // leaving it needs no search: its links in its size class, or (below,
  // tree_position) its node in the tree of larger blocks.
  heap_links free_links;

  // --- second cache line: what a free reads of its own block ---
  stream_handle stream = 0;
  segment* owner = nullptr;
  std::size_t requested_size = 0;  // 0 while free
  // The lock acquisition of this block's last reuse from the recent frees,
  // or of the free that kept it right after one (Note [repeated reuse]).
  std::uint64_t reuse_chain = 0;
  // Reuses of this block taken back without the lock (Note [repeats without
  // the lock]), written through atomic builtins by the thread holding the
  // block (repeat_slot), and how many of them the statistics count.
  std::uint64_t lock_free_reuses = 0;
  std::uint64_t lock_free_reuses_counted = 0;
  std::vector<stream_handle> stream_uses;
  free_block_tree::iterator tree_position;

  bool is_free() const { return !allocated && pending_events == 0 && !recent; }
  // A free block whose memory can be reused or coalesced.
  bool is_free_mapped() const { return is_free() && mapped; }
  // Shares its (mapped part of a) segment with other blocks.
  bool is_split() const { return (prev != nullptr && prev->mapped) || (next != nullptr && next->mapped); }
};

// Note [block layout]: the first cache line of a block holds what is read of
// a block that an operation only passes or looks at: what coalescing checks
// of a neighbour (its stream only once it is found free) and what a size
// class's pairing heap reads of the blocks it passes. The second starts with
// what a free reads of its own block. Blocks come from new (aligned new
// since C++17), so each starts a line. A block grew from 152 to 192 bytes; a
// cache model of the mixed pattern counted 17% fewer L1 misses, and the
// threads pattern ran 8-12% faster on one H200 host and no faster on
// another (bench/RESULTS.md, twentieth session).
static_assert(alignof(block) == 64, "a block starts a cache line");
static_assert(offsetof(block, free_links) + sizeof(heap_links) <= 64,
              "the fields a neighbour or a heap walk reads fit the first cache line");
static_assert(offsetof(block, stream) == 64, "a free's own fields start the second cache line");

struct segment {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  stream_handle stream = 0;  // stream that caused the segment to be created
  bool is_small = false;
  pool_id pool = 0;
  free_block_index* free_set = nullptr;  // where its free blocks are cached
  block* first = nullptr;

  // --- expandable segments only (address and size are the range's) ---
  // The reserved range and its chunks; nullptr for a plain segment.
  std::unique_ptr<expandable_range> range;
  free_block_index* unmapped_set = nullptr;  // where its unmapped blocks are kept

  bool expandable() const { return range != nullptr; }
};

}  // namespace streamalloc
