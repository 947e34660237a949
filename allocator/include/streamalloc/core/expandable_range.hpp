// expandable_range: one reserved address range of an expandable segment and
// the physical chunks mapped into it, the way torch's ExpandableSegment is
// one type. It owns the mechanics -- the reservation, the chunk handle and
// stitched flag of every chunk slot, the devices its mappings are opened to
// -- and does what the device is asked: map, unmap, open to a peer,
// release. The allocator keeps the policy (where to map, when to grow,
// stitch or give chunks back; Note [expandable segments] in
// expandable_segments.cpp) and the statistics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/util/status.hpp"

namespace streamalloc {

class expandable_range {
 public:
  // Reserves `bytes` of address space (a multiple of `chunk_bytes`); the
  // chunks mapped into it will be opened to `peers`. nullptr, with the
  // backend's status in `*error`, when the device refuses. `backend` must
  // outlive the range.
  static std::unique_ptr<expandable_range> reserve(device_backend& backend, std::size_t bytes,
                                                   std::size_t chunk_bytes, std::vector<int> peers, status* error);
  expandable_range(const expandable_range&) = delete;
  expandable_range& operator=(const expandable_range&) = delete;

  std::uintptr_t address() const { return address_; }
  std::size_t size() const { return size_; }
  std::size_t chunk_bytes() const { return chunk_bytes_; }
  // Chunk slots: slot i covers [address + i * chunk_bytes, +chunk_bytes).
  std::size_t slots() const { return chunks_.size(); }
  std::size_t slot_of(std::uintptr_t at) const { return (at - address_) / chunk_bytes_; }
  // The chunk mapped in `slot` (0: none) and whether it arrived by stitching.
  physical_handle chunk(std::size_t slot) const { return chunks_[slot]; }
  bool stitched(std::size_t slot) const { return stitched_[slot]; }
  // Whether a chunk of [from, to) arrived by stitching.
  bool any_stitched(std::uintptr_t from, std::uintptr_t to) const;
  std::size_t mapped_chunks() const { return mapped_; }
  // The chunk handles of the slots [first, end).
  std::vector<physical_handle> chunks_of(std::size_t first, std::size_t end) const;

  // What map() did: chunks mapped (and booked) before a failure, and how
  // many of those it unmapped again.
  struct map_result {
    std::size_t mapped = 0;
    std::size_t undone = 0;
  };
  // Maps `handles` at consecutive chunk slots from `at`, each opened to the
  // range's peers; the first `stolen` are marked stitched. On a failure the
  // chunks mapped so far are unmapped again (one the device refuses to
  // unmap stays booked as mapped) and the status is returned; the handles
  // stay the caller's to destroy.
  status map(std::uintptr_t at, const std::vector<physical_handle>& handles, std::size_t stolen, map_result* out);
  // Unmaps up to `count` chunks ending at `end` (chunk-aligned), the last
  // first, so a failure leaves one contiguous run mapped; stops at the
  // first the device refuses. Each unmapped chunk's handle goes to
  // `take(handle)` at once. Returns the number unmapped.
  template <typename fn>
  std::size_t unmap_backwards(std::uintptr_t end, std::size_t count, fn&& take) {
    std::size_t done = 0;
    while (done < count) {
      const std::uintptr_t at = end - (done + 1) * chunk_bytes_;
      physical_handle handle = 0;
      if (!unmap(at, &handle)) break;
      take(handle);
      ++done;
    }
    return done;
  }
  // Opens every chunk mapped now to `peer_device`, and those mapped later.
  // On a failure the peer is not remembered (some chunks may be open).
  status allow_peer(int peer_device);
  // Undoes allow_peer's remembering, not its grants: for the allocator,
  // when another range refused the same peer.
  void forget_peer(int peer_device);
  // Returns the address space to the device; only a range with nothing
  // mapped. False when chunks are mapped or the device refuses.
  bool release();
  // At exit: unmaps and destroys every chunk and releases the range,
  // ignoring failures. The caller has synchronized the device.
  void release_at_exit();

 private:
  expandable_range(device_backend& backend, std::uintptr_t address, std::size_t bytes, std::size_t chunk_bytes,
                   std::vector<int> peers);
  // Unmaps the chunk at `at` and forgets it; its handle goes to `*handle`.
  bool unmap(std::uintptr_t at, physical_handle* handle);
  void* pointer(std::uintptr_t at) const { return reinterpret_cast<void*>(at); }

  device_backend& backend_;
  std::uintptr_t address_;
  std::size_t size_;
  std::size_t chunk_bytes_;
  std::vector<physical_handle> chunks_;  // per slot, 0 when unmapped
  std::vector<bool> stitched_;           // per slot
  std::size_t mapped_ = 0;
  std::vector<int> peers_;  // devices every mapping is opened to
};

}  // namespace streamalloc
