// oom_diagnosis: see the header. The error is already failing, so this
// path takes no allocator lock it does not need (stats() takes the failing
// device's, briefly), allocates only host memory, and swallows its own
// failures: a report must never replace the out-of-memory error.
#include "oom_diagnosis.hpp"

#include <exception>
#include <mutex>
#include <utility>

#include "introspection.hpp"
#include "torch_tags.hpp"

namespace streamalloc {
namespace {

constexpr std::size_t k_top_holders = 5;

struct last_report_store {
  std::mutex mutex;
  std::optional<oom_report> report;
};

// Never destroyed, as the allocators it describes.
last_report_store& store() {
  static last_report_store* const instance = new last_report_store();
  return *instance;
}

}  // namespace

std::string diagnose_out_of_memory(const out_of_memory& error) noexcept {
  try {
    const oom_context& context = error.context();
    device_allocator* allocator = existing_allocator_of(context.device);
    if (allocator == nullptr) return {};
    const device_stats stats = allocator->stats();
    const bool expandable = allocator->config().expandable_segments && allocator->backend().supports_virtual_memory();
    std::optional<tag_summary> tags;
    if (tagging_on()) tags = process_allocation_tags().summary(context.device);
    oom_report report = make_oom_report(context, stats, tags ? &*tags : nullptr, expandable, k_top_holders);
    std::string text = describe(report);
    std::lock_guard<std::mutex> lock(store().mutex);
    store().report = std::move(report);
    return text;
  } catch (const std::exception&) {
    return {};
  }
}

std::optional<oom_report> last_oom_report() {
  std::lock_guard<std::mutex> lock(store().mutex);
  return store().report;
}

}  // namespace streamalloc
