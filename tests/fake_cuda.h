// The fake CUDA driver's calls (tests/fake_libcuda.cc), for tests that run
// stream-ordered operations without a GPU, and buffers in its "device
// memory" or in host memory.
#pragma once

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>

namespace braid::test {

// The fake driver's calls, loaded once per rank process (before braid looks
// for libcuda.so.1, which it finds by that soname).
struct FakeCuda {
  void* (*stream_create)();
  void (*stream_destroy)(void*);
  void (*stream_hold)(void*, int);
  void (*stream_capture)(void*, int);  // marks a stream as being captured into a graph
  void (*stream_synchronize)(void*);
  int (*pinned_blocks)();
  int (*copies)();
  void (*set_device_range)(const void*, size_t);
  int (*launch_host_func)(void*, void (*)(void*), void*);
  void* (*malloc)(size_t);
  void (*free)(void*);
  void* (*malloc_managed)(size_t);           // "managed memory": the host may read it
  void* (*malloc_in_other_context)(size_t);  // device memory of another context (free with `free`)
  void (*free_managed)(void*);
  // Device memory from cuMemAlloc still held, peers' memory still mapped
  // through IPC, and frees of memory another process still mapped.
  int (*live_allocs)();
  int (*live_imports)();
  int (*violations)();
  void (*fail_ipc_open)(int on);
  void (*fail_host_alloc)(int on);  // cuMemHostAlloc fails (out of memory)
  void (*device_fault)(int code);   // a sticky device error: streams stop, calls return `code`
  void (*set_pci_bus_id)(const char* bus_id);
  void (*set_peer_bus_ids)(const char* csv);
  // As if another thread captured a graph in global mode; whether a call
  // braid made then ended that capture.
  void (*global_capture)(int on);
  int (*capture_invalidated)();
};

inline const FakeCuda& fake_cuda() {
  static FakeCuda f = [] {
    void* lib = dlopen(BRAID_FAKE_LIBCUDA, RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) {
      ADD_FAILURE() << dlerror();
      _exit(3);
    }
    FakeCuda c{};
    c.stream_create = reinterpret_cast<void* (*)()>(dlsym(lib, "fake_cuda_stream_create"));
    c.stream_destroy = reinterpret_cast<void (*)(void*)>(dlsym(lib, "fake_cuda_stream_destroy"));
    c.stream_hold = reinterpret_cast<void (*)(void*, int)>(dlsym(lib, "fake_cuda_stream_hold"));
    c.stream_capture = reinterpret_cast<void (*)(void*, int)>(dlsym(lib, "fake_cuda_stream_capture"));
    c.stream_synchronize = reinterpret_cast<void (*)(void*)>(dlsym(lib, "fake_cuda_stream_synchronize"));
    c.pinned_blocks = reinterpret_cast<int (*)()>(dlsym(lib, "fake_cuda_pinned_blocks"));
    c.copies = reinterpret_cast<int (*)()>(dlsym(lib, "fake_cuda_copies"));
    c.set_device_range =
        reinterpret_cast<void (*)(const void*, size_t)>(dlsym(lib, "fake_cuda_set_device_range"));
    c.launch_host_func =
        reinterpret_cast<int (*)(void*, void (*)(void*), void*)>(dlsym(lib, "cuLaunchHostFunc"));
    c.malloc = reinterpret_cast<void* (*)(size_t)>(dlsym(lib, "fake_cuda_malloc"));
    c.free = reinterpret_cast<void (*)(void*)>(dlsym(lib, "fake_cuda_free"));
    c.malloc_managed = reinterpret_cast<void* (*)(size_t)>(dlsym(lib, "fake_cuda_malloc_managed"));
    c.free_managed = reinterpret_cast<void (*)(void*)>(dlsym(lib, "fake_cuda_free_managed"));
    c.malloc_in_other_context =
        reinterpret_cast<void* (*)(size_t)>(dlsym(lib, "fake_cuda_malloc_in_other_context"));
    c.live_allocs = reinterpret_cast<int (*)()>(dlsym(lib, "fake_cuda_live_allocs"));
    c.live_imports = reinterpret_cast<int (*)()>(dlsym(lib, "fake_cuda_live_imports"));
    c.violations = reinterpret_cast<int (*)()>(dlsym(lib, "fake_cuda_violations"));
    c.fail_ipc_open = reinterpret_cast<void (*)(int)>(dlsym(lib, "fake_cuda_fail_ipc_open"));
    c.fail_host_alloc = reinterpret_cast<void (*)(int)>(dlsym(lib, "fake_cuda_fail_host_alloc"));
    c.global_capture = reinterpret_cast<void (*)(int)>(dlsym(lib, "fake_cuda_global_capture"));
    c.capture_invalidated = reinterpret_cast<int (*)()>(dlsym(lib, "fake_cuda_capture_invalidated"));
    c.device_fault = reinterpret_cast<void (*)(int)>(dlsym(lib, "fake_cuda_device_fault"));
    c.set_pci_bus_id = reinterpret_cast<void (*)(const char*)>(dlsym(lib, "fake_cuda_set_pci_bus_id"));
    c.set_peer_bus_ids = reinterpret_cast<void (*)(const char*)>(dlsym(lib, "fake_cuda_set_peer_bus_ids"));
    return c;
  }();
  return f;
}

// A buffer in the fake driver's "device memory" (braid stages it through
// pinned blocks), or in ordinary host memory (braid uses it in place).
template <class T>
class Buffer {
 public:
  Buffer(bool device, size_t n, T fill) : device_(device), n_(n) {
    p_ = device ? static_cast<T*>(fake_cuda().malloc(n * sizeof(T))) : new T[n];
    std::fill(p_, p_ + n, fill);
  }
  ~Buffer() {
    if (device_) {
      fake_cuda().free(p_);
    } else {
      delete[] p_;
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data() { return p_; }
  size_t size() const { return n_; }
  T& operator[](size_t i) { return p_[i]; }

 private:
  bool device_;
  size_t n_;
  T* p_;
};

}  // namespace braid::test
