// repeat_slot: the block of a loop that frees it and asks for the same
// bytes again, handed back and forth without the allocator's lock (Note
// [repeats without the lock] in caching_allocator.cpp). The lock's holder
// arms it with a block it has just handed out; the arming holds until the
// next critical section begins. Meanwhile a free of that block parks it
// here, and a request for the same bytes on the same stream takes it back.
// A parked block is still counted allocated; the next critical section
// unparks it and frees it for real. With several arenas the device's ledger
// may claim a parked block (Note [claimed repeats] in arena_ledger.hpp):
// it stays parked, marked, and can no longer be taken back. Every member is
// atomic: the fast paths run on any thread, without the lock.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/core/block.hpp"

namespace streamalloc {

class repeat_slot {
 public:
  // Under the lock, in critical section `section` (never 0): `b`, just
  // handed out for `requested` bytes on its stream, may be parked and taken
  // back until another section begins.
  void arm(block* b, std::size_t requested, std::uint64_t section) {
    // A seqlock's write, with release stores instead of fences (which
    // ThreadSanitizer does not model): a reader that sees any new field
    // sees section_ changed.
    section_.store(k_disarmed, std::memory_order_relaxed);
    block_.store(b, std::memory_order_release);
    address_.store(b->address, std::memory_order_release);
    size_.store(b->size, std::memory_order_release);
    small_.store(b->owner->is_small, std::memory_order_release);
    requested_.store(requested, std::memory_order_release);
    stream_.store(b->stream, std::memory_order_release);
    section_.store(section, std::memory_order_release);
  }
  // Under the lock: no block is armed (its block is being freed).
  void disarm() {
    section_.store(k_disarmed, std::memory_order_relaxed);
    block_.store(nullptr, std::memory_order_release);
  }
  // Under the lock: the armed block, nullptr if none. It is allocated or
  // parked, never freed while armed.
  block* armed() const { return block_.load(std::memory_order_relaxed); }

  // Without the lock; `now`: the lock's count of sections. Parks the armed
  // block if `ptr` is its address and no section began since the arming:
  // the free is done. false: the caller frees through the lock.
  bool park(const void* ptr, std::uint64_t now) {
    arming a;
    if (!read_arming(now, &a) || reinterpret_cast<std::uintptr_t>(ptr) != a.address) return false;
    // Fails when a block is parked already: a second free, or a block
    // parked under an arming since ended, for the lock's path to free.
    block* expected = nullptr;
    return parked_.compare_exchange_strong(expected, a.b, std::memory_order_acq_rel, std::memory_order_relaxed);
  }

  // Without the lock: the parked block's address, taken back, if it is the
  // armed block, no section began since the arming and the request is the
  // one it was armed with; else nullptr. Counts the reuse in the block.
  // `*orphan`: a parked block this call took out but may not hand out (a
  // section began meanwhile), for the caller to free through the lock.
  void* take(std::size_t requested, stream_handle stream, std::uint64_t now, block** orphan) {
    if (parked_.load(std::memory_order_relaxed) == nullptr) return nullptr;
    arming a;
    if (!read_arming(now, &a) || a.requested != requested || a.stream != stream) return nullptr;
    // Only the armed block: anything else parked stays for the lock's path.
    block* b = a.b;
    if (!parked_.compare_exchange_strong(b, nullptr, std::memory_order_acq_rel, std::memory_order_relaxed)) {
      return nullptr;
    }
    // Taken: it is free to its owner and no longer parked. Unless the same
    // arming still holds (a block freed, recycled and armed again could be
    // parked at the same place), it goes back through the lock.
    arming again;
    if (!read_arming(now, &again) || again.b != a.b || again.address != a.address) {
      *orphan = b;
      return nullptr;
    }
    // This thread alone holds b until its caller frees it: the count has one
    // writer at a time; the lock's holder reads it (reuses_of).
    __atomic_store_n(&b->lock_free_reuses, __atomic_load_n(&b->lock_free_reuses, __ATOMIC_RELAXED) + 1,
                     __ATOMIC_RELAXED);
    return reinterpret_cast<void*>(a.address);
  }

