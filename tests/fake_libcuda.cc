// A stand-in for the CUDA driver (soname libcuda.so.1), for tests without a
// GPU:
// - cuPointerGetAttribute calls a chosen address range, and what
//   fake_cuda_malloc returns, "memory of CUDA device 3" (braid must ask the
//   driver about buffers: it refuses device memory in host-ordered calls and
//   stages it in stream-ordered ones);
// - streams are threads that run what is enqueued on them in order: copies,
//   host functions and waits on a 32-bit word, as the driver's calls that
//   braid's stream-ordered operations use (transports/cuda). Copies move
//   host memory; "device buffers" are ordinary memory here;
// - cuMemAlloc gives memory other processes can map through the IPC calls,
//   as the driver's does: a memfd mapped shared, opened by another process
//   through /proc/<pid>/fd. A header page before the data counts the
//   processes that map it, so that freeing memory a peer still maps (which
//   CUDA leaves undefined) is counted as a violation the tests can assert on.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

namespace {
uintptr_t g_lo = 0, g_hi = 0;

constexpr int kSuccess = 0, kInvalidValue = 1, kInvalidHandle = 400, kNotReady = 600;

// fake_cuda_device_fault: a sticky device error, as an illegal address in a
// kernel leaves its context. From then on streams run nothing (host
// functions included) and calls that enqueue or query return it.
std::atomic<int> g_device_fault{0};

// One stream: a thread running its queue in order.
class FakeStream {
 public:
  FakeStream() : thread_([this] { run(); }) {}
  ~FakeStream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void push(std::function<void()> work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(work));
    }
    cv_.notify_all();
  }
  void hold(bool on) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ = on;
    }
    cv_.notify_all();
  }
  // A stream being captured into a graph (cuStreamIsCapturing says so).
  std::atomic<bool> capturing{false};
  void synchronize() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  }
  bool idle() {
    std::lock_guard<std::mutex> lock(mu_);
    return queue_.empty() && !busy_;
  }
  // Whether the stream ran what it was given within `limit`; a held stream
  // (a test's slow GPU) counts as done.
  bool synchronize_for(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return held_ || (queue_.empty() && !busy_); });
  }

 private:
  void run() {
    // FAKE_CUDA_JITTER_US=N: each item starts up to N us late, so that
    // streams of different ranks interleave in changing orders.
    const char* jitter_env = std::getenv("FAKE_CUDA_JITTER_US");
    const int jitter = jitter_env != nullptr ? std::atoi(jitter_env) : 0;
    std::minstd_rand rng(static_cast<unsigned>(getpid()) * 7919u +
                         static_cast<unsigned>(reinterpret_cast<uintptr_t>(this)));
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || (!held_ && !queue_.empty()); });
      if (stop_) return;
      std::function<void()> work = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      if (jitter > 0) usleep(static_cast<useconds_t>(rng() % static_cast<unsigned>(jitter)));
      if (g_device_fault.load() == 0) work();
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool held_ = false, busy_ = false, stop_ = false;
  std::thread thread_;
};

std::mutex g_streams_mu;
std::set<void*> g_streams;
// Held shared by cuMemFree while it waits for streams, so that no stream is
// deleted under it.
std::shared_mutex g_stream_lifetimes;
int g_pinned = 0;                       // live cuMemHostAlloc blocks
int g_copies = 0;                       // cuMemcpyAsync calls
std::map<uintptr_t, size_t> g_device;   // fake_cuda_malloc's blocks: start -> bytes
std::map<uintptr_t, size_t> g_managed;  // fake_cuda_malloc_managed's
std::set<uintptr_t> g_other_context;    // fake_cuda_malloc_in_other_context's

// The start of the block of `blocks` that holds p, or 0 (g_streams_mu held).
uintptr_t block_holding(const std::map<uintptr_t, size_t>& blocks, uintptr_t p) {
  auto it = blocks.upper_bound(p);
  if (it == blocks.begin()) return 0;
  --it;
  return p < it->first + it->second ? it->first : 0;
}

bool in_block(const std::map<uintptr_t, size_t>& blocks, uintptr_t p) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  return block_holding(blocks, p) != 0;
}

