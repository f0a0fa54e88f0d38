// A stand-in for the CUDA driver (soname libcuda.so.1) with one call,
// cuPointerGetAttribute, that calls a chosen address range "memory of CUDA
// device 3": lets api_test check, without a GPU, that braid asks the driver
// about buffers and refuses device memory with a message.
#include <cstddef>
#include <cstdint>

namespace {
uintptr_t g_lo = 0, g_hi = 0;
}  // namespace

extern "C" {

__attribute__((visibility("default"))) void fake_cuda_set_device_range(const void* p, size_t bytes) {
  g_lo = reinterpret_cast<uintptr_t>(p);
  g_hi = g_lo + bytes;
}

// CUDA_SUCCESS (0) with the attribute for the device range; otherwise
// CUDA_ERROR_INVALID_VALUE (1), what the driver answers for host memory it
// never registered.
__attribute__((visibility("default"))) int cuPointerGetAttribute(void* data, int attribute,
                                                                 unsigned long long ptr) {
  if (ptr < g_lo || ptr >= g_hi) return 1;
  switch (attribute) {
    case 2:  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE: CU_MEMORYTYPE_DEVICE
      *static_cast<unsigned*>(data) = 2;
      return 0;
    case 8:  // CU_POINTER_ATTRIBUTE_IS_MANAGED
      *static_cast<unsigned*>(data) = 0;
      return 0;
    case 9:  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
      *static_cast<int*>(data) = 3;
      return 0;
    default:
      return 1;
  }
}

}  // extern "C"
