#include "src/core/engine.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <mutex>
#include <utility>

#include "src/core/logging.h"

namespace braid {

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::kSend:
      return "send";
    case OpKind::kRecv:
      return "recv";
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kReduce:
      return "reduce";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kGather:
      return "gather";
    case OpKind::kScatter:
      return "scatter";
    case OpKind::kAllToAll:
      return "all_to_all";
    case OpKind::kAllToAllv:
      return "all_to_allv";
    case OpKind::kRecvAny:
      return "recv (any source)";
    case OpKind::kBarrier:
      return "barrier";
  }
  return "?";
}

std::string describe_call(const CallTag& t) {
  const auto kind = static_cast<OpKind>(t.kind);
  if (kind == OpKind::kSend) {
    std::string s = "send/recv";
    if (t.user_tag != 0) s += " with tag " + std::to_string(t.user_tag);
    s += " of " + std::to_string(t.count) + " bytes";
    return t.path == CallTag::kReadPath ? s + " (a buffer offered to be read in place)" : s;
  }
  if (t.kind == kCallCheckTag) return "the call check of #" + std::to_string(t.seq) + " (BRAID_CHECK_CALLS)";
  if (t.kind == kIpcConnectTag) return "the CUDA IPC setup #" + std::to_string(t.seq);
  if (t.kind == kIpcDisconnectTag) return "the CUDA IPC teardown #" + std::to_string(t.seq);
  if (t.kind == kWindowRegisterTag) return "comm_register #" + std::to_string(t.seq);
  if (t.kind == kWindowDeregisterTag) return "comm_deregister #" + std::to_string(t.seq);
  std::string s = std::string(op_kind_name(kind)) + " #" + std::to_string(t.seq);
  std::string args;
  auto add = [&](const std::string& x) { args += (args.empty() ? "" : ", ") + x; };
  if (kind == OpKind::kAllToAllv && t.count != 0) add("a block of " + std::to_string(t.count) + " bytes");
  if (kind != OpKind::kBarrier && kind != OpKind::kAllToAllv) add("count " + std::to_string(t.count));
  if (t.dtype != 0xff) add(braid_dtype_name(static_cast<braid_dtype_t>(t.dtype)));
  if (t.op != 0xff) add(braid_redop_name(static_cast<braid_redop_t>(t.op)));
  if (t.root >= 0) add("root " + std::to_string(t.root));
  if (t.path == CallTag::kDevicePath) add("device memory through CUDA IPC");
  return args.empty() ? s : s + " (" + args + ")";
}

Status call_mismatch(int rank, const CallTag& mine, int peer, const CallTag& theirs) {
  return Status(BRAID_ERR_MISMATCH, "call mismatch: rank " + std::to_string(rank) + " called " +
                                        describe_call(mine) + ", rank " + std::to_string(peer) +
                                        " sent it a message of " + describe_call(theirs));
}

namespace {

// What every small operation takes from its thread: the op's memory block,
// coroutine frames and the op being resumed. One pointer to it (and the
// current op) live in initial-exec TLS: a plain %fs-relative load, where the
// general model called into the dynamic linker for each access (a few dozen
// per 8-byte all_reduce, 10% of its time). See BRAID_FAST_TLS.
constexpr size_t kFrameGrain = 64;
constexpr size_t kFrameClasses = 32;  // frames up to 2 KiB are recycled
constexpr int kFramesKept = 64;       // per class and thread
constexpr int kOpBlocksKept = 8;      // a group's ops, or an i-call's and the next call's

struct ThreadCache {
  struct Node {
    Node* next;
  };
  Node* frames[kFrameClasses] = {};
  int frame_count[kFrameClasses] = {};
  void* op_blocks[kOpBlocksKept] = {};  // allocate_shared's blocks, one op each
  int op_block_count = 0;
  size_t op_block_bytes = 0;
  ~ThreadCache() {
    for (size_t cls = 0; cls < kFrameClasses; ++cls) {
      while (Node* n = frames[cls]) {
        frames[cls] = n->next;
        ::operator delete(n);
      }
      frame_count[cls] = 0;
    }
    while (op_block_count > 0) ::operator delete(op_blocks[--op_block_count]);
  }
};

BRAID_FAST_TLS thread_local ThreadCache* t_cache = nullptr;
BRAID_FAST_TLS thread_local Op* t_current_op = nullptr;
BRAID_FAST_TLS thread_local int t_in_callback = 0;  // Op::in_callback
// Set once the thread's cache is destroyed (thread exit; on the main thread,
// before static destructors and atexit handlers, which may still call
// braid): a destroyed thread_local is never made again, so from then on
// frames and ops go straight to the general allocator.
BRAID_FAST_TLS thread_local bool t_cache_gone = false;

// The thread's cache, made on first use and freed when the thread exits;
// null after that.
ThreadCache* make_thread_cache() {
  if (t_cache_gone) return nullptr;
  struct Owner {
    ThreadCache cache;
    ~Owner() {
      t_cache = nullptr;
      t_cache_gone = true;
    }
  };
  thread_local Owner owner;
  t_cache = &owner.cache;
  return t_cache;
}

inline ThreadCache* thread_cache() {
  ThreadCache* c = t_cache;
  return c != nullptr ? c : make_thread_cache();
}

// allocate_shared's allocator for ops: a few cached blocks per thread.
template <class T>
struct OpAllocator {
  using value_type = T;
  OpAllocator() = default;
  template <class U>
  OpAllocator(const OpAllocator<U>&) {}
  T* allocate(size_t n) {
    ThreadCache* c = thread_cache();
    if (c != nullptr && c->op_block_count > 0 && c->op_block_bytes == n * sizeof(T))
      return static_cast<T*>(c->op_blocks[--c->op_block_count]);
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) {
    ThreadCache* c = thread_cache();
    if (c != nullptr && c->op_block_count < kOpBlocksKept &&
        (c->op_block_count == 0 || c->op_block_bytes == n * sizeof(T))) {
      c->op_blocks[c->op_block_count++] = p;
      c->op_block_bytes = n * sizeof(T);
      return;
    }
    ::operator delete(p);
  }
  template <class U>
  bool operator==(const OpAllocator<U>&) const {
    return true;
  }
};

}  // namespace

std::shared_ptr<Op> new_op() {
  return std::allocate_shared<Op>(OpAllocator<Op>());
}

Op*& current_op() {
  return t_current_op;
}

