// Kernels for the [gpu] data-integrity tests, behind host-callable launchers
// (the kernels live in pattern_kernels.cu): fill a block with a pattern
// derived from (key, word index) and count the words that differ from it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace streamalloc::testing {

// What the check launches found, accumulated in device memory (zero it
// before the first launch; read it after synchronizing).
struct pattern_tally {
  // Words that differ from the pattern; a block's partial last word (sizes
  // that are not a multiple of 4) counts as one word.
  unsigned long long mismatched_words;
  // Bytes the check kernels compared: proves every byte was looked at.
  unsigned long long checked_bytes;
  // One mismatch kept for the failure message (valid when sample_taken).
  unsigned int sample_taken;
  std::uint32_t sample_key;
  unsigned long long sample_word;
  std::uint32_t sample_expected;
  std::uint32_t sample_actual;
};

// The pattern's 32-bit word number `word` for `key`. A partial last word
// holds the low bytes of its pattern word (little-endian).
std::uint32_t pattern_word(std::uint32_t key, std::uint64_t word);

// Queues a kernel on `stream` writing the pattern of `key` over every byte
// of [data, data + bytes). `data` must be 4-byte aligned. Returns the
// launch's error (cudaErrorInvalidValue for a misaligned or null `data`).
cudaError_t launch_fill_pattern(void* data, std::size_t bytes, std::uint32_t key, cudaStream_t stream);

// Queues a kernel on `stream` comparing every byte of [data, data + bytes)
// with the pattern of `key`, adding to `tally` (device memory).
cudaError_t launch_check_pattern(const void* data, std::size_t bytes, std::uint32_t key, pattern_tally* tally,
                                 cudaStream_t stream);

}  // namespace streamalloc::testing
