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

  // "cuMemcpyAsync failed: CUDA_ERROR_INVALID_VALUE (invalid argument)".
  Status error(const char* call, CUresult r) const;
};

constexpr unsigned kMemHostAllocPortable = 0x01;   // CU_MEMHOSTALLOC_PORTABLE
constexpr unsigned kMemHostAllocDeviceMap = 0x02;  // CU_MEMHOSTALLOC_DEVICEMAP
constexpr unsigned kStreamWaitValueGeq = 0x0;      // CU_STREAM_WAIT_VALUE_GEQ

// The driver's entry points, or an unsupported-error saying why there are
// none (no libcuda in the process, or one without a needed call).
Status cuda_driver(const CudaDriver** out);

// Makes the stream's context current on this thread for the scope (the
// caller's thread may have another one current, or none).
class StreamContext {
 public:
  StreamContext(const CudaDriver& cu, CUstream stream);
  ~StreamContext();
  StreamContext(const StreamContext&) = delete;
  StreamContext& operator=(const StreamContext&) = delete;
  const Status& status() const { return status_; }
  CUcontext context() const { return ctx_; }

 private:
  const CudaDriver& cu_;
  CUcontext ctx_ = nullptr;
  bool pushed_ = false;
  Status status_;
};

}  // namespace braid