// Ordinary memory the fake's pointer queries know by the map it is in.
void* tracked_alloc(std::map<uintptr_t, size_t>& blocks, size_t bytes) {
  void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  std::lock_guard<std::mutex> lock(g_streams_mu);
  blocks[reinterpret_cast<uintptr_t>(p)] = bytes;
  return p;
}

void tracked_free(std::map<uintptr_t, size_t>& blocks, void* p) {
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    blocks.erase(reinterpret_cast<uintptr_t>(p));
    g_other_context.erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
}

bool in_device_block(uintptr_t p) {
  return in_block(g_device, p);
}

// CU_STREAM_LEGACY: the legacy default stream, one per process here.
void* const kLegacyStream = reinterpret_cast<void*>(0x1);

FakeStream* find_stream(void* s) {
  if (s == kLegacyStream) {
    static FakeStream* legacy = [] {
      auto* l = new FakeStream();  // lives as long as the process
      std::lock_guard<std::mutex> lock(g_streams_mu);
      g_streams.insert(l);
      return l;
    }();
    return legacy;
  }
  std::lock_guard<std::mutex> lock(g_streams_mu);
  return g_streams.count(s) != 0 ? static_cast<FakeStream*>(s) : nullptr;
}

std::string g_bus_id = "0000:03:00.0";    // the PCI bus id of "device 3"
std::vector<std::string> g_peer_bus_ids;  // devices 4, 5, ...

// cuMemAlloc's memory: [header page][data], a memfd mapped shared.
constexpr size_t kHeaderPage = 4096;
struct SharedHeader {
  std::atomic<int> mappers;  // processes with an open IPC mapping of it
};
struct Mapping {
  char* base;  // the header page
  size_t bytes;
  int fd;  // the owner's memfd (-1 in an importer)
};
std::map<uintptr_t, Mapping> g_allocs;   // cuMemAlloc: data start -> mapping
std::map<uintptr_t, Mapping> g_imports;  // cuIpcOpenMemHandle: data start -> mapping
// cuMemFree while another process maps it, or that waited 5 s for a stream
int g_violations = 0;
int g_fail_ipc_open = 0;  // fake_cuda_fail_ipc_open
// fake_cuda_global_capture: some thread captures a graph in global mode.
// Then a query or allocation from a thread whose capture mode is not
// relaxed fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and ends that
// capture, as the driver does.
std::atomic<int> g_global_capture{0};
std::atomic<int> g_capture_invalidated{0};
thread_local int t_capture_mode = 0;  // CU_STREAM_CAPTURE_MODE_GLOBAL
constexpr int kCaptureUnsupported = 900, kCaptureModeRelaxed = 2;
bool prohibited_by_capture() {
  if (g_global_capture.load() == 0 || t_capture_mode == kCaptureModeRelaxed) return false;
  g_capture_invalidated.store(1);
  return true;
}
int g_fail_host_alloc = 0;  // fake_cuda_fail_host_alloc

// What cuIpcGetMemHandle hands out (the driver's is 64 opaque bytes).
struct FakeIpcHandle {
  uint32_t magic;
  int32_t pid;
  int32_t fd;
  uint32_t pad;
  uint64_t bytes;
  char rest[40];
};
static_assert(sizeof(FakeIpcHandle) == 64);
constexpr uint32_t kHandleMagic = 0x1bcda7a5;

