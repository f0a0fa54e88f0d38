// Stream-ordered operations through pinned host memory ("host staging"),
// with NCCL's semantics: the call enqueues on the caller's CUDA stream and
// returns. On the stream, in order:
//   1. copies of the inputs into a pinned staging block (device or host
//      buffers alike: one address space under UVA);
//   2. a host function that marks the block "staged" and wakes the engine;
//   3. a wait until the block's release word is 1 (cuStreamWaitValue32 on
//      pinned, device-mapped memory: the GPU waits, no CPU thread blocks);
//   4. copies of the results from the block into the outputs;
//   5. a host function that marks the block "finished" and returns it.
// The engine runs the host operation over the block once it is staged (so
// the stream's earlier work, which wrote the inputs, is done), sets the
// release word, and completes the op once the stream finished: braid_wait on
// an i-request thus waits for the stream work too. A failed op sets the
// release word as well, so a stream never waits forever; the error reaches
// braid_wait, or braid_comm_get_async_error for the blocking form.
//
// Host functions make no CUDA call (CUDA forbids it) and never block: they
// store a flag and wake the engine. No CPU thread waits on the stream.
//
// A device error (an illegal address in any kernel of the context, say)
// stops the context's host functions, so steps 2 and 5 would never come: an
// event recorded after step 5 is queried while the engine waits (at most
// once a millisecond), and an error there fails the op, and so the
// communicator, at once instead of at its timeout.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "src/core/status.h"
#include "src/core/task.h"
#include "transports/cuda/cuda_driver.h"

namespace braid {

class StagingPool;

// The header at the start of each pinned allocation; `data` follows it.
struct StagingBlock {
  std::atomic<uint32_t> release{0};   // set by the host; the stream waits for it (step 3)
  std::atomic<uint32_t> staged{0};    // step 2 ran
  std::atomic<uint32_t> finished{0};  // step 5 ran
  // The stream (until step 5) and the op (until it completes) hold the
  // block; it goes back to the pool when both let go.
  std::atomic<int> holders{0};
  StagingPool* pool = nullptr;
  const CudaDriver* cu = nullptr;
  CUcontext ctx = nullptr;  // the context it was pinned in (to free it there)
  CUevent probe = nullptr;  // recorded after step 5; its query reports a device error
  // Engine thread only: the driver's error once the probe reported one, and
  // when to query it next.
  CUresult device_error = 0;
  std::chrono::steady_clock::time_point next_probe{};
  CUdeviceptr release_dev = 0;
  size_t capacity = 0;
  char* data = nullptr;
};

// The pinned blocks of one communicator. Blocks are taken on the calling
// thread and come back from the stream's host function; they are reused,
// since pinning costs milliseconds.
class StagingPool {
 public:
  // `wake` tells the engine that a block's state changed.
  explicit StagingPool(std::function<void()> wake) : wake_(std::move(wake)) {}
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // A block of at least `bytes` of data, flags cleared (the stream's context
  // current on this thread).
  Status take(const CudaDriver& cu, CUcontext ctx, size_t bytes, StagingBlock** out);
  // Gives back a block whose step 5 could not be enqueued: the stream may
  // still touch it, so it is never reused nor freed.
  void abandon(StagingBlock* b);
  // Ends the pool (instead of delete): waits up to `timeout_s` for the
  // blocks lent to come back, frees the blocks and the pool. If a stream may
  // still touch a block (it never ran that far), the block and the pool stay
  // allocated, the pool stops waking anyone, and a warning names `rank`.
  void shut_down(double timeout_s, int rank);

  // Steps 2 and 5, run by CUDA on its own thread.
  static void on_staged(void* block);
  static void on_finished(void* block);
  // The op's completion (Op::on_complete): releases the stream, failed or
  // not, and lets go of the block.
  static void op_completed(void* block);

 private:
  void notify();
  void let_go(StagingBlock* b);  // one holder less

  std::mutex mu_;
  std::function<void()> wake_;  // null once shut down
  const CudaDriver* cu_ = nullptr;
  std::vector<StagingBlock*> free_;
  size_t lent_ = 0;       // taken and not back
  size_t abandoned_ = 0;  // lent for good (see abandon)
  ~StagingPool() = default;
};

// A piece of a user's buffer the stream copies: to the block's data at
// `block_offset` (step 1) or from it (step 4).
struct StagedCopy {
  size_t block_offset;
  size_t bytes;
  const void* user;
};

// What one stream-ordered call needs enqueued on its stream.
struct StagedCall {
  const CudaDriver* cu = nullptr;
  CUstream stream = nullptr;
  StagingPool* pool = nullptr;
  StagingBlock* block = nullptr;
  std::vector<StagedCopy> inputs, outputs;
  bool enqueued_any = false;  // the stream may touch the block
  // The op moves the data device to device through CUDA IPC: the block only
  // carries the stream's flags (nothing is copied through it).
  bool device_ipc = false;
  char* ipc_input_copy = nullptr;  // scratch for an input that overlaps its output
};

// Steps 1 and 2, then 3 to 5 (each makes the stream's context current). Split so that
// a group's calls on one stream are all staged before the stream waits for
// any (their host operations may depend on each other: a send and a recv).
// On failure, the call is given up (see give_up) and must not be posted.
Status enqueue_stage_in(StagedCall& call);
Status enqueue_stage_out(StagedCall& call);
// The block goes back, or is abandoned if the stream may still touch it.
void give_up(StagedCall& call);

// The op's task around the host operation `inner`: waits for the block to be
// staged, runs `inner`, releases the stream, waits for it to finish.
Task stream_staged(StagingBlock* b, Task inner);

}  // namespace braid
