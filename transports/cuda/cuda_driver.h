// The few CUDA driver calls that stream-ordered operations make, found in
// the libcuda the process has already loaded. libbraid links no CUDA: a
// caller that passes a stream has loaded the driver (it made the stream), and
// a CPU-only process never pays for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "src/core/status.h"

namespace braid {

// Driver types as the driver ABI has them (cuda.h), declared here so that a
// build without the toolkit compiles the same code.
using CUresult = int;
using CUstream = void*;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;
using CUhostFn = void (*)(void* user_data);
using CUdevice = int;
using CUevent = void*;
// CUipcMemHandle: 64 opaque bytes, passed by value.
struct CuIpcMemHandle {
  char reserved[64];
};

struct CudaDriver {
  CUresult (*mem_host_alloc)(void** p, size_t bytes, unsigned flags);
  CUresult (*mem_free_host)(void* p);
  CUresult (*mem_host_get_device_pointer)(CUdeviceptr* dptr, void* p, unsigned flags);
  CUresult (*memcpy_async)(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);
  CUresult (*launch_host_func)(CUstream stream, CUhostFn fn, void* user_data);
  CUresult (*stream_wait_value32)(CUstream stream, CUdeviceptr addr, uint32_t value, unsigned flags);
  CUresult (*stream_get_ctx)(CUstream stream, CUcontext* ctx);
  CUresult (*ctx_push_current)(CUcontext ctx);
  CUresult (*ctx_pop_current)(CUcontext* ctx);
  CUresult (*get_error_string)(CUresult error, const char** text);
  // An event behind a call's last host function, queried while the engine
  // waits for the stream: it reports a context's device error, after which
  // host functions no longer run (transports/cuda/stream_staging.h).
  CUresult (*event_create)(CUevent* event, unsigned flags);
  CUresult (*event_record)(CUevent event, CUstream stream);
  CUresult (*event_query)(CUevent event);
  CUresult (*event_destroy)(CUevent event);

  // For device collectives through CUDA IPC (transports/cuda/ipc_window.h).
  // Looked up with the rest but optional: null where the driver lacks one,
  // and has_ipc() says whether all are there.
  CUresult (*mem_alloc)(CUdeviceptr* p, size_t bytes);
  CUresult (*mem_free)(CUdeviceptr p);
  CUresult (*ipc_get_mem_handle)(CuIpcMemHandle* handle, CUdeviceptr p);
  CUresult (*ipc_open_mem_handle)(CUdeviceptr* p, CuIpcMemHandle handle, unsigned flags);
  CUresult (*ipc_close_mem_handle)(CUdeviceptr p);
  CUresult (*stream_create)(CUstream* stream, unsigned flags);
  CUresult (*stream_destroy)(CUstream stream);
  CUresult (*stream_query)(CUstream stream);
  CUresult (*ctx_get_device)(CUdevice* device);
  CUresult (*device_get_pci_bus_id)(char* bus_id, int len, CUdevice device);
  CUresult (*device_get_by_pci_bus_id)(CUdevice* device, const char* bus_id);
  CUresult (*device_can_access_peer)(int* can, CUdevice device, CUdevice peer);
  // Optional too: where present, a stream being captured into a CUDA graph
  // is refused (the call's copies and waits would be recorded, not run).
  CUresult (*stream_is_capturing)(CUstream stream, int* status);
  // Optional: sets this thread's stream capture mode, returning the old one
  // in *mode. StreamContext makes braid's calls relaxed (2) for its scope:
  // in the default global mode, a query or allocation while any thread
  // captures a graph fails and ruins that thread's capture.
  CUresult (*thread_exchange_stream_capture_mode)(int* mode);
  bool has_ipc() const {
    return mem_alloc && mem_free && ipc_get_mem_handle && ipc_open_mem_handle && ipc_close_mem_handle &&
           stream_create && stream_destroy && stream_query && ctx_get_device && device_get_pci_bus_id &&
           device_get_by_pci_bus_id && device_can_access_peer;
  }

  // "cuMemcpyAsync failed: CUDA_ERROR_INVALID_VALUE (invalid argument)".
  Status error(const char* call, CUresult r) const;
};

constexpr unsigned kMemHostAllocPortable = 0x01;    // CU_MEMHOSTALLOC_PORTABLE
constexpr unsigned kMemHostAllocDeviceMap = 0x02;   // CU_MEMHOSTALLOC_DEVICEMAP
constexpr unsigned kStreamWaitValueGeq = 0x0;       // CU_STREAM_WAIT_VALUE_GEQ
constexpr unsigned kStreamNonBlocking = 0x1;        // CU_STREAM_NON_BLOCKING
constexpr unsigned kIpcLazyEnablePeerAccess = 0x1;  // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
constexpr unsigned kEventDisableTiming = 0x2;       // CU_EVENT_DISABLE_TIMING
constexpr CUresult kCudaErrorNotReady = 600;        // CUDA_ERROR_NOT_READY

// The driver's entry points, or an unsupported-error saying why there are
// none (no libcuda in the process, or one without a needed call).
Status cuda_driver(const CudaDriver** out);

// Makes the stream's context current on this thread for the scope (the
// caller's thread may have another one current, or none), and the thread's
// stream capture mode relaxed: braid's queries and allocations then leave
// a graph another thread captures alone (in global mode they would fail,
// and end that capture).
class StreamContext {
 public:
  StreamContext(const CudaDriver& cu, CUstream stream);
  // A context known already (one braid made something in).
  struct Known {
    CUcontext ctx;
  };
  StreamContext(const CudaDriver& cu, Known known);
  ~StreamContext();
  StreamContext(const StreamContext&) = delete;
  StreamContext& operator=(const StreamContext&) = delete;
  const Status& status() const { return status_; }
  CUcontext context() const { return ctx_; }

 private:
  void push(CUcontext ctx);
  const CudaDriver& cu_;
  CUcontext ctx_ = nullptr;
  bool pushed_ = false;
  bool relaxed_ = false;  // the thread's capture mode was set relaxed
  int previous_mode_ = 0;
  Status status_;
};

}  // namespace braid