char* map_shared(int fd, size_t bytes) {
  void* p = mmap(nullptr, kHeaderPage + bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

}  // namespace

extern "C" {

#define FAKE_API __attribute__((visibility("default")))

FAKE_API void* fake_cuda_stream_create() {
  auto* s = new FakeStream();
  std::lock_guard<std::mutex> lock(g_streams_mu);
  g_streams.insert(s);
  return s;
}

FAKE_API void fake_cuda_stream_destroy(void* stream) {
  std::unique_lock<std::shared_mutex> alive(g_stream_lifetimes);
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    g_streams.erase(stream);
  }
  delete static_cast<FakeStream*>(stream);
}

// While held, the stream runs nothing: work enqueued stays queued.
FAKE_API void fake_cuda_stream_hold(void* stream, int on) {
  find_stream(stream)->hold(on != 0);
}

FAKE_API void fake_cuda_stream_capture(void* stream, int on) {
  find_stream(stream)->capturing.store(on != 0);
}

FAKE_API int cuStreamIsCapturing(void* stream, int* status) {
  FakeStream* s = find_stream(stream);
  if (s == nullptr) return kInvalidHandle;
  *status = s->capturing.load() ? 1 : 0;  // CU_STREAM_CAPTURE_STATUS_ACTIVE : _NONE
  return kSuccess;
}

FAKE_API void fake_cuda_stream_synchronize(void* stream) {
  find_stream(stream)->synchronize();
}

// "Managed memory": ordinary memory that cuPointerGetAttribute calls managed,
// of memory type host (the driver may say host or device for it).
FAKE_API void* fake_cuda_malloc_managed(size_t bytes) {
  return tracked_alloc(g_managed, bytes);
}

FAKE_API void fake_cuda_free_managed(void* p) {
  tracked_free(g_managed, p);
}

// "Device memory": ordinary memory that cuPointerGetAttribute calls device 3's.
FAKE_API void* fake_cuda_malloc(size_t bytes) {
  return tracked_alloc(g_device, bytes);
}

FAKE_API void fake_cuda_free(void* p) {
  tracked_free(g_device, p);
}

FAKE_API int fake_cuda_copies() {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  return g_copies;
}

FAKE_API int fake_cuda_pinned_blocks() {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  return g_pinned;
}

FAKE_API int cuStreamGetCtx(void* stream, void** ctx) {
  if (find_stream(stream) == nullptr) return kInvalidHandle;
  *ctx = reinterpret_cast<void*>(0x1);
  return kSuccess;
}

FAKE_API int cuCtxPushCurrent_v2(void*) {
  return kSuccess;
}

FAKE_API int cuCtxPopCurrent_v2(void** ctx) {
  if (ctx != nullptr) *ctx = reinterpret_cast<void*>(0x1);
  return kSuccess;
}

FAKE_API int cuMemHostAlloc(void** p, size_t bytes, unsigned) {
  if (prohibited_by_capture()) return kCaptureUnsupported;
  if (g_fail_host_alloc) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (*p == nullptr) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  std::lock_guard<std::mutex> lock(g_streams_mu);
  ++g_pinned;
  return kSuccess;
}

FAKE_API int cuMemFreeHost(void* p) {
  std::free(p);
  std::lock_guard<std::mutex> lock(g_streams_mu);
  --g_pinned;
  return kSuccess;
}

FAKE_API int cuMemHostGetDevicePointer_v2(unsigned long long* dptr, void* p, unsigned) {
  *dptr = reinterpret_cast<uintptr_t>(p);
  return kSuccess;
}

FAKE_API int cuMemcpyAsync(unsigned long long dst, unsigned long long src, size_t bytes, void* stream) {
  FakeStream* s = find_stream(stream);
  if (s == nullptr) return kInvalidHandle;
  if (int fault = g_device_fault.load()) return fault;
  if (dst == 0 || src == 0) return kInvalidValue;
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    ++g_copies;
  }
  s->push([=] { std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes); });
  return kSuccess;
}

FAKE_API int cuLaunchHostFunc(void* stream, void (*fn)(void*), void* data) {
  FakeStream* s = find_stream(stream);
  if (s == nullptr) return kInvalidHandle;
  if (int fault = g_device_fault.load()) return fault;
  s->push([=] { fn(data); });
  return kSuccess;
}

// CU_STREAM_WAIT_VALUE_GEQ (flags 0) only: waits until (int32_t)(*addr - value) >= 0.
FAKE_API int cuStreamWaitValue32_v2(void* stream, unsigned long long addr, uint32_t value, unsigned flags) {
  FakeStream* s = find_stream(stream);
  if (s == nullptr) return kInvalidHandle;
  if (flags != 0) return kInvalidValue;
  if (int fault = g_device_fault.load()) return fault;
  auto* word = reinterpret_cast<uint32_t*>(addr);
  s->push([=] {
    while (static_cast<int32_t>(__atomic_load_n(word, __ATOMIC_ACQUIRE) - value) < 0 &&
           g_device_fault.load() == 0)
      usleep(20);
  });
  return kSuccess;
}