  // Under the lock: whether a block may be parked (unpark tells).
  bool maybe_parked() const { return parked_.load(std::memory_order_relaxed) != nullptr; }
  // Under the lock: the parked block, claimed or not, no longer parked;
  // nullptr if none.
  block* unpark() {
    return maybe_parked() ? unmarked(parked_.exchange(nullptr, std::memory_order_acq_rel)) : nullptr;
  }
  // Under the lock: the parked block, claimed or not, left parked (a
  // reader's look).
  const block* parked() const { return unmarked(parked_.load(std::memory_order_acquire)); }

  // Without the lock, by the ledger, holding this arena's share of it:
  // marks the parked block claimed, so that no take hands it out again, and
  // gives its size and pool. false: nothing parked, already claimed, or the
  // arming changed meanwhile.
  bool claim(std::size_t* size, bool* small) {
    block* b = parked_.load(std::memory_order_acquire);
    if (b == nullptr || is_claimed(b)) return false;
    // A parked block is the current arming's: an arming begins in a section
    // that unparked first, and a park needs the arming in force. The
    // section, read again after the mark, tells that no arming came
    // between (sections only grow), so the size read is the block's.
    const std::uint64_t section = section_.load(std::memory_order_acquire);
    if (section == k_disarmed || block_.load(std::memory_order_acquire) != b) return false;
    *size = size_.load(std::memory_order_acquire);
    *small = small_.load(std::memory_order_acquire);
    if (!parked_.compare_exchange_strong(b, marked(b), std::memory_order_acq_rel, std::memory_order_relaxed)) {
      return false;
    }
    if (section_.load(std::memory_order_acquire) == section) return true;
    // Left as it was, unless a section unparked it since (then it is freed
    // there, counted by that section's publish).
    block* claimed = marked(b);
    parked_.compare_exchange_strong(claimed, b, std::memory_order_acq_rel, std::memory_order_relaxed);
    return false;
  }
  // With this arena's share of the ledger held: the parked block, if the
  // ledger claimed it.
  const block* claimed() const {
    block* b = parked_.load(std::memory_order_acquire);
    return is_claimed(b) ? unmarked(b) : nullptr;
  }

  // Reuses of `b` taken back here so far (the lock's holder subtracts
  // those it has counted).
  static std::uint64_t reuses_of(const block* b) { return __atomic_load_n(&b->lock_free_reuses, __ATOMIC_RELAXED); }

 private:
  static constexpr std::uint64_t k_disarmed = 0;
  // A claimed block is parked with its address's lowest bit set: park's
  // and take's exchanges, which expect nullptr or the plain block, fail.
  static constexpr std::uintptr_t k_claim_mark = 1;
  static bool is_claimed(const block* b) { return (reinterpret_cast<std::uintptr_t>(b) & k_claim_mark) != 0; }
  static block* marked(block* b) { return reinterpret_cast<block*>(reinterpret_cast<std::uintptr_t>(b) | k_claim_mark); }
  static block* unmarked(block* b) {
    return reinterpret_cast<block*>(reinterpret_cast<std::uintptr_t>(b) & ~k_claim_mark);
  }
  struct arming {
    block* b;
    std::uintptr_t address;
    std::size_t requested;
    stream_handle stream;
  };
  // A consistent copy of the arming (a seqlock read), if it holds at `now`.
  bool read_arming(std::uint64_t now, arming* out) const {
    const std::uint64_t section = section_.load(std::memory_order_acquire);
    if (section == k_disarmed || section != now) return false;
    out->b = block_.load(std::memory_order_acquire);
    out->address = address_.load(std::memory_order_acquire);
    out->requested = requested_.load(std::memory_order_acquire);
    out->stream = stream_.load(std::memory_order_acquire);
    return section_.load(std::memory_order_relaxed) == section;
  }

  // Its own cache line: the thread running the loop writes it on every
  // call, while the allocator's other state stays with the lock's holder.
  alignas(64) std::atomic<block*> parked_{nullptr};
  std::atomic<std::uint64_t> section_{k_disarmed};
  std::atomic<block*> block_{nullptr};
  std::atomic<std::uintptr_t> address_{0};
  std::atomic<std::size_t> size_{0};  // read by claims only
  std::atomic<bool> small_{false};
  std::atomic<std::size_t> requested_{0};
  std::atomic<stream_handle> stream_{0};
};

}  // namespace streamalloc
