// The "braid" backend of torch.distributed: a c10d::Backend over braid's C
// API. Every operation starts braid's non-blocking form and returns a
// BraidWork; completion reaches torch two ways:
//  - Work::wait() drives braid on the calling thread (lowest latency), and
//  - a completion thread, fed by braid's request callbacks, completes the
//    Work and its Future when nobody waits (DDP's comm hooks only use the
//    future), so future callbacks never run on braid's progress thread.
#pragma once

#include <braid/braid.h>
#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "torch_compat.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace braid_torch {

class CompletionQueue;

// A work on CUDA tensors is stream-ordered (NCCL's semantics): braid
// enqueues it on the device's current stream, and the work counts as done
// once enqueued; wait() makes the caller's current stream wait for it, and
// its Future is a CUDA future whose callbacks see the results in stream
// order. Errors found later break the communicator: the next call, wait()
// and getError() report them.
class BraidWork : public c10d::Work {
 public:
  BraidWork(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
            c10::Device device, braid_comm_t comm);
  ~BraidWork() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  int sourceRank() const override { return source_rank_; }
  void abort() override;

  // Set up by the backend before the requests start.
  std::vector<at::Tensor> keep_alive;  // inputs and staging buffers in use by braid
  std::function<void()> on_success;    // copies staging buffers into the outputs
  int source_rank_ = -1;
  // The CUDA stream the work is enqueued on (the current stream of its
  // device), or null for CPU tensors.
  braid_stream_t stream = nullptr;
  // Its calls wait in the braid group of a coalescing until endCoalescing
  // starts them: wait() returns at once meanwhile, as NCCL's does there
  // (the results are there once the coalescing ended and its work was
  // waited on).
  std::atomic<bool> deferred{false};

  // Takes ownership of the requests and arms their callbacks.
  void track(std::vector<braid_request_t> requests, const std::shared_ptr<CompletionQueue>& queue);
  // Completes the work once: copy-out, then the Future. Idempotent.
  void finalize();
  // A stream-ordered work, once braid enqueued it: the copy-out enqueued
  // behind it, an event recorded, the work and its Future complete.
  void complete_enqueued();
  void record_error(braid_result_t code, const std::string& message);
  const std::string& what() const { return what_; }
  c10::Device device() const { return device_; }

 private:
  // Runs on_success, if set, without grad.
  void copy_out();
  // Sets completed_ (once the Future is complete) and wakes the waiters.
  void mark_completed();
  friend class CompletionQueue;
  const std::string what_;  // "all_reduce (group 'default_pg', rank 0 of 2)"
  std::vector<at::Tensor> outputs_;
  const c10::Device device_;
  const braid_comm_t comm_;
  std::optional<c10::Event> event_;  // behind a stream-ordered work on its stream
  bool finishing_ = false;           // under mutex_: completing (Future first), once
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::mutex requests_mu_;
  std::vector<braid_request_t> requests_;  // still owned by this work
  std::atomic<int> remaining_{0};          // callbacks still to come
  // A thread is in wait() and will finalize: the completion thread need not
  // wake (on a busy host that wakeup costs the peer ranks CPU time).
  std::atomic<bool> waiter_{false};
  std::mutex error_mu_;
  braid_result_t error_code_ = BRAID_SUCCESS;
  std::string error_message_;
};

// What endCoalescing returns: the works of the ops between startCoalescing
// and endCoalescing (batch_isend_irecv's, say), done when all are; its
// Future holds all their outputs.
class CoalescedWork : public c10d::Work {
 public:
  CoalescedWork(int rank, std::vector<c10::intrusive_ptr<BraidWork>> parts, c10::Device device);
  bool isCompleted() override;
  bool isSuccess() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

 private:
  std::vector<c10::intrusive_ptr<BraidWork>> parts_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// Runs Work completion (and so Future callbacks) off braid's threads, on
// one thread, and more while callbacks hold them (up to kMaxWorkers).
class CompletionQueue {
 public:
  CompletionQueue();
  ~CompletionQueue();
  void push(c10::intrusive_ptr<BraidWork> work);
  static void on_request_done(void* user, braid_result_t result, const char* message);

 private:
  static constexpr size_t kMaxWorkers = 64;
  void loop();
  void add_worker_if_needed();  // under mu_
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<BraidWork>> queue_;
  bool stop_ = false;
  int idle_ = 0;  // threads waiting for work
  std::vector<std::thread> threads_;
};

class BraidBackend : public c10d::Backend {
 public:
  // Collective over the group: rank 0 makes a braid unique id and publishes
  // it through the (group-prefixed) store; every rank then joins.
  BraidBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
               std::chrono::milliseconds timeout, std::string group_name);
  ~BraidBackend() override;

