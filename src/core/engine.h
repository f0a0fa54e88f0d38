// The progress engine of one communicator: it owns the operations in flight,
// resumes each when what it waits for is ready, enforces deadlines, notices
// dead peers, and decides how to wait (spin briefly, then block on the shm
// doorbell or poll the sockets).
//
// Ordering: collectives run one at a time in call order (same order on every
// rank); sends to a peer run in post order, as do receives from a peer; the
// three kinds of lanes progress independently, so a pending receive never
// blocks a collective.
//
// Driving: one thread at a time is the "driver" and advances every lane. A
// blocking call drives on the calling thread (lowest latency); `i`-operations
// are driven by a progress thread when no caller is driving, and a caller
// that waits on one takes the driver's role over from the progress thread.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "src/core/config.h"
#include "src/core/deadline.h"
#include "src/core/doorbell_watcher.h"
#include "src/core/futex.h"
#include "src/core/status.h"
#include "src/core/task.h"
#include "src/core/trace.h"
#include "transports/connection.h"

namespace braid {

enum class OpKind {
  kSend,
  kRecv,
  kRecvAny,
  kAllReduce,
  kBroadcast,
  kReduce,
  kAllGather,
  kReduceScatter,
  kGather,
  kScatter,
  kAllToAll,
  kAllToAllv,
  kBarrier
};
const char* op_kind_name(OpKind kind);
// The tag BRAID_CHECK_CALLS's exchange of tags travels under (any OpKind
// otherwise).
constexpr uint8_t kCallCheckTag = 0xfe;
// The tags of setting up and tearing down device collectives through CUDA
// IPC (src/algo/ipc_collectives.h), which run as collectives of their own.
constexpr uint8_t kIpcConnectTag = 0xfd, kIpcDisconnectTag = 0xfc;
// braid_comm_register and braid_comm_deregister (src/algo/window_collectives.h).
constexpr uint8_t kWindowRegisterTag = 0xfb, kWindowDeregisterTag = 0xfa;
// "all_reduce #5 (count 1024, float32, sum)": what a tag says was called.
std::string describe_call(const CallTag& tag);
// A message from `peer` was sent by another call than this rank's.
Status call_mismatch(int rank, const CallTag& mine, int peer, const CallTag& theirs);

enum class LaneKind { kCollective, kSend, kRecv };

class Op {
 public:
  // User-provided, so make_shared does not zero the whole object before the
  // member initializers run (a measurable part of a small call).
  Op() {}

  const char* name = "";  // "all_reduce", "send", ... (static)
  uint64_t seq = 0;       // collective sequence number, or message number on its lane
  CallTag tag;            // sent with every message; what received ones must carry
  LaneKind lane = LaneKind::kCollective;
  int lane_peer = -1;
  bool async = false;
  Task task;
  std::unique_ptr<char[]> input_copy;  // what the algorithm reads as input: see Communicator::make_op
  std::vector<char> work;              // temporary buffers the algorithm owns
  std::vector<size_t> layout;          // all_to_allv counts and displacements
  Status failure;                      // set by an algorithm that found a protocol error
  // Called when the op completes, failed or not: a stream-ordered op lets
  // its stream go on (transports/cuda/stream_staging.h), so that no stream
  // waits forever, and gives up its staging block.
  void (*on_complete)(void* ctx) = nullptr;
  void* on_complete_ctx = nullptr;
  std::shared_ptr<void> on_complete_state;  // owns on_complete_ctx where the op does
  // Called when the op fails, before its coroutine frames are freed (the
  // context may live in them): an algorithm that lent its buffer to a peer
  // takes it back. Set and cleared by the algorithm.
  void (*before_failing)(void* ctx) = nullptr;
  void* before_failing_ctx = nullptr;

  // A receive from any source waits unbound (lane_peer == -1) until some
  // peer's connection in `any_source_conns` holds a message; the engine then
  // builds its task with `bind(peer)`, moves it to that peer's receive lane
  // and stores the peer in *source_out.
  std::vector<Connection*> any_source_conns;
  std::function<Task(int peer)> bind;
  int* source_out = nullptr;
  uint64_t recv_order = 0;  // post order among this engine's receives

  // What traces and dumps show.
  const char* algo = "";     // the algorithm that runs it ("ring", "peer_read", ...)
  size_t bytes = 0;          // the largest buffer it passes
  uint32_t steps = 0;        // waits so far
  uint64_t start_ticks = 0;  // when it started (trace_ticks)
  uint64_t wait_since_ticks = 0;
  uint32_t wait_checks = 0;  // failed readiness checks of the current wait
  bool traced = false;
  bool untraceable = false;  // the communicator's own (init probes): never in a trace

