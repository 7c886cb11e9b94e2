// Copies of buffers too large for the caches: non-temporal (streaming) stores, and the size
// of the last-level cache that decides when they pay off.
//
// Why this exists: a tensor put into a shared segment is read next by another process or a
// device, not by the writer, so a copy larger than the cache gains nothing from leaving its
// destination in the cache and pays for reading every destination line first (the
// read-for-ownership of an ordinary store). glibc switches memcpy to streaming stores only
// above its non_temporal_threshold, which it derives from the shared cache size it computes
// from CPUID; on this project's development VM (glibc 2.36, AMD EPYC in KVM) that comes out
// as 384 MiB instead of the 32 MiB that sysfs reports, so a 64 MiB memcpy used ordinary
// stores (19-20 GB/s where streaming stores reach 26-28 GB/s; docs/streaming.md).
//
// Thread-safety: both functions may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace expert_arena::platform {

// The size of the largest cache level of CPU 0, from
// /sys/devices/system/cpu/cpu0/cache/index*/{level,size}; 0 when sysfs does not say. Read once
// and cached.
uint64_t LastLevelCacheBytes();

// memcpy(to, from, bytes) whose stores bypass the caches: AVX2 streaming stores when the CPU
// has AVX2, SSE2 otherwise, plain memcpy on other architectures. The buffers must not
// overlap. Ordered like a memcpy: an sfence follows the streaming stores, so a release store
// made after it publishes the bytes.
void CopyNonTemporal(void* to, const void* from, size_t bytes);

}  // namespace expert_arena::platform
