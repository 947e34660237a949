// The segments of a torch.cuda.MemPool created with its own allocator
// (MemPool(allocator=CUDAPluggableAllocator(...))) come from that
// allocator's raw_alloc / raw_delete, as with torch's native allocator.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <memory>

#include "streamalloc/core/segment_source.hpp"

namespace streamalloc {

class pool_segment_source final : public segment_source {
 public:
  pool_segment_source(int device, std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator)
      : device_(device), allocator_(std::move(allocator)) {}
  status allocate_segment(std::size_t bytes, stream_handle stream, void** out) override;
  status free_segment(void* ptr, std::size_t bytes, stream_handle stream) override;

 private:
  int device_;
  std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator_;
};

}  // namespace streamalloc
