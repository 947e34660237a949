// memory_history: torch's memory history (torch.cuda.memory.
// _record_memory_history, _snapshot()["device_traces"], memory_viz) and its
// allocator trace trackers (torch's NCCL process group registers memory
// through one), built on the trace events of the caching allocators.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "streamalloc/core/device_allocator.hpp"
#include "streamalloc/core/trace.hpp"

namespace streamalloc {

class memory_history {
 public:
  using context_ptr = std::shared_ptr<c10::GatheredContext>;
  using record_context = c10::CachingDeviceAllocator::RecordContext;

  // torch's recordHistory: `enabled` false stops recording and drops the
  // history; `clear` drops it while recording goes on.
  void record(bool enabled, c10::CachingDeviceAllocator::CreateContextFn recorder, std::size_t max_entries,
              record_context when, bool clear, const std::vector<std::string>& skip_actions);
  bool recording() const { return recording_.load(std::memory_order_relaxed); }
  void attach_tracker(c10::CachingDeviceAllocator::AllocatorTraceTracker tracker);
  // Carried by every entry recorded from now on (torch's
  // _set_memory_metadata), and the innermost compiled region entered
  // (torch.compile's compile_context; "N/A" outside every region).
  void set_user_metadata(const std::string& metadata);
  std::string user_metadata() const;
  void push_compile_context(const std::string& context);
  void pop_compile_context();
  // torch's recordAnnotation (record_function regions while recording with
  // global_record_annotations): one entry per connected device, kept with
  // the history and bounded like it.
  void record_annotation(const std::vector<std::pair<std::string, std::string>>& metadata);

  // Connects `allocator` (of `device`) while history or a tracker is on;
  // called for every allocator, existing or created later.
  void connect(int device, device_allocator& allocator);

  // Whether an allocator call should gather a context first: the level is
  // STATE for allocations, ALL for frees (as torch gathers).
  bool wants_context(record_context level) const {
    return recording() && static_cast<int>(when_.load(std::memory_order_relaxed)) >= static_cast<int>(level);
  }
  // Gathers the calling thread's stack for the allocator call that follows
  // on this thread; the scope ends the call.
  class call_scope {
   public:
    call_scope(memory_history& history, record_context level);
    ~call_scope();
    call_scope(const call_scope&) = delete;
    call_scope& operator=(const call_scope&) = delete;

   private:
    bool active_ = false;
  };

  // Contexts of live blocks and of segments (snapshot frames); nullptr when
  // none was recorded.
  context_ptr block_context(std::uintptr_t address) const;
  context_ptr segment_context(std::uintptr_t address) const;
  // The recorded entries of every device, oldest first.
  std::vector<std::vector<c10::CachingDeviceAllocator::TraceEntry>> traces(int device_count) const;
  // The recorded annotations, device by device, oldest first.
  std::vector<c10::CachingDeviceAllocator::AnnotationEntry> annotations() const;

 private:
  class device_listener final : public trace_listener {
   public:
    device_listener(memory_history& owner, int device) : owner_(owner), device_(device) {}
    void on_trace(const trace_event* events, std::size_t count) override { owner_.on_trace(device_, events, count); }

   private:
    memory_history& owner_;
    int device_;
  };

  void on_trace(int device, const trace_event* events, std::size_t count);
  bool active_locked() const { return recording_.load(std::memory_order_relaxed) || !trackers_.empty(); }
  void reconnect_locked();

  mutable std::mutex mutex_;
  std::atomic<bool> recording_{false};
  std::atomic<record_context> when_{record_context::NEVER};
  c10::CachingDeviceAllocator::CreateContextFn recorder_ = nullptr;
  std::size_t max_entries_ = 0;
  std::unordered_set<int> skipped_;  // TraceEntry::Action values
  std::vector<std::deque<c10::CachingDeviceAllocator::TraceEntry>> entries_;  // per device
  std::vector<std::deque<c10::CachingDeviceAllocator::AnnotationEntry>> annotations_;  // per device
  std::vector<c10::CachingDeviceAllocator::AllocatorTraceTracker> trackers_;
  std::unordered_map<std::uintptr_t, context_ptr> block_contexts_;
  std::unordered_map<std::uintptr_t, context_ptr> segment_contexts_;
  std::string user_metadata_;
  std::vector<std::string> compile_contexts_;
  // Allocators seen so far and their listeners (one per device, never freed
  // while an allocator may still point at it).
  std::vector<device_allocator*> allocators_;
  std::vector<std::unique_ptr<device_listener>> listeners_;
};

}  // namespace streamalloc