  // Engine state (driver thread only, except `done` and `status` after done).
  bool started = false;
  bool finished = false;
  // Per tcp connection this op sent on (index into the engine's list): the
  // frame count once its last frame was committed. A finished op completes
  // once the kernel has those, not everything queued on the connection.
  std::vector<std::pair<uint32_t, uint64_t>> tcp_marks;
  std::coroutine_handle<> leaf;
  const WaitPoint* wait = nullptr;
  Deadline deadline;
  double timeout_s = 0;  // what the deadline was set from (braid_comm_set_timeout when posted)
  Status status;
  std::atomic<uint32_t> done{0};
  // Handed to the engine (Engine::post): an op of a group stays unposted
  // until its thread's braid_group_end.
  std::atomic<bool> posted{false};
  std::atomic<uint32_t> sleepers{0};  // threads in futex_wait on `done`

  // Completion callback (braid_request_set_callback). It runs once, on the
  // thread that completes the op, or at once if the op is already done.
  // `has_callback` keeps the common case (no callback) free of the mutex.
  void set_callback(std::function<void(const Status&)> fn);
  void run_callback();
  // Whether this thread is inside a request's completion callback, where a
  // call into braid could wait on itself (the callback runs while its
  // thread drives the engine).
  static bool in_callback();
  bool has_callback() const { return has_callback_.load(std::memory_order_seq_cst); }
  // For a waiter that saw done: returns once a callback set on the op has
  // returned (callbacks are short; they may not call braid).
  void await_callback() const;

 private:
  std::mutex callback_mu_;
  std::function<void(const Status&)> callback_;
  std::atomic<bool> has_callback_{false};
  std::atomic<bool> callback_ran_{false};
};

// A new op. Its memory (with the shared_ptr's count) is recycled through a
// per-thread cache of one block: a call frees its op just before the next
// call of the same thread makes one.
std::shared_ptr<Op> new_op();

// The right to drive an engine. Only ever tried, never waited for (a
// thread that does not get it leaves the work to the holder), so it needs
// no futex and no waiter count: one exchange to take it, one to give it
// back. Giving it back is a full barrier, as pthread's unlock is on x86:
// release_driver's check for an abort right after, and abort()'s failed
// try_lock after it raised the flag, rely on one seeing the other.
class DriverRole {
 public:
  bool try_lock() { return !held_.load() && !held_.exchange(true, std::memory_order_acquire); }
  void unlock() { held_.exchange(false); }

 private:
  std::atomic<bool> held_{false};
};

// A spinning wait's pause between checks.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Engine final : private CommitObserver {
 public:
  // `peers[r]` holds the connections to rank r (this rank's to itself too).
  Engine(int rank, const Config& config, const std::vector<std::vector<Connection*>>& peers, Doorbell* bell);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Called when this rank fails, so peers learn it (shm flag, closed sockets).
  void set_failure_notifier(std::function<void(const Status&)> notify) {
    notify_failure_ = std::move(notify);
  }

