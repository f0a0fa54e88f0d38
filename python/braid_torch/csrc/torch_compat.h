// What differs between the torch releases braid_torch builds against (2.4
// to 2.11): virtuals of c10d::Backend that later releases added, the
// options' asyncOp, and how a CUDA stream's handle is read. Everything
// else in the backend is the same code for every release.
#pragma once

#include <c10/core/Stream.h>
#include <torch/version.h>

#include <type_traits>
#include <utility>

#define BRAID_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// abort(), shutdown(), getError() and supportsCoalescing() became virtuals
// of c10d::Backend in torch 2.7, setTimeout() in 2.9: braid_torch defines
// them for every release and overrides them where they exist (older torch
// reaches them through braid_torch's own calls and destructor only).
#if BRAID_TORCH_AT_LEAST(2, 7)
#define BRAID_TORCH_HAS_ERROR_TYPE 1
#define BRAID_OVERRIDE_SINCE_2_7 override
#else
#define BRAID_TORCH_HAS_ERROR_TYPE 0
#define BRAID_OVERRIDE_SINCE_2_7
#endif
#if BRAID_TORCH_AT_LEAST(2, 9)
#define BRAID_OVERRIDE_SINCE_2_9 override
#else
#define BRAID_OVERRIDE_SINCE_2_9
#endif

namespace braid_torch {

template <typename Options, typename = void>
struct HasAsyncOp : std::false_type {};
template <typename Options>
struct HasAsyncOp<Options, std::void_t<decltype(std::declval<const Options&>().asyncOp)>> : std::true_type {};

// Whether torch waits for the op as soon as it returns (async_op=False):
// the options say so from torch 2.7 (some) and 2.8 (all); before, torch
// always waits through the Work it gets back.
template <typename Options>
bool waited_at_once(const Options& opts) {
  if constexpr (HasAsyncOp<Options>::value) {
    return !opts.asyncOp;
  } else {
    return false;
  }
}

// The cudaStream_t of a CUDA stream: Stream::native_handle() from torch
// 2.11; before, c10::cuda::CUDAStream::stream() from torch's libc10_cuda,
// looked up at run time so that braid_torch needs neither CUDA's headers
// nor a link to it (a CUDAStream holds a c10::Stream and nothing else).
void* cuda_stream_handle(const c10::Stream& stream);

}  // namespace braid_torch
