// Copies into memory another core reads next (shared-memory slots).
#pragma once

#include <cstddef>

namespace braid::kernels {

// dst = src (bytes), written with non-temporal (streaming) stores: the
// destination's lines go to memory instead of staying dirty in this core's
// cache, so a reader on another core fetches them from memory rather than
// from this core's cache. Ordered before any later store (it ends with a
// store fence), so a flag released after it covers the data. Plain memcpy
// where the CPU has no streaming stores. The ranges must not overlap.
void copy_streaming(void* dst, const void* src, size_t bytes);

}  // namespace braid::kernels
