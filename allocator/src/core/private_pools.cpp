// Private pools shared by torch.cuda.MemPool, CUDA graph captures and graph
// trees: use counts, segments from a pool's own segment_source, the
// use_on_oom and no_split options, emptying one pool, checkpoints of a
// pool's block layout, and the ranges CUDA IPC shares.
//
// Note [released pools]: when the last use of a pool is released (its graph
// destroyed, its MemPool deleted) torch keeps the pool's cached segments
// reserved until emptyCache, or until an allocation about to fail releases
// cached memory: after `del graph` its segment.* and reserved_bytes.* stats
// do not move, and after empty_cache they drop to the segments still holding
// tensors of the graph. We do the same. release_pool only stops the pool
// from serving new requests; release_unused_segments_locked (empty_cache,
// the OOM ladder's last stage, garbage collection) returns its unused
// segments; empty_cache(id), which torch's MemPool destructor calls right
// after releasePool, returns just this pool's. The pool's books go with its
// last segment.
//
// Note [use_on_oom pools]: a MemPool made with use_on_oom lends its cached
// free blocks to requests outside every private pool that would otherwise
// fail. After growth has failed, before any cached memory is released, each
// such pool is searched for the request's stream by best fit (no growth, no
// other streams, as in torch). The block stays in its pool's segment and
// returns to that pool when freed.
//
// Note [pool checkpoints]: graph trees (torch.compile "reduce-overhead")
// record many graphs into one private pool, arranged as a tree of paths.
// Replaying a graph bypasses the allocator, so afterwards the pool's books no
// longer say which of its blocks hold live tensors. Before recording a new
// graph after replaying a path, graph trees put the pool back into the
// layout it had when that path's last graph was recorded:
// - checkpoint_pool records every segment of the pool and every block in it
//   (address, size, requested size, stream, allocated or free);
// - restore_pool ends every allocation the pool has now, which the caller
//   declares dead (their stream uses are dropped without events: the caller
//   has synchronized), then cuts each checkpointed segment at exactly the
//   recorded block boundaries and makes the recorded allocations live again,
//   now owned by the caller. Both lists are returned.
// Each checkpointed segment must still exist (a pool keeps its memory while
// it is in use); segments created after the checkpoint stay, all free. A
// block awaiting stream events can be neither recorded nor restored, as its
// memory depends on work the checkpoint cannot describe: both calls refuse
// with usage_error until the streams are synchronized. Every change goes
// through the ordinary free and allocate bookkeeping, so the stats stay
// exact. pool_allocations_match lets graph trees check that the allocator
// agrees with their own list of live tensors.
#include <algorithm>
#include <string>

#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {
namespace {

std::uintptr_t to_address(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr); }

std::string pool_name(pool_id id) { return "streamalloc: private pool " + std::to_string(id); }

}  // namespace

// ---------------------------------------------------------------------------
// Uses and options

void caching_allocator::create_or_incref_pool(pool_id id, std::shared_ptr<segment_source> source) {
  if (id == 0) throw usage_error("streamalloc: private pool id 0 is reserved for the default pool");
  std::lock_guard<adaptive_mutex> lock(mutex_);
  auto [it, created] = private_pools_.try_emplace(id, &set_nodes_, config_.min_block_bytes);
  if (created) it->second.source = std::move(source);
  ++it->second.use_count;
}

int caching_allocator::pool_use_count(pool_id id) const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  auto it = private_pools_.find(id);
  return it == private_pools_.end() ? 0 : it->second.use_count;
}

void caching_allocator::set_pool_use_on_oom(pool_id id, bool use_on_oom) {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  auto it = id == 0 ? private_pools_.end() : private_pools_.find(id);
  if (it == private_pools_.end()) throw usage_error(pool_name(id) + " does not exist (set_pool_use_on_oom)");
  it->second.use_on_oom = use_on_oom;
}

void caching_allocator::set_pool_no_split(pool_id id, bool no_split) {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  auto it = id == 0 ? private_pools_.end() : private_pools_.find(id);
  if (it == private_pools_.end()) throw usage_error(pool_name(id) + " does not exist (set_pool_no_split)");
  it->second.no_split = no_split;
}

bool caching_allocator::pool_in_use_locked(pool_id pool) const {
  auto it = private_pools_.find(pool);
  return it != private_pools_.end() && it->second.use_count > 0;
}