void op_suspend(Op* op, std::coroutine_handle<> leaf, const WaitPoint* wait) {
  op->leaf = leaf;
  op->wait = wait;
  ++op->steps;
  op->wait_since_ticks = 0;  // traced ops: set once the wait proves long (see advance_lane)
  op->wait_checks = 0;
}

bool FailOp::never(void*) {
  return false;
}

void FailOp::await_suspend(std::coroutine_handle<> h) {
  current_op()->failure = why;
  op_suspend(current_op(), h, &wp);
}

namespace {

// SIGUSR1 asks every communicator of the process for a dump of what it has
// in flight; drivers notice within one wake-up.
std::atomic<uint32_t> g_dump_signals{0};
static_assert(std::atomic<uint32_t>::is_always_lock_free);

void on_dump_signal(int) {
  g_dump_signals.fetch_add(1, std::memory_order_relaxed);
}

// Installs the handler once, and only where the application left SIGUSR1 alone.
void install_dump_signal(int rank) {
  static std::once_flag once;
  std::call_once(once, [rank] {
    struct sigaction old {};
    if (sigaction(SIGUSR1, nullptr, &old) != 0 || old.sa_handler != SIG_DFL) {
      BRAID_INFO("DUMP", rank, "SIGUSR1 already has a handler: braid leaves it; use braid_comm_dump");
      return;
    }
    struct sigaction sa {};
    sa.sa_handler = on_dump_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, nullptr);
  });
}

std::string elapsed_text(double us) {
  char buf[32];
  if (us >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.2f s", us * 1e-6);
  } else if (us >= 1e3) {
    std::snprintf(buf, sizeof buf, "%.2f ms", us * 1e-3);
  } else {
    std::snprintf(buf, sizeof buf, "%.0f us", us);
  }
  return buf;
}

}  // namespace

void op_finished(Op* op) {
  op->finished = true;
}

void Op::set_callback(std::function<void(const Status&)> fn) {
  {
    std::lock_guard<std::mutex> lock(callback_mu_);
    callback_ = std::move(fn);
  }
  // Dekker-style pairing with the completer (done, then has_callback): at
  // least one side sees the other's store, and run_callback takes the
  // function at most once.
  has_callback_.store(true, std::memory_order_seq_cst);
  if (done.load(std::memory_order_seq_cst) != 0) run_callback();
}

void Op::run_callback() {
  std::function<void(const Status&)> fn;
  {
    std::lock_guard<std::mutex> lock(callback_mu_);
    fn.swap(callback_);
  }
  // Only the caller that took the function: the other may race here first.
  if (fn) {
    ++t_in_callback;
    fn(status);
    --t_in_callback;
    callback_ran_.store(true, std::memory_order_release);
  }
}

bool Op::in_callback() {
  return t_in_callback > 0;
}

void Op::await_callback() const {
  // done is published (and its waiters woken) before the callback runs: a
  // waiter must not return, and free what the callback uses, before it ends.
  while (has_callback_.load(std::memory_order_seq_cst) && !callback_ran_.load(std::memory_order_acquire))
    std::this_thread::yield();
}

void* frame_alloc(size_t bytes) {
  const size_t cls = (bytes + kFrameGrain - 1) / kFrameGrain;
  if (cls >= kFrameClasses) return ::operator new(bytes);
  ThreadCache* c = thread_cache();
  if (ThreadCache::Node* n = c != nullptr ? c->frames[cls] : nullptr) {
    c->frames[cls] = n->next;
    --c->frame_count[cls];
    return n;
  }
  return ::operator new(cls* kFrameGrain);
}

void frame_free(void* frame, size_t bytes) {
  const size_t cls = (bytes + kFrameGrain - 1) / kFrameGrain;
  ThreadCache* c = thread_cache();
  if (cls >= kFrameClasses || c == nullptr || c->frame_count[cls] >= kFramesKept) {
    ::operator delete(frame);
    return;
  }
  auto* n = static_cast<ThreadCache::Node*>(frame);
  n->next = c->frames[cls];
  c->frames[cls] = n;
  ++c->frame_count[cls];
}

namespace {

// How long a blocked driver sleeps before it re-checks deadlines and peers.
constexpr int kBlockMs = 20;
// A driver that keeps making progress reads the clock every this many
// rounds to see whether peers and deadlines are due a check (every
// kBlockMs): a round takes from a few hundred ns (small messages) up.
constexpr unsigned kBusyRoundsPerClockRead = 256;
// How long an i-call drives on the caller's thread before leaving the op
// to the progress thread: a small collective with its peers ready
// completes within it; a large one gives the caller back its thread at
// once, as an i-call must.
constexpr int kEagerDriveUs = 5;
// How long an i-operation left over by its call waits for a caller to drive
// it before the progress thread takes it up (DDP's gradient buckets: the
// backward pass goes on computing, and the bucket's all_reduce starts this
// much later, against milliseconds of compute).
constexpr long kProgressDelayUs = 50;
// When a wait involves both a socket and shm, poll cannot see the shm
// doorbell, so it sleeps briefly: a ring across hosts waits so at every
// hop that receives over shm and sends over tcp.
constexpr long kMixedBlockUs = 100;
// After this long idle, such a wait sleeps through the doorbell watcher
// instead: a wake-up every 100 us cost 16% of a core over a 2 s wait.
constexpr auto kMixedPollingFor = std::chrono::milliseconds(1);

}  // namespace

Engine::Engine(int rank, const Config& config, const std::vector<std::vector<Connection*>>& peers,
               Doorbell* bell)
    : rank_(rank), spin_us_(config.spin_us), timeout_s_(config.timeout_s), bell_(bell) {
  for (size_t r = 0; r < peers.size(); ++r)
    for (Connection* c : peers[r]) {
      peer_conns_.emplace_back(static_cast<int>(r), c);
      if (c->pollable()) {
        c->report_commits(this, static_cast<uint32_t>(tcp_conns_.size()));
        tcp_conns_.push_back(c);
      }
    }
  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  progress_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  timer_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  lanes_.push_back({LaneKind::kCollective, -1, {}});
  if (config.dump_on_signal) install_dump_signal(rank);
  signals_served_ = g_dump_signals.load();
  progress_thread_ = std::thread([this] { progress_loop(); });
}