// Events: complete once their stream reaches the record. A record still
// queued completes after a destroy, as the driver's: the queued work holds
// the event.
struct FakeEvent {
  std::atomic<bool> reached{true};  // never recorded: complete, as the driver's
};
std::map<void*, std::shared_ptr<FakeEvent>> g_events;  // under g_streams_mu

std::shared_ptr<FakeEvent> find_event(void* event) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  auto it = g_events.find(event);
  return it == g_events.end() ? nullptr : it->second;
}

FAKE_API int cuEventCreate(void** event, unsigned) {
  if (event == nullptr) return kInvalidValue;
  auto e = std::make_shared<FakeEvent>();
  std::lock_guard<std::mutex> lock(g_streams_mu);
  *event = e.get();
  g_events[e.get()] = std::move(e);
  return kSuccess;
}

FAKE_API int cuEventRecord(void* event, void* stream) {
  FakeStream* s = find_stream(stream);
  std::shared_ptr<FakeEvent> e = find_event(event);
  if (s == nullptr || e == nullptr) return kInvalidHandle;
  if (int fault = g_device_fault.load()) return fault;
  e->reached.store(false);
  s->push([e] { e->reached.store(true); });
  return kSuccess;
}

FAKE_API int cuEventQuery(void* event) {
  if (prohibited_by_capture()) return kCaptureUnsupported;
  std::shared_ptr<FakeEvent> e = find_event(event);
  if (e == nullptr) return kInvalidHandle;
  if (int fault = g_device_fault.load()) return fault;
  return e->reached.load() ? kSuccess : kNotReady;
}

FAKE_API int cuEventDestroy_v2(void* event) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  return g_events.erase(event) == 1 ? kSuccess : kInvalidHandle;
}

FAKE_API void fake_cuda_device_fault(int code) {
  g_device_fault.store(code);
}

FAKE_API int cuMemAlloc_v2(unsigned long long* dptr, size_t bytes) {
  if (prohibited_by_capture()) return kCaptureUnsupported;
  if (dptr == nullptr || bytes == 0) return kInvalidValue;
  const int fd = memfd_create("fake_cuda_device", 0);
  if (fd < 0) return 2;
  if (ftruncate(fd, static_cast<off_t>(kHeaderPage + bytes)) != 0) {
    close(fd);
    return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  }
  char* base = map_shared(fd, bytes);
  if (base == nullptr) {
    close(fd);
    return 2;
  }
  new (base) SharedHeader{0};
  const uintptr_t data = reinterpret_cast<uintptr_t>(base + kHeaderPage);
  std::lock_guard<std::mutex> lock(g_streams_mu);
  g_allocs[data] = {base, bytes, fd};
  g_device[data] = bytes;
  *dptr = data;
  return kSuccess;
}

FAKE_API int cuMemFree_v2(unsigned long long dptr) {
  {
    // As the driver's, freeing waits for the work queued on every stream.
    // Where a stream waits for the freeing thread (a stream-ordered op that
    // only the engine's driver can end) the driver would wait forever; the
    // fake waits 5 s, then counts a violation and goes on.
    std::shared_lock<std::shared_mutex> alive(g_stream_lifetimes);
    std::vector<FakeStream*> streams;
    {
      std::lock_guard<std::mutex> lock(g_streams_mu);
      for (void* st : g_streams) streams.push_back(static_cast<FakeStream*>(st));
    }
    for (FakeStream* st : streams) {
      if (st->synchronize_for(std::chrono::seconds(5))) continue;
      std::fprintf(stderr, "fake cuda: cuMemFree waited 5 s for a stream (a real driver waits for ever)\n");
      std::lock_guard<std::mutex> lock(g_streams_mu);
      ++g_violations;
    }
  }
  Mapping m;
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    auto it = g_allocs.find(dptr);
    if (it == g_allocs.end()) return kInvalidValue;
    m = it->second;
    g_allocs.erase(it);
    g_device.erase(dptr);
    if (reinterpret_cast<SharedHeader*>(m.base)->mappers.load() != 0) ++g_violations;
  }
  munmap(m.base, kHeaderPage + m.bytes);
  close(m.fd);
  return kSuccess;
}

