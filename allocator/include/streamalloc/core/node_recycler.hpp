// node_recycler: keeps the nodes of the free-block trees (the blocks above
// the size classes of a free_block_index) for reuse, so that moving a block
// in and out of a pool never reaches malloc.
// Not thread-safe: it belongs to one caching_allocator and is used under
// that allocator's lock.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace streamalloc {

class node_recycler {
 public:
  node_recycler() = default;
  node_recycler(const node_recycler&) = delete;
  node_recycler& operator=(const node_recycler&) = delete;
  ~node_recycler() {
    for (void* node : spare_) ::operator delete(node);
  }

  void* take(std::size_t bytes) {
    if (bytes == node_bytes_ && !spare_.empty()) {
      void* node = spare_.back();
      spare_.pop_back();
      return node;
    }
    if (node_bytes_ == 0) node_bytes_ = bytes;
    return ::operator new(bytes);
  }

  void give(void* node, std::size_t bytes) {
    if (bytes == node_bytes_) {
      spare_.push_back(node);
    } else {
      ::operator delete(node);
    }
  }

 private:
  std::size_t node_bytes_ = 0;  // the one node size that is recycled
  std::vector<void*> spare_;
};

// Standard allocator adaptor over a node_recycler (single nodes only).
template <typename T>
class recycling_allocator {
 public:
  using value_type = T;

  explicit recycling_allocator(node_recycler* recycler) : recycler_(recycler) {}
  template <typename U>
  recycling_allocator(const recycling_allocator<U>& other) : recycler_(other.recycler()) {}

  T* allocate(std::size_t n) {
    if (n == 1) return static_cast<T*>(recycler_->take(sizeof(T)));
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) {
    if (n == 1) {
      recycler_->give(p, sizeof(T));
    } else {
      ::operator delete(p);
    }
  }
  node_recycler* recycler() const { return recycler_; }

  template <typename U>
  bool operator==(const recycling_allocator<U>& other) const {
    return recycler_ == other.recycler();
  }
  template <typename U>
  bool operator!=(const recycling_allocator<U>& other) const {
    return recycler_ != other.recycler();
  }

 private:
  node_recycler* recycler_;
};

}  // namespace streamalloc