Engine::~Engine() {
  stop_.store(true);
  wake_progress_thread();
  wake_driver();
  if (progress_thread_.joinable()) progress_thread_.join();
  watcher_.reset();  // writes to event_fd_
  if (event_fd_ >= 0) close(event_fd_);
  if (progress_fd_ >= 0) close(progress_fd_);
  if (timer_fd_ >= 0) close(timer_fd_);
}

Status Engine::error() const {
  std::lock_guard<std::mutex> lock(const_cast<std::mutex&>(post_mu_));
  return error_;
}

void Engine::admit(Op& op) {
  op.timeout_s = timeout_s_.load();
  op.deadline = Deadline::after_seconds(op.timeout_s);
  op.traced = trace_ != nullptr && !op.untraceable;
}

void Engine::start(Op& op) {
  op.started = true;
  op.leaf = op.task.handle();
  op.task.handle().promise().top_level_op = &op;
}

void Engine::resume(Op& op) {
  current_op() = &op;
  op.wait = nullptr;
  op.leaf.resume();
  current_op() = nullptr;
}

void Engine::committed(uint32_t connection_index, uint64_t frames_committed) {
  // Only ops commit frames on the driver, one op at a time; a frame
  // committed outside any op (none today) belongs to no op's wait.
  Op* op = current_op();
  if (op == nullptr) return;
  for (auto& mark : op->tcp_marks)
    if (mark.first == connection_index) {
      mark.second = frames_committed;
      return;
    }
  op->tcp_marks.emplace_back(connection_index, frames_committed);
}

void Engine::wake_progress_thread() {
  uint64_t one = 1;
  ssize_t ignored = write(progress_fd_, &one, sizeof(one));
  (void)ignored;
}

void Engine::wake_progress_thread_later() {
  // Armed once: re-arming on every post moved the wake back each time, and
  // a thread posting faster than the delay kept the progress thread asleep.
  if (timer_armed_.exchange(true)) return;
  itimerspec in{};
  in.it_value.tv_nsec = kProgressDelayUs * 1000L;
  if (timer_fd_ < 0 || timerfd_settime(timer_fd_, 0, &in, nullptr) != 0) wake_progress_thread();
}

void Engine::cancel_later_wake() {
  if (!timer_armed_.exchange(false)) return;
  itimerspec off{};
  (void)timerfd_settime(timer_fd_, 0, &off, nullptr);
}

void Engine::progress_sleep(int max_ms) {
  pollfd fds[2] = {{progress_fd_, POLLIN, 0}, {timer_fd_, POLLIN, 0}};
  const nfds_t n = timer_fd_ >= 0 ? 2 : 1;
  if (poll(fds, n, max_ms) > 0) {
    uint64_t drained;
    for (nfds_t i = 0; i < n; ++i) {
      if (fds[i].revents == 0) continue;
      if (i == 1) timer_armed_.store(false);  // fired: the next later wake arms it again
      ssize_t ignored = read(fds[i].fd, &drained, sizeof(drained));
      (void)ignored;
    }
  }
}

void Engine::post(const std::shared_ptr<Op>& op) {
  admit(*op);
  op->posted.store(true, std::memory_order_release);
  {
    std::unique_lock<std::mutex> lock(post_mu_);
    if (!error_.is_ok()) {
      // Named as a failure in flight is (the progress thread may have found
      // the cause while no op waited: a peer's abort over tcp).
      const std::string where = named(*op);
      op->status = error_.code() == BRAID_ERR_ABORTED
                       ? error_.with_context(where)
                       : Status(error_.code(),
                                where + ": communicator is broken by an earlier error: " + error_.message());
      lock.unlock();  // finishing runs its callback and release hook
      // Never counted in active_: finished as complete() finishes an op
      // (its frame, and what that holds, such as a registered window's pin,
      // go now, not when the request is freed).
      finish(op);
      return;
    }
    if (op->lane == LaneKind::kRecv) op->recv_order = recv_posted_++;
    posted_.push_back(op);
    have_posted_.store(true, std::memory_order_release);
    active_.fetch_add(1);
  }
  if (op->async) {
    // Drive briefly on the caller's thread first: a small operation whose
    // peers are ready finishes here, and the progress thread sleeps on.
    // Waking it costs two context switches per call, which on a 2-core VM
    // made an iall_reduce + wait of 8 B take 14 us against 2 us blocking.
    drive_a_moment(*op);
    // Something is left: the progress thread takes it up unless a caller
    // waits for it first (most wait soon after posting, and waking the
    // progress thread at once cost them two context switches: 25 us of a
    // 1 MiB iall_reduce + wait on 2 ranks).
    if (active_.load() > 0) wake_progress_thread_later();
  }
  if (driver_sleeping_.load()) wake_driver();
}

bool Engine::drive_a_moment(const Op& op) {
  // The progress thread may hold the driver's lock (it woke on its own
  // timer between the post and here): it finishes a ready op within the
  // same moment, so waiting for it beats leaving the op unfinished.
  const Clock::time_point until = Clock::now() + std::chrono::microseconds(kEagerDriveUs);
  while (!is_done(op)) {
    if (driver_role_.try_lock()) {
      drive_briefly(op);
      release_driver();
      break;
    }
    if (Clock::now() >= until) break;
    cpu_relax();
  }
  return is_done(op);
}

void Engine::drive_briefly(const Op& op) {
  const Clock::time_point until = Clock::now() + std::chrono::microseconds(kEagerDriveUs);
  while (!is_done(op)) {
    if (!advance()) cpu_relax();
    if (Clock::now() >= until) return;
  }
}

void Engine::wake_driver() {
  if (bell_ != nullptr) bell_->ring(true);
  if (event_fd_ >= 0) {
    uint64_t one = 1;
    ssize_t ignored = write(event_fd_, &one, sizeof(one));
    (void)ignored;
  }
}

Engine::Lane& Engine::lane_for(const Op& op) {
  if (op.lane == LaneKind::kCollective) return lanes_[0];
  if (Lane* l = find_lane(op.lane, op.lane_peer)) return *l;
  lanes_.push_back({op.lane, op.lane_peer, {}});
  return lanes_.back();
}

Engine::Lane* Engine::find_lane(LaneKind kind, int peer) {
  for (auto& l : lanes_)
    if (l.kind == kind && l.peer == peer) return &l;
  return nullptr;
}

