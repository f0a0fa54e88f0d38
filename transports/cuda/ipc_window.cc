#include "transports/cuda/ipc_window.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "kernels/cuda/reduce_kernels.h"  // BRAID_CUDA_MAX_SOURCES
#include "src/core/bootstrap.h"           // random_token
#include "src/core/logging.h"

namespace braid {
namespace {

// How long tearing down waits for the internal stream: its work never waits
// on anything outside braid, so this is only a bound on copies and kernels.
constexpr double kDrainSeconds = 10.0;

}  // namespace

void IpcWindowRecord::set_failure(const std::string& reason) {
  ok = 0;
  std::memset(why, 0, sizeof(why));
  std::strncpy(why, reason.c_str(), sizeof(why) - 1);
}

IpcWindow::IpcWindow(const CudaDriver& cu, CUcontext ctx, int nranks, int rank)
    : cu_(cu),
      ctx_(ctx),
      rank_(rank),
      bases_(nranks, nullptr),
      mapped_(nranks, false),
      opened_(nranks, false) {}

Status IpcWindow::make(const CudaDriver& cu, CUcontext ctx, size_t region_bytes, int nranks, int rank,
                       std::function<void()> wake, std::atomic<uint64_t>* moved,
                       std::unique_ptr<IpcWindow>* out) {
  if (!cu.has_ipc())
    return Status::unsupported(
        "the CUDA driver in this process lacks the IPC or stream calls device collectives use");
  // A reduce_scatter chunk holds a piece of every rank's block.
  if (region_bytes < 256 * static_cast<size_t>(nranks))
    return Status::invalid_argument("BRAID_CUDA_CHUNK_BYTES=" + std::to_string(region_bytes) +
                                    " is too small for " + std::to_string(nranks) + " ranks");
  std::unique_ptr<IpcWindow> w(new IpcWindow(cu, ctx, nranks, rank));
  BRAID_RETURN_IF_ERROR(cuda_kernels(&w->kernels_));
  StreamContext context(cu, StreamContext::Known{ctx});
  BRAID_RETURN_IF_ERROR(context.status());
  if (CUresult r = cu.ctx_get_device(&w->device_); r != 0) return cu.error("cuCtxGetDevice", r);
  if (CUresult r = cu.device_get_pci_bus_id(w->bus_id_, sizeof(w->bus_id_), w->device_); r != 0)
    return cu.error("cuDeviceGetPCIBusId", r);
  // Every kernel loaded now, not at its first launch inside an op, where
  // its user's stream already waits (loading may synchronise the context).
  char error[256] = {};
  if (braid_result_t r = w->kernels_->preload(error, sizeof(error)); r != BRAID_SUCCESS)
    return Status(r, std::string("braid_cuda_preload: ") + error);
  if (CUresult r = cu.mem_alloc(&w->own_, 2 * region_bytes); r != 0)
    return cu.error(("cuMemAlloc of the " + bytes_text(2 * region_bytes) +
                     " device window (BRAID_CUDA_CHUNK_BYTES sets each half)")
                        .c_str(),
                    r);
  w->region_bytes_ = region_bytes;
  w->bases_[rank] = reinterpret_cast<char*>(w->own_);
  // Freed by the destructor unless a peer may map it: until the records
  // went out, none can.
  w->peers_unmapped_ = true;
  if (CUresult r = cu.ipc_get_mem_handle(&w->handle_, w->own_); r != 0)
    return cu.error("cuIpcGetMemHandle of the device window", r);
  if (CUresult r = cu.stream_create(&w->stream_, kStreamNonBlocking); r != 0)
    return cu.error("cuStreamCreate", r);
  w->moved_ = moved;
  w->marks_ = new Marks();
  w->marks_->wake = std::move(wake);
  *out = std::move(w);
  return Status::ok();
}

namespace {

// This process's token in window records, drawn once (as job tokens are).
uint64_t process_token() {
  static const uint64_t token = [] {
    const JobToken t = random_token();
    uint64_t v = 0;
    std::memcpy(&v, t.data(), sizeof v);
    return v;
  }();
  return token;
}

}  // namespace

IpcWindowRecord IpcWindow::record() {
  IpcWindowRecord r;
  r.ok = 1;
  r.pid = static_cast<int32_t>(getpid());
  r.process_token = process_token();
  r.context = reinterpret_cast<uint64_t>(ctx_);
  r.device = device_;
  r.region_bytes = region_bytes_;
  r.handle = handle_;
  r.base = static_cast<uint64_t>(own_);
  std::memcpy(r.bus_id, bus_id_, sizeof(r.bus_id));
  // A peer may map it from now on.
  peers_unmapped_ = false;
  return r;
}

Status IpcWindow::map_peer(int member, const IpcWindowRecord& theirs, const GpuPathCheck& path_allowed) {
  if (theirs.region_bytes != region_bytes_)
    return Status(BRAID_ERR_MISMATCH, "its window has regions of " + bytes_text(theirs.region_bytes) +
                                          ", this rank's " + bytes_text(region_bytes_) +
                                          " (BRAID_CUDA_CHUNK_BYTES must agree)");
  StreamContext context(cu_, StreamContext::Known{ctx_});
  BRAID_RETURN_IF_ERROR(context.status());
  const std::string theirs_bus(theirs.bus_id, strnlen(theirs.bus_id, sizeof(theirs.bus_id)));
  if (theirs_bus != bus_id_) {
    // Another GPU: the kernels read its memory directly, over a path the
    // policy accepts, and with peer access (a mapping without it would
    // fault on the first load).
    if (path_allowed) BRAID_RETURN_IF_ERROR(path_allowed(bus_id_, theirs_bus));
    CUdevice peer = -1;
    if (CUresult r = cu_.device_get_by_pci_bus_id(&peer, theirs_bus.c_str()); r != 0)
      return cu_.error(("cuDeviceGetByPCIBusId of rank " + std::to_string(member) + "'s GPU " + theirs_bus +
                        " (not visible in this process? CUDA_VISIBLE_DEVICES)")
                           .c_str(),
                       r);
    int can = 0;
    if (CUresult r = cu_.device_can_access_peer(&can, device_, peer); r != 0)
      return cu_.error("cuDeviceCanAccessPeer", r);
    if (!can)
      return Status::unsupported("this rank's GPU " + std::string(bus_id_) + " has no peer access to rank " +
                                 std::to_string(member) + "'s GPU " + theirs_bus);
  }
  if (theirs.pid == static_cast<int32_t>(getpid()) && theirs.process_token == process_token()) {
    // A rank of this process: its window is already in our address space.
    // On the same GPU and context the kernels read it as is; another GPU
    // would need peer access enabled in this context, which braid does not
    // do, and another context's allocation is not mapped in this one.
    if (theirs_bus != bus_id_)
      return Status::unsupported("rank " + std::to_string(member) + " runs in this same process on GPU " +
                                 theirs_bus + " (this rank: " + bus_id_ +
                                 "): ranks of one process share windows only on one GPU");
    if (theirs.context != reinterpret_cast<uint64_t>(ctx_))
      return Status::unsupported(
          "rank " + std::to_string(member) +
          " runs in this same process in another CUDA context of this GPU: ranks of one "
          "process share windows only in one context");
    bases_[member] = reinterpret_cast<char*>(theirs.base);
    mapped_[member] = true;
    return Status::ok();
  }
  CUdeviceptr p = 0;
  if (CUresult r = cu_.ipc_open_mem_handle(&p, theirs.handle, kIpcLazyEnablePeerAccess); r != 0)
    return cu_.error(("cuIpcOpenMemHandle (rank " + std::to_string(member) + " on CUDA device " +
                      std::to_string(theirs.device) + " of its process, this rank on device " +
                      std::to_string(device_) + ")")
                         .c_str(),
                     r);
  bases_[member] = reinterpret_cast<char*>(p);
  mapped_[member] = true;
  opened_[member] = true;
  return Status::ok();
}

void IpcWindow::unmap_peers() {
  StreamContext context(cu_, StreamContext::Known{ctx_});
  for (size_t m = 0; m < mapped_.size(); ++m) {
    if (!mapped_[m]) continue;
    if (opened_[m])
      if (CUresult r = cu_.ipc_close_mem_handle(reinterpret_cast<CUdeviceptr>(bases_[m])); r != 0)
        BRAID_WARN("CUDA", rank_, "%s", cu_.error("cuIpcCloseMemHandle", r).message().c_str());
    mapped_[m] = false;
    opened_[m] = false;
    bases_[m] = nullptr;
  }
}

bool IpcWindow::drain_stream() {
  if (stream_ == nullptr) return true;
  StreamContext context(cu_, StreamContext::Known{ctx_});
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(kDrainSeconds);
  for (;;) {
    const CUresult r = cu_.stream_query(stream_);
    if (r == 0) return true;
    if (r != kCudaErrorNotReady) {
      BRAID_WARN("CUDA", rank_, "%s",
                 cu_.error("cuStreamQuery of braid's internal stream", r).message().c_str());
      return false;
    }
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

IpcWindow::~IpcWindow() {
  // Nothing of ours may still read a peer's window when it is unmapped.
  const bool drained = drain_stream();
  if (drained) unmap_peers();
  StreamContext context(cu_, StreamContext::Known{ctx_});
  if (stream_ != nullptr) (void)cu_.stream_destroy(stream_);
  if (drained)
    for (CUdeviceptr p : scratch_) (void)cu_.mem_free(p);
  if (own_ != 0) {
    if (drained && peers_unmapped_) {
      if (CUresult r = cu_.mem_free(own_); r != 0)
        BRAID_WARN("CUDA", rank_, "%s", cu_.error("cuMemFree of the device window", r).message().c_str());
    } else {
      BRAID_WARN("CUDA", rank_, "the %s device window stays allocated until the process exits: %s",
                 bytes_text(2 * region_bytes_).c_str(),
                 drained ? "not every peer said it no longer maps it (a peer failed or did not destroy its "
                           "communicator in time)"
                         : "braid's internal stream did not finish");
    }
  }
  if (marks_ != nullptr) {
    std::unique_lock<std::mutex> lock(marks_->mu);
    marks_->wake = nullptr;
    const bool pending = marks_->done.load() < marks_posted_;
    lock.unlock();
    // A host function still to run would find freed memory: keep it then
    // (the stream did not drain; the warning above said so).
    if (!pending) delete marks_;
  }
}

void IpcWindow::count_if_peer(const void* src, size_t bytes) {
  const char* p = static_cast<const char*>(src);
  for (size_t m = 0; m < bases_.size(); ++m)
    if (mapped_[m] && p >= bases_[m] && p < bases_[m] + 2 * region_bytes_) {
      moved_->fetch_add(bytes, std::memory_order_relaxed);
      return;
    }
}

Status IpcWindow::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return Status::ok();
  count_if_peer(src, bytes);
  StreamContext context(cu_, StreamContext::Known{ctx_});
  BRAID_RETURN_IF_ERROR(context.status());
  if (CUresult r = cu_.memcpy_async(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src),
                                    bytes, stream_);
      r != 0)
    return cu_.error(("cuMemcpyAsync of " + bytes_text(bytes) + " on braid's internal stream").c_str(), r);
  return Status::ok();
}

Status IpcWindow::reduce(braid_dtype_t dtype, braid_redop_t op, const std::vector<const void*>& srcs,
                         void* dst, size_t count) {
  if (count == 0) return Status::ok();
  StreamContext context(cu_, StreamContext::Known{ctx_});
  BRAID_RETURN_IF_ERROR(context.status());
  for (const void* src : srcs) count_if_peer(src, count * braid_dtype_size(dtype));
  char error[256] = {};
  void* const dsts[1] = {dst};
  auto* stream = static_cast<CUstream_st*>(stream_);
  // The first group of sources into dst, then dst and the next group into
  // dst (a destination may be a source exactly).
  const size_t first = std::min(srcs.size(), size_t{BRAID_CUDA_MAX_SOURCES});
  std::vector<const void*> group(srcs.begin(), srcs.begin() + static_cast<ptrdiff_t>(first));
  for (size_t next = first;;) {
    if (braid_result_t r = kernels_->reduce_copy(dtype, op, group.data(), static_cast<int>(group.size()),
                                                 dsts, 1, count, stream, error, sizeof(error));
        r != BRAID_SUCCESS)
      return Status(r, std::string("braid_cuda_reduce_copy: ") + error);
    if (next == srcs.size()) return Status::ok();
    const size_t take = std::min(srcs.size() - next, size_t{BRAID_CUDA_MAX_SOURCES - 1});
    group.assign(1, dst);
    group.insert(group.end(), srcs.begin() + static_cast<ptrdiff_t>(next),
                 srcs.begin() + static_cast<ptrdiff_t>(next + take));
    next += take;
  }
}

Status IpcWindow::divide(braid_dtype_t dtype, const void* in, void* out, size_t count, int divisor) {
  if (count == 0) return Status::ok();
  StreamContext context(cu_, StreamContext::Known{ctx_});
  BRAID_RETURN_IF_ERROR(context.status());
  count_if_peer(in, count * braid_dtype_size(dtype));
  char error[256] = {};
  if (braid_result_t r = kernels_->divide(dtype, in, out, count, divisor, static_cast<CUstream_st*>(stream_),
                                          error, sizeof(error));
      r != BRAID_SUCCESS)
    return Status(r, std::string("braid_cuda_divide: ") + error);
  return Status::ok();
}

Status IpcWindow::scratch(size_t bytes, char** out) {
  std::lock_guard<std::mutex> lock(scratch_mu_);
  if (bytes > scratch_bytes_) {
    StreamContext context(cu_, StreamContext::Known{ctx_});
    BRAID_RETURN_IF_ERROR(context.status());
    CUdeviceptr p = 0;
    if (CUresult r = cu_.mem_alloc(&p, bytes); r != 0)
      return cu_.error(
          ("cuMemAlloc of " + bytes_text(bytes) + " for a copy of an input that overlaps its output").c_str(),
          r);
    scratch_.push_back(p);
    scratch_bytes_ = bytes;
  }
  *out = reinterpret_cast<char*>(scratch_.back());
  return Status::ok();
}

void IpcWindow::on_mark(void* p) {
  auto* m = static_cast<Marks*>(p);
  // Under the lock: the window's destructor, which decides under it whether
  // a host function is still to come, must not free `m` between the two.
  std::lock_guard<std::mutex> lock(m->mu);
  m->done.fetch_add(1, std::memory_order_seq_cst);
  if (m->wake) m->wake();
}

bool IpcWindow::is_settled(void* p) {
  auto* w = static_cast<IpcWindow*>(p);
  if (w->marks_->done.load(std::memory_order_acquire) >= w->awaited_) return true;
  // Now and then, whether the stream failed (its host functions then never
  // run): a query costs a driver call, a check here a few nanoseconds.
  if (++w->settle_checks_ % 256 != 0) return false;
  StreamContext context(w->cu_, StreamContext::Known{w->ctx_});
  const CUresult r = w->cu_.stream_query(w->stream_);
  if (r == 0 || r == kCudaErrorNotReady) return false;
  w->stream_error_ = w->cu_.error("braid's internal stream (a device copy or kernel of CUDA IPC)", r);
  return true;
}

Status IpcWindow::post_mark() {
  StreamContext context(cu_, StreamContext::Known{ctx_});
  BRAID_RETURN_IF_ERROR(context.status());
  if (CUresult r = cu_.launch_host_func(stream_, &IpcWindow::on_mark, marks_); r != 0)
    return cu_.error("cuLaunchHostFunc on braid's internal stream", r);
  awaited_ = ++marks_posted_;
  return Status::ok();
}

}  // namespace braid
