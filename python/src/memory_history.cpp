// memory_history: see the header. Trace events arrive from the caching
// allocators after their locks are released (trace.hpp); this turns them into
// torch's TraceEntry records, keeps the newest max_entries per device, the
// stacks of live blocks and segments for snapshots, and feeds trackers.
#include "memory_history.hpp"

#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>

#include <utility>

#include "torch_pool_ids.hpp"

namespace streamalloc {
namespace {

using c10::CachingDeviceAllocator::TraceEntry;

TraceEntry::Action to_torch(trace_action action) {
  switch (action) {
    case trace_action::alloc:
      return TraceEntry::ALLOC;
    case trace_action::free_requested:
      return TraceEntry::FREE_REQUESTED;
    case trace_action::free_completed:
      return TraceEntry::FREE_COMPLETED;
    case trace_action::segment_alloc:
      return TraceEntry::SEGMENT_ALLOC;
    case trace_action::segment_free:
      return TraceEntry::SEGMENT_FREE;
    case trace_action::segment_map:
      return TraceEntry::SEGMENT_MAP;
    case trace_action::segment_unmap:
      return TraceEntry::SEGMENT_UNMAP;
    case trace_action::oom:
      return TraceEntry::OOM;
  }
  return TraceEntry::ALLOC;
}

// The stack gathered for the allocator call running on this thread (see
// call_scope); events of other calls delivered meanwhile find none.
thread_local std::shared_ptr<c10::GatheredContext> t_call_context;

}  // namespace

memory_history::call_scope::call_scope(memory_history& history, record_context level) {
  if (!history.wants_context(level)) return;
  c10::CachingDeviceAllocator::CreateContextFn recorder = nullptr;
  {
    std::lock_guard<std::mutex> lock(history.mutex_);
    recorder = history.recorder_;
  }
  if (recorder == nullptr) return;
  // Outside every lock: the recorder may take the GIL to read Python frames.
  t_call_context = recorder();
  active_ = true;
}

memory_history::call_scope::~call_scope() {
  if (active_) t_call_context.reset();
}

void memory_history::record(bool enabled, c10::CachingDeviceAllocator::CreateContextFn recorder,
                            std::size_t max_entries, record_context when, bool clear,
                            const std::vector<std::string>& skip_actions) {
  TORCH_CHECK(when == record_context::NEVER || recorder != nullptr,
              "streamalloc: recording stacks needs a context recorder");
  std::unordered_set<int> skipped;
  for (const std::string& name : skip_actions) {
    skipped.insert(static_cast<int>(c10::CachingDeviceAllocator::parseTraceEntryAction(name)));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  recorder_ = enabled ? recorder : nullptr;
  max_entries_ = max_entries == 0 ? 1 : max_entries;
  skipped_ = std::move(skipped);
  when_.store(enabled ? when : record_context::NEVER, std::memory_order_relaxed);
  recording_.store(enabled, std::memory_order_relaxed);
  if (!enabled || clear) {
    for (auto& device_entries : entries_) device_entries.clear();
    for (auto& device_annotations : annotations_) device_annotations.clear();
  }
  if (!enabled) {
    block_contexts_.clear();
    segment_contexts_.clear();
  }
  for (auto& device_entries : entries_) {
    while (device_entries.size() > max_entries_) device_entries.pop_front();
  }
  for (auto& device_annotations : annotations_) {
    while (device_annotations.size() > max_entries_) device_annotations.pop_front();
  }
  reconnect_locked();
}

void memory_history::record_annotation(const std::vector<std::pair<std::string, std::string>>& metadata) {
  if (!recording()) return;
  const c10::approx_time_t now = c10::getApproximateTime();
  std::lock_guard<std::mutex> lock(mutex_);
  if (!recording()) return;
  for (std::size_t d = 0; d < annotations_.size(); ++d) {
    if (allocators_[d] == nullptr) continue;
    c10::CachingDeviceAllocator::AnnotationEntry entry(static_cast<c10::DeviceIndex>(d), now);
    for (const auto& [name, value] : metadata) entry.recordUserMetadata(name, value);
    auto& device_annotations = annotations_[d];
    device_annotations.push_back(std::move(entry));
    while (device_annotations.size() > max_entries_) device_annotations.pop_front();
  }
}

void memory_history::attach_tracker(c10::CachingDeviceAllocator::AllocatorTraceTracker tracker) {
  std::lock_guard<std::mutex> lock(mutex_);
  trackers_.push_back(std::move(tracker));
  reconnect_locked();
}

void memory_history::connect(int device, device_allocator& allocator) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto index = static_cast<std::size_t>(device);
  if (allocators_.size() <= index) {
    allocators_.resize(index + 1, nullptr);
    listeners_.resize(index + 1);
    entries_.resize(index + 1);
    annotations_.resize(index + 1);
  }
  allocators_[index] = &allocator;
  if (!listeners_[index]) listeners_[index] = std::make_unique<device_listener>(*this, device);
  allocator.set_trace_listener(active_locked() ? listeners_[index].get() : nullptr);
}

void memory_history::reconnect_locked() {
  const bool active = active_locked();
  for (std::size_t d = 0; d < allocators_.size(); ++d) {
    if (allocators_[d] != nullptr) allocators_[d]->set_trace_listener(active ? listeners_[d].get() : nullptr);
  }
}

void memory_history::on_trace(int device, const trace_event* events, std::size_t count) {
  std::vector<TraceEntry> for_trackers;
  std::vector<c10::CachingDeviceAllocator::AllocatorTraceTracker> trackers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool recording = recording_.load(std::memory_order_relaxed);
    const auto when = when_.load(std::memory_order_relaxed);
    const bool keep_state = recording && static_cast<int>(when) >= static_cast<int>(record_context::STATE);
    const bool stacks_in_trace = recording && static_cast<int>(when) >= static_cast<int>(record_context::ALLOC);
    for (std::size_t i = 0; i < count; ++i) {
      const trace_event& e = events[i];
      context_ptr context;
      switch (e.action) {
        case trace_action::alloc:
          if (keep_state && t_call_context) block_contexts_[e.address] = t_call_context;
          if (stacks_in_trace) context = t_call_context;
          break;
        case trace_action::segment_alloc:
          if (keep_state && t_call_context) segment_contexts_[e.address] = t_call_context;
          if (stacks_in_trace) context = t_call_context;
          break;
        case trace_action::segment_map:
          // A mapped run grows and merges with its neighbours: like torch's
          // expandable segments, it keeps no stack of its own.
          if (stacks_in_trace) context = t_call_context;
          break;
        case trace_action::free_requested:
          context = when == record_context::ALL ? t_call_context : nullptr;
          break;
        case trace_action::free_completed: {
          auto it = block_contexts_.find(e.address);
          if (when == record_context::ALL && t_call_context) {
            context = t_call_context;
          } else if (stacks_in_trace && it != block_contexts_.end()) {
            context = it->second;
          }
          if (it != block_contexts_.end()) block_contexts_.erase(it);
          break;
        }
        case trace_action::segment_free:
        case trace_action::segment_unmap:
          segment_contexts_.erase(e.address);
          if (when == record_context::ALL) context = t_call_context;
          break;
        case trace_action::oom:
          if (stacks_in_trace) context = t_call_context;
          break;
      }
      TraceEntry entry(to_torch(e.action), static_cast<c10::DeviceIndex>(device), e.address, e.size,
                       reinterpret_cast<void*>(e.stream), to_mempool_id(e.pool), c10::getApproximateTime(),
                       std::move(context), compile_contexts_.empty() ? "N/A" : compile_contexts_.back(),
                       user_metadata_);
      if (!trackers_.empty()) for_trackers.push_back(entry);
      if (recording && skipped_.count(static_cast<int>(entry.action_)) == 0) {
        auto& device_entries = entries_[static_cast<std::size_t>(device)];
        device_entries.push_back(std::move(entry));
        if (device_entries.size() > max_entries_) device_entries.pop_front();
      }
    }
    if (!for_trackers.empty()) trackers = trackers_;
  }
  for (const TraceEntry& entry : for_trackers) {
    for (const auto& tracker : trackers) tracker(entry);
  }
}

