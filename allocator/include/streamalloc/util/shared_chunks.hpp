// The bytes that name chunks exported for CUDA IPC (vmm_backend::vm_export)
// to the process that imports them: the sender's pid, the chunk size and
// one descriptor number per chunk. The layout is torch's own header for
// expandable segments (a 4-byte pid padded to 8, the chunk size and the
// count as 8-byte integers, then 4-byte descriptors), so either allocator
// reads the other's handles. Every byte comes from a value, padding
// included: one range always encodes to the same string, and a receiver
// keys the mappings it has open on that string.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace streamalloc {

struct shared_chunks {
  int pid = 0;
  std::size_t chunk_bytes = 0;
  std::vector<int> fds;  // in the sender, one per chunk, in address order
};

std::string encode_shared_chunks(const shared_chunks& chunks);

// false when `bytes` is not exactly one encoding of at least one chunk of
// a non-zero size.
bool decode_shared_chunks(std::string_view bytes, shared_chunks* out);

}  // namespace streamalloc
