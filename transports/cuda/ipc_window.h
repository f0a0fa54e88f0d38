// One rank's part in device collectives between the ranks of one host
// through CUDA IPC: a window of device memory, two regions (input and
// output) of region_bytes each, that every other rank maps
// (cuIpcGetMemHandle / cuIpcOpenMemHandle), and an internal stream on which
// the engine enqueues the copies and reduction kernels (kernels/cuda) of
// those collectives. The data moves device to device (NVLink, PCIe, or the
// one GPU's memory when ranks share it); messages on the collective channel
// only order the phases (src/algo/ipc_collectives.h holds the protocols).
//
// Everything here is local to the rank: making the window, mapping a peer's
// from the record it sent, enqueueing work. The internal stream never waits
// on anything outside braid (no events of user streams, no flags), so its
// work always finishes: settled() is bounded, and so is tearing down.
#pragma once

#include <braid/braid.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "src/core/status.h"
#include "src/core/task.h"
#include "transports/cuda/cuda_driver.h"
#include "transports/cuda/cuda_kernels.h"

namespace braid {

// What a rank tells the others about its window (one message, fixed size).
struct IpcWindowRecord {
  uint32_t ok = 0;  // 0: this rank has no usable window (or, in the verdict round, could not map one)
  int32_t pid = 0;
  int32_t device = -1;  // the CUDA device ordinal in its process (for logs)
  uint32_t reserved = 0;
  uint64_t region_bytes = 0;
  CuIpcMemHandle handle{};
  char bus_id[16] = {};  // the GPU's PCI bus id: the same GPU in every process
  // The window's address in its own process: a rank of the same process
  // (ranks as threads) uses it directly, since CUDA refuses to open a
  // process's own IPC handle. The same process is the same pid and the
  // same random token (pids repeat across PID namespaces, and containers
  // can be one host to braid), and the address is used only in the same
  // context (the value of its CUcontext).
  uint64_t base = 0;
  uint64_t process_token = 0;
  uint64_t context = 0;
  char why[384] = {};  // when !ok: what went wrong, naming the rank
  void set_failure(const std::string& reason);
};
static_assert(sizeof(IpcWindowRecord) == 512, "travels as one message");

class IpcWindow {
 public:
  // This rank's window in `ctx`: cuMemAlloc of the two regions, a
  // non-blocking internal stream, the kernel library. `wake` runs on CUDA's
  // callback thread when enqueued work settled (it wakes the engine).
  // `moved` counts the bytes this rank reads from peers' windows (for
  // braid_comm_transport_bytes "cuda_ipc"); it must outlive the window.
  static Status make(const CudaDriver& cu, CUcontext ctx, size_t region_bytes, int nranks, int rank,
                     std::function<void()> wake, std::atomic<uint64_t>* moved,
                     std::unique_ptr<IpcWindow>* out);
  // Unmaps the peers' windows. Frees this rank's own only if every peer said
  // it no longer maps it (peers_unmapped()): freeing memory another process
  // still maps is undefined behaviour in CUDA, so otherwise it stays
  // allocated until the process exits, with a warning.
  ~IpcWindow();
  IpcWindow(const IpcWindow&) = delete;
  IpcWindow& operator=(const IpcWindow&) = delete;

  // What this rank sends the others; from then on a peer may map the window.
  IpcWindowRecord record();
  // Decides whether this rank may read another GPU's memory, by the path
  // between the two (bus ids: this rank's GPU, then the peer's).
  using GpuPathCheck = std::function<Status(const std::string& mine, const std::string& theirs)>;
  // Maps `member`'s window from the record it sent, once its GPU is this
  // one, or one that `path_allowed` (when set) accepts and this GPU has
  // peer access to (kernels read the mapping).
  Status map_peer(int member, const IpcWindowRecord& theirs, const GpuPathCheck& path_allowed);
  void unmap_peers();
  // Every peer has unmapped this rank's window (a sync after their unmap_peers).
  void peers_unmapped() { peers_unmapped_ = true; }

  CUcontext context() const { return ctx_; }
  int rank() const { return rank_; }
  int device() const { return device_; }
  size_t region_bytes() const { return region_bytes_; }
  // `member`'s regions in this process's address space (this rank's own or a
  // peer's mapping).
  char* input(int member) const { return bases_[member]; }
  char* output(int member) const { return bases_[member] + region_bytes_; }

  // Enqueued on the internal stream, in order; an error names the call.
  Status copy(void* dst, const void* src, size_t bytes);
  // dst = srcs[0] op srcs[1] op ... (any number of sources, folded in groups
  // the kernel takes; dst may be one of them exactly). AVG reduces as SUM.
  Status reduce(braid_dtype_t dtype, braid_redop_t op, const std::vector<const void*>& srcs, void* dst,
                size_t count);
  // out = in / divisor (out is in, or disjoint from it).
  Status divide(braid_dtype_t dtype, const void* in, void* out, size_t count, int divisor);
  // Device memory of at least `bytes` for this rank's use in one op (the
  // largest asked for so far; kept until the window goes: freeing could
  // wait on streams that wait on braid).
  // Thread-safe: allocated when the call is made, before its stream waits
  // on braid (an allocation while a stream waits may serialise the device).
  Status scratch(size_t bytes, char** out);
  // A copy or kernel of the internal stream failed (a device error): the
  // host functions behind it never run, so settled() sees it through a
  // query of the stream, and this names it.
  const Status& stream_error() const { return stream_error_; }
  // Marks the end of what is enqueued so far; settled() holds once the stream
  // ran it. One mark awaited at a time (the collective lane runs one op).
  Status post_mark();
  // Waits (bounded) until the internal stream ran everything: a failed op
  // lets its user stream go on only once no copy of its can still write
  // into the user's buffers.
  bool drain_stream();
  WaitPoint settled_wait() {
    return WaitPoint{
        &IpcWindow::is_settled, this, -1, "for its device copies and kernels (CUDA IPC)", {}, {}};
  }

 private:
  // Shared with the stream's host functions, which may run after the window
  // is gone if a stream outlived it (see the destructor).
  struct Marks {
    std::atomic<uint64_t> done{0};
    std::mutex mu;
    std::function<void()> wake;  // null once the window is gone
  };
  static void on_mark(void* marks);
  static bool is_settled(void* window);
  IpcWindow(const CudaDriver& cu, CUcontext ctx, int nranks, int rank);
  // Adds `bytes` to moved_ when `src` lies in a peer's window.
  void count_if_peer(const void* src, size_t bytes);

  const CudaDriver& cu_;
  const CudaKernels* kernels_ = nullptr;
  CUcontext ctx_;
  int rank_;
  int device_ = -1;
  size_t region_bytes_ = 0;
  CUdeviceptr own_ = 0;
  CuIpcMemHandle handle_{};
  char bus_id_[16] = {};
  CUstream stream_ = nullptr;
  std::mutex scratch_mu_;             // scratch() is called where calls are made
  std::vector<CUdeviceptr> scratch_;  // the last is the largest
  size_t scratch_bytes_ = 0;
  Status stream_error_;
  uint32_t settle_checks_ = 0;
  std::vector<char*> bases_;  // per member
  std::vector<bool> mapped_;  // per member: a peer's window we reach (opened, or in this process)
  std::vector<bool> opened_;  // per member: opened through cuIpcOpenMemHandle, to be closed
  bool peers_unmapped_ = false;
  std::atomic<uint64_t>* moved_ = nullptr;
  Marks* marks_ = nullptr;
  uint64_t marks_posted_ = 0;
  uint64_t awaited_ = 0;
};

}  // namespace braid