void memory_history::set_user_metadata(const std::string& metadata) {
  std::lock_guard<std::mutex> lock(mutex_);
  user_metadata_ = metadata;
}

std::string memory_history::user_metadata() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return user_metadata_;
}

void memory_history::push_compile_context(const std::string& context) {
  std::lock_guard<std::mutex> lock(mutex_);
  compile_contexts_.push_back(context);
}

void memory_history::pop_compile_context() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!compile_contexts_.empty()) compile_contexts_.pop_back();
}

memory_history::context_ptr memory_history::block_context(std::uintptr_t address) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = block_contexts_.find(address);
  return it == block_contexts_.end() ? nullptr : it->second;
}

memory_history::context_ptr memory_history::segment_context(std::uintptr_t address) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = segment_contexts_.find(address);
  return it == segment_contexts_.end() ? nullptr : it->second;
}

std::vector<c10::CachingDeviceAllocator::AnnotationEntry> memory_history::annotations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<c10::CachingDeviceAllocator::AnnotationEntry> out;
  for (const auto& device_annotations : annotations_) {
    out.insert(out.end(), device_annotations.begin(), device_annotations.end());
  }
  return out;
}

std::vector<std::vector<TraceEntry>> memory_history::traces(int device_count) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::vector<TraceEntry>> out(static_cast<std::size_t>(device_count));
  for (std::size_t d = 0; d < out.size() && d < entries_.size(); ++d) {
    out[d].assign(entries_[d].begin(), entries_[d].end());
  }
  return out;
}

}  // namespace streamalloc