bool Engine::bind_any_source() {
  bool progressed = false;
  for (;;) {
    Lane* any = find_lane(LaneKind::kRecv, -1);
    if (any == nullptr || any->ops.empty()) return progressed;
    std::shared_ptr<Op> op = any->ops.front();
    const size_t n = op->any_source_conns.size();
    int chosen = -1;
    for (size_t k = 0; k < n && chosen < 0; ++k) {
      const int p = static_cast<int>((any_source_next_ + k) % n);
      Connection* c = op->any_source_conns[p];
      if (c == nullptr) continue;
      // The peer's next message belongs to an earlier receive from it, if any.
      Lane* lane = find_lane(LaneKind::kRecv, p);
      if (lane != nullptr && !lane->ops.empty() &&
          (lane->ops.front()->started || lane->ops.front()->recv_order < op->recv_order))
        continue;
      const void* data;
      size_t bytes;
      if (c->recv_ready(&data, &bytes)) chosen = p;
    }
    if (chosen < 0) return progressed;  // later any-source receives wait their turn
    any_source_next_ = static_cast<size_t>(chosen) + 1;
    any->ops.pop_front();
    op->lane_peer = chosen;
    op->task = op->bind(chosen);
    if (op->source_out != nullptr) *op->source_out = chosen;
    lane_for(*op).ops.push_front(op);  // may add a lane: `any` is stale from here
    progressed = true;
  }
}

void Engine::complete(const std::shared_ptr<Op>& op, const Status& st) {
  if (!st.is_ok() && op->before_failing != nullptr) op->before_failing(op->before_failing_ctx);
  op->status = st;
  active_.fetch_sub(1);
  finish(op);
}

void Engine::finish(const std::shared_ptr<Op>& op) {
  const uint64_t end = op->traced && op->started ? trace_ticks() : 0;
  op->task = Task();  // frees the coroutine frames
  op->wait = nullptr;
  // Most ops complete on the thread that waits for them: skip the syscall
  // unless another thread sleeps on this op (it counts itself in first).
  if (op->on_complete != nullptr) op->on_complete(op->on_complete_ctx);
  op->done.store(1, std::memory_order_seq_cst);
  if (op->sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&op->done, false);
  if (op->has_callback()) op->run_callback();
  // Recorded after the waiter is released: off the critical path.
  if (end != 0) trace_->op_done(*op, end, op->status);
}

bool Engine::own_writes_flushed(const Op& op) {
  // Only the op's own frames: another op's bytes (an isend the peer does not
  // read yet) must not hold it back, or ranks waiting on each other's next
  // call would wait forever.
  for (const auto& [i, mark] : op.tcp_marks) {
    Connection* c = tcp_conns_[i];
    if (c->sends_written() >= mark) continue;
    // An error stays on the connection; advance() fails the ops with it.
    (void)c->progress();
    if (c->sends_written() < mark) return false;
  }
  return true;
}

bool Engine::advance_lane(Lane& lane) {
  bool progressed = false;
  if (lane.kind == LaneKind::kRecv && lane.peer < 0) return false;  // bind_any_source's
  while (!lane.ops.empty()) {
    std::shared_ptr<Op> op = lane.ops.front();
    if (op->finished) {
      // A blocking call returns once its data is the kernel's: bytes left in
      // tcp slots would wait for the next call, and a peer waiting for them
      // could wait forever (this rank may block in another library meanwhile).
      if (!own_writes_flushed(*op)) return progressed;
      lane.ops.pop_front();
      complete(op, Status::ok());
      progressed = true;
      continue;
    }
    bool ready;
    if (!op->started) {
      if (lane.kind == LaneKind::kRecv) {
        // An earlier receive from any source may claim this peer's message.
        Lane* any = find_lane(LaneKind::kRecv, -1);
        if (any != nullptr && !any->ops.empty() && any->ops.front()->recv_order < op->recv_order)
          return progressed;
      }
      start(*op);
      op->start_ticks = trace_ticks();
      ready = true;
    } else {
      ready = op->wait == nullptr || op->wait->ready(op->wait->ctx);
      // Only long waits are traced, and a wait proves long by failing many
      // checks, or by outlasting the spin (note_long_waits): the short ones
      // (most, for small messages) read no clock. The recorded start is that
      // of the long_wait_checks_-th failed check, or of the first block.
      if (op->traced && op->wait != nullptr) {
        if (!ready) {
          if (++op->wait_checks == long_wait_checks_ && op->wait_since_ticks == 0)
            op->wait_since_ticks = trace_ticks();
        } else if (op->wait_since_ticks != 0) {
          trace_->wait(*op, op->wait_since_ticks, trace_ticks(), op->wait->peer, op->wait->what);
        }
      }
    }
    if (!ready) return progressed;
    resume(*op);
    progressed = true;
    if (!op->failure.is_ok()) {
      fail_all(op->failure);
      return progressed;
    }
    if (!op->finished) return progressed;
    // The top of the loop completes it (once its tcp bytes are written).
  }
  return progressed;
}

void Engine::note_long_waits() {
  // A wait that outlasted the spin is long however few checks it failed:
  // yielding the core between checks (oversubscribed), a few may take ms.
  for (Lane& lane : lanes_) {
    if (lane.ops.empty()) continue;
    Op& op = *lane.ops.front();
    if (op.traced && op.started && op.wait != nullptr && op.wait_since_ticks == 0)
      op.wait_since_ticks = trace_ticks();
  }
}

bool Engine::advance() {
  if (abort_requested_.load(std::memory_order_relaxed)) serve_abort();
  if (have_posted_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(post_mu_);
    for (auto& op : posted_) lane_for(*op).ops.push_back(op);
    posted_.clear();
    have_posted_.store(false, std::memory_order_relaxed);
  }
  for (Connection* c : tcp_conns_) {
    if (!c->wants_write()) continue;
    Status st = c->progress();
    if (!st) {
      // Named with the collective in flight, if any: it fails for this
      // (the head of a send or receive lane may be to another peer).
      const Lane& coll = lanes_[0];
      fail_all(
          st.with_context(coll.ops.empty() ? "rank " + std::to_string(rank_) : named(*coll.ops.front())));
      return true;
    }
  }
  bool progressed = bind_any_source();
  for (size_t i = 0; i < lanes_.size(); ++i) progressed |= advance_lane(lanes_[i]);
  return progressed;
}

