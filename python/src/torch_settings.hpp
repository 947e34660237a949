// Run-time allocator settings: torch.cuda.memory._set_allocator_settings
// (torch._C._accelerator_setAllocatorSettings) parses its string into
// torch's allocator configuration and then calls the device configuration
// hook; streamalloc chains onto that hook so the keys it shares with
// torch's allocator take effect on streamalloc's allocators too.
#pragma once

#include <string>

namespace streamalloc {

// The keys of torch's device allocator settings that streamalloc applies.
// Others of torch's device-allocator keys are ignored with a warning that
// names them; keys of torch's pinned host allocator (pinned_*) are torch's
// own, since torch still manages pinned memory.
void apply_torch_allocator_settings(const std::string& settings);

// Chains apply_torch_allocator_settings onto torch's configuration hook.
// Idempotent.
void hook_torch_allocator_settings();

}  // namespace streamalloc
