// The device reduction kernels (kernels/cuda, libbraid_cuda), loaded when a
// device collective first needs them. libbraid links no CUDA (see
// docs/design.md, "CUDA: what is built"), so it opens the kernel library
// with dlopen: BRAID_CUDA_KERNELS if set (a path), else libbraid_cuda.so.0
// in libbraid's own directory, else wherever the dynamic linker finds it.
#pragma once

#include <braid/braid.h>

#include <cstddef>

#include "src/core/status.h"

struct CUstream_st;

namespace braid {

struct CudaKernels {
  // kernels/cuda/reduce_kernels.h: braid_cuda_reduce_copy, braid_cuda_divide, braid_cuda_preload.
  braid_result_t (*reduce_copy)(braid_dtype_t dtype, braid_redop_t op, const void* const* srcs, int nsrcs,
                                void* const* dsts, int ndsts, size_t count, CUstream_st* stream, char* error,
                                size_t error_size);
  braid_result_t (*divide)(braid_dtype_t dtype, const void* in, void* out, size_t count, int divisor,
                           CUstream_st* stream, char* error, size_t error_size);
  braid_result_t (*preload)(char* error, size_t error_size);
};

// The library's entry points, or an unsupported-error naming where it was
// looked for. Loaded once per process; the handle stays open.
Status cuda_kernels(const CudaKernels** out);

}  // namespace braid