void Engine::dump(const char* why) {
  const uint64_t now = trace_ticks();
  std::vector<std::shared_ptr<Op>> queued;
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    queued = posted_;
  }
  size_t count = queued.size();
  for (auto& lane : lanes_) count += lane.ops.size();
  BRAID_WARN("DUMP", rank_, "%s: %zu operation(s) in flight", why, count);
  for (auto& lane : lanes_) {
    for (auto& op : lane.ops) {
      std::string line = std::string(op->name) + " #" + std::to_string(op->seq);
      if (*op->algo != '\0')
        line += std::string(" (") + op->algo + ", " + std::to_string(op->bytes) + " bytes)";
      if (!op->started) {
        line += ": queued behind the one above";
      } else {
        line += ": step " + std::to_string(op->steps) + ", running for " +
                elapsed_text(ticks_to_us(now - op->start_ticks));
        if (op->wait != nullptr) {
          line += std::string(", waiting ") + op->wait->what;
          if (op->wait->peer >= 0) line += " rank " + std::to_string(op->wait->peer);
        }
      }
      BRAID_WARN("DUMP", rank_, "  %s", line.c_str());
    }
  }
  for (auto& op : queued) {
    BRAID_WARN("DUMP", rank_, "  %s #%llu: posted, not yet picked up", op->name,
               static_cast<unsigned long long>(op->seq));
  }
}

void Engine::serve_dumps() {
  const uint32_t requested = dumps_requested_.load(std::memory_order_relaxed);
  if (requested != dumps_served_) {
    dumps_served_ = requested;
    dump("braid_comm_dump");
  }
  const uint32_t signals = g_dump_signals.load(std::memory_order_relaxed);
  if (signals != signals_served_) {
    signals_served_ = signals;
    dump("SIGUSR1");
  }
}

void Engine::request_dump() {
  dumps_requested_.fetch_add(1);
  if (driver_role_.try_lock()) {
    serve_dumps();
    release_driver();
    return;
  }
  wake_driver();
}

// Any of the peers may be the sender. One that reported a failure fails the
// receive now. One that is gone without a report may have finished its part
// and left (a worker done with its results), so the receive fails only once
// every peer is gone: no other rank is left to send (it waited for the
// deadline before). A peer with a message waiting is alive enough: binding
// takes it.
Status Engine::any_source_failure(const Op& op, bool thorough) {
  Status gone;
  size_t candidates = 0, departed = 0;
  for (size_t p = 0; p < op.any_source_conns.size(); ++p) {
    Connection* c = op.any_source_conns[p];
    // This rank's own connection never leaves: it does not count.
    if (c == nullptr || static_cast<int>(p) == rank_) continue;
    ++candidates;
    const void* data = nullptr;
    size_t bytes = 0;
    if (c->recv_ready(&data, &bytes)) continue;
    BRAID_RETURN_IF_ERROR(c->peer_failure());
    if (Status st = c->check_peer(thorough); !st) {
      ++departed;
      if (gone.is_ok()) gone = st;
    }
  }
  if (candidates == 0 || departed < candidates) return Status::ok();
  return gone.with_context("every rank it could receive from is gone");
}

void Engine::check_peers(bool thorough) {
  if (Lane* any = find_lane(LaneKind::kRecv, -1); any != nullptr && !any->ops.empty()) {
    Op& op = *any->ops.front();
    if (op.deadline.expired()) {
      dump("timed out");
      fail_all(Status::timeout(named(op) + " timed out: not done within the timeout of " +
                               seconds_text(op.timeout_s) + ", waiting for a message from any rank"));
      return;
    }
    if (Status st = any_source_failure(op, thorough); !st) {
      fail_unless_progress(op, st);
      return;
    }
  }
  for (auto& lane : lanes_) {
    if (lane.ops.empty()) continue;
    Op& op = *lane.ops.front();
    // Started or not: a receive waits unstarted while an earlier receive
    // from any rank may still take its message, and keeps its own deadline.
    if (op.deadline.expired()) {
      const char* what = op.wait       ? op.wait->what
                         : op.finished ? "for the kernel to take its last bytes over tcp"
                         : op.started  ? "to start"
                                       : "to start, behind a receive from any rank";
      int peer = op.wait ? op.wait->peer : -1;
      dump("timed out");
      fail_all(Status::timeout(named(op) + " timed out: not done within the timeout of " +
                               seconds_text(op.timeout_s) + ", waiting " + what +
                               (peer >= 0 ? " rank " + std::to_string(peer) : std::string())));
      return;
    }
    // An op queued behind the front keeps its own deadline (a shorter one
    // set around its call with braid_comm_set_timeout).
    for (size_t k = 1; k < lane.ops.size(); ++k) {
      const Op& queued = *lane.ops[k];
      if (!queued.deadline.expired()) continue;
      dump("timed out");
      fail_all(Status::timeout(named(queued) + " timed out: not done within the timeout of " +
                               seconds_text(queued.timeout_s) + ", queued behind " + op.name + " #" +
                               std::to_string(op.seq)));
      return;
    }
    Status st;
    if (lane.kind == LaneKind::kCollective && op.started && thorough) st = watch_collective(op);
    for (int i = 0; st && op.wait != nullptr && i < 2; ++i) {
      Connection* c = op.wait->conn[i];
      if (c == nullptr) continue;
      // A peer that sent what this wait needs from it and then left (its
      // part of the call done) does not block it: the other side does (a
      // chain's next rank yet to free a slot). Only a failure it reported counts.
      const void* data = nullptr;
      size_t bytes = 0;
      if (op.wait->events[i] == POLLIN && c->recv_ready(&data, &bytes))
        st = c->peer_failure();
      else
        st = c->check_peer(thorough);
    }
    if (st) continue;
    fail_unless_progress(op, st);
    return;
  }
}

std::string Engine::named(const Op& op) const {
  return "rank " + std::to_string(rank_) + ": " + op.name + " #" + std::to_string(op.seq);
}

void Engine::fail_unless_progress(const Op& op, const Status& why) {
  // The peer may have sent its last messages (or the cause) just before:
  // take what is there first, and judge again on the next check. The op is
  // named first: advance() may complete it (an abort it serves, which then
  // stands as the failure).
  const std::string where = named(op);
  // Progress elsewhere (a live peer's steady traffic on another lane) would
  // postpone the judgement for ever: it is postponed for a while only.
  const Clock::time_point now = Clock::now();
  if (postponed_op_ != &op || postponed_seq_ != op.seq) {
    postponed_op_ = &op;
    postponed_seq_ = op.seq;
    postponed_since_ = now;
  }
  const bool progressed = advance();
  if (broken_.load()) return;
  if (progressed && now - postponed_since_ < std::chrono::milliseconds(kFailureGraceMs)) return;
  fail_all(why.with_context(where));
}