  // Queues an op (thread-safe). On a broken communicator it fails at once.
  void post(const std::shared_ptr<Op>& op);
  // Waits for the op, driving the engine when no other thread does.
  Status wait(Op& op);
  // Waits for all `n` ops in one drive: waiting for them one at a time
  // would hand the rest to the progress thread between them (a wake-up
  // and two context switches per op of a send/recv group).
  void wait_all(Op* const* ops, size_t n);
  // Has the progress thread drive what is in flight (a group's ops on a
  // communicator whose caller drives another one).
  void wake_progress_thread();
  // A blocking collective, run on the calling thread when nothing else is in
  // flight: no queue, no lane, no lock beyond the driver's, which is what a
  // small call's latency is made of. If it must wait longer than a short
  // spin, fails, or leaves tcp bytes unwritten, it joins its lane and the
  // driver loop finishes it. Returns false, having done nothing, when the
  // engine is busy or broken: the caller then posts and waits.
  bool run_blocking(const std::shared_ptr<Op>& op, Status* result);
  // Cheaper still, for a call that can be done at once without an op:
  // where nothing is in flight, the engine is healthy and no other thread
  // drives, tries `attempt` (which does all or nothing, and says which) a
  // few times on the calling thread as the driver. False: nothing was done,
  // and the call goes the op's way, which reports what stood in the way.
  template <class Attempt>
  bool run_inline(Attempt attempt);
  bool is_done(const Op& op) const { return op.done.load(std::memory_order_acquire) != 0; }
  // Moves the engine along for a moment on the caller's thread (an i-call's
  // post, braid_test): drives if no other thread does, else gives the
  // thread that does as long to finish `op`. True once `op` is done.
  bool drive_a_moment(const Op& op);
  // Waits until every posted op completed (destroy).
  void drain();
  // After drain(), on a healthy engine: a message a peer sent that no call
  // here took (a collective whose ranks disagreed, e.g. on broadcast's
  // root, with nothing after it to notice; a send never received) gives
  // BRAID_ERR_MISMATCH naming it. Only what has arrived is seen.
  Status unclaimed_messages();
  // Fails every op in flight and every later one with `why` (abort, errors).
  void abort(const Status& why);
  Status error() const;
  double timeout_s() const { return timeout_s_.load(); }
  void set_timeout_s(double s) { timeout_s_.store(s); }
  // The number the next collective takes (a call done inline takes it only
  // once done).
  uint64_t collective_seq() const { return coll_seq_.load(std::memory_order_relaxed); }
  // Not a read-modify-write (a locked instruction on every call): calls on
  // one communicator are ordered by the caller (braid.h), and the setup ops
  // that also take numbers run inside such calls.
  uint64_t next_collective_seq() {
    const uint64_t s = coll_seq_.load(std::memory_order_relaxed);
    coll_seq_.store(s + 1, std::memory_order_relaxed);
    return s;
  }
  // The user's first collective is #0 whatever init ran before it: every
  // rank calls this at the same point, with no collective in flight.
  void restart_collective_seq() { coll_seq_.store(0); }
  // Records a timeline of every op from now on (before any op is posted).
  void set_trace(TraceRecorder* trace) { trace_ = trace; }
  // The connections collectives use, indexed by rank (this rank's is skipped):
  // watched while a collective waits, for failed peers and stray messages.
  void set_collective_conns(std::vector<Connection*> conns) { coll_conns_ = std::move(conns); }
  // More ranks than cores on this machine: a waiting rank yields its core at
  // once, since the peer it waits for may need it to run.
  void set_oversubscribed(bool over) {
    spins_per_yield_ = over ? 1 : kSpinsPerYield;
    long_wait_checks_ = over ? kLongWaitYields : kLongWaitSpins;
  }
  // Something an op waits on changed outside the engine (a CUDA stream
  // reached it): wakes the driver if it sleeps.
  void wake_if_sleeping() {
    if (driver_sleeping_.load()) wake_driver();
  }
  // Prints the operations in flight (braid_comm_dump): at once when no other
  // thread drives, else the driver prints within one wake-up (<= 20 ms).
  void request_dump();

 private:
  struct Lane {
    LaneKind kind;
    int peer;
    std::deque<std::shared_ptr<Op>> ops;
  };

  // Advances every lane until stop() holds; when idle, spins for `spin_us`
  // (yielding between checks), then blocks.
  template <class Pred>
  void drive(Pred stop, double spin_us);
  // What post() gives an op: its deadline and whether it is traced
  // (run_blocking sets the deadline only if the op joins its lane).
  void admit(Op& op);
  // The op's coroutine becomes its leaf, reporting to it when it finishes.
  void start(Op& op);
  // One step of the op on this thread, until it waits, fails or finishes.
  void resume(Op& op);
  // Wakes the progress thread after kProgressDelayUs unless a caller
  // starts driving first (cancel_later_wake).
  void wake_progress_thread_later();
  void cancel_later_wake();
  // The progress thread's sleep: until woken, the later wake fires, or max_ms.
  void progress_sleep(int max_ms);
  // Advances every lane without blocking until `op` is done or a few
  // microseconds pass (the driver's lock held).
  void drive_briefly(const Op& op);
  bool advance();
  bool advance_lane(Lane& lane);
  // Writes what the op committed to tcp connections; true once the kernel
  // has all of it.
  bool own_writes_flushed(const Op& op);
  // Sleeps until op is done or 1 ms has passed.
  void sleep_on(Op& op);
  // A tcp connection committed a frame: it is the running op's (if any).
  void committed(uint32_t connection_index, uint64_t frames_committed) override;
  // Binds waiting any-source receives to peers with a message (see Op).
  bool bind_any_source();
  Lane* find_lane(LaneKind kind, int peer);
  // Sleeps until something may have arrived, at most max_ms. long_wait: the
  // driver has been idle a while, so a wait on shm and tcp at once sleeps
  // through the doorbell watcher instead of polling shm every 100 us.
  void block(int max_ms, bool long_wait);
  // Traced ops about to wait in block(): their waits count as long from now.
  void note_long_waits();
  void check_peers(bool thorough);
  // Why an unbound receive from any source can no longer be served (ok: it can).
  Status any_source_failure(const Op& op, bool thorough);
  // "rank 1: all_reduce #4": how failures name the op they end.
  std::string named(const Op& op) const;
  // Fails everything with `why`, about `op`, unless advance() makes progress
  // first (what the peer sent before it went) or serves an abort.
  void fail_unless_progress(const Op& op, const Status& why);
  // Whether a thorough check of peers and deadlines is due (every kBlockMs);
  // if so, the next one counts from `now` (driver only).
  bool thorough_check_due(Clock::time_point now);
  Status watch_collective(const Op& op);
  // One line per operation in flight: its step and what it waits on (driver only).
  void dump(const char* why);
  // Serves dump requests and SIGUSR1 (driver only).
  void serve_dumps();
  void fail_all(const Status& why);
  // Fails everything with the abort's status if one is pending (driver only).
  void serve_abort();
  // Gives up the driver's role, serving an abort that arrived while this
  // thread held it (abort() found the lock taken and left the work to it).
  void release_driver();
  // Takes the driver's role where nothing is in flight and the engine is
  // healthy (run_blocking and run_inline start so); false: not taken.
  bool take_role_if_idle();
  void complete(const std::shared_ptr<Op>& op, const Status& st);
  // What complete() does besides counting the op out of active_: frees its
  // frames, marks it done (wakes waiters, runs its callbacks), traces it.
  void finish(const std::shared_ptr<Op>& op);
  void progress_loop();
  void wake_driver();
  Lane& lane_for(const Op& op);