FAKE_API int cuIpcGetMemHandle(FakeIpcHandle* handle, unsigned long long dptr) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  auto it = g_allocs.find(dptr);  // the start of a cuMemAlloc block only, as the driver wants
  if (it == g_allocs.end()) return kInvalidValue;
  *handle =
      FakeIpcHandle{kHandleMagic, static_cast<int32_t>(getpid()), it->second.fd, 0, it->second.bytes, {}};
  return kSuccess;
}

FAKE_API int cuIpcOpenMemHandle_v2(unsigned long long* dptr, FakeIpcHandle handle, unsigned flags) {
  if (flags != 1 || handle.magic != kHandleMagic) return kInvalidValue;
  if (handle.pid == getpid()) return 201;  // CUDA_ERROR_INVALID_CONTEXT: a process's own memory
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    if (g_fail_ipc_open) return 205;  // CUDA_ERROR_MAP_FAILED
  }
  const std::string path = "/proc/" + std::to_string(handle.pid) + "/fd/" + std::to_string(handle.fd);
  const int fd = open(path.c_str(), O_RDWR);
  if (fd < 0) return 205;
  char* base = map_shared(fd, handle.bytes);
  close(fd);
  if (base == nullptr) return 205;
  reinterpret_cast<SharedHeader*>(base)->mappers.fetch_add(1);
  const uintptr_t data = reinterpret_cast<uintptr_t>(base + kHeaderPage);
  std::lock_guard<std::mutex> lock(g_streams_mu);
  g_imports[data] = {base, handle.bytes, -1};
  g_device[data] = handle.bytes;
  *dptr = data;
  return kSuccess;
}

FAKE_API int cuIpcCloseMemHandle(unsigned long long dptr) {
  Mapping m;
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    auto it = g_imports.find(dptr);
    if (it == g_imports.end()) return kInvalidValue;
    m = it->second;
    g_imports.erase(it);
    g_device.erase(dptr);
  }
  reinterpret_cast<SharedHeader*>(m.base)->mappers.fetch_sub(1);
  munmap(m.base, kHeaderPage + m.bytes);
  return kSuccess;
}

FAKE_API int cuStreamCreate(void** stream, unsigned) {
  *stream = fake_cuda_stream_create();
  return kSuccess;
}

// The driver lets queued work finish after a destroy: so does this.
FAKE_API int cuStreamDestroy_v2(void* stream) {
  FakeStream* s = find_stream(stream);
  if (s == nullptr) return kInvalidHandle;
  s->synchronize();
  fake_cuda_stream_destroy(stream);
  return kSuccess;
}

FAKE_API int cuStreamQuery(void* stream) {
  if (prohibited_by_capture()) return kCaptureUnsupported;
  FakeStream* s = find_stream(stream);
  if (s == nullptr) return kInvalidHandle;
  return s->idle() ? kSuccess : 600;  // CUDA_ERROR_NOT_READY
}

FAKE_API int cuCtxGetDevice(int* device) {
  *device = 3;  // the device fake "device memory" belongs to
  return kSuccess;
}

FAKE_API int cuDeviceGetPCIBusId(char* bus_id, int len, int device) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  const size_t peer = static_cast<size_t>(device - 4);
  if (len < 13 || device < 3 || (device > 3 && peer >= g_peer_bus_ids.size())) return kInvalidValue;
  std::snprintf(bus_id, static_cast<size_t>(len), "%s",
                device == 3 ? g_bus_id.c_str() : g_peer_bus_ids[peer].c_str());
  return kSuccess;
}

// This process's device is 3; the other GPUs it sees (fake_cuda_set_peer_bus_ids)
// are 4, 5, ... in the order given.
FAKE_API int cuDeviceGetByPCIBusId(int* device, const char* bus_id) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  if (g_bus_id == bus_id) {
    *device = 3;
    return kSuccess;
  }
  for (size_t i = 0; i < g_peer_bus_ids.size(); ++i) {
    if (g_peer_bus_ids[i] == bus_id) {
      *device = 4 + static_cast<int>(i);
      return kSuccess;
    }
  }
  return 101;  // CUDA_ERROR_INVALID_DEVICE
}

FAKE_API int cuDeviceCanAccessPeer(int* can, int, int) {
  *can = 1;
  return kSuccess;
}

// This process's device claims another PCI bus id: its peers, which cannot
// see that GPU, must not map its memory.
FAKE_API void fake_cuda_set_pci_bus_id(const char* bus_id) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  g_bus_id = bus_id;
}

