// expandable_range: the device calls behind one expandable segment --
// reserve, map and unmap chunks, open them to peers, release -- and the
// books of which chunk is mapped where. Policy is the allocator's
// (expandable_segments.cpp).
#include "streamalloc/core/expandable_range.hpp"

#include <algorithm>
#include <utility>

namespace streamalloc {

std::unique_ptr<expandable_range> expandable_range::reserve(device_backend& backend, std::size_t bytes,
                                                            std::size_t chunk_bytes, std::vector<int> peers,
                                                            status* error) {
  void* base = nullptr;
  const status st = backend.vm_reserve(bytes, &base);
  if (!st) {
    *error = st;
    return nullptr;
  }
  return std::unique_ptr<expandable_range>(
      new expandable_range(backend, reinterpret_cast<std::uintptr_t>(base), bytes, chunk_bytes, std::move(peers)));
}

expandable_range::expandable_range(device_backend& backend, std::uintptr_t address, std::size_t bytes,
                                   std::size_t chunk_bytes, std::vector<int> peers)
    : backend_(backend),
      address_(address),
      size_(bytes),
      chunk_bytes_(chunk_bytes),
      chunks_(bytes / chunk_bytes, 0),
      stitched_(bytes / chunk_bytes, false),
      peers_(std::move(peers)) {}

bool expandable_range::any_stitched(std::uintptr_t from, std::uintptr_t to) const {
  for (std::size_t slot = slot_of(from); slot < slot_of(to); ++slot) {
    if (stitched_[slot]) return true;
  }
  return false;
}

std::vector<physical_handle> expandable_range::chunks_of(std::size_t first, std::size_t end) const {
  return {chunks_.begin() + static_cast<std::ptrdiff_t>(first), chunks_.begin() + static_cast<std::ptrdiff_t>(end)};
}

status expandable_range::map(std::uintptr_t at, const std::vector<physical_handle>& handles, std::size_t stolen,
                             map_result* out) {
  *out = map_result{};
  for (std::size_t i = 0; i < handles.size(); ++i) {
    const std::uintptr_t chunk_at = at + i * chunk_bytes_;
    status st = backend_.vm_map(pointer(chunk_at), chunk_bytes_, handles[i]);
    for (std::size_t p = 0; st && p < peers_.size(); ++p) {
      st = backend_.vm_allow_peer(pointer(chunk_at), chunk_bytes_, peers_[p]);
      if (!st) (void)backend_.vm_unmap(pointer(chunk_at), chunk_bytes_);
    }
    if (!st) {
      // Undo the part already mapped, last first.
      for (std::size_t j = i; j-- > 0;) {
        physical_handle ignored = 0;
        if (unmap(at + j * chunk_bytes_, &ignored)) ++out->undone;
      }
      return st;
    }
    const std::size_t slot = slot_of(chunk_at);
    chunks_[slot] = handles[i];
    stitched_[slot] = i < stolen;
    ++mapped_;
    ++out->mapped;
  }
  return status::success();
}

bool expandable_range::unmap(std::uintptr_t at, physical_handle* handle) {
  if (!backend_.vm_unmap(pointer(at), chunk_bytes_)) return false;
  const std::size_t slot = slot_of(at);
  *handle = chunks_[slot];
  chunks_[slot] = 0;
  stitched_[slot] = false;
  --mapped_;
  return true;
}

status expandable_range::allow_peer(int peer_device) {
  for (std::size_t slot = 0; slot < chunks_.size(); ++slot) {
    if (chunks_[slot] == 0) continue;
    const status st = backend_.vm_allow_peer(pointer(address_ + slot * chunk_bytes_), chunk_bytes_, peer_device);
    if (!st) return st;
  }
  peers_.push_back(peer_device);
  return status::success();
}

void expandable_range::forget_peer(int peer_device) {
  peers_.erase(std::remove(peers_.begin(), peers_.end(), peer_device), peers_.end());
}

bool expandable_range::release() {
  return mapped_ == 0 && backend_.vm_release(pointer(address_), size_).ok();
}

void expandable_range::release_at_exit() {
  for (std::size_t slot = 0; slot < chunks_.size(); ++slot) {
    if (chunks_[slot] == 0) continue;
    backend_.vm_unmap(pointer(address_ + slot * chunk_bytes_), chunk_bytes_);
    backend_.vm_destroy(chunks_[slot]);
  }
  backend_.vm_release(pointer(address_), size_);
  std::fill(chunks_.begin(), chunks_.end(), 0);
  std::fill(stitched_.begin(), stitched_.end(), false);
  mapped_ = 0;
}

}  // namespace streamalloc