  const int rank_;
  const double spin_us_;
  static constexpr unsigned kSpinsPerYield = 64;
  unsigned spins_per_yield_ = kSpinsPerYield;  // failed checks between clock reads and yields
  // A traced wait is recorded once it fails this many checks: spinning, 64
  // take a few microseconds; yielding the core, a few checks do.
  static constexpr uint32_t kLongWaitSpins = 64, kLongWaitYields = 4;
  uint32_t long_wait_checks_ = kLongWaitSpins;
  std::atomic<double> timeout_s_;
  std::vector<Connection*> tcp_conns_;
  std::vector<Connection*> coll_conns_;
  std::vector<std::pair<int, Connection*>> peer_conns_;  // (peer, connection), every channel
  Doorbell* bell_;                                       // our shm doorbell, or null
  int event_fd_ = -1;
  std::unique_ptr<DoorbellWatcher> watcher_;  // made at the first long wait on shm and tcp at once
  std::function<void(const Status&)> notify_failure_;

  std::mutex post_mu_;  // guards posted_ and error_
  std::vector<std::shared_ptr<Op>> posted_;
  std::atomic<bool> have_posted_{false};  // posted_ is not empty: the driver's loop skips the lock otherwise
  Status error_;
  std::atomic<bool> broken_{false};
  std::atomic<bool> abort_requested_{false};
  std::atomic<uint64_t> aborts_served_{0};  // bumped once serve_abort failed the ops
  // fail_unless_progress: the op whose peer failure waits for a quiet moment, and since when.
  const Op* postponed_op_ = nullptr;
  uint64_t postponed_seq_ = 0;
  std::chrono::steady_clock::time_point postponed_since_{};
  static constexpr int kFailureGraceMs = 200;
  static constexpr double kAbortServeSeconds = 6;
  Status abort_status_;  // under post_mu_

  DriverRole driver_role_;   // held by the driving thread
  std::vector<Lane> lanes_;  // driver only
  // When peers and deadlines were last checked thoroughly, and the progress
  // rounds since the clock was last read for it (driver only).
  Clock::time_point last_thorough_check_{};
  unsigned busy_rounds_ = 0;
  std::atomic<int> active_{0};
  std::atomic<bool> driver_sleeping_{false};
  // The progress thread drives only while no caller waits: a caller in
  // wait() takes the driver's role from it (see Engine::wait).
  std::atomic<bool> progress_driving_{false};
  std::atomic<int> callers_taking_over_{0};
  // The progress thread found a caller driving and sleeps until that caller
  // gives the role up (release_driver wakes it).
  std::atomic<bool> progress_awaits_driver_{false};
  int progress_fd_ = -1;  // eventfd: wakes the progress thread
  int timer_fd_ = -1;     // timerfd: a later wake of the progress thread
  std::atomic<bool> timer_armed_{false};

  std::atomic<uint64_t> coll_seq_{0};
  uint64_t recv_posted_ = 0;    // under post_mu_
  size_t any_source_next_ = 0;  // round-robin start, driver only
  std::atomic<bool> stop_{false};
  TraceRecorder* trace_ = nullptr;
  std::atomic<uint32_t> dumps_requested_{0};
  // Written by the driver only; atomic because the idle progress thread
  // reads them without the role, to see a dump nobody served.
  std::atomic<uint32_t> dumps_served_{0};
  std::atomic<uint32_t> signals_served_{0};
  std::thread progress_thread_;
};

template <class Attempt>
bool Engine::run_inline(Attempt attempt) {
  if (!take_role_if_idle()) return false;
  bool done = false;
  const unsigned checks = std::min(spins_per_yield_, 16u);
  for (unsigned k = 0; !(done = attempt()) && k + 1 < checks; ++k) cpu_relax();
  release_driver();
  if (active_.load() > 0) wake_progress_thread();
  return done;
}

}  // namespace braid