// Other GPUs this process sees, as CUDA names them (comma-separated bus
// ids): ranks on them may map each other's memory (peer access is granted).
FAKE_API void fake_cuda_set_peer_bus_ids(const char* csv) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  g_peer_bus_ids.clear();
  std::string list(csv);
  for (size_t at = 0; at <= list.size();) {
    size_t comma = list.find(',', at);
    if (comma == std::string::npos) comma = list.size();
    if (comma > at) g_peer_bus_ids.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
}

// For tests: device memory this process allocated and still holds, the
// peers' windows it maps, frees of memory another process still mapped.
FAKE_API int fake_cuda_live_allocs() {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  return static_cast<int>(g_allocs.size());
}

FAKE_API int fake_cuda_live_imports() {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  return static_cast<int>(g_imports.size());
}

FAKE_API int fake_cuda_violations() {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  return g_violations;
}

FAKE_API int cuThreadExchangeStreamCaptureMode(int* mode) {
  const int old = t_capture_mode;
  t_capture_mode = *mode;
  *mode = old;
  return kSuccess;
}

FAKE_API void fake_cuda_global_capture(int on) {
  g_global_capture.store(on);
  if (on) g_capture_invalidated.store(0);
}

FAKE_API int fake_cuda_capture_invalidated() {
  return g_capture_invalidated.load();
}

// While on, cuMemHostAlloc fails with CUDA_ERROR_OUT_OF_MEMORY.
FAKE_API void fake_cuda_fail_host_alloc(int on) {
  g_fail_host_alloc = on;
}

// While on, cuIpcOpenMemHandle fails (a peer's memory cannot be mapped here).
FAKE_API void fake_cuda_fail_ipc_open(int on) {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  g_fail_ipc_open = on;
}

FAKE_API int cuGetErrorString(int error, const char** text) {
  switch (error) {
    case kInvalidHandle:
      *text = "invalid resource handle";
      break;
    case 205:
      *text = "mapping of buffer object failed";
      break;
    case 101:
      *text = "invalid device ordinal";
      break;
    case 700:
      *text = "an illegal memory access was encountered";
      break;
    default:
      *text = "fake driver error";
  }
  return kSuccess;
}

FAKE_API void fake_cuda_set_device_range(const void* p, size_t bytes) {
  g_lo = reinterpret_cast<uintptr_t>(p);
  g_hi = g_lo + bytes;
}

// CUDA_SUCCESS (0) with the attribute for the device range; otherwise
// CUDA_ERROR_INVALID_VALUE (1), what the driver answers for host memory it
// never registered.
// Device memory of another context on the same device (as a library that
// made its own context would allocate): cuMemcpyAsync copies it, but the
// current context's kernels cannot address it.
FAKE_API void* fake_cuda_malloc_in_other_context(size_t bytes) {
  void* p = fake_cuda_malloc(bytes);
  std::lock_guard<std::mutex> lock(g_streams_mu);
  g_other_context.insert(reinterpret_cast<uintptr_t>(p));
  return p;
}

FAKE_API int cuPointerGetAttribute(void* data, int attribute, unsigned long long ptr) {
  const bool managed = in_block(g_managed, ptr);
  if (!managed && (ptr < g_lo || ptr >= g_hi) && !in_device_block(ptr)) return 1;
  switch (attribute) {
    case 1: {  // CU_POINTER_ATTRIBUTE_CONTEXT: the streams' (0x1), or another
      std::lock_guard<std::mutex> lock(g_streams_mu);
      const bool other = g_other_context.count(block_holding(g_device, ptr)) != 0;
      *static_cast<void**>(data) = reinterpret_cast<void*>(other ? 0x2 : 0x1);
      return 0;
    }
    case 2:  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE: managed says host here, device memory device
      *static_cast<unsigned*>(data) = managed ? 1 : 2;
      return 0;
    case 8:  // CU_POINTER_ATTRIBUTE_IS_MANAGED
      *static_cast<unsigned*>(data) = managed ? 1 : 0;
      return 0;
    case 9:  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
      *static_cast<int*>(data) = 3;
      return 0;
    default:
      return 1;
  }
}

}  // extern "C"
