/* The C entry points of libstreamalloc_config.so: streamalloc's
 * configuration (STREAMALLOC_CONF) without CUDA or torch, for the Python
 * package's config() and config_keys() (through ctypes) and the README's
 * generated table. No C++ exception leaves them. */
#pragma once

#define STREAMALLOC_CONFIG_EXPORT __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

/* streamalloc's version, from project(VERSION) in CMakeLists.txt. */
STREAMALLOC_CONFIG_EXPORT const char* streamalloc_config_version(void);

/* Every configuration key, one line each, in the order of the key table:
 * "key\tdefault\tdescription\n". The text lives as long as the library. */
STREAMALLOC_CONFIG_EXPORT const char* streamalloc_config_keys(void);

/* Parses `text` (STREAMALLOC_CONF syntax, NULL or "" for none) over the
 * keys that `torch_settings` (torch's allocator variable, NULL or "" for
 * none) shares with streamalloc, over the defaults: the configuration
 * install() creates the allocators with. Returns 0 and sets *result to
 * every key with its value in STREAMALLOC_CONF syntax, or returns -1 and
 * sets *result to the error (naming the key and listing the valid ones).
 * *result stays valid until the calling thread's next call. */
STREAMALLOC_CONFIG_EXPORT int streamalloc_config_resolve(const char* torch_settings, const char* text,
                                                         const char** result);

#ifdef __cplusplus
}
#endif
