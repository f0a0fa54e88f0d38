#include "transports/cuda/stream_staging.h"

#include <algorithm>
#include <chrono>
#include <new>
#include <thread>

#include "src/core/deadline.h"
#include "src/core/logging.h"

namespace braid {
namespace {

// The header takes one cache line's multiple; data starts aligned for any dtype.
constexpr size_t kHeaderBytes = (sizeof(StagingBlock) + 127) / 128 * 128;
// Small blocks are rounded up so that one block serves a run of sizes.
constexpr size_t kMinBlockBytes = 64 * 1024;

size_t block_capacity(size_t bytes) {
  if (bytes == 0) return 0;  // flags only: every buffer is host memory
  size_t c = kMinBlockBytes;
  while (c < bytes) c *= 2;
  return c;
}

bool is_staged(void* ctx) {
  return static_cast<StagingBlock*>(ctx)->staged.load(std::memory_order_acquire) != 0;
}

bool is_finished(void* ctx) {
  return static_cast<StagingBlock*>(ctx)->finished.load(std::memory_order_acquire) != 0;
}

// Whether the block's context has a device error, asking the driver at
// most once a millisecond: the engine checks a wait on every pass, and a
// healthy stream answers through its host functions anyway.
bool device_failed(StagingBlock* b) {
  if (b->device_error != 0) return true;
  const auto now = std::chrono::steady_clock::now();
  if (now < b->next_probe) return false;
  b->next_probe = now + std::chrono::milliseconds(1);
  StreamContext context(*b->cu, StreamContext::Known{b->ctx});
  if (!context.status()) return false;
  const CUresult r = b->cu->event_query(b->probe);
  if (r != 0 && r != kCudaErrorNotReady) b->device_error = r;
  return b->device_error != 0;
}

bool staged_or_failed(void* ctx) {
  return is_staged(ctx) || device_failed(static_cast<StagingBlock*>(ctx));
}

bool finished_or_failed(void* ctx) {
  return is_finished(ctx) || device_failed(static_cast<StagingBlock*>(ctx));
}

}  // namespace

Status StagingPool::take(const CudaDriver& cu, CUcontext ctx, size_t bytes, StagingBlock** out) {
  StagingBlock* b = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cu_ = &cu;
    // The smallest free block that fits, pinned in the same context.
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if ((*it)->capacity >= bytes && (*it)->ctx == ctx &&
          (best == free_.end() || (*it)->capacity < (*best)->capacity))
        best = it;
    if (best != free_.end()) {
      b = *best;
      free_.erase(best);
      ++lent_;
    }
  }
  if (b == nullptr) {
    // Not under mu_: pinning (and freeing) host memory may wait for the
    // device, whose host functions (on_staged, on_finished) take mu_.
    const size_t capacity = block_capacity(bytes);
    void* p = nullptr;
    if (CUresult r =
            cu.mem_host_alloc(&p, kHeaderBytes + capacity, kMemHostAllocPortable | kMemHostAllocDeviceMap);
        r != 0)
      return cu.error(
          ("cuMemHostAlloc of " + bytes_text(kHeaderBytes + capacity) + " of staging memory").c_str(), r);
    b = new (p) StagingBlock();  // `release` first: its device address is the block's
    b->pool = this;
    b->cu = &cu;
    b->ctx = ctx;
    b->capacity = capacity;
    b->data = static_cast<char*>(p) + kHeaderBytes;
    if (CUresult r = cu.mem_host_get_device_pointer(&b->release_dev, p, 0); r != 0) {
      (void)cu.mem_free_host(p);
      return cu.error("cuMemHostGetDevicePointer of the staging memory", r);
    }
    if (CUresult r = cu.event_create(&b->probe, kEventDisableTiming); r != 0) {
      (void)cu.mem_free_host(p);
      return cu.error("cuEventCreate", r);
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++lent_;
  }
  b->release.store(0, std::memory_order_relaxed);
  b->staged.store(0, std::memory_order_relaxed);
  b->finished.store(0, std::memory_order_relaxed);
  b->holders.store(2, std::memory_order_relaxed);
  b->device_error = 0;
  b->next_probe = {};
  *out = b;
  return Status::ok();
}

void StagingPool::abandon(StagingBlock* b) {
  // The stream may wait on it: let it pass (its copies then move stale bytes
  // into a staging block nobody reads, or stale results out: the call failed).
  b->release.store(1, std::memory_order_release);
  std::lock_guard<std::mutex> lock(mu_);
  ++abandoned_;
}

void StagingPool::notify() {
  std::lock_guard<std::mutex> lock(mu_);
  if (wake_) wake_();
}

void StagingPool::on_staged(void* block) {
  auto* b = static_cast<StagingBlock*>(block);
  b->staged.store(1, std::memory_order_seq_cst);
  b->pool->notify();
}

void StagingPool::let_go(StagingBlock* b) {
  if (b->holders.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(b);
  --lent_;
}

void StagingPool::on_finished(void* block) {
  auto* b = static_cast<StagingBlock*>(block);
  StagingPool* pool = b->pool;
  b->finished.store(1, std::memory_order_seq_cst);
  pool->notify();
  pool->let_go(b);
}

void StagingPool::op_completed(void* block) {
  auto* b = static_cast<StagingBlock*>(block);
  b->release.store(1, std::memory_order_release);
  b->pool->let_go(b);
}

void StagingPool::shut_down(double timeout_s, int rank) {
  const Deadline deadline = Deadline::after_seconds(timeout_s);
  std::unique_lock<std::mutex> lock(mu_);
  while (lent_ > abandoned_ && !deadline.expired()) {
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    lock.lock();
  }
  wake_ = nullptr;
  std::vector<StagingBlock*> to_free;
  to_free.swap(free_);
  const size_t still_lent = lent_;
  lock.unlock();
  // Outside mu_ (see take): a free may wait for the device, and a lent
  // block's host function takes mu_.
  for (StagingBlock* b : to_free) {
    if (cu_ != nullptr && cu_->ctx_push_current(b->ctx) == 0) {
      (void)cu_->event_destroy(b->probe);
      (void)cu_->mem_free_host(b);
      CUcontext popped = nullptr;
      (void)cu_->ctx_pop_current(&popped);
    }
  }
  if (still_lent > 0) {
    BRAID_WARN("CUDA", rank,
               "%zu staging block(s) are still in use by CUDA streams that never reached their operations; "
               "they stay allocated",
               still_lent);
    return;  // the pool too: those streams' host functions still find it
  }
  delete this;
}

void give_up(StagedCall& call) {
  if (call.block == nullptr) return;
  if (call.enqueued_any) {
    call.pool->abandon(call.block);
  } else {
    // Nothing reached the stream, and no op holds it: free again.
    StagingPool::on_finished(call.block);
    StagingPool::op_completed(call.block);
  }
  call.block = nullptr;
}

namespace {

Status given_up(StagedCall& call, Status why) {
  give_up(call);
  return why;
}

Status failed(StagedCall& call, const char* what, CUresult r) {
  return given_up(call, call.cu->error(what, r));
}

}  // namespace

Status enqueue_stage_in(StagedCall& call) {
  const CudaDriver& cu = *call.cu;
  StagingBlock* b = call.block;
  StreamContext context(cu, call.stream);
  if (!context.status()) return given_up(call, context.status());
  for (const StagedCopy& c : call.inputs) {
    if (c.bytes == 0) continue;
    if (CUresult r = cu.memcpy_async(reinterpret_cast<CUdeviceptr>(b->data + c.block_offset),
                                     reinterpret_cast<CUdeviceptr>(c.user), c.bytes, call.stream);
        r != 0)
      return failed(call, "cuMemcpyAsync of an input to the staging memory", r);
    call.enqueued_any = true;
  }
  if (CUresult r = cu.launch_host_func(call.stream, &StagingPool::on_staged, b); r != 0)
    return failed(call, "cuLaunchHostFunc", r);
  call.enqueued_any = true;
  return Status::ok();
}

Status enqueue_stage_out(StagedCall& call) {
  const CudaDriver& cu = *call.cu;
  StagingBlock* b = call.block;
  StreamContext context(cu, call.stream);
  if (!context.status()) return given_up(call, context.status());
  if (CUresult r = cu.stream_wait_value32(call.stream, b->release_dev, 1, kStreamWaitValueGeq); r != 0)
    return failed(call, "cuStreamWaitValue32 (stream memory operations must be enabled)", r);
  for (const StagedCopy& c : call.outputs) {
    if (c.bytes == 0) continue;
    if (CUresult r =
            cu.memcpy_async(reinterpret_cast<CUdeviceptr>(c.user),
                            reinterpret_cast<CUdeviceptr>(b->data + c.block_offset), c.bytes, call.stream);
        r != 0)
      return failed(call, "cuMemcpyAsync of a result from the staging memory", r);
  }
  if (CUresult r = cu.launch_host_func(call.stream, &StagingPool::on_finished, b); r != 0)
    return failed(call, "cuLaunchHostFunc", r);
  if (CUresult r = cu.event_record(b->probe, call.stream); r != 0) return failed(call, "cuEventRecord", r);
  return Status::ok();
}

namespace {

// The op fails with the context's error. Its block will not come back from
// the stream (step 5 never runs), so the pool stops waiting for it.
Status device_failure(StagingBlock* b) {
  b->pool->abandon(b);
  return b->cu->error("the call's CUDA stream (its context has a device error: cuEventQuery)",
                      b->device_error);
}

}  // namespace

Task stream_staged(StagingBlock* b, Task inner) {
  if (!is_staged(b))
    co_await Until{WaitPoint{staged_or_failed, b, -1, "for its CUDA stream to reach it", {}, {}}};
  if (!is_staged(b)) {
    FailOp fail{device_failure(b)};  // named: see checked_call (src/algo/collectives.cc)
    co_await fail;
  }
  co_await std::move(inner);
  b->release.store(1, std::memory_order_release);
  if (!is_finished(b))
    co_await Until{
        WaitPoint{finished_or_failed, b, -1, "for its CUDA stream to copy the results back", {}, {}}};
  if (!is_finished(b)) {
    FailOp fail{device_failure(b)};
    co_await fail;
  }
}

}  // namespace braid
