#include "transports/cuda/cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

namespace braid {
namespace {

std::mutex g_mu;
CudaDriver g_driver;
bool g_loaded = false;  // under g_mu until set, then read-only

template <class Fn>
void find(void* lib, const char* name, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*out == nullptr && missing != nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
}

// CU_STREAM_CAPTURE_MODE_RELAXED.
constexpr int kCaptureModeRelaxed = 2;

}  // namespace

Status CudaDriver::error(const char* call, CUresult r) const {
  const char* text = nullptr;
  if (get_error_string == nullptr || get_error_string(r, &text) != 0 || text == nullptr)
    text = "unknown error";
  return Status(BRAID_ERR_SYSTEM,
                std::string(call) + " failed: CUDA error " + std::to_string(r) + " (" + text + ")");
}

Status cuda_driver(const CudaDriver** out) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_loaded) {
    // Only a driver already in the process: whoever made the stream loaded it.
    // The handle stays open for the process's life.
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr)
      return Status::unsupported(
          "stream is not NULL, but no CUDA driver (libcuda.so.1) is loaded in this process: a stream-ordered "
          "operation takes a stream made with the CUDA runtime or driver (pass NULL for a host-ordered one)");
    CudaDriver d{};
    std::string missing;
    find(lib, "cuMemHostAlloc", &d.mem_host_alloc, &missing);
    find(lib, "cuMemFreeHost", &d.mem_free_host, &missing);
    find(lib, "cuMemHostGetDevicePointer_v2", &d.mem_host_get_device_pointer, &missing);
    find(lib, "cuMemcpyAsync", &d.memcpy_async, &missing);
    find(lib, "cuLaunchHostFunc", &d.launch_host_func, &missing);
    find(lib, "cuStreamWaitValue32_v2", &d.stream_wait_value32, &missing);
    find(lib, "cuStreamGetCtx", &d.stream_get_ctx, &missing);
    find(lib, "cuCtxPushCurrent_v2", &d.ctx_push_current, &missing);
    find(lib, "cuCtxPopCurrent_v2", &d.ctx_pop_current, &missing);
    find(lib, "cuGetErrorString", &d.get_error_string, &missing);
    find(lib, "cuEventCreate", &d.event_create, &missing);
    find(lib, "cuEventRecord", &d.event_record, &missing);
    find(lib, "cuEventQuery", &d.event_query, &missing);
    find(lib, "cuEventDestroy_v2", &d.event_destroy, &missing);
    // Optional: device collectives through CUDA IPC use them (has_ipc()).
    find(lib, "cuMemAlloc_v2", &d.mem_alloc, nullptr);
    find(lib, "cuMemFree_v2", &d.mem_free, nullptr);
    find(lib, "cuIpcGetMemHandle", &d.ipc_get_mem_handle, nullptr);
    find(lib, "cuIpcOpenMemHandle_v2", &d.ipc_open_mem_handle, nullptr);
    find(lib, "cuIpcCloseMemHandle", &d.ipc_close_mem_handle, nullptr);
    find(lib, "cuStreamCreate", &d.stream_create, nullptr);
    find(lib, "cuStreamDestroy_v2", &d.stream_destroy, nullptr);
    find(lib, "cuStreamQuery", &d.stream_query, nullptr);
    find(lib, "cuCtxGetDevice", &d.ctx_get_device, nullptr);
    find(lib, "cuDeviceGetPCIBusId", &d.device_get_pci_bus_id, nullptr);
    find(lib, "cuDeviceGetByPCIBusId", &d.device_get_by_pci_bus_id, nullptr);
    find(lib, "cuDeviceCanAccessPeer", &d.device_can_access_peer, nullptr);
    find(lib, "cuStreamIsCapturing", &d.stream_is_capturing, nullptr);
    find(lib, "cuThreadExchangeStreamCaptureMode", &d.thread_exchange_stream_capture_mode, nullptr);
    if (!missing.empty())
      return Status::unsupported("the CUDA driver in this process lacks " + missing +
                                 " (stream-ordered operations need a driver of CUDA 12 or later)");
    g_driver = d;
    g_loaded = true;
  }
  *out = &g_driver;
  return Status::ok();
}

StreamContext::StreamContext(const CudaDriver& cu, CUstream stream) : cu_(cu) {
  CUcontext ctx = nullptr;
  if (CUresult r = cu.stream_get_ctx(stream, &ctx); r != 0) {
    status_ = cu.error("cuStreamGetCtx (is the stream a live CUDA stream?)", r);
    return;
  }
  push(ctx);
}

StreamContext::StreamContext(const CudaDriver& cu, Known known) : cu_(cu) {
  push(known.ctx);
}

void StreamContext::push(CUcontext ctx) {
  ctx_ = ctx;
  if (CUresult r = cu_.ctx_push_current(ctx_); r != 0) {
    status_ = cu_.error("cuCtxPushCurrent", r);
    return;
  }
  pushed_ = true;
  if (cu_.thread_exchange_stream_capture_mode != nullptr) {
    int mode = kCaptureModeRelaxed;
    if (cu_.thread_exchange_stream_capture_mode(&mode) == 0) {
      previous_mode_ = mode;
      relaxed_ = true;
    }
  }
}

StreamContext::~StreamContext() {
  if (relaxed_) {
    int mode = previous_mode_;
    (void)cu_.thread_exchange_stream_capture_mode(&mode);
  }
  if (!pushed_) return;
  CUcontext popped = nullptr;
  (void)cu_.ctx_pop_current(&popped);
}

}  // namespace braid
