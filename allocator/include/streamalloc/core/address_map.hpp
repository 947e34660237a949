// address_map: an open-addressing hash map from block address to block,
// for the pointer lookup on every free. Linear probing with backward-shift
// deletion keeps it tombstone-free; no node is allocated per entry.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace streamalloc {

struct block;

class address_map {
 public:
  address_map() : slots_(k_initial_slots) {}

  block* find(std::uintptr_t address) const { return slots_[slot_of(address)].value; }

  // Where the address is (or, when absent, an empty slot), so that erasing
  // a found entry (erase_at) needs no second probe. Valid until the map
  // next changes.
  std::size_t slot_of(std::uintptr_t address) const {
    for (std::size_t i = index_of(address);; i = (i + 1) & mask()) {
      const slot& s = slots_[i];
      if (s.value == nullptr || s.key == address) return i;
    }
  }
  block* at(std::size_t i) const { return slots_[i].value; }

  // The address must not be present.
  void insert(std::uintptr_t address, block* value) {
    if ((size_ + 1) * 4 > slots_.size() * 3) grow();
    place(address, value);
    ++size_;
  }

  // Removes and returns the entry, or nullptr when absent.
  block* erase(std::uintptr_t address) {
    const std::size_t i = slot_of(address);
    block* found = slots_[i].value;
    if (found != nullptr) erase_at(i);
    return found;
  }

  // Removes the entry of a slot_of that found one.
  void erase_at(std::size_t i) {
    // Shift later members of the probe run back so lookups never stop early.
    // A member stays when its home lies in (i, j] (wrapping around): it is
    // nearer its home than the hole is.
    for (std::size_t j = (i + 1) & mask();; j = (j + 1) & mask()) {
      if (slots_[j].value == nullptr) break;
      const std::size_t home = index_of(slots_[j].key);
      const bool stays = ((j - home) & mask()) < ((j - i) & mask());
      if (stays) continue;
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i] = slot{};
    --size_;
  }

  std::size_t size() const { return size_; }

  template <typename fn>
  void for_each(fn&& visit) const {
    for (const slot& s : slots_) {
      if (s.value != nullptr) visit(s.key, s.value);
    }
  }

 private:
  struct slot {
    std::uintptr_t key = 0;
    block* value = nullptr;
  };
  static constexpr std::size_t k_initial_slots = 1024;

  std::size_t mask() const { return slots_.size() - 1; }
  std::size_t index_of(std::uintptr_t address) const {
    // Blocks are 512-byte aligned: drop the always-zero bits, then mix.
    return static_cast<std::size_t>(((address >> 9) * 0x9E3779B97F4A7C15ull) >> 20) & mask();
  }
  void place(std::uintptr_t address, block* value) {
    std::size_t i = index_of(address);
    while (slots_[i].value != nullptr) i = (i + 1) & mask();
    slots_[i] = {address, value};
  }
  void grow() {
    std::vector<slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const slot& s : old) {
      if (s.value != nullptr) place(s.key, s.value);
    }
  }

  std::vector<slot> slots_;
  std::size_t size_ = 0;
};

}  // namespace streamalloc
