// [gpu] fork safety of the process-wide allocator (Note [fork] in
// python/src/process_allocator.cpp). The scenario needs a process whose
// allocators are created by it alone, so the [gpu] test re-runs this binary
// on the hidden test tagged [fork_scenario]: there a thread allocates and frees
// CUDA memory while the main thread forks; each child must not deadlock,
// must see no allocator, must get the clear "forked child" error instead of
// touching CUDA, and the parent must keep working.
#include <signal.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gpu/gpu_support.hpp"
#include "process_allocator.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"

extern char** environ;

using namespace streamalloc;
using streamalloc::testing::contains;

namespace {

// Child exit codes.
enum child_status : int {
  child_ok = 0,
  child_not_marked = 20,
  child_sees_allocators = 21,
  child_no_error = 22,
  child_wrong_error = 23,
};

// What the forked child checks; never returns.
[[noreturn]] void run_child() {
  int code = child_ok;
  if (!in_forked_child()) {
    code = child_not_marked;
  } else if (find_process_allocators() != nullptr || process_allocators_created()) {
    code = child_sees_allocators;
  } else {
    try {
      process_allocators();
      code = child_no_error;
    } catch (const device_failure& e) {
      const std::string message = e.what();
      if (!contains(message, "CUDA cannot be used in a forked child process") || !contains(message, "'spawn'")) {
        code = child_wrong_error;
      }
    } catch (...) {
      code = child_wrong_error;
    }
  }
  _exit(code);
}

// Exit code of `child`, or -1 after killing it when it outlives `timeout`.
int wait_with_timeout(pid_t child, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t done = waitpid(child, &status, WNOHANG);
    if (done == child) break;
    if (done < 0) return -2;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -3;
}

}  // namespace

TEST_CASE("fork: a child forked while another thread allocates gets the clear error", "[.][fork_scenario]") {
  device_allocator& device0 = process_allocators().at(0);
  void* parent_block = device0.allocate(4_MiB, 0);
  REQUIRE(!in_forked_child());

  std::atomic<bool> stop{false};
  std::atomic<long> steps{0};
  std::thread busy([&] {
    std::size_t bytes = 4_KiB;
    while (!stop.load()) {
      void* p = device0.allocate(bytes, 0);
      device0.free(p);
      bytes = bytes < 64_MiB ? bytes * 2 : 4_KiB;
      steps.fetch_add(1);
    }
  });
  for (int i = 0; i < 20; ++i) {
    const long before = steps.load();
    while (steps.load() < before + 20) std::this_thread::yield();
    const pid_t child = fork();
    if (child == 0) run_child();
    REQUIRE(child > 0);
    const int code = wait_with_timeout(child, std::chrono::seconds(30));
    CAPTURE(i);
    INFO("-1: the child hung (deadlock); 20 not marked forked, 21 sees allocators, 22 no error, 23 wrong error");
    CHECK(code == child_ok);
    if (code != child_ok) break;
  }
  stop.store(true);
  busy.join();
  // The parent was never marked and its allocator still works.
  CHECK(!in_forked_child());
  CHECK(device0.owns(parent_block));
  device0.free(parent_block);
  device0.validate();
}

TEST_CASE("fork: children of a process using streamalloc never deadlock and never touch CUDA", "[gpu][fork]") {
  STREAMALLOC_REQUIRE_GPU();
  char self[4096] = {};
  const ssize_t length = readlink("/proc/self/exe", self, sizeof self - 1);
  REQUIRE(length > 0);
  std::string program(self, static_cast<std::size_t>(length));
  std::string filter = "[fork_scenario]";
  char* argv[] = {program.data(), filter.data(), nullptr};
  pid_t scenario = 0;
  REQUIRE(posix_spawn(&scenario, program.c_str(), nullptr, nullptr, argv, environ) == 0);
  const int code = wait_with_timeout(scenario, std::chrono::seconds(240));
  INFO("re-run of this binary on [fork_scenario] (run it by hand to see its output); -1 means it hung");
  CHECK(code == 0);
}
