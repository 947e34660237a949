// The one process-wide allocator set that torch and the extern "C" entry
// points share: a device_allocators over every visible GPU with the CUDA
// backend. Created on first use and never destroyed (see the .cpp).
#pragma once

#include <string>

#include "streamalloc/core/config.hpp"
#include "streamalloc/core/device_allocators.hpp"

namespace streamalloc {

// Creates (once, thread-safely) the allocators over every visible GPU with
// the configuration from STREAMALLOC_CONF, or the one set by
// configure_process_allocators(). Throws device_failure with the CUDA
// error when there is no GPU or driver (a later call tries again) and
// config_error when STREAMALLOC_CONF is malformed.
device_allocators& process_allocators();

// Whether process_allocators() has succeeded; never creates anything.
bool process_allocators_created();

// The process allocators if created, else nullptr; never creates anything.
// Always nullptr in a forked child (see in_forked_child).
device_allocators* find_process_allocators();

// Whether this process was forked from one whose allocators existed (CUDA
// was in use). There process_allocators() throws device_failure with
// "streamalloc: CUDA cannot be used in a forked child process; use the
// 'spawn' start method", and frees must be no-ops: the blocks belong to
// the parent's CUDA context.
bool in_forked_child();

// Replaces the configuration the allocators will be created with (the
// caller layers it on STREAMALLOC_CONF, e.g. from_environment().with(...)).
// Throws usage_error once the allocators exist.
void configure_process_allocators(const allocator_config& config);

// Applies `key:value,...` overrides on top of the configuration the
// allocators would be created with now. Throws config_error for a bad
// string and usage_error once the allocators exist.
void configure_process_allocators(const std::string& overrides);

// The configuration in use once created, else the one that would be used.
allocator_config process_allocator_config();

}  // namespace streamalloc