bool Engine::thorough_check_due(Clock::time_point now) {
  if (last_thorough_check_ == Clock::time_point{}) last_thorough_check_ = now;
  if (now - last_thorough_check_ <= std::chrono::milliseconds(kBlockMs)) return false;
  last_thorough_check_ = now;
  return true;
}

// While a collective waits on one peer, the others may already show that it
// cannot finish: a peer that marked itself failed, or a message whose tag
// says its sender ran a different call at this sequence number, or one this
// rank already finished (so nothing will ever read it). Without this, a
// mismatch where nobody reads the wrong message would wait for the timeout.
Status Engine::watch_collective(const Op& op) {
  for (size_t p = 0; p < coll_conns_.size(); ++p) {
    Connection* c = coll_conns_[p];
    if (c == nullptr || static_cast<int>(p) == rank_) continue;
    BRAID_RETURN_IF_ERROR(c->peer_failure());
    const void* data = nullptr;
    size_t bytes = 0;
    // During BRAID_CHECK_CALLS's exchange, its own comparison reports.
    if (op.tag.kind == kCallCheckTag || !c->recv_ready(&data, &bytes)) continue;
    const CallTag& t = c->recv_tag();
    const auto ahead = static_cast<int32_t>(t.seq - op.tag.seq);
    // all_to_allv's messages carry their block's size, which its receive
    // checks; the call's own tag carries none.
    const bool same =
        op.tag.kind == static_cast<uint8_t>(OpKind::kAllToAllv) ? t.same_call_as(op.tag) : t == op.tag;
    if (ahead > 0 || (ahead == 0 && same)) continue;  // the peer may run ahead
    // The peer already in BRAID_CHECK_CALLS's exchange of this call, which
    // this rank has not begun (a stream-ordered op waits for its stream
    // first): the exchange will compare.
    if (ahead == 0 && t.kind == kCallCheckTag) continue;
    return call_mismatch(rank_, op.tag, static_cast<int>(p), t);
  }
  return Status::ok();
}

void Engine::block(int max_ms, bool long_wait) {
  driver_sleeping_.store(true);
  // A caller taking over saw the driver awake and rang nothing: the
  // progress thread must not sleep on it (both sides are seq_cst).
  if (progress_driving_.load() && callers_taking_over_.load() > 0) {
    driver_sleeping_.store(false);
    return;
  }
  // What the heads of the lanes wait on decides how to sleep: on the shm
  // doorbell (a futex, which poll cannot watch), in poll() on sockets, or,
  // when both are awaited, in poll() with a short timeout. Without a
  // doorbell the eventfd that wake_driver() writes is always watched.
  std::vector<pollfd> fds;
  bool waits_on_shm = false;
  if (!tcp_conns_.empty() || bell_ == nullptr) fds.push_back({event_fd_, POLLIN, 0});
  if (!tcp_conns_.empty()) {
    for (Connection* c : tcp_conns_)
      if (c->wants_write()) c->poll_fds(POLLOUT, &fds);
    for (auto& lane : lanes_) {
      if (lane.ops.empty()) continue;
      if (lane.kind == LaneKind::kRecv && lane.peer < 0) {
        for (Connection* c : lane.ops.front()->any_source_conns) {
          if (c == nullptr) continue;
          if (c->pollable())
            c->poll_fds(POLLIN, &fds);
          else
            waits_on_shm = true;
        }
        continue;
      }
      const WaitPoint* w = lane.ops.front()->wait;
      if (w == nullptr) continue;
      for (int i = 0; i < 2; ++i) {
        if (w->conn[i] == nullptr) continue;
        if (!w->conn[i]->pollable()) {
          waits_on_shm = true;
        } else if (w->events[i] != POLLOUT) {
          // A tcp send slot frees when its bytes are written: the POLLOUT
          // entries above cover that. An idle socket is always writable, so
          // polling it for POLLOUT here would spin.
          w->conn[i]->poll_fds(w->events[i], &fds);
        }
      }
    }
  }
  if (fds.size() > 1 || (fds.size() == 1 && bell_ == nullptr)) {
    const bool mixed = bell_ != nullptr && waits_on_shm;
    const bool watched = mixed && long_wait;
    uint32_t seen = 0;
    if (watched) {
      // Counted a sleeper before the last check, as below: a ring after it
      // moves seq past `seen`, and the watcher sees that.
      bell_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      seen = bell_->seq.load(std::memory_order_seq_cst);
    }
    if (!advance()) {
      if (watched) {
        if (!watcher_) watcher_ = std::make_unique<DoorbellWatcher>(bell_, event_fd_);
        watcher_->arm(seen);
      }
      const long us = mixed && !watched ? std::min(max_ms * 1000L, kMixedBlockUs) : max_ms * 1000L;
      const timespec limit{us / 1000000, (us % 1000000) * 1000};
      ppoll(fds.data(), fds.size(), &limit, nullptr);
      if (watched) watcher_->disarm();
      uint64_t drained;
      ssize_t ignored = read(event_fd_, &drained, sizeof(drained));
      (void)ignored;
    }
    if (watched) bell_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  } else {
    bell_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t seen = bell_->seq.load(std::memory_order_seq_cst);
    // A caller that began taking over after the check above may have rung
    // before this thread counted itself a sleeper, and so rung nothing: it
    // is seen here (its count comes before its ring, ours before `seen`).
    const bool handing_over = progress_driving_.load() && callers_taking_over_.load() > 0;
    if (!handing_over && !advance()) futex_wait(&bell_->seq, seen, max_ms, true);
    bell_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
  driver_sleeping_.store(false);
}

template <class Pred>
void Engine::drive(Pred stop, double spin_us) {
  // The idle period starts at the first clock read after the last progress:
  // a call that completes while spinning (most small ones) reads no clock.
  Clock::time_point idle_since{};
  bool idle_known = false;
  const auto spin =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::micro>(spin_us));
  unsigned spins = 0;
  for (;;) {
    bool progressed = advance();
    if (dumps_requested_.load(std::memory_order_relaxed) != dumps_served_ ||
        g_dump_signals.load(std::memory_order_relaxed) != signals_served_) {
      serve_dumps();
    }
    if (stop()) return;
    if (progressed) {
      spins = 0;
      idle_known = false;
      // Steady traffic with one peer must not hide a dead other peer, or an
      // op past its deadline on another lane.
      if (++busy_rounds_ >= kBusyRoundsPerClockRead) {
        busy_rounds_ = 0;
        if (thorough_check_due(Clock::now())) {
          check_peers(true);
          if (stop()) return;
        }
      }
      continue;
    }
    // Check the clock only every few spins: it is the costly part of an idle loop.
    if (++spins < spins_per_yield_) {
      cpu_relax();
      continue;
    }
    spins = 0;
    auto now = Clock::now();
    if (!idle_known) {
      idle_since = now;
      idle_known = true;
      if (last_thorough_check_ == Clock::time_point{}) last_thorough_check_ = now;
    }
    if (now - idle_since < spin) {
      // A long spin (BRAID_SPIN_US) between sparse progress would otherwise
      // never reach a check: the clock is read here anyway.
      if (thorough_check_due(now)) {
        check_peers(true);
        if (stop()) return;
      }
      sched_yield();  // ranks often outnumber cores: let the peer we wait for run
      continue;
    }
    if (trace_ != nullptr) note_long_waits();
    block(kBlockMs, now - idle_since >= kMixedPollingFor);
    // Take whatever arrived before asking whether peers are alive: a peer
    // that finished and left may have sent exactly what we wait for.
    if (advance()) {
      idle_known = false;
      if (stop()) return;
      continue;
    }
    check_peers(thorough_check_due(Clock::now()));
    if (stop()) return;
  }
}

