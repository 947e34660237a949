// torch's allocator settings (Note [torch's settings] in config.cpp): at
// installation, the keys of torch's variable that streamalloc shares go
// beneath STREAMALLOC_CONF; at run time, torch.cuda.memory.
// _set_allocator_settings (torch._C._accelerator_setAllocatorSettings)
// parses its string into torch's allocator configuration and then calls
// the device configuration hook, which streamalloc chains onto so the
// shared keys take effect on streamalloc's allocators too.
#pragma once

#include <string>

#include "streamalloc/core/config.hpp"

namespace streamalloc {

// The keys of torch's device allocator settings that streamalloc applies.
// Others of torch's device-allocator keys are ignored with a warning that
// names them; keys of torch's pinned host allocator (pinned_*) are torch's
// own, since torch still manages pinned memory.
void apply_torch_allocator_settings(const std::string& settings);

// The configuration a first installation creates the allocators with:
// the keys torch's allocator settings share with streamalloc (torch's
// variable as torch parsed it at start-up), then STREAMALLOC_CONF, then
// `overrides` (install()'s options). With `warn_ignored`, warns about
// torch's keys it ignores. Throws config_error for a bad value.
allocator_config startup_config(const std::string& overrides, bool warn_ignored);

// Chains apply_torch_allocator_settings onto torch's configuration hook.
// Idempotent.
void hook_torch_allocator_settings();

}  // namespace streamalloc
