// The pattern fill and check kernels of the [gpu] data-integrity tests and
// their launchers (declared in pattern_kernels.hpp). Grid-stride loops over
// 32-bit words; thread 0 also handles the 1-3 bytes after the last word.
#include "gpu/pattern_kernels.hpp"

namespace streamalloc::testing {
namespace {

constexpr unsigned k_threads = 256;
constexpr unsigned k_warp_size = 32;
constexpr unsigned k_warps = k_threads / k_warp_size;
// Enough blocks to keep an H100/H200 streaming; larger buffers loop.
constexpr std::size_t k_max_blocks = 1024;
constexpr unsigned k_full_warp = 0xFFFFFFFFu;

// A bijective 32-bit mixer (lowbias32): neighbouring inputs give unrelated
// outputs, so a block read at a shifted address or with another block's
// contents fails the check.
__host__ __device__ std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

__host__ __device__ std::uint32_t key_hash(std::uint32_t key) { return mix32(key ^ 0xA5A5A5A5u); }

// Mixing the word index before the key keeps the pattern nonlinear in the
// index: no key's pattern is another key's pattern shifted by some words.
__host__ __device__ std::uint32_t pattern_of(std::uint32_t hashed_key, std::uint64_t word) {
  const auto low = static_cast<std::uint32_t>(word);
  const auto high = static_cast<std::uint32_t>(word >> 32);
  return mix32(mix32(low ^ high * 0x9E3779B9u) ^ hashed_key);
}

struct launch_shape {
  unsigned blocks;
  std::size_t words;
  unsigned tail_bytes;
};

launch_shape shape_for(std::size_t bytes) {
  launch_shape shape{};
  shape.words = bytes / sizeof(std::uint32_t);
  shape.tail_bytes = static_cast<unsigned>(bytes % sizeof(std::uint32_t));
  const std::size_t wanted = (shape.words + k_threads - 1) / k_threads;
  shape.blocks = static_cast<unsigned>(wanted == 0 ? 1 : (wanted < k_max_blocks ? wanted : k_max_blocks));
  return shape;
}

bool word_aligned(const void* data) {
  return data != nullptr && reinterpret_cast<std::uintptr_t>(data) % sizeof(std::uint32_t) == 0;
}

__global__ void fill_kernel(std::uint32_t* words, std::size_t word_count, unsigned tail_bytes, std::uint32_t key) {
  const std::uint32_t hashed = key_hash(key);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < word_count; i += stride) {
    words[i] = pattern_of(hashed, i);
  }
  if (tail_bytes != 0 && blockIdx.x == 0 && threadIdx.x == 0) {
    auto* tail = reinterpret_cast<unsigned char*>(words + word_count);
    const std::uint32_t value = pattern_of(hashed, word_count);
    for (unsigned j = 0; j < tail_bytes; ++j) tail[j] = static_cast<unsigned char>(value >> (8 * j));
  }
}

__device__ void note_mismatch(pattern_tally* tally, std::uint32_t key, std::uint64_t word, std::uint32_t expected,
                              std::uint32_t actual) {
  if (atomicCAS(&tally->sample_taken, 0u, 1u) != 0u) return;
  tally->sample_key = key;
  tally->sample_word = word;
  tally->sample_expected = expected;
  tally->sample_actual = actual;
}

__global__ void check_kernel(const std::uint32_t* words, std::size_t word_count, unsigned tail_bytes,
                             std::uint32_t key, pattern_tally* tally) {
  const std::uint32_t hashed = key_hash(key);
  unsigned long long bad = 0;
  unsigned long long seen_bytes = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < word_count; i += stride) {
    const std::uint32_t expected = pattern_of(hashed, i);
    const std::uint32_t actual = words[i];
    seen_bytes += sizeof(std::uint32_t);
    if (actual != expected) {
      ++bad;
      note_mismatch(tally, key, i, expected, actual);
    }
  }
  if (tail_bytes != 0 && blockIdx.x == 0 && threadIdx.x == 0) {
    const auto* tail = reinterpret_cast<const unsigned char*>(words + word_count);
    const std::uint32_t value = pattern_of(hashed, word_count);
    std::uint32_t expected = 0;
    std::uint32_t actual = 0;
    for (unsigned j = 0; j < tail_bytes; ++j) {
      expected |= value & (0xFFu << (8 * j));
      actual |= static_cast<std::uint32_t>(tail[j]) << (8 * j);
    }
    seen_bytes += tail_bytes;
    if (actual != expected) {
      ++bad;
      note_mismatch(tally, key, word_count, expected, actual);
    }
  }

  // One atomic per block and counter: warp sums, then the block's.
  for (unsigned offset = k_warp_size / 2; offset > 0; offset /= 2) {
    bad += __shfl_down_sync(k_full_warp, bad, offset);
    seen_bytes += __shfl_down_sync(k_full_warp, seen_bytes, offset);
  }
  __shared__ unsigned long long warp_bad[k_warps];
  __shared__ unsigned long long warp_seen[k_warps];
  if (threadIdx.x % k_warp_size == 0) {
    warp_bad[threadIdx.x / k_warp_size] = bad;
    warp_seen[threadIdx.x / k_warp_size] = seen_bytes;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  unsigned long long block_bad = 0;
  unsigned long long block_seen = 0;
  for (unsigned w = 0; w < k_warps; ++w) {
    block_bad += warp_bad[w];
    block_seen += warp_seen[w];
  }
  if (block_bad != 0) atomicAdd(&tally->mismatched_words, block_bad);
  atomicAdd(&tally->checked_bytes, block_seen);
}

}  // namespace

std::uint32_t pattern_word(std::uint32_t key, std::uint64_t word) { return pattern_of(key_hash(key), word); }

cudaError_t launch_fill_pattern(void* data, std::size_t bytes, std::uint32_t key, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (!word_aligned(data)) return cudaErrorInvalidValue;
  const launch_shape shape = shape_for(bytes);
  fill_kernel<<<shape.blocks, k_threads, 0, stream>>>(static_cast<std::uint32_t*>(data), shape.words, shape.tail_bytes,
                                                      key);
  return cudaGetLastError();
}

cudaError_t launch_check_pattern(const void* data, std::size_t bytes, std::uint32_t key, pattern_tally* tally,
                                 cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (!word_aligned(data) || tally == nullptr) return cudaErrorInvalidValue;
  const launch_shape shape = shape_for(bytes);
  check_kernel<<<shape.blocks, k_threads, 0, stream>>>(static_cast<const std::uint32_t*>(data), shape.words,
                                                       shape.tail_bytes, key, tally);
  return cudaGetLastError();
}

}  // namespace streamalloc::testing