Status Engine::wait(Op& op) {
  Op* one = &op;
  wait_all(&one, 1);
  return op.status;
}

void Engine::sleep_on(Op& op) {
  // Counted in first: the completer wakes only ops with sleepers. 1 ms at
  // most, so a caller that sleeps here also looks for the driver role again.
  op.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (!is_done(op)) futex_wait(&op.done, 0, 1, false);
  op.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

void Engine::wait_all(Op* const* ops, size_t n) {
  size_t next = 0;  // ops before it are done
  auto all_done = [&] {
    while (next < n && is_done(*ops[next])) ++next;
    return next == n;
  };
  while (!all_done()) {
    Op& op = *ops[next];
    bool driving = driver_role_.try_lock();
    if (!driving && progress_driving_.load()) {
      // The progress thread drives without spinning (it shares the cores
      // with the caller's computation), so every wait on a peer costs it a
      // sleep and a wake-up: 35 us on a 1 MiB all_reduce of 2 ranks. A
      // caller that waits has nothing else to do: it takes over and spins.
      callers_taking_over_.fetch_add(1);
      if (driver_sleeping_.load()) wake_driver();
      // Not lock(): another waiter may win the role and keep it until its
      // own ops are done, which may need this thread to return first.
      // Whoever drives completes this op and wakes its sleepers.
      for (;;) {
        if (driver_role_.try_lock()) {
          driving = true;
          break;
        }
        if (is_done(op)) break;
        sleep_on(op);
      }
      callers_taking_over_.fetch_sub(1);
      // The progress thread may have seen this caller coming and stood
      // back: the async ops it left wait for a driver.
      if (!driving && active_.load() > 0) wake_progress_thread();
    }
    if (driving) {
      cancel_later_wake();
      drive(all_done, spin_us_);
      release_driver();
      // Hand the remaining async ops to the progress thread.
      if (active_.load() > 0) wake_progress_thread();
      break;
    }
    sleep_on(op);
  }
}

bool Engine::take_role_if_idle() {
  if (active_.load(std::memory_order_acquire) != 0 || !driver_role_.try_lock()) return false;
  // Under the driver's role no fail_all can run, so broken_ is exact; an
  // abort in progress shows as abort_requested_, which the driver handles.
  if (active_.load() == 0 && !broken_.load() && !abort_requested_.load()) return true;
  release_driver();
  return false;
}

bool Engine::run_blocking(const std::shared_ptr<Op>& op, Status* result) {
  if (op->lane != LaneKind::kCollective || !take_role_if_idle()) return false;
  // Not counted in active_ while it runs here: no other thread can see it,
  // and the driver's lock keeps every other driver out.
  // The deadline is set if the op has to wait in its lane (below): an op
  // done here reads no clock for it.
  op->traced = trace_ != nullptr && !op->untraceable;
  start(*op);
  // Untraced, the start time is only for dumps, which see the op only once
  // it waits in its lane: an op done here reads no clock.
  if (op->traced) op->start_ticks = trace_ticks();
  // Spin checks before the op joins its lane: a small collective's peers
  // answer within a few hundred nanoseconds when they are running.
  const unsigned inline_checks = std::min(spins_per_yield_, 16u);
  bool inline_done = false;
  for (;;) {
    resume(*op);
    if (!op->failure.is_ok()) break;
    if (op->finished) {
      if (own_writes_flushed(*op)) {
        // complete() without what only other threads need: nobody else
        // holds this op, so no sleeper to wake, no callback, no count.
        const uint64_t end = op->traced ? trace_ticks() : 0;
        op->task = Task();
        op->done.store(1, std::memory_order_release);
        if (end != 0) trace_->op_done(*op, end, op->status);
        inline_done = true;
      }
      break;
    }
    unsigned checks = 0;
    while (checks < inline_checks && op->wait != nullptr && !op->wait->ready(op->wait->ctx)) {
      cpu_relax();
      ++checks;
    }
    if (checks == inline_checks) break;
  }
  op->posted.store(true, std::memory_order_relaxed);  // this thread runs it: no waiter elsewhere
  if (!inline_done) {
    // The lane is empty (nothing was in flight): the op is its front.
    op->timeout_s = timeout_s_.load();
    op->deadline = Deadline::after_seconds(op->timeout_s);
    if (!op->traced) op->start_ticks = trace_ticks();
    active_.fetch_add(1);
    lanes_[0].ops.push_back(op);
    if (!op->failure.is_ok()) fail_all(op->failure);
    drive([&] { return is_done(*op); }, spin_us_);
  }
  release_driver();
  // Ops other threads posted meanwhile go to the progress thread.
  if (active_.load() > 0) wake_progress_thread();
  *result = op->status;
  return true;
}

void Engine::drain() {
  // Done means every op completed and every byte they sent left this process
  // (tcp keeps committed sends in staging slots until the socket takes them).
  auto idle = [&] {
    if (active_.load() > 0) return false;
    if (broken_.load()) return true;
    for (Connection* c : tcp_conns_)
      if (c->wants_write()) return false;
    return true;
  };
  // idle() reads driver-owned state: evaluate it only while driving.
  for (;;) {
    if (driver_role_.try_lock()) {
      drive(idle, spin_us_);
      release_driver();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

Status Engine::unclaimed_messages() {
  while (!driver_role_.try_lock()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  Status found;
  if (!broken_.load()) {
    for (auto [peer, c] : peer_conns_) {
      // Reads what tcp has; a peer that already left closed its end, and
      // what it sent before is still read.
      (void)c->progress();
      const void* data = nullptr;
      size_t bytes = 0;
      // A peer that failed (a timeout, an abort) said so itself; what it
      // sent before is not news.
      if (!c->peer_failure().is_ok() || !c->recv_ready(&data, &bytes)) continue;
      const CallTag& t = c->recv_tag();
      if (t.kind == kIpcDisconnectTag) continue;  // the teardown that follows destroy
      const bool p2p = t.kind == static_cast<uint8_t>(OpKind::kSend);
      const std::string sender =
          peer == rank_ ? "this rank sent itself" : "rank " + std::to_string(peer) + " sent";
      found =
          Status(BRAID_ERR_MISMATCH,
                 "rank " + std::to_string(rank_) + ": comm_destroy: " + sender + " a message of " +
                     describe_call(t) + " that no call on this rank took: the ranks' calls did not match (" +
                     (p2p ? "a send with no receive"
                          : "a root that differs between ranks, a count of 0 on some ranks only, or a "
                            "call only some ranks made") +
                     "), so the last calls may have returned wrong data");
      break;
    }
  }
  release_driver();
  return found;
}

void Engine::progress_loop() {
  // Wake-ups arrive as eventfd counts (progress_fd_) or the timer of a
  // later wake: both stay readable until drained, so none is lost between
  // a check below and the sleep.
  while (!stop_.load()) {
    if (active_.load() == 0) {
      progress_sleep(100);
      // Idle: answer SIGUSR1 and braid_comm_dump here, since no driver will
      // (a dump asked for while another thread briefly held the role).
      if ((g_dump_signals.load(std::memory_order_relaxed) != signals_served_ ||
           dumps_requested_.load() != dumps_served_) &&
          driver_role_.try_lock()) {
        serve_dumps();
        release_driver();
      }
      continue;
    }
    if (callers_taking_over_.load() > 0) {
      // A caller drives next; it wakes this thread when it is done.
      progress_sleep(100);
      continue;
    }
    if (!driver_role_.try_lock()) {
      // A caller drives (usually one that waits right after posting): it
      // wakes this thread when it gives up the role with work left
      // (release_driver). Queueing on the mutex instead cost a second
      // wake-up per call; waking every 1 ms cost 2.5% of a core over a long
      // wait. The flag is set before the second try, so a caller that
      // released in between is seen here, or sees the flag.
      progress_awaits_driver_.store(true);
      if (!driver_role_.try_lock()) {
        progress_sleep(kBlockMs);
        progress_awaits_driver_.store(false);
        continue;
      }
      progress_awaits_driver_.store(false);
    }
    progress_driving_.store(true);
    // The progress thread runs while the caller computes (the backward pass
    // under DDP): spinning would take the core from that work, so it blocks
    // as soon as nothing moves.
    drive([&] { return active_.load() == 0 || stop_.load() || callers_taking_over_.load() > 0; }, 0.0);
    progress_driving_.store(false);
    release_driver();
  }
}

void Engine::abort(const Status& why) {
  std::vector<std::shared_ptr<Op>> queued;
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    if (error_.is_ok()) error_ = why;
    // The first abort is what the driver reports and peers learn.
    if (abort_status_.is_ok()) abort_status_ = why;
    queued.swap(posted_);
  }
  // Outside the lock: completing runs callbacks and release hooks, which
  // must not hold up every post meanwhile.
  for (auto& op : queued) complete(op, why);
  // A read-modify-write, not a store: it pairs with release_driver's load
  // after its unlock (a failed try_lock orders nothing), so one side sees
  // the other. (A fence would do, but TSan refuses fences.)
  const uint64_t served_before = aborts_served_.load();
  (void)abort_requested_.exchange(true);
  wake_driver();
  // Nobody may be driving: take the driver role briefly to fail queued ops.
  // Else the driver serves it, before it gives up the role at the latest.
  if (driver_role_.try_lock()) release_driver();
  // Another thread drives (the progress thread, or one blocked in a call):
  // wait until it has failed the ops, so that no receive's buffer is
  // written after abort returns (braid.h). It looks within microseconds,
  // or once woken; failing waits at most 5 s for a sender's chunk.
  const Deadline bound = Deadline::after_seconds(kAbortServeSeconds);
  while (aborts_served_.load() == served_before && !bound.expired())
    std::this_thread::sleep_for(std::chrono::microseconds(50));
}

void Engine::serve_abort() {
  if (!abort_requested_.exchange(false)) return;
  Status why;
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    why = abort_status_;
  }
  fail_all(why);
  aborts_served_.fetch_add(1);
}

void Engine::release_driver() {
  // An abort between the driver's last advance() and the unlock would wait
  // for the next call: peers would not learn of it meanwhile.
  for (;;) {
    if (abort_requested_.load(std::memory_order_relaxed)) serve_abort();
    driver_role_.unlock();
    if (progress_awaits_driver_.load() && progress_awaits_driver_.exchange(false) && active_.load() > 0)
      wake_progress_thread();
    if (!abort_requested_.load() || !driver_role_.try_lock()) return;
  }
}

void Engine::fail_all(const Status& why) {
  std::vector<std::shared_ptr<Op>> queued;
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    if (error_.is_ok()) error_ = why;
    queued.swap(posted_);
  }
  for (auto& op : queued) complete(op, why);
  // Peers learn the first failure only: it is the cause, and rewriting the
  // reason they may be reading would tear it.
  const bool first = !broken_.exchange(true);
  if (why.code() == BRAID_ERR_ABORTED) {
    BRAID_INFO("COLL", rank_, "%s", why.message().c_str());
  } else {
    BRAID_WARN("COLL", rank_, "%s", why.message().c_str());
  }
  if (first && notify_failure_) notify_failure_(why);
  for (auto& lane : lanes_) {
    for (auto& op : lane.ops) complete(op, why);
    lane.ops.clear();
  }
}

}  // namespace braid
