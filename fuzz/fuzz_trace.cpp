// libFuzzer harness for the trace reader and replay: any byte string (plain
// or gzip'd) is read to its end or to a trace_error, and a trace that reads
// is replayed on a simulated device, which must end consistent and empty.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "recording_start.hpp"
#include "requested_frees.hpp"
#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "streamalloc/util/bytes.hpp"
#include "trace_reader.hpp"
#include "trace_replay.hpp"

namespace {

using namespace streamalloc;

void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz_trace: %s\n", what);
  std::abort();
}

// The reader takes a path: the input goes into an in-memory file, so the
// fuzzer never touches the disk.
class memory_file {
 public:
  memory_file() : fd_(memfd_create("fuzz_trace", 0)) { require(fd_ >= 0, "memfd_create failed"); }
  ~memory_file() { close(fd_); }
  memory_file(const memory_file&) = delete;
  memory_file& operator=(const memory_file&) = delete;

  std::string write(const std::uint8_t* data, std::size_t size) {
    require(ftruncate(fd_, 0) == 0 && lseek(fd_, 0, SEEK_SET) == 0, "cannot rewind the memory file");
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = ::write(fd_, data + done, size - done);
      require(n > 0, "cannot write the memory file");
      done += static_cast<std::size_t>(n);
    }
    return "/proc/self/fd/" + std::to_string(fd_);
  }

 private:
  int fd_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static memory_file file;
  const std::string path = file.write(data, size);
  std::vector<trace_file_event> events;
  try {
    events = load_trace(path);
  } catch (const trace_error&) {
    return 0;
  }
  // As streamalloc-replay loads a trace.
  free_at_requests_without_completions(&events);
  add_allocations_before_recording(&events);
  sim_config device;
  device.capacity_bytes = 1_GiB;
  sim_backend sim(device);
  caching_allocator alloc(sim, allocator_config{});
  try {
    replay_trace(events, alloc, path);
  } catch (const trace_error&) {
  } catch (const replay_out_of_memory&) {
  }
  alloc.validate();
  // Replay frees every allocation it made, even when it stops early.
  require(alloc.stats().allocated_bytes[0].current == 0, "replay left allocations behind");
  require(static_cast<std::int64_t>(sim.used_bytes()) == alloc.stats().reserved_bytes[0].current,
          "device usage differs from reserved bytes");
  return 0;
}