  const std::string getBackendName() const override { return "braid"; }
  void setTimeout(std::chrono::milliseconds timeout) BRAID_OVERRIDE_SINCE_2_9;
#if BRAID_TORCH_HAS_ERROR_TYPE
  c10d::ErrorType getError() override;
#endif
  void abort() BRAID_OVERRIDE_SINCE_2_7;
  void shutdown() BRAID_OVERRIDE_SINCE_2_7;
  // At the interpreter's exit: where a work is still pending, aborts the
  // group and completes every pending work (with the abort's error) on this
  // thread or the completion threads before returning. True if it did.
  bool end_if_pending();

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  // Counts collectives (not point-to-point, whose counts differ by rank);
  // TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper compares it across ranks.
  void setSequenceNumberForGroup() override {
    seq_.store(0);
  }
  // torch's coalescing (batch_isend_irecv, _coalescing_manager with a
  // device): the ops in between form one braid group, started together at
  // endCoalescing, as NCCL's group does. Without it a CUDA ring of sends
  // and receives could wait forever (each rank's receive behind its send on
  // the stream).
  bool supportsCoalescing() const BRAID_OVERRIDE_SINCE_2_7 {
    return true;
  }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  // Every operation holds one: an exception out of an operation that joined
  // a coalescing ends it (its calls start, its works complete), since torch
  // then never calls endCoalescing, and every later call of the thread
  // would wait in a group that never starts.
  class CoalescingGuard {
   public:
    explicit CoalescingGuard(BraidBackend* b) : backend_(b), uncaught_(std::uncaught_exceptions()) {}
    ~CoalescingGuard() {
      if (std::uncaught_exceptions() > uncaught_) backend_->end_coalescing(true);
    }

   private:
    BraidBackend* backend_;
    int uncaught_;
  };
  uint64_t getSequenceNumberForGroup() override {
    return seq_.load();
  }

  braid_comm_t comm() const {
    return comm_;
  }

 private:
  // Starts the braid calls `start` makes (inside a braid group when
  // `grouped`), wires their requests to the work and returns it. With
  // `blocking`, start uses braid's blocking calls and the work is complete
  // on return. A call braid rejects throws at once, naming the operation.
  using StartFn = std::function<void(std::vector<braid_request_t>& reqs, bool blocking)>;
  c10::intrusive_ptr<c10d::Work> launch(const c10::intrusive_ptr<BraidWork>& work, const StartFn& start,
                                        bool grouped = false, bool blocking = false);
  c10::intrusive_ptr<c10d::Work> sparse_allreduce(at::Tensor t, const c10d::AllreduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> allgather_uneven(std::vector<at::Tensor>& outputs, const at::Tensor& in,
                                                  const c10d::AllgatherOptions& opts);
  // Starts the calls of the coalescing this thread opened and arms their
  // works; returns them. `abandon` (after an exception): if there is one.
  std::vector<c10::intrusive_ptr<BraidWork>> end_coalescing(bool abandon);
  // `device`: where the op's tensors are (CUDA: the work is stream-ordered).
  c10::intrusive_ptr<BraidWork> make_work(c10d::OpType type, const char* op, std::vector<at::Tensor> outputs,
                                          c10::Device device = c10::Device(c10::kCPU));
  std::string describe() const;
  // Destroys (or, after a failed monitored_barrier, aborts) the
  // communicator once; what went wrong (a mismatch destroy found), or "".
  std::string close_comm();
  [[noreturn]] void fail_call(const char* op, braid_result_t code) const;  // with braid's last error
  [[noreturn]] void fail_call(const char* op, braid_result_t code, const std::string& why) const;
  void check(braid_result_t code, const char* op) const {
    if (code != BRAID_SUCCESS) fail_call(op, code);
  }

  // Atomic: abort() may come from another thread (a watchdog) while ops
  // start; an op that read it just before gets braid's "not a live
  // communicator" error.
  std::atomic<braid_comm_t> comm_{nullptr};
  std::atomic<bool> aborted_{false};  // getError() reports it once comm_ is gone
  // Ops may come from several threads (DDP hooks run on autograd threads):
  // braid calls start under this lock so each rank issues them in one order.
  std::mutex launch_mu_;
  // A sparse all_reduce's second phase is sized by its first's result: no
  // other collective may start between the two (ranks would order them
  // differently), but sends and receives may, and must (a peer may wait
  // for one before its own all_reduce). Both under launch_mu_.
  bool sparse_between_phases_ = false;
  std::condition_variable sparse_phases_cv_;
  // Takes launch_mu_ for a collective (or a coalescing): once no sparse
  // all_reduce is between its phases.
  std::unique_lock<std::mutex> lock_for_collective();
  // Registers a host work left to complete on the completion threads: for
  // barrier() (collectives) and for end_if_pending (all).
  void register_pending(const c10::intrusive_ptr<BraidWork>& work);
  std::string group_name_;
  std::chrono::milliseconds timeout_;
  std::atomic<uint64_t> seq_{0};
  // Between startCoalescing and endCoalescing (on the thread that started:
  // braid's groups are per thread), the works whose calls joined the group
  // and their requests, armed once the group has started.
  struct Deferred {
    c10::intrusive_ptr<BraidWork> work;
    std::vector<braid_request_t> requests;
  };
  std::atomic<std::thread::id> coalescing_thread_{};  // none: a default id
  std::vector<Deferred> coalesced_;
  // Shared with the callbacks still to come (see CallbackSlot).
  std::shared_ptr<CompletionQueue> completions_ = std::make_shared<CompletionQueue>();
  // Host collectives that may still be completing on the queue: a barrier
  // completes them (copy-out, Future) before it does, as gloo's does.
  std::mutex inflight_mu_;
  std::vector<c10::weak_intrusive_ptr<BraidWork>> inflight_;
  // Every work left to complete on the completion threads (p2p too), for
  // end_if_pending; under inflight_mu_.
  std::vector<c10::weak_intrusive_ptr<BraidWork>> tracked_;
  // A monitored_barrier failed: its receives from the missing ranks are
  // still posted, so the group ends by abort, not by destroy (which would
  // wait for them until the timeout).
  std::atomic<bool> barrier_failed_{false};
};

}  // namespace braid_torch