void caching_allocator::forget_pool_segment_locked(pool_id pool) {
  auto p = private_pools_.find(pool);
  if (--p->second.segments == 0 && p->second.use_count == 0) private_pools_.erase(p);
}

bool caching_allocator::pool_no_split_locked(pool_id pool) const {
  auto it = private_pools_.find(pool);
  return it != private_pools_.end() && it->second.no_split;
}

// ---------------------------------------------------------------------------
// Segments of a pool with its own source

status caching_allocator::allocate_segment_locked(std::size_t bytes, stream_handle stream, pool_id pool, void** out) {
  if (pool != 0) {
    auto it = private_pools_.find(pool);
    if (it != private_pools_.end() && it->second.source) return it->second.source->allocate_segment(bytes, stream, out);
  }
  return backend_.allocate_segment(bytes, out);
}

bool caching_allocator::free_segment_locked(const segment* s) {
  void* ptr = reinterpret_cast<void*>(s->address);
  if (s->pool != 0) {
    // A pool's books outlive its segments, so its source is still there.
    auto it = private_pools_.find(s->pool);
    if (it != private_pools_.end() && it->second.source) return it->second.source->free_segment(ptr, s->size, s->stream).ok();
  }
  return backend_.free_segment(ptr, s->size).ok();
}

block* caching_allocator::take_from_use_on_oom_pools_locked(std::size_t rounded, stream_handle stream) {
  for (auto& [id, p] : private_pools_) {
    if (!p.use_on_oom) continue;
    free_block_index& set = policy_.in_small_pool(rounded, id) ? p.free.small : p.free.large;
    if (block* b = find_free_block_locked(set, rounded, stream)) return b;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------
// Emptying one pool

void caching_allocator::empty_cache(pool_id id) {
  if (id == 0) {
    empty_cache();
    return;
  }
  locked_call call(*this);
  flush_recent_locked();
  // As empty_cache(): a capture may neither synchronize nor free memory.
  if (capture_count_.load(std::memory_order_relaxed) != 0) return;
  auto it = private_pools_.find(id);
  // A pool in use keeps its cache: a graph replays into it, a MemPool
  // allocates from it again.
  if (it == private_pools_.end() || it->second.use_count > 0) return;
  synchronize_pool_events_locked(id);
  release_idle_chunks_locked(id);
  for (auto seg = segments_.begin(); seg != segments_.end();) {
    segment* s = seg->second;
    ++seg;  // releasing erases s (and, with its last segment, the pool)
    if (s->pool != id) continue;
    if (s->expandable()) {
      release_range_locked(s);
    } else if (segment_unused(s)) {
      release_segment_locked(s);
    }
  }
}

void caching_allocator::synchronize_pool_events_locked(pool_id pool) {
  // Only the events of this pool's pending frees: the other pools' streams
  // keep running.
  bool device_synced = false;
  for (auto it = pending_.begin(); it != pending_.end();) {
    std::deque<pending_event>& queue = it->second;
    for (auto e = queue.begin(); e != queue.end();) {
      if (e->owner->owner->pool != pool) {
        ++e;
        continue;
      }
      if (!backend_.synchronize_event(e->event)) {
        if (!device_synced && !backend_.synchronize_device()) {
          ++e;  // no proof that the stream is done: the free stays pending
          continue;
        }
        device_synced = true;
      }
      const pending_event entry = *e;
      e = queue.erase(e);
      complete_event_locked(entry);
    }
    it = queue.empty() ? pending_.erase(it) : std::next(it);
  }
  const auto in_pool = [&](const block* b) { return b->owner->pool == pool; };
  if (std::none_of(awaiting_device_sync_.begin(), awaiting_device_sync_.end(), in_pool)) return;
  if (!device_synced && !backend_.synchronize_device()) return;
  std::vector<block*> ready;
  for (auto b = awaiting_device_sync_.begin(); b != awaiting_device_sync_.end();) {
    if (in_pool(*b)) {
      ready.push_back(*b);
      b = awaiting_device_sync_.erase(b);
    } else {
      ++b;
    }
  }
  for (block* b : ready) {
    if (--b->pending_events == 0) return_to_pool_locked(b);
  }
}

// ---------------------------------------------------------------------------
// Checkpoints (Note [pool checkpoints])

pool_checkpoint caching_allocator::checkpoint_pool(pool_id id) const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  if (id == 0 || !pool_in_use_locked(id)) throw usage_error(pool_name(id) + " is not in use (checkpoint_pool)");
  pool_checkpoint out;
  out.pool = id;
  for (const auto& [address, s] : segments_) {
    if (s->pool != id) continue;
    pool_checkpoint::segment_state seg;
    seg.address = s->address;
    seg.size = s->size;
    seg.is_small = s->is_small;
    for (const block* b = s->first; b != nullptr; b = b->next) {
      if (b->pending_events > 0) {
        throw usage_error(pool_name(id) + ": the block at " + std::to_string(b->address) +
                          " awaits stream events; synchronize before checkpoint_pool");
      }
      seg.blocks.push_back({b->address, b->size, b->requested_size, b->stream, b->allocated, b->mapped});
    }
    out.segments.push_back(std::move(seg));
  }
  return out;
}

pool_restore_result caching_allocator::restore_pool(const pool_checkpoint& state) {
  locked_call call(*this);
  const std::vector<segment*> targets = restorable_segments_locked(state);
  // Its allocations raise stats past what the recent frees took away, which
  // a reuse of one must not see (Note [recent frees]).
  flush_recent_locked();
  pool_restore_result out;
  std::vector<block*> live;
  for (const auto& [address, s] : segments_) {
    if (s->pool != state.pool) continue;
    for (block* b = s->first; b != nullptr; b = b->next) {
      if (b->allocated) live.push_back(b);
    }
  }
  // Coalescing only merges free neighbours into the freed block, so every
  // block still to be freed survives the frees before it.
  for (block* b : live) {
    out.freed.push_back(reinterpret_cast<void*>(b->address));
    end_allocation_locked(b);
  }
  for (std::size_t i = 0; i < targets.size(); ++i) rebuild_segment_locked(targets[i], state.segments[i], &out);
  return out;
}

std::vector<segment*> caching_allocator::restorable_segments_locked(const pool_checkpoint& state) const {
  const pool_id id = state.pool;
  if (id == 0 || !pool_in_use_locked(id)) throw usage_error(pool_name(id) + " is not in use (restore_pool)");
  for (const auto& [address, s] : segments_) {
    if (s->pool != id) continue;
    for (const block* b = s->first; b != nullptr; b = b->next) {
      if (b->pending_events > 0) {
        throw usage_error(pool_name(id) + ": the block at " + std::to_string(b->address) +
                          " awaits stream events; synchronize before restore_pool");
      }
    }
  }
  std::vector<segment*> out;
  out.reserve(state.segments.size());
  for (const pool_checkpoint::segment_state& seg : state.segments) {
    const std::string where = pool_name(id) + ": checkpointed segment at " + std::to_string(seg.address);
    auto found = segments_.find(seg.address);
    if (found == segments_.end() || found->second->pool != id || found->second->size != seg.size) {
      throw usage_error(where + " is no longer in the pool (restore_pool)");
    }
    if (std::find(out.begin(), out.end(), found->second) != out.end()) throw usage_error(where + " appears twice");
    std::uintptr_t expected = seg.address;
    for (const pool_checkpoint::block_state& b : seg.blocks) {
      if (b.address != expected || b.size == 0 || b.size > seg.address + seg.size - expected) {
        throw usage_error(where + ": its blocks do not tile it");
      }
      expected += b.size;
    }
    if (expected != seg.address + seg.size) throw usage_error(where + ": its blocks do not tile it");
    if (found->second->expandable()) {
      // Note [private ranges]: a range's chunks stay mapped while its pool
      // is in use, so what was mapped then is mapped now.
      const expandable_range& range = *found->second->range;
      for (const pool_checkpoint::block_state& b : seg.blocks) {
        if (!b.mapped) continue;
        for (std::size_t slot = range.slot_of(b.address); slot <= range.slot_of(b.address + b.size - 1); ++slot) {
          if (range.chunk(slot) == 0) throw usage_error(where + ": memory it recorded is no longer mapped");
        }
      }
    }
    out.push_back(found->second);
  }
  return out;
}

void caching_allocator::end_allocation_locked(block* b) {
  allocated_.erase(b->address);
  unmark_allocated_locked(b);
  uncount_allocation_locked(b);
  b->stream_uses.clear();
  return_to_pool_locked(b);
}

void caching_allocator::rebuild_segment_locked(segment* s, const pool_checkpoint::segment_state& state,
                                               pool_restore_result* out) {
  // Every block of s is free now. Its free blocks may carry several streams
  // (cross-stream reuse), so it is relinked from the checkpoint rather than
  // cut from one free block.
  for (block* b = s->first; b != nullptr;) {
    block* next = b->next;
    if (b->mapped) {
      erase_free_locked(b);
    } else {
      s->unmapped_set->erase(b);
    }
    delete_block_locked(b);
    b = next;
  }
  s->first = nullptr;
  block* last = nullptr;
  const auto append = [&](const pool_checkpoint::block_state& piece) {
    // Free neighbours of one stream coalesce, as do unmapped ones, as the
    // invariants require.
    if (!piece.allocated && last != nullptr && !last->allocated && last->mapped == piece.mapped &&
        (!piece.mapped || last->stream == piece.stream)) {
      last->size += piece.size;
      return;
    }
    block* b = new_block_locked();
    b->address = piece.address;
    b->size = piece.size;
    b->stream = piece.stream;
    b->owner = s;
    b->mapped = piece.mapped;
    b->allocated = piece.allocated;  // counted below, once the neighbours are linked
    b->prev = last;
    if (last != nullptr) {
      last->next = b;
    } else {
      s->first = b;
    }
    last = b;
  };
  for (const pool_checkpoint::block_state& recorded : state.blocks) {
    if (recorded.mapped) {
      append(recorded);
      continue;
    }
    // Note [private ranges]: chunks mapped since the checkpoint stay mapped,
    // free, of the range's stream. One piece per run of chunks mapped or not.
    const expandable_range& range = *s->range;
    const std::size_t end = range.slot_of(recorded.address + recorded.size - 1) + 1;
    for (std::size_t slot = range.slot_of(recorded.address); slot < end;) {
      const bool mapped = range.chunk(slot) != 0;
      std::size_t next = slot + 1;
      while (next < end && (range.chunk(next) != 0) == mapped) ++next;
      append({range.address() + slot * range.chunk_bytes(), (next - slot) * range.chunk_bytes(), 0,
              mapped ? s->stream : 0, false, mapped});
      slot = next;
    }
  }
  // Both loops need the whole list: a free block's inactive_split status
  // depends on its neighbours.
  auto recorded = state.blocks.begin();
  for (block* b = s->first; b != nullptr; b = b->next) {
    if (!b->allocated) continue;
    while (recorded->address != b->address) ++recorded;
    allocated_.insert(b->address, b);
    mark_allocated_locked(b, recorded->requested_size);
    out->allocated.push_back(reinterpret_cast<void*>(b->address));
  }
  for (block* b = s->first; b != nullptr; b = b->next) {
    if (b->allocated) continue;
    if (b->mapped) {
      insert_free_locked(b);
    } else {
      s->unmapped_set->insert(b);
    }
  }
}

bool caching_allocator::pool_allocations_match(pool_id id, const std::vector<const void*>& expected) const {
  std::vector<std::uintptr_t> wanted;
  wanted.reserve(expected.size());
  for (const void* p : expected) wanted.push_back(to_address(p));
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  std::lock_guard<adaptive_mutex> lock(mutex_);
  if (id == 0 || private_pools_.find(id) == private_pools_.end()) {
    throw usage_error(pool_name(id) + " does not exist (pool_allocations_match)");
  }
  std::size_t live = 0;
  for (const auto& [address, s] : segments_) {
    if (s->pool != id) continue;
    for (const block* b = s->first; b != nullptr; b = b->next) {
      if (!b->allocated) continue;
      if (!std::binary_search(wanted.begin(), wanted.end(), b->address)) return false;
      ++live;
    }
  }
  return live == wanted.size();
}

// ---------------------------------------------------------------------------
// CUDA IPC

caching_allocator::shareable_range caching_allocator::share_range(const void* ptr) const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  const block* b = allocated_block_locked(ptr);
  if (b == nullptr) throw usage_error("share_range: " + describe_unknown_pointer_locked(ptr));
  const segment* s = b->owner;
  shareable_range out;
  if (!s->expandable()) {
    out.address = s->address;
    out.size = s->size;
    return out;
  }
  // The chunks under the block: its range widened to chunk boundaries,
  // which are offsets from the range's base.
  const expandable_range& range = *s->range;
  const std::size_t chunk = range.chunk_bytes();
  const std::size_t first = range.slot_of(b->address);
  const std::size_t end = range.slot_of(b->address + b->size - 1) + 1;
  out.address = s->address + first * chunk;
  out.size = (end - first) * chunk;
  out.expandable = true;
  out.chunk_bytes = chunk;
  out.chunks = range.chunks_of(first, end);
  return out;
}

}  // namespace streamalloc
