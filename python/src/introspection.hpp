// Introspection of the process allocators shared by the torch allocator
// object and the Python module: finding a device's allocator, statistics,
// segments and cache control, without creating allocators that do not
// exist yet (a statistics call must not initialise a GPU).
#pragma once

#include <vector>

#include "streamalloc/core/device_allocator.hpp"
#include "streamalloc/core/snapshot.hpp"
#include "streamalloc/core/stats.hpp"

namespace streamalloc {

// Device selector for collect_segments: every device streamalloc uses.
constexpr int k_all_devices = -1;

// The allocator of `device` if it exists, else nullptr.
device_allocator* existing_allocator_of(int device);
// The allocator of `device`, created on first use.
device_allocator& allocator_of(int device);
// Number of devices streamalloc manages (0 before CUDA is initialised).
int managed_device_count();

// Counters of `device`; all zero while streamalloc has not used it.
// These throw usage_error for a device index that does not exist.
device_stats device_stats_of(int device);
void reset_peak_stats_of(int device);
void reset_accumulated_stats_of(int device);
// Returns every unused cached segment of every device to the driver.
void empty_caches();
// Segments of `device` (or of every device), in device then address order.
std::vector<segment_info> collect_segments(int device);

}  // namespace streamalloc
