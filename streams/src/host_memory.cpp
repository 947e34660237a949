// Anonymous host mappings for the register_touched pin method: aligned for
// transparent huge pages (fewer pages to fault and to lock) and pre-faulted
// in parallel, because one thread faulting gigabytes is what makes a fresh
// cudaHostAlloc slow.
#include "streamalloc/streams/host_memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "streamalloc/util/bytes.hpp"

namespace streamalloc {
namespace {

constexpr std::size_t k_huge_page_bytes = 2_MiB;
// Below this a second touching thread is not worth starting.
constexpr std::size_t k_min_touch_bytes_per_thread = 16_MiB;

std::size_t page_bytes() {
  static const std::size_t bytes = [] {
    const long v = sysconf(_SC_PAGESIZE);
    return v > 0 ? static_cast<std::size_t>(v) : std::size_t{4096};
  }();
  return bytes;
}

// The length actually mapped for a request of `bytes`.
std::size_t mapped_length(std::size_t bytes) {
  const std::size_t unit = bytes >= k_huge_page_bytes ? k_huge_page_bytes : page_bytes();
  return (bytes + unit - 1) / unit * unit;
}

void touch_range(unsigned char* begin, std::size_t bytes, std::size_t step) {
  volatile unsigned char* p = begin;
  for (std::size_t offset = 0; offset < bytes; offset += step) p[offset] = 0;
}

}  // namespace

void touch_pages(void* ptr, std::size_t bytes, int threads) {
  const std::size_t step = page_bytes();
  const std::size_t pages = (bytes + step - 1) / step;
  const std::size_t wanted = std::max<std::size_t>(bytes / k_min_touch_bytes_per_thread, 1);
  const std::size_t count = std::min({wanted, static_cast<std::size_t>(std::max(threads, 1)), pages});
  auto* base = static_cast<unsigned char*>(ptr);
  if (count <= 1) {
    touch_range(base, bytes, step);
    return;
  }
  const std::size_t pages_per_thread = (pages + count - 1) / count;
  std::vector<std::thread> helpers;
  helpers.reserve(count - 1);
  for (std::size_t i = 1; i < count; ++i) {
    const std::size_t begin = std::min(i * pages_per_thread * step, bytes);
    const std::size_t end = std::min(begin + pages_per_thread * step, bytes);
    helpers.emplace_back(touch_range, base + begin, end - begin, step);
  }
  touch_range(base, std::min(pages_per_thread * step, bytes), step);
  for (std::thread& t : helpers) t.join();
}

status map_host_pages(std::size_t bytes, int touch_threads, void** out) {
  if (bytes == 0) return {status_code::invalid_argument, "map_host_pages: zero bytes"};
  const std::size_t length = mapped_length(bytes);
  const bool huge = length >= k_huge_page_bytes;
  // Over-map by one huge page so an aligned start exists, then unmap the
  // unaligned head and tail.
  const std::size_t span = huge ? length + k_huge_page_bytes : length;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    const int error = errno;
    return {error == ENOMEM ? status_code::out_of_memory : status_code::device_error,
            "mmap of " + std::to_string(span) + " bytes failed: " + std::strerror(error)};
  }
  auto* start = static_cast<unsigned char*>(raw);
  if (huge) {
    const auto address = reinterpret_cast<std::uintptr_t>(raw);
    const std::size_t head = (k_huge_page_bytes - address % k_huge_page_bytes) % k_huge_page_bytes;
    const std::size_t tail = span - head - length;
    if (head > 0) munmap(raw, head);
    if (tail > 0) munmap(start + head + length, tail);
    start += head;
    // Advice only: without THP the pages are simply 4 KiB.
    madvise(start, length, MADV_HUGEPAGE);
  }
  touch_pages(start, length, touch_threads);
  *out = start;
  return status::success();
}

status unmap_host_pages(void* ptr, std::size_t bytes) {
  if (munmap(ptr, mapped_length(bytes)) != 0) {
    return {status_code::invalid_argument, std::string("munmap failed: ") + std::strerror(errno)};
  }
  return status::success();
}

}  // namespace streamalloc
