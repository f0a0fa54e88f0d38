#include "src/core/device_memory.h"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

namespace braid {
namespace {

// The CUDA driver API's pointer query, declared here (stable ABI values from
// cuda.h) so that a build without the toolkit can still recognise device
// memory that another library (torch) allocated.
using CUresult = int;
using PointerGetAttribute = CUresult (*)(void* data, int attribute, unsigned long long ptr);
constexpr int kAttrContext = 1;        // CU_POINTER_ATTRIBUTE_CONTEXT
constexpr int kAttrMemoryType = 2;     // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttrIsManaged = 8;      // CU_POINTER_ATTRIBUTE_IS_MANAGED
constexpr int kAttrDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeDevice = 2;

std::atomic<PointerGetAttribute> g_query{nullptr};
std::atomic<unsigned long long> g_loads_seen{~0ull};
std::mutex g_probe_mu;

int count_loads(struct dl_phdr_info* info, size_t, void* out) {
  *static_cast<unsigned long long*>(out) = info->dlpi_adds;
  return 1;  // the counter is the same in every entry: stop at the first
}

// The driver's query once libcuda is in the process, else null. Looking for
// it costs tens of microseconds, so it is done again only after the process
// loaded another library (dl_iterate_phdr's load counter, about 15 ns).
PointerGetAttribute driver_query() {
  PointerGetAttribute q = g_query.load(std::memory_order_acquire);
  if (q != nullptr) return q;
  unsigned long long loads = 0;
  dl_iterate_phdr(count_loads, &loads);
  // No load since the last probe: its answer stands. Read again, since a
  // probe on another thread may have stored it after the load above (it
  // stores the query before the count): null from the first read alone told
  // a second thread that memory of the device was the host's.
  if (loads == g_loads_seen.load(std::memory_order_acquire)) return g_query.load(std::memory_order_acquire);
  std::lock_guard<std::mutex> lock(g_probe_mu);
  // The handle stays open: the function must outlive whoever loaded it.
  if (void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD))
    q = reinterpret_cast<PointerGetAttribute>(dlsym(lib, "cuPointerGetAttribute"));
  if (q != nullptr) {
    g_query.store(q, std::memory_order_release);
    g_cuda_driver_loaded.store(true, std::memory_order_relaxed);
  }
  g_loads_seen.store(loads, std::memory_order_release);
  return q;
}

}  // namespace

BRAID_FAST_TLS __thread const void* t_host_seen[2];
std::atomic<bool> g_cuda_driver_loaded{false};

// Device memory the host cannot read (managed memory it can). Host memory
// the driver never saw fails the query: that is the answer "host". So does
// every pointer before cuInit, when no device memory exists.
bool device_memory(PointerGetAttribute query, const void* p) {
  const auto addr = reinterpret_cast<unsigned long long>(p);
  unsigned type = 0, managed = 0;
  if (query(&type, kAttrMemoryType, addr) != 0 || type != kMemoryTypeDevice) return false;
  query(&managed, kAttrIsManaged, addr);
  return managed == 0;
}

Status check_host_memory_slow(const void* p, const char* what) {
  if (p == nullptr) return Status::ok();
  if (PointerGetAttribute query = driver_query()) {
    if (device_memory(query, p)) {
      int device = -1;
      query(&device, kAttrDeviceOrdinal, reinterpret_cast<unsigned long long>(p));
      char addr[32];
      std::snprintf(addr, sizeof(addr), "%p", p);
      return Status::unsupported(std::string(what) + " (" + addr + ") is memory of CUDA device " +
                                 std::to_string(device) +
                                 ": a host-ordered call (stream NULL) takes host memory (ordinary, pinned "
                                 "or managed); pass the CUDA stream to order it on for device buffers");
    }
    return Status::ok();  // not remembered: see t_host_seen
  }
  t_host_seen[1] = t_host_seen[0];
  t_host_seen[0] = p;
  return Status::ok();
}

bool is_stream_staged_memory(const void* p) {
  PointerGetAttribute query = driver_query();
  if (query == nullptr || p == nullptr) return false;
  const auto addr = reinterpret_cast<unsigned long long>(p);
  // Managed memory may say host or device, wherever it is (cuda.h): its own
  // attribute decides.
  unsigned type = 0, managed = 0;
  if (query(&type, kAttrMemoryType, addr) == 0 && type == kMemoryTypeDevice) return true;
  return query(&managed, kAttrIsManaged, addr) == 0 && managed != 0;
}

bool device_memory_place(const void* p, DevicePlace* out) {
  PointerGetAttribute query = driver_query();
  if (query == nullptr || p == nullptr || !device_memory(query, p)) return false;
  const auto addr = reinterpret_cast<unsigned long long>(p);
  return query(&out->ordinal, kAttrDeviceOrdinal, addr) == 0 && query(&out->context, kAttrContext, addr) == 0;
}

}  // namespace braid
