// Which memory a buffer is in: host, or a CUDA device's. Needs no CUDA at
// build time: it asks the CUDA driver (libcuda) only once the process has
// loaded it, since no device memory can exist before that.
#pragma once

#include <atomic>

#include "src/core/status.h"
#include "src/core/task.h"  // BRAID_FAST_TLS

namespace braid {

// The thread's last two buffers found to be host memory while no CUDA
// driver was loaded (initial-exec TLS: the check of a buffer passed again is
// two compares, inlined in the caller). Once the driver is in the process
// every buffer is asked about: a freed host buffer's addresses may come back
// as device memory.
extern BRAID_FAST_TLS __thread const void* t_host_seen[2];  // __thread: no C++ TLS wrapper call
extern std::atomic<bool> g_cuda_driver_loaded;

// True for memory a stream-ordered call copies through its staging block
// instead of touching from the host: device memory, and managed memory,
// which the host must not touch while kernels run on a device without
// concurrent managed access (and which migrates page by page if it does).
bool is_stream_staged_memory(const void* p);
// Where memory of a CUDA device the host cannot read (not managed) lives:
// the device's ordinal and the context that allocated it. False for any
// other memory, or where the driver does not say.
struct DevicePlace {
  int ordinal = -1;
  void* context = nullptr;
};
bool device_memory_place(const void* p, DevicePlace* out);

// The query behind check_host_memory.
Status check_host_memory_slow(const void* p, const char* what);

// OK for memory the host can read (ordinary, pinned, managed); an
// unsupported-error naming `what`, the address and the device for memory of
// a CUDA device, which host-ordered operations cannot take.
__attribute__((always_inline)) inline Status check_host_memory(const void* p, const char* what) {
  if ((p == t_host_seen[0] || p == t_host_seen[1]) && !g_cuda_driver_loaded.load(std::memory_order_relaxed))
      [[likely]]
    return Status::ok();
  return check_host_memory_slow(p, what);
}

}  // namespace braid
