// The C API: validates arguments, maps handles to objects, and turns Status
// into braid_result_t plus a last-error message.
#include <braid/braid.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/reduce_kernels.h"
#include "src/core/bootstrap.h"
#include "src/core/communicator.h"
#include "src/core/config.h"
#include "src/core/device_memory.h"
#include "src/core/dtype.h"
#include "src/core/logging.h"
#include "transports/cuda/stream_staging.h"
#include "transports/shm/shared_memory.h"

#define BRAID_API extern "C" __attribute__((visibility("default")))

namespace braid {
namespace {

// ---- handles: opaque ids that are never reused and never dereferenced ----

// A request does not keep its communicator: braid_comm_destroy and
// braid_comm_abort tear it down at once (ops drained or failed first), even
// where the caller still holds requests it never waited for.
struct Request {
  Request(const std::shared_ptr<Communicator>& c, std::shared_ptr<Op> o) : comm(c), op(std::move(o)) {}
  std::weak_ptr<Communicator> comm;
  std::shared_ptr<Op> op;
  std::atomic<bool> callback_set{false};

  bool done() const { return op->done.load(std::memory_order_acquire) != 0; }
  // The communicator, or, once it is gone, why the op can no longer be
  // waited for (it is always done by then: the teardown drains).
  Status live(std::shared_ptr<Communicator>* out) const {
    *out = comm.lock();
    if (*out && (*out)->forked()) {
      out->reset();
      return Status::invalid_usage(std::string("the request's ") + op->name +
                                   " was started before this process was forked: it belongs to the parent");
    }
    if (*out || done()) return Status::ok();
    return Status::invalid_usage(std::string("the communicator of this request's ") + op->name +
                                 " was destroyed before the operation completed");
  }
};

template <class T>
class Registry {
 public:
  // Each registry's ids carry its own tag in the low 4 bits: a request's
  // handle passed as a communicator (easy through void* bindings) finds
  // nothing, rather than another live object.
  explicit Registry(uintptr_t tag) : next_(0x10000 | tag) {}
  uintptr_t add(std::shared_ptr<T> obj) {
    std::lock_guard<std::mutex> lock(mu_);
    uintptr_t id = next_;
    next_ += 16;
    objects_[id] = std::move(obj);
    generation_.fetch_add(1, std::memory_order_release);
    return id;
  }
  // Every call looks its handle up: each thread remembers its last answer,
  // good while nothing was added or taken since (no lock, no hash). The memo
  // holds a weak reference, so it never keeps a destroyed object alive.
  std::shared_ptr<T> get(uintptr_t id) {
    struct Memo {
      uint64_t generation = ~uint64_t{0};
      uintptr_t id = 0;
      std::weak_ptr<T> obj;
    };
    thread_local Memo memo;
    if (memo.id == id && memo.generation == generation_.load(std::memory_order_acquire)) {
      if (std::shared_ptr<T> obj = memo.obj.lock()) return obj;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(id);
    if (it == objects_.end()) return nullptr;
    memo.generation = generation_.load(std::memory_order_relaxed);
    memo.id = id;
    memo.obj = it->second;
    return it->second;
  }
  std::shared_ptr<T> take(uintptr_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(id);
    if (it == objects_.end()) return nullptr;
    auto obj = std::move(it->second);
    objects_.erase(it);
    generation_.fetch_add(1, std::memory_order_release);
    return obj;
  }

 private:
  std::mutex mu_;
  uintptr_t next_;
  std::unordered_map<uintptr_t, std::shared_ptr<T>> objects_;
  std::atomic<uint64_t> generation_{0};  // bumped by every add and take
};

Registry<Communicator>& comms() {
  static auto* r = new Registry<Communicator>(1);  // outlives static destructors
  return *r;
}
Registry<Request>& requests() {
  static auto* r = new Registry<Request>(2);
  return *r;
}

// Communicators braid_comm_destroy is draining, by handle: abort reaches
// them (once). Destroy waits for such an abort to let go before it drops
// the last reference, so that the communicator is freed by destroy, before
// it returns, as braid.h says.
struct Draining {
  Communicator* comm = nullptr;  // kept alive by destroy's reference
  bool aborted = false;
  bool aborting = false;  // an abort is using it
};
std::mutex& draining_mu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::condition_variable& draining_cv() {
  static auto* cv = new std::condition_variable();
  return *cv;
}
std::unordered_map<uintptr_t, Draining>& draining() {
  static auto* map = new std::unordered_map<uintptr_t, Draining>();
  return *map;
}

uintptr_t id_of(const void* handle) {
  return reinterpret_cast<uintptr_t>(handle);
}

std::string& thread_last_error() {
  thread_local std::string message;
  return message;
}

braid_result_t finish(const Status& st, Communicator* comm = nullptr) {
  if (st.is_ok()) return BRAID_SUCCESS;
  thread_last_error() = st.message();
  if (comm != nullptr) comm->set_last_error(st.message());
  return st.code();
}

Status lookup(braid_comm_t handle, std::shared_ptr<Communicator>* out) {
  if (handle == nullptr) return Status::invalid_argument("comm is NULL");
  *out = comms().get(id_of(handle));
  if (!*out) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%p", static_cast<void*>(handle));
    return Status::invalid_argument(std::string("comm ") + buf +
                                    " is not a live communicator (destroyed, aborted, or never created)");
  }
  if ((*out)->forked()) {
    out->reset();
    return Status::invalid_usage(
        "the communicator was made before this process was forked: it belongs to the parent, and a child "
        "makes its own (braid_comm_destroy releases the child's handle)");
  }
  return Status::ok();
}

// ---- groups (per thread) ----

struct Pending {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Op> op;
  bool blocking;
  std::shared_ptr<StagedCall> staged;  // a stream-ordered call, enqueued at group_end
};
struct GroupState {
  std::vector<Pending> ops;
  // The group's first calls, while they are all blocking sends and receives
  // on one communicator that run_p2p_inline may do: no op is made for them
  // unless a later call of the group needs one (make_deferred_ops keeps the
  // order) or they are not all done inline at group_end.
  std::vector<Communicator::P2pCall> deferred;
  std::shared_ptr<Communicator> deferred_comm;
  // The first call the group refused (bad arguments), and its communicator.
  Status refused;
  std::shared_ptr<Communicator> refused_comm;
  // group_end's scratch, kept for its capacity.
  std::vector<Op*> waiting;
  std::vector<Engine*> engines;
};
GroupState& group() {
  thread_local GroupState g;
  return g;
}
// How deep in group_start this thread is; every call looks (BRAID_FAST_TLS).
BRAID_FAST_TLS thread_local int t_group_depth = 0;

// The group's deferred calls not done inline become ops, in their order,
// ahead of any the group makes later.
// Each is marked done as its op joins the group, so a make_op that throws
// (std::bad_alloc) leaves none to be made twice.
void make_deferred_ops() {
  GroupState& g = group();
  for (Communicator::P2pCall& call : g.deferred) {
    if (call.done) continue;
    g.ops.push_back({g.deferred_comm,
                     g.deferred_comm->make_op(call.kind, call.args, false, Algo::kAuto, true), true,
                     nullptr});
    call.done = true;
  }
  g.deferred.clear();
  g.deferred_comm.reset();
}

// ---- argument checks ----

// The raw value a C caller passed for an enum. Read through memcpy: in C++ a
// value outside the enumerators' range is undefined behaviour to load, and C
// callers may pass anything.
template <class E>
int raw_value(const E& e) {
  static_assert(sizeof(E) == sizeof(int));
  int v;
  std::memcpy(&v, &e, sizeof(v));
  return v;
}

// Each check is small and inlined into every call; the texts of its errors
// are built out of line (BRAID_COLD), off the path of a valid call.
#define BRAID_CHECK inline __attribute__((always_inline))
#define BRAID_COLD __attribute__((cold, noinline))

BRAID_COLD Status bad_dtype(int v) {
  return Status::invalid_argument("dtype=" + std::to_string(v) + " is not a braid_dtype_t (valid: 0.." +
                                  std::to_string(BRAID_NUM_DTYPES - 1) + ")");
}

BRAID_CHECK Status check_dtype(const braid_dtype_t& dtype) {
  if (raw_value(dtype) < 0 || raw_value(dtype) >= BRAID_NUM_DTYPES) return bad_dtype(raw_value(dtype));
  return Status::ok();
}

BRAID_COLD Status bad_redop(int v, braid_dtype_t dtype) {
  if (v < 0 || v >= BRAID_NUM_OPS)
    return Status::invalid_argument("op=" + std::to_string(v) + " is not a braid_redop_t (valid: 0.." +
                                    std::to_string(BRAID_NUM_OPS - 1) + ")");
  return Status::invalid_argument(std::string("op=") + braid_redop_name(static_cast<braid_redop_t>(v)) +
                                  " is not defined for dtype=" + braid_dtype_name(dtype) +
                                  " (avg needs a floating type, band/bor/bxor an integer type)");
}

BRAID_CHECK Status check_redop(const braid_redop_t& op, braid_dtype_t dtype) {
  if (raw_value(op) < 0 || raw_value(op) >= BRAID_NUM_OPS || !kernels::redop_supported(dtype, op))
    return bad_redop(raw_value(op), dtype);
  return Status::ok();
}

BRAID_COLD Status bad_count(size_t count, size_t multiplier, size_t esize, const char* name) {
  return Status::invalid_argument(
      std::string(name) + "=" + std::to_string(count) + " overflows: " + std::to_string(count) + " x " +
      std::to_string(multiplier) + " x " + std::to_string(esize) + " bytes exceeds the address space");
}

BRAID_CHECK Status check_count(size_t count, braid_dtype_t dtype, size_t multiplier, const char* name) {
  const size_t esize = dtype_size(dtype);
  size_t bytes = 0;  // multiplied, not divided: two divisions cost more than the rest of the check
  if (__builtin_mul_overflow(count, multiplier, &bytes) || __builtin_mul_overflow(bytes, esize, &bytes) ||
      bytes > static_cast<size_t>(std::numeric_limits<ptrdiff_t>::max()))
    return bad_count(count, multiplier, esize, name);
  return Status::ok();
}

BRAID_COLD Status null_buffer(size_t count, const char* name, const char* count_name) {
  return Status::invalid_argument(std::string(name) + " is NULL with " + count_name + "=" +
                                  std::to_string(count));
}

// A stream-ordered call takes device and host buffers alike (its stream
// copies them); a host-ordered one only host memory.
BRAID_CHECK Status check_buffer(braid_stream_t stream, const void* buf, size_t count, const char* name,
                                const char* count_name) {
  if (count == 0) return Status::ok();
  if (buf == nullptr) return null_buffer(count, name, count_name);
  if (stream != nullptr) return Status::ok();
  return check_host_memory(buf, name);
}

BRAID_COLD Status bad_rank(int r, int nranks, const char* name) {
  return Status::invalid_argument(std::string(name) + "=" + std::to_string(r) +
                                  " is out of range for a communicator of " + std::to_string(nranks) +
                                  " ranks");
}

BRAID_CHECK Status check_rank(int r, int nranks, const char* name) {
  if (r < 0 || r >= nranks) return bad_rank(r, nranks, name);
  return Status::ok();
}

// Everything a collective or point-to-point call needs checked, in one place.
struct Call {
  OpKind kind;
  CollArgs args;
  braid_comm_t handle;
  braid_stream_t stream;
  braid_request_t* request;  // null for the blocking form
};

Status validate(const Call& c, Communicator& comm) {
  const int n = comm.nranks(), r = comm.rank();
  const CollArgs& a = c.args;
  if (c.kind == OpKind::kBarrier) return Status::ok();
  BRAID_RETURN_IF_ERROR(check_dtype(a.dtype));
  const bool reduces =
      c.kind == OpKind::kAllReduce || c.kind == OpKind::kReduce || c.kind == OpKind::kReduceScatter;
  if (reduces) BRAID_RETURN_IF_ERROR(check_redop(a.op, a.dtype));
  const bool rooted = c.kind == OpKind::kBroadcast || c.kind == OpKind::kReduce ||
                      c.kind == OpKind::kGather || c.kind == OpKind::kScatter;
  if (rooted) BRAID_RETURN_IF_ERROR(check_rank(a.root, n, "root"));
  const bool is_root = rooted && a.root == r;
  switch (c.kind) {
    case OpKind::kSend:
    case OpKind::kRecv:
      BRAID_RETURN_IF_ERROR(check_rank(a.peer, n, "peer"));
      BRAID_RETURN_IF_ERROR(check_count(a.count, a.dtype, 1, "count"));
      return check_buffer(c.stream, c.kind == OpKind::kSend ? a.sendbuf : a.recvbuf, a.count, "buf", "count");
    case OpKind::kAllReduce:
      BRAID_RETURN_IF_ERROR(check_count(a.count, a.dtype, 1, "count"));
      BRAID_RETURN_IF_ERROR(check_buffer(c.stream, a.sendbuf, a.count, "sendbuf", "count"));
      return check_buffer(c.stream, a.recvbuf, a.count, "recvbuf", "count");
    case OpKind::kBroadcast:
      BRAID_RETURN_IF_ERROR(check_count(a.count, a.dtype, 1, "count"));
      if (is_root)
        BRAID_RETURN_IF_ERROR(check_buffer(c.stream, a.sendbuf, a.count, "sendbuf (on the root)", "count"));
      return check_buffer(c.stream, a.recvbuf, a.count, "recvbuf", "count");
    case OpKind::kReduce:
      BRAID_RETURN_IF_ERROR(check_count(a.count, a.dtype, 1, "count"));
      BRAID_RETURN_IF_ERROR(check_buffer(c.stream, a.sendbuf, a.count, "sendbuf", "count"));
      return is_root ? check_buffer(c.stream, a.recvbuf, a.count, "recvbuf (on the root)", "count")
                     : Status::ok();
    case OpKind::kAllGather:
      BRAID_RETURN_IF_ERROR(check_count(a.count, a.dtype, static_cast<size_t>(n), "sendcount"));
      BRAID_RETURN_IF_ERROR(check_buffer(c.stream, a.sendbuf, a.count, "sendbuf", "sendcount"));
      return check_buffer(c.stream, a.recvbuf, a.count, "recvbuf", "sendcount");
    case OpKind::kReduceScatter:
      BRAID_RETURN_IF_ERROR(check_count(a.count, a.dtype, static_cast<size_t>(n), "recvcount"));
      BRAID_RETURN_IF_ERROR(check_buffer(c.stream, a.sendbuf, a.count, "sendbuf", "recvcount"));
      return check_buffer(c.stream, a.recvbuf, a.count, "recvbuf", "recvcount");
    case OpKind::kGather:
      BRAID_RETURN_IF_ERROR(check_count(a.count, a.dtype, static_cast<size_t>(n), "sendcount"));
      BRAID_RETURN_IF_ERROR(check_buffer(c.stream, a.sendbuf, a.count, "sendbuf", "sendcount"));
      return is_root ? check_buffer(c.stream, a.recvbuf, a.count, "recvbuf (on the root)", "sendcount")
                     : Status::ok();
    case OpKind::kScatter:
      BRAID_RETURN_IF_ERROR(check_count(a.count, a.dtype, static_cast<size_t>(n), "recvcount"));
      if (is_root)
        BRAID_RETURN_IF_ERROR(
            check_buffer(c.stream, a.sendbuf, a.count, "sendbuf (on the root)", "recvcount"));
      return check_buffer(c.stream, a.recvbuf, a.count, "recvbuf", "recvcount");
    case OpKind::kAllToAll:
      BRAID_RETURN_IF_ERROR(check_count(a.count, a.dtype, static_cast<size_t>(n), "count"));
      BRAID_RETURN_IF_ERROR(check_buffer(c.stream, a.sendbuf, a.count, "sendbuf", "count"));
      return check_buffer(c.stream, a.recvbuf, a.count, "recvbuf", "count");
    case OpKind::kRecvAny:
      if (a.source == nullptr)
        return Status::invalid_argument("source is NULL (where should the sender's rank go?)");
      BRAID_RETURN_IF_ERROR(check_count(a.count, a.dtype, 1, "count"));
      return check_buffer(c.stream, a.recvbuf, a.count, "buf", "count");
    case OpKind::kAllToAllv: {
      // a.layout is never NULL here: submit_all_to_allv refuses NULL arrays, naming which.
      const size_t un = static_cast<size_t>(n);
      const size_t *scount = a.layout, *sdispl = a.layout + un, *rcount = a.layout + 2 * un,
                   *rdispl = a.layout + 3 * un;
      const size_t limit = static_cast<size_t>(std::numeric_limits<ptrdiff_t>::max()) / dtype_size(a.dtype);
      // Each buffer is checked once, at the first rank whose count needs it
      // (the message names that index): the check depends on the buffer only.
      bool send_checked = false, recv_checked = false;
      for (int p = 0; p < n; ++p) {
        if (scount[p] > limit || sdispl[p] > limit - scount[p] || rcount[p] > limit ||
            rdispl[p] > limit - rcount[p])
          return Status::invalid_argument("counts or displacements for rank " + std::to_string(p) +
                                          " overflow the address space");
        if (scount[p] > 0 && !send_checked) {
          send_checked = true;
          BRAID_RETURN_IF_ERROR(check_buffer(c.stream, a.sendbuf, scount[p], "sendbuf",
                                             ("sendcounts[" + std::to_string(p) + "]").c_str()));
        }
        if (rcount[p] > 0 && !recv_checked) {
          recv_checked = true;
          BRAID_RETURN_IF_ERROR(check_buffer(c.stream, a.recvbuf, rcount[p], "recvbuf",
                                             ("recvcounts[" + std::to_string(p) + "]").c_str()));
        }
      }
      if (scount[r] != rcount[r])
        return Status::invalid_argument("sendcounts[" + std::to_string(r) + "]=" + std::to_string(scount[r]) +
                                        " differs from recvcounts[" + std::to_string(r) +
                                        "]=" + std::to_string(rcount[r]) + " (this rank's block to itself)");
      return Status::ok();
    }
    case OpKind::kBarrier:
      break;
  }
  return Status::ok();
}

// NCCL's semantics: enqueued on the stream, the call returns; the op runs
// when the stream reaches it (transports/cuda/stream_staging.h). Errors
// found later reach braid_wait, or braid_comm_get_async_error.
braid_result_t refuse(const Status& st, const std::shared_ptr<Communicator>& comm);

braid_result_t submit_stream_ordered(const Call& c, const std::shared_ptr<Communicator>& comm) {
  // Inside a group, a refusal fails the group as any other call's does.
  auto error = [&](const Status& st) {
    return refuse(st.with_context("rank " + std::to_string(comm->rank()) + ": " + op_kind_name(c.kind)),
                  comm);
  };
  auto call = std::make_shared<StagedCall>();
  CollArgs staged;
  // A call refused before anything was set up (a bad stream, one being
  // captured: call->cu still unset) can be made again. Past that, what
  // failed is a resource (staging memory, the driver) on this rank alone,
  // while its peers make their half of the call: the communicator breaks,
  // so they learn why now instead of at their timeout (as a group's
  // enqueue failure does in braid_group_end).
  auto fail_and_break = [&](const Status& st) {
    comm->engine().abort(
        st.with_context("rank " + std::to_string(comm->rank()) + ": " + op_kind_name(c.kind)));
    return error(st);
  };
  Status st = comm->prepare_stream_op(c.kind, c.args, c.stream, call.get(), &staged);
  if (!st) {
    const bool refused = call->cu == nullptr;
    give_up(*call);
    return refused ? error(st) : fail_and_break(st);
  }
  if (t_group_depth == 0) {
    // Enqueued before the op is made, so that a failure leaves the
    // communicator's sequence as it was.
    st = enqueue_stage_in(*call);
    if (st) st = enqueue_stage_out(*call);
    if (!st) return fail_and_break(st);
  }
  std::shared_ptr<Op> op = comm->make_stream_op(c.kind, staged, *call);
  if (c.request != nullptr)
    *c.request = reinterpret_cast<braid_request_t>(requests().add(std::make_shared<Request>(comm, op)));
  if (t_group_depth > 0) {
    group().ops.push_back({comm, op, false, std::move(call)});
    return BRAID_SUCCESS;
  }
  comm->engine().post(op);
  return BRAID_SUCCESS;
}

// A call from inside a completion callback: the callback runs on a thread
// that drives the engine, so a call that waits would wait on itself.
#define BRAID_REFUSE_IN_CALLBACK(what)                                                                    \
  do {                                                                                                    \
    if (Op::in_callback())                                                                                \
      return finish(Status::invalid_usage(std::string(what) +                                             \
                                          " called from a completion callback: a callback must not call " \
                                          "braid (it would wait on the thread that runs it)"));           \
  } while (0)

// A call refused before it was made. Inside a group the group fails too:
// its end reports the first refusal and aborts the communicator (every
// communicator of the group where the call named none that lives), since
// the peers made their part of the call.
braid_result_t refuse(const Status& st, const std::shared_ptr<Communicator>& comm) {
  if (t_group_depth > 0 && group().refused.is_ok()) {
    group().refused = st;
    group().refused_comm = comm;
  }
  return finish(st, comm.get());
}

braid_result_t submit(const Call& c) {
  BRAID_REFUSE_IN_CALLBACK(op_kind_name(c.kind));
  std::shared_ptr<Communicator> comm;
  Status st = lookup(c.handle, &comm);
  if (!st) return refuse(st.with_context(op_kind_name(c.kind)), nullptr);
  st = validate(c, *comm);
  if (!st)
    return refuse(st.with_context("rank " + std::to_string(comm->rank()) + ": " + op_kind_name(c.kind)),
                  comm);
  const bool async = c.request != nullptr;
  const bool p2p_inline = (c.kind == OpKind::kSend || c.kind == OpKind::kRecv) && !async &&
                          c.stream == nullptr && comm->p2p_inline_candidate(c.kind, c.args);
  if (t_group_depth > 0) {
    GroupState& g = group();
    // Deferred while the group holds nothing else, so its ops keep the
    // calls' order.
    if (p2p_inline && g.ops.empty() && (g.deferred.empty() || g.deferred_comm == comm)) {
      if (g.deferred.empty()) g.deferred_comm = comm;
      g.deferred.push_back({c.kind, c.args});
      return BRAID_SUCCESS;
    }
    if (!g.deferred.empty()) make_deferred_ops();
  } else if (p2p_inline) {
    Communicator::P2pCall call{c.kind, c.args};
    if (comm->run_p2p_inline(&call, 1)) return BRAID_SUCCESS;
  }
  if (c.stream != nullptr) return submit_stream_ordered(c, comm);
  const Communicator::Inline part =
      !async && t_group_depth == 0 ? comm->run_inline(c.kind, c.args) : Communicator::Inline::kNothing;
  if (part == Communicator::Inline::kDone) return BRAID_SUCCESS;
  // Sends made inline leave a direct collective's receives to its op.
  const bool sent = part == Communicator::Inline::kSent;
  std::shared_ptr<Op> op =
      comm->make_op(c.kind, c.args, async, sent ? Algo::kDirect : Algo::kAuto, t_group_depth > 0, sent);
  if (async)
    *c.request = reinterpret_cast<braid_request_t>(requests().add(std::make_shared<Request>(comm, op)));
  if (t_group_depth > 0) {
    group().ops.push_back({comm, op, !async, nullptr});
    return BRAID_SUCCESS;
  }
  if (!async) {
    Status result;
    if (comm->engine().run_blocking(op, &result)) return finish(result, comm.get());
  }
  comm->engine().post(op);
  if (async) return BRAID_SUCCESS;
  return finish(comm->engine().wait(*op), comm.get());
}

braid_result_t request_arg(braid_request_t* request, braid_comm_t handle) {
  if (request != nullptr) return BRAID_SUCCESS;
  std::shared_ptr<Communicator> comm;
  (void)lookup(handle, &comm);  // the group's communicator to abort, if it names one
  return refuse(Status::invalid_argument("request is NULL (the i-form needs somewhere to put the handle)"),
                comm);
}

}  // namespace
}  // namespace braid

using namespace braid;

// ---- errors and versions ----

BRAID_API const char* braid_get_error_string(braid_result_t result) {
  switch (result) {
    case BRAID_SUCCESS:
      return "success";
    case BRAID_ERR_INVALID_ARGUMENT:
      return "invalid argument";
    case BRAID_ERR_INVALID_USAGE:
      return "invalid usage";
    case BRAID_ERR_SYSTEM:
      return "system call failed";
    case BRAID_ERR_INTERNAL:
      return "internal error";
    case BRAID_ERR_REMOTE:
      return "remote peer failed";
    case BRAID_ERR_TIMEOUT:
      return "timed out";
    case BRAID_ERR_ABORTED:
      return "aborted";
    case BRAID_ERR_MISMATCH:
      return "ranks called mismatched operations";
    case BRAID_ERR_UNSUPPORTED:
      return "not supported";
    case BRAID_ERR_IN_PROGRESS:
      return "in progress";
  }
  return "unknown result code";
}

BRAID_API const char* braid_get_last_error(void) {
  return thread_last_error().c_str();
}

BRAID_API const char* braid_comm_get_last_error(braid_comm_t handle) {
  thread_local std::string copy;
  std::shared_ptr<Communicator> comm;
  Status st = lookup(handle, &comm);
  copy = st ? comm->last_error() : st.message();
  return copy.c_str();
}

BRAID_API braid_result_t braid_get_version(int* version) {
  if (version == nullptr) return finish(Status::invalid_argument("version is NULL"));
  *version = BRAID_VERSION_CODE;
  return BRAID_SUCCESS;
}

BRAID_API size_t braid_dtype_size(braid_dtype_t dtype) {
  // A C caller may pass any int: read it as one (raw_value), then the table.
  const int v = raw_value(dtype);
  return v >= 0 && v < BRAID_NUM_DTYPES ? dtype_size(static_cast<braid_dtype_t>(v)) : 0;
}

BRAID_API const char* braid_dtype_name(braid_dtype_t dtype) {
  static const char* kNames[] = {"int8",   "uint8",   "int32",    "uint32",  "int64",
                                 "uint64", "float16", "bfloat16", "float32", "float64"};
  int v = raw_value(dtype);
  return (v >= 0 && v < BRAID_NUM_DTYPES) ? kNames[v] : "unknown";
}

BRAID_API const char* braid_redop_name(braid_redop_t op) {
  static const char* kNames[] = {"sum", "prod", "min", "max", "avg", "band", "bor", "bxor"};
  int v = raw_value(op);
  return (v >= 0 && v < BRAID_NUM_OPS) ? kNames[v] : "unknown";
}

// ---- communicators ----

BRAID_API braid_result_t braid_get_unique_id(braid_unique_id_t* id) {
  if (id == nullptr) return finish(Status::invalid_argument("id is NULL"));
  Config config;
  Status st = Config::from_env(&config);
  if (!st) return finish(st);
  SockAddr addr;
  // Without BRAID_SOCKET_IFNAME, a job that names its master (torchrun,
  // TorchDistributor) gets the interface that reaches MASTER_ADDR.
  const char* master = std::getenv("MASTER_ADDR");
  SockAddr master_addr;
  if (config.socket_ifname.empty() && master != nullptr && *master != '\0' &&
      SockAddr::parse(master, 0, &master_addr).is_ok()) {
    st = local_address_toward(master_addr, &addr);
  } else {
    st = choose_local_address(config.socket_ifname, &addr);
  }
  if (!st) return finish(st.with_context("choosing the rendezvous address"));
  UniqueId u;
  u.token = random_token();
  st = start_rendezvous_root(addr, u.token, config.timeout_s, &u.root);
  if (!st) return finish(st.with_context("starting the rendezvous root"));
  u.encode(id->internal);
  return BRAID_SUCCESS;
}

namespace {

braid_result_t init_with(braid_comm_t* out, const UniqueId& id, int nranks, int rank, const Config& config) {
  std::unique_ptr<Bootstrap> b;
  Deadline deadline = Deadline::after_seconds(config.timeout_s);
  Status st = Bootstrap::join(id, rank, nranks, config.socket_ifname, deadline, &b);
  std::shared_ptr<Communicator> comm;
  if (st) st = Communicator::create(std::move(b), config, &comm);
  if (!st) return finish(st);
  *out = reinterpret_cast<braid_comm_t>(comms().add(std::move(comm)));
  return BRAID_SUCCESS;
}

}  // namespace

BRAID_API braid_result_t braid_comm_init_rank(braid_comm_t* comm, int nranks, braid_unique_id_t id,
                                              int rank) {
  BRAID_REFUSE_IN_CALLBACK("comm_init_rank");
  if (comm == nullptr)
    return finish(Status::invalid_argument("comm is NULL (where should the communicator go?)"));
  *comm = nullptr;
  if (nranks < 1)
    return finish(Status::invalid_argument("nranks=" + std::to_string(nranks) + " must be at least 1"));
  if (nranks > kMaxRanks)
    return finish(Status::invalid_argument("nranks=" + std::to_string(nranks) + " exceeds the most ranks a " +
                                           "communicator may have, " + std::to_string(kMaxRanks)));
  if (rank < 0 || rank >= nranks)
    return finish(Status::invalid_argument("rank=" + std::to_string(rank) +
                                           " is out of range for nranks=" + std::to_string(nranks)));
  UniqueId u;
  Status st = UniqueId::decode(id.internal, &u);
  if (!st) return finish(st);
  Config config;
  st = Config::from_env(&config);
  if (!st) return finish(st);
  return init_with(comm, u, nranks, rank, config);
}

BRAID_API braid_result_t braid_comm_init_env(braid_comm_t* comm) {
  BRAID_REFUSE_IN_CALLBACK("comm_init_env");
  if (comm == nullptr)
    return finish(Status::invalid_argument("comm is NULL (where should the communicator go?)"));
  *comm = nullptr;
  Config config;
  Status st = Config::from_env(&config);
  if (!st) return finish(st);
  const char* master = std::getenv("MASTER_ADDR");
  if (master == nullptr || *master == '\0')
    return finish(Status::invalid_argument("environment variable MASTER_ADDR is not set (torchrun sets it)"));
  long port = 0, rank = 0, world = 0, root_port = 0;
  bool present = false;
  st = env_int("MASTER_PORT", 1, 65535, &port, &present);
  if (st && !present) st = Status::invalid_argument("environment variable MASTER_PORT is not set");
  if (st) st = env_int("WORLD_SIZE", 1, kMaxRanks, &world, &present);
  if (st && !present) st = Status::invalid_argument("environment variable WORLD_SIZE is not set");
  if (st) st = env_int("RANK", 0, world - 1, &rank, &present);
  if (st && !present) st = Status::invalid_argument("environment variable RANK is not set");
  root_port = port + 1;
  if (st) st = env_int("BRAID_ROOT_PORT", 1, 65535, &root_port, &present);
  if (st && !present && port == 65535)
    st = Status::invalid_argument(
        "MASTER_PORT=65535 leaves no port above it for braid's rendezvous root (MASTER_PORT+1); "
        "set BRAID_ROOT_PORT");
  if (!st) return finish(st);
  UniqueId u;
  st = SockAddr::parse(master, static_cast<uint16_t>(root_port), &u.root);
  if (!st) return finish(st.with_context("MASTER_ADDR"));
  // The token binds ranks of this job: from BRAID_JOB_TOKEN when set (a
  // secret), else derived from what every rank of the job sees alike.
  // Not WORLD_SIZE: a rank that disagrees on it must reach the root, which
  // tells it so (a different token would make it a stranger, not answered).
  std::string seed = std::string(master) + ":" + std::to_string(port);
  if (const char* t = std::getenv("BRAID_JOB_TOKEN")) seed += std::string("/") + t;
  if (const char* t = std::getenv("TORCHELASTIC_RUN_ID")) seed += std::string("/") + t;
  uint64_t h1 = 1469598103934665603ull, h2 = 1099511628211ull;
  for (unsigned char ch : seed) {
    h1 = (h1 ^ ch) * 1099511628211ull;
    h2 = (h2 + ch) * 6364136223846793005ull + 1442695040888963407ull;
  }
  std::memcpy(u.token.data(), &h1, 8);
  std::memcpy(u.token.data() + 8, &h2, 8);
  if (rank == 0) {
    SockAddr any = u.root;
    st = start_rendezvous_root(any, u.token, config.timeout_s, &any);
    if (!st)
      return finish(
          st.with_context("rank 0 starting the rendezvous root on " + u.root.str() +
                          " (MASTER_ADDR must be this host; set BRAID_ROOT_PORT to move the port)"));
  }
  return init_with(comm, u, static_cast<int>(world), static_cast<int>(rank), config);
}

BRAID_API braid_result_t braid_comm_split(braid_comm_t handle, int color, int key, braid_comm_t* newcomm) {
  BRAID_REFUSE_IN_CALLBACK("comm_split");
  if (newcomm == nullptr) return finish(Status::invalid_argument("newcomm is NULL"));
  *newcomm = nullptr;
  std::shared_ptr<Communicator> comm;
  Status st = lookup(handle, &comm);
  if (!st) return finish(st.with_context("comm_split"));
  std::shared_ptr<Communicator> child;
  st = comm->split(color, key, &child);
  if (!st)
    return finish(st.with_context("rank " + std::to_string(comm->rank()) + ": comm_split"), comm.get());
  if (child) *newcomm = reinterpret_cast<braid_comm_t>(comms().add(std::move(child)));
  return BRAID_SUCCESS;
}

BRAID_API braid_result_t braid_comm_destroy(braid_comm_t handle) {
  BRAID_REFUSE_IN_CALLBACK("comm_destroy");
  if (handle == nullptr) return finish(Status::invalid_argument("comm is NULL"));
  if (t_group_depth > 0) {
    // Its ops would start at group_end on a destroyed communicator.
    std::shared_ptr<Communicator> live;
    const auto holds = [&] {
      if (group().deferred_comm == live) return true;
      for (const Pending& p : group().ops)
        if (p.comm == live) return true;
      return false;
    };
    if (lookup(handle, &live) && holds())
      return finish(Status::invalid_usage(
          "comm_destroy: this thread's open group holds operations on the communicator; end the group "
          "first"));
  }
  const uintptr_t id = id_of(handle);
  std::shared_ptr<Communicator> comm;
  {
    // Taken and listed as draining in one step: an abort finds it in one place or the other.
    std::lock_guard<std::mutex> lock(draining_mu());
    comm = comms().take(id);
    if (comm && !comm->forked()) draining()[id].comm = comm.get();
  }
  if (!comm)
    return finish(
        Status::invalid_argument("comm_destroy: comm is not a live communicator (destroyed twice?)"));
  if (comm->forked()) {
    // The parent's: its progress thread is not in this process, and closing
    // its sockets or marking its shared memory would break the parent's job.
    // The child's copy is left as it is.
    static auto* kept = new std::vector<std::shared_ptr<Communicator>>();
    kept->push_back(std::move(comm));
    return BRAID_SUCCESS;
  }
  // While destroy waits for the communicator's operations, abort (from
  // another thread, a watchdog's) still finds it and cancels them: the
  // handle is gone for every other call.
  comm->engine().drain();
  Status unclaimed = comm->engine().unclaimed_messages();
  // A call of this rank's that failed (refused, say) may be why a peer's
  // message was left: say so, since it is the likelier cause.
  if (const std::string mine = comm->last_error(); !unclaimed && !mine.empty())
    unclaimed = Status(unclaimed.code(),
                       unclaimed.message() + " (or: this rank's own call failed before: " + mine + ")");
  {
    std::unique_lock<std::mutex> lock(draining_mu());
    draining_cv().wait(lock, [id] { return !draining()[id].aborting; });
    draining().erase(id);
  }
  comm.reset();  // the last reference: freed before destroy returns, also on error
  return unclaimed ? BRAID_SUCCESS : finish(unclaimed);
}

BRAID_API braid_result_t braid_comm_abort(braid_comm_t handle) {
  BRAID_REFUSE_IN_CALLBACK("comm_abort");
  if (handle == nullptr) return finish(Status::invalid_argument("comm is NULL"));
  const uintptr_t id = id_of(handle);
  std::shared_ptr<Communicator> comm;
  Status st = lookup(handle, &comm);  // names what is wrong with the handle
  Communicator* being_destroyed = nullptr;
  {
    std::lock_guard<std::mutex> lock(draining_mu());
    comm = st ? comms().take(id) : nullptr;
    if (!comm) {
      auto it = draining().find(id);
      if (it == draining().end() || it->second.aborted) {
        if (st) st = Status::invalid_argument("comm is not a live communicator");
        return finish(st.with_context("comm_abort"));
      }
      if (it->second.comm->forked())  // a child of a process that was destroying it
        return finish(
            Status::invalid_usage("comm_abort: the communicator belongs to the parent of this "
                                  "forked process"));
      it->second.aborted = it->second.aborting = true;
      being_destroyed = it->second.comm;
    }
  }
  const auto why = [](const Communicator& c) {
    return Status::aborted("rank " + std::to_string(c.rank()) + ": communicator aborted by braid_comm_abort");
  };
  if (being_destroyed != nullptr) {
    being_destroyed->abort(why(*being_destroyed));
    {
      std::lock_guard<std::mutex> lock(draining_mu());
      draining()[id].aborting = false;
    }
    draining_cv().notify_all();
    return BRAID_SUCCESS;
  }
  comm->abort(why(*comm));
  return BRAID_SUCCESS;
}

BRAID_API braid_result_t braid_comm_rank(braid_comm_t handle, int* rank) {
  std::shared_ptr<Communicator> comm;
  Status st = lookup(handle, &comm);
  if (st && rank == nullptr) st = Status::invalid_argument("rank is NULL");
  if (!st) return finish(st.with_context("comm_rank"));
  *rank = comm->rank();
  return BRAID_SUCCESS;
}

BRAID_API braid_result_t braid_comm_size(braid_comm_t handle, int* size) {
  std::shared_ptr<Communicator> comm;
  Status st = lookup(handle, &comm);
  if (st && size == nullptr) st = Status::invalid_argument("size is NULL");
  if (!st) return finish(st.with_context("comm_size"));
  *size = comm->nranks();
  return BRAID_SUCCESS;
}

BRAID_API braid_result_t braid_comm_get_async_error(braid_comm_t handle, braid_result_t* async_error) {
  std::shared_ptr<Communicator> comm;
  Status st = lookup(handle, &comm);
  if (st && async_error == nullptr) st = Status::invalid_argument("async_error is NULL");
  if (!st) return finish(st.with_context("comm_get_async_error"));
  Status err = comm->engine().error();
  *async_error = err.code();
  if (!err.is_ok()) comm->set_last_error(err.message());
  return BRAID_SUCCESS;
}

BRAID_API braid_result_t braid_comm_dump(braid_comm_t handle) {
  std::shared_ptr<Communicator> comm;
  if (Status st = lookup(handle, &comm); !st) return finish(st.with_context("comm_dump"));
  comm->engine().request_dump();
  return BRAID_SUCCESS;
}

BRAID_API braid_result_t braid_comm_transport_bytes(braid_comm_t handle, const char* transport,
                                                    uint64_t* bytes) {
  std::shared_ptr<Communicator> comm;
  Status st = lookup(handle, &comm);
  if (st && bytes == nullptr) st = Status::invalid_argument("bytes is NULL");
  if (st) st = comm->transport_bytes(transport, bytes);
  if (!st) return finish(st.with_context("comm_transport_bytes"), comm.get());
  return BRAID_SUCCESS;
}

// ---- registered host memory ----

BRAID_API braid_result_t braid_mem_alloc(void** ptr, size_t bytes) {
  return finish(shared_alloc(bytes, ptr).with_context("mem_alloc"));
}

BRAID_API braid_result_t braid_mem_free(void* ptr) {
  return finish(shared_free(ptr).with_context("mem_free"));
}

BRAID_API braid_result_t braid_comm_register(braid_comm_t handle, void* buf, size_t bytes) {
  BRAID_REFUSE_IN_CALLBACK("comm_register");
  std::shared_ptr<Communicator> comm;
  Status st = lookup(handle, &comm);
  if (st) st = comm->register_window(buf, bytes);
  if (!st) return finish(st.with_context("comm_register"), comm.get());
  return BRAID_SUCCESS;
}

BRAID_API braid_result_t braid_comm_deregister(braid_comm_t handle, void* buf) {
  BRAID_REFUSE_IN_CALLBACK("comm_deregister");
  std::shared_ptr<Communicator> comm;
  Status st = lookup(handle, &comm);
  if (st) st = comm->deregister_window(buf);
  if (!st) return finish(st.with_context("comm_deregister"), comm.get());
  return BRAID_SUCCESS;
}

BRAID_API braid_result_t braid_comm_set_timeout(braid_comm_t handle, double seconds) {
  std::shared_ptr<Communicator> comm;
  Status st = lookup(handle, &comm);
  if (st && !(seconds > 0 && seconds <= 1e9))
    st = Status::invalid_argument("seconds=" + std::to_string(seconds) + " must be in (0, 1e9]");
  if (!st) return finish(st.with_context("comm_set_timeout"), comm.get());
  comm->engine().set_timeout_s(seconds);
  return BRAID_SUCCESS;
}

// ---- requests ----

namespace braid {
namespace {
// An op of this thread's open group starts only at braid_group_end: a wait
// for it before then would never end.
Status not_in_open_group(const Request& req, const char* what) {
  if (t_group_depth == 0) return Status::ok();
  for (const Pending& p : group().ops)
    if (p.op == req.op)
      return Status::invalid_usage(std::string(what) + ": the request's " + req.op->name +
                                   " is in a group that has not ended; it starts at braid_group_end, so "
                                   "wait for it after that call");
  return Status::ok();
}
}  // namespace
}  // namespace braid

BRAID_API braid_result_t braid_wait(braid_request_t* request) {
  BRAID_REFUSE_IN_CALLBACK("wait");
  if (request == nullptr || *request == nullptr)
    return finish(Status::invalid_argument("wait: request is NULL"));
  if (t_group_depth > 0)
    if (std::shared_ptr<Request> live = requests().get(id_of(*request)))
      if (Status st = not_in_open_group(*live, "wait"); !st) return finish(st);
  std::shared_ptr<Request> req = requests().take(id_of(*request));
  if (!req)
    return finish(Status::invalid_argument("wait: request is not a live request (already completed?)"));
  *request = nullptr;
  std::shared_ptr<Communicator> comm;
  if (Status st = req->live(&comm); !st) return finish(st.with_context("wait"));
  if (comm && !req->op->posted.load(std::memory_order_acquire)) {
    // Its op waits in another thread's open group: it has no deadline until
    // that group ends, so this wait takes the communicator's.
    const Deadline deadline = Deadline::after_seconds(comm->engine().timeout_s());
    while (!req->op->posted.load(std::memory_order_acquire) && !deadline.expired())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!req->op->posted.load(std::memory_order_acquire))
      return finish(Status::timeout("wait: the request's " + std::string(req->op->name) +
                                    " is in another thread's group that did not end within the timeout of " +
                                    seconds_text(comm->engine().timeout_s())),
                    comm.get());
  }
  if (comm) (void)comm->engine().wait(*req->op);
  req->op->await_callback();
  return finish(req->op->status, comm.get());
}

BRAID_API braid_result_t braid_test(braid_request_t* request, int* done) {
  BRAID_REFUSE_IN_CALLBACK("test");
  if (request == nullptr || *request == nullptr || done == nullptr)
    return finish(Status::invalid_argument(request == nullptr ? "test: request is NULL"
                                           : *request == nullptr
                                               ? "test: *request is NULL (already completed?)"
                                               : "test: done is NULL"));
  *done = 0;
  std::shared_ptr<Request> req = requests().get(id_of(*request));
  if (!req)
    return finish(Status::invalid_argument("test: request is not a live request (already completed?)"));
  if (Status st = not_in_open_group(*req, "test"); !st) return finish(st);
  // Like MPI_Test, a test moves the op along: a caller polling for it
  // needs no progress thread to wake.
  std::shared_ptr<Communicator> comm;
  if (Status st = req->live(&comm); !st) return finish(st.with_context("test"));
  if (comm && !comm->engine().drive_a_moment(*req->op)) return BRAID_SUCCESS;
  req->op->await_callback();
  requests().take(id_of(*request));
  *request = nullptr;
  *done = 1;
  return finish(req->op->status, comm.get());
}

BRAID_API braid_result_t braid_wait_all(int count, braid_request_t* reqs) {
  if (count < 0)
    return finish(Status::invalid_argument("wait_all: count is negative (" + std::to_string(count) + ")"));
  if (count > 0 && reqs == nullptr)
    return finish(Status::invalid_argument("wait_all: requests is NULL with count " + std::to_string(count)));
  braid_result_t first = BRAID_SUCCESS;
  std::string message;
  for (int i = 0; i < count; ++i) {
    if (reqs[i] == nullptr) continue;
    braid_result_t r = braid_wait(&reqs[i]);
    if (r != BRAID_SUCCESS && first == BRAID_SUCCESS) {
      first = r;
      message = thread_last_error();
    }
  }
  if (first != BRAID_SUCCESS) thread_last_error() = message;
  return first;
}

BRAID_API braid_result_t braid_request_free(braid_request_t request) {
  if (request == nullptr) return finish(Status::invalid_argument("request_free: request is NULL"));
  if (!requests().take(id_of(request)))
    return finish(Status::invalid_argument("request_free: request is not a live request"));
  return BRAID_SUCCESS;
}

BRAID_API braid_result_t braid_request_set_callback(braid_request_t request, braid_callback_t callback,
                                                    void* user) {
  if (request == nullptr || callback == nullptr)
    return finish(Status::invalid_argument(request == nullptr ? "request_set_callback: request is NULL"
                                                              : "request_set_callback: callback is NULL"));
  std::shared_ptr<Request> req = requests().get(id_of(request));
  if (!req) return finish(Status::invalid_argument("request_set_callback: request is not a live request"));
  std::shared_ptr<Communicator> comm;
  if (Status st = req->live(&comm); !st) return finish(st.with_context("request_set_callback"));
  if (req->callback_set.exchange(true))
    return finish(Status::invalid_usage("request_set_callback: this request already has a callback"));
  req->op->set_callback(
      [callback, user](const Status& st) { callback(user, st.code(), st.message().c_str()); });
  return BRAID_SUCCESS;
}

// ---- groups ----

BRAID_API braid_result_t braid_group_start(void) {
  ++t_group_depth;
  return BRAID_SUCCESS;
}

BRAID_API braid_result_t braid_group_end(void) {
  BRAID_REFUSE_IN_CALLBACK("group_end");
  if (t_group_depth == 0) return finish(Status::invalid_usage("group_end without a matching group_start"));
  if (--t_group_depth > 0) return BRAID_SUCCESS;
  if (GroupState& g = group(); !g.deferred.empty()) {
    if (g.refused.is_ok() && g.deferred_comm->run_p2p_inline(g.deferred.data(), g.deferred.size())) {
      g.deferred.clear();
      g.deferred_comm.reset();
      return BRAID_SUCCESS;
    }
    make_deferred_ops();  // those not done; a refused call's group makes them all
  }
  std::vector<Pending> ops;
  ops.swap(group().ops);
  Status first;
  // A call the group refused: its peers made theirs, and this rank's other
  // ops of the group on that communicator are made too, so the call cannot
  // be made again there. The communicator is aborted (its peers learn why at
  // once) and group_end reports the refusal, as NCCL's reports a group's
  // first error.
  if (Status refused = std::exchange(group().refused, Status()); !refused.is_ok()) {
    std::shared_ptr<Communicator> comm = std::move(group().refused_comm);
    first = Status(refused.code(), "a call in this group was refused: " + refused.message());
    std::vector<Communicator*> aborted;
    for (const Pending& p : ops)
      if ((comm == nullptr || p.comm == comm) &&
          std::find(aborted.begin(), aborted.end(), p.comm.get()) == aborted.end()) {
        p.comm->engine().abort(first);
        p.comm->set_last_error(first.message());
        aborted.push_back(p.comm.get());
      }
    if (comm != nullptr) comm->set_last_error(first.message());
  }
  // Every stream-ordered call is staged before any stream waits for one:
  // their host ops may need each other (a send and the matching recv).
  // A call that cannot be enqueued breaks its communicator, since the
  // others' ops are made already and its peers would wait for it.
  for (int phase = 0; phase < 2; ++phase) {
    for (auto& p : ops) {
      if (!p.staged || p.staged->block == nullptr) continue;
      Status st = phase == 0 ? enqueue_stage_in(*p.staged) : enqueue_stage_out(*p.staged);
      if (st) continue;
      p.op->on_complete = nullptr;  // give_up settled its block
      st = st.with_context("rank " + std::to_string(p.comm->rank()) + ": " + p.op->name + " in a group");
      p.comm->engine().abort(st);
      if (first.is_ok()) first = st;
    }
  }
  for (auto& p : ops) p.comm->engine().post(p.op);
  // The blocking ops of each communicator, waited for together.
  // Taken out of the thread's state while in use, so a group_end that runs
  // inside this one (a callback that breaks the rules) gets lists of its own.
  std::vector<Op*> waiting;
  std::vector<Engine*> engines;  // those with blocking ops (a group usually has one)
  waiting.swap(group().waiting);
  engines.swap(group().engines);
  for (const Pending& p : ops)
    if (p.blocking && std::find(engines.begin(), engines.end(), &p.comm->engine()) == engines.end())
      engines.push_back(&p.comm->engine());
  // This thread drives one communicator at a time: the progress threads
  // drive the others meanwhile, since their ops may be what a peer waits
  // for before it can finish ours.
  if (engines.size() > 1)
    for (Engine* engine : engines) engine->wake_progress_thread();
  for (Engine* engine : engines) {
    waiting.clear();
    for (const Pending& q : ops)
      if (q.blocking && &q.comm->engine() == engine) waiting.push_back(q.op.get());
    engine->wait_all(waiting.data(), waiting.size());
  }
  waiting.clear();
  engines.clear();
  group().waiting.swap(waiting);
  group().engines.swap(engines);
  for (auto& p : ops) {
    if (!p.blocking) continue;
    const Status& st = p.op->status;
    if (!st && first.is_ok()) {
      first = st;
      p.comm->set_last_error(st.message());
    }
  }
  // The list's memory serves the thread's next group.
  ops.clear();
  if (group().ops.empty()) group().ops.swap(ops);
  return finish(first);
}

// ---- operations ----

#define BRAID_CALL(kind, req, ...)                          \
  do {                                                      \
    Call c{kind, CollArgs{__VA_ARGS__}, comm, stream, req}; \
    return submit(c);                                       \
  } while (0)

namespace {

// A point-to-point call, tagged (tag 0: the untagged forms).
braid_result_t submit_p2p(OpKind kind, const void* sendbuf, void* recvbuf, size_t count, braid_dtype_t dtype,
                          int peer, int* source, uint32_t tag, braid_comm_t comm, braid_stream_t stream,
                          braid_request_t* request) {
  CollArgs a{sendbuf, recvbuf, count, dtype, BRAID_SUM, 0, peer};
  a.source = source;
  a.tag = tag;
  return submit(Call{kind, a, comm, stream, request});
}

}  // namespace

BRAID_API braid_result_t braid_send(const void* buf, size_t count, braid_dtype_t dtype, int peer,
                                    braid_comm_t comm, braid_stream_t stream) {
  return submit_p2p(OpKind::kSend, buf, nullptr, count, dtype, peer, nullptr, 0, comm, stream, nullptr);
}
BRAID_API braid_result_t braid_recv(void* buf, size_t count, braid_dtype_t dtype, int peer, braid_comm_t comm,
                                    braid_stream_t stream) {
  return submit_p2p(OpKind::kRecv, nullptr, buf, count, dtype, peer, nullptr, 0, comm, stream, nullptr);
}
BRAID_API braid_result_t braid_isend(const void* buf, size_t count, braid_dtype_t dtype, int peer,
                                     braid_comm_t comm, braid_stream_t stream, braid_request_t* request) {
  if (request_arg(request, comm) != BRAID_SUCCESS) return BRAID_ERR_INVALID_ARGUMENT;
  return submit_p2p(OpKind::kSend, buf, nullptr, count, dtype, peer, nullptr, 0, comm, stream, request);
}
BRAID_API braid_result_t braid_irecv(void* buf, size_t count, braid_dtype_t dtype, int peer,
                                     braid_comm_t comm, braid_stream_t stream, braid_request_t* request) {
  if (request_arg(request, comm) != BRAID_SUCCESS) return BRAID_ERR_INVALID_ARGUMENT;
  return submit_p2p(OpKind::kRecv, nullptr, buf, count, dtype, peer, nullptr, 0, comm, stream, request);
}
BRAID_API braid_result_t braid_send_tagged(const void* buf, size_t count, braid_dtype_t dtype, int peer,
                                           uint32_t tag, braid_comm_t comm, braid_stream_t stream) {
  return submit_p2p(OpKind::kSend, buf, nullptr, count, dtype, peer, nullptr, tag, comm, stream, nullptr);
}
BRAID_API braid_result_t braid_recv_tagged(void* buf, size_t count, braid_dtype_t dtype, int peer,
                                           uint32_t tag, braid_comm_t comm, braid_stream_t stream) {
  return submit_p2p(OpKind::kRecv, nullptr, buf, count, dtype, peer, nullptr, tag, comm, stream, nullptr);
}
BRAID_API braid_result_t braid_isend_tagged(const void* buf, size_t count, braid_dtype_t dtype, int peer,
                                            uint32_t tag, braid_comm_t comm, braid_stream_t stream,
                                            braid_request_t* request) {
  if (request_arg(request, comm) != BRAID_SUCCESS) return BRAID_ERR_INVALID_ARGUMENT;
  return submit_p2p(OpKind::kSend, buf, nullptr, count, dtype, peer, nullptr, tag, comm, stream, request);
}
BRAID_API braid_result_t braid_irecv_tagged(void* buf, size_t count, braid_dtype_t dtype, int peer,
                                            uint32_t tag, braid_comm_t comm, braid_stream_t stream,
                                            braid_request_t* request) {
  if (request_arg(request, comm) != BRAID_SUCCESS) return BRAID_ERR_INVALID_ARGUMENT;
  return submit_p2p(OpKind::kRecv, nullptr, buf, count, dtype, peer, nullptr, tag, comm, stream, request);
}

BRAID_API braid_result_t braid_all_reduce(const void* sendbuf, void* recvbuf, size_t count,
                                          braid_dtype_t dtype, braid_redop_t op, braid_comm_t comm,
                                          braid_stream_t stream) {
  BRAID_CALL(OpKind::kAllReduce, nullptr, sendbuf, recvbuf, count, dtype, op, 0, -1);
}
BRAID_API braid_result_t braid_broadcast(const void* sendbuf, void* recvbuf, size_t count,
                                         braid_dtype_t dtype, int root, braid_comm_t comm,
                                         braid_stream_t stream) {
  BRAID_CALL(OpKind::kBroadcast, nullptr, sendbuf, recvbuf, count, dtype, BRAID_SUM, root, -1);
}
BRAID_API braid_result_t braid_reduce(const void* sendbuf, void* recvbuf, size_t count, braid_dtype_t dtype,
                                      braid_redop_t op, int root, braid_comm_t comm, braid_stream_t stream) {
  BRAID_CALL(OpKind::kReduce, nullptr, sendbuf, recvbuf, count, dtype, op, root, -1);
}
BRAID_API braid_result_t braid_all_gather(const void* sendbuf, void* recvbuf, size_t sendcount,
                                          braid_dtype_t dtype, braid_comm_t comm, braid_stream_t stream) {
  BRAID_CALL(OpKind::kAllGather, nullptr, sendbuf, recvbuf, sendcount, dtype, BRAID_SUM, 0, -1);
}
BRAID_API braid_result_t braid_reduce_scatter(const void* sendbuf, void* recvbuf, size_t recvcount,
                                              braid_dtype_t dtype, braid_redop_t op, braid_comm_t comm,
                                              braid_stream_t stream) {
  BRAID_CALL(OpKind::kReduceScatter, nullptr, sendbuf, recvbuf, recvcount, dtype, op, 0, -1);
}
BRAID_API braid_result_t braid_gather(const void* sendbuf, void* recvbuf, size_t sendcount,
                                      braid_dtype_t dtype, int root, braid_comm_t comm,
                                      braid_stream_t stream) {
  BRAID_CALL(OpKind::kGather, nullptr, sendbuf, recvbuf, sendcount, dtype, BRAID_SUM, root, -1);
}
BRAID_API braid_result_t braid_scatter(const void* sendbuf, void* recvbuf, size_t recvcount,
                                       braid_dtype_t dtype, int root, braid_comm_t comm,
                                       braid_stream_t stream) {
  BRAID_CALL(OpKind::kScatter, nullptr, sendbuf, recvbuf, recvcount, dtype, BRAID_SUM, root, -1);
}
BRAID_API braid_result_t braid_all_to_all(const void* sendbuf, void* recvbuf, size_t count,
                                          braid_dtype_t dtype, braid_comm_t comm, braid_stream_t stream) {
  BRAID_CALL(OpKind::kAllToAll, nullptr, sendbuf, recvbuf, count, dtype, BRAID_SUM, 0, -1);
}
BRAID_API braid_result_t braid_barrier(braid_comm_t comm, braid_stream_t stream) {
  BRAID_CALL(OpKind::kBarrier, nullptr, nullptr, nullptr, 0, BRAID_UINT8, BRAID_SUM, 0, -1);
}

BRAID_API braid_result_t braid_recv_any(void* buf, size_t count, braid_dtype_t dtype, int* source,
                                        braid_comm_t comm, braid_stream_t stream) {
  return submit_p2p(OpKind::kRecvAny, nullptr, buf, count, dtype, -1, source, 0, comm, stream, nullptr);
}
BRAID_API braid_result_t braid_irecv_any(void* buf, size_t count, braid_dtype_t dtype, int* source,
                                         braid_comm_t comm, braid_stream_t stream, braid_request_t* request) {
  if (request_arg(request, comm) != BRAID_SUCCESS) return BRAID_ERR_INVALID_ARGUMENT;
  return submit_p2p(OpKind::kRecvAny, nullptr, buf, count, dtype, -1, source, 0, comm, stream, request);
}
BRAID_API braid_result_t braid_recv_any_tagged(void* buf, size_t count, braid_dtype_t dtype, int* source,
                                               uint32_t tag, braid_comm_t comm, braid_stream_t stream) {
  return submit_p2p(OpKind::kRecvAny, nullptr, buf, count, dtype, -1, source, tag, comm, stream, nullptr);
}
BRAID_API braid_result_t braid_irecv_any_tagged(void* buf, size_t count, braid_dtype_t dtype, int* source,
                                                uint32_t tag, braid_comm_t comm, braid_stream_t stream,
                                                braid_request_t* request) {
  if (request_arg(request, comm) != BRAID_SUCCESS) return BRAID_ERR_INVALID_ARGUMENT;
  return submit_p2p(OpKind::kRecvAny, nullptr, buf, count, dtype, -1, source, tag, comm, stream, request);
}

namespace {

// all_to_allv packs its four arrays into one layout (the op keeps a copy).
braid_result_t submit_all_to_allv(const void* sendbuf, const size_t* sendcounts, const size_t* sdispls,
                                  void* recvbuf, const size_t* recvcounts, const size_t* rdispls,
                                  braid_dtype_t dtype, braid_comm_t handle, braid_stream_t stream,
                                  braid_request_t* request) {
  std::shared_ptr<Communicator> comm;
  Status st = lookup(handle, &comm);
  if (!st) return refuse(st.with_context("all_to_allv"), nullptr);
  std::vector<size_t> layout;
  CollArgs a{sendbuf, recvbuf, 0, dtype, BRAID_SUM, 0, -1};
  const char* missing = sendcounts == nullptr   ? "sendcounts"
                        : sdispls == nullptr    ? "sdispls"
                        : recvcounts == nullptr ? "recvcounts"
                        : rdispls == nullptr    ? "rdispls"
                                                : nullptr;
  if (missing != nullptr)
    return refuse(Status::invalid_argument(std::string(missing) + " is NULL")
                      .with_context("rank " + std::to_string(comm->rank()) + ": all_to_allv"),
                  comm);
  const int n = comm->nranks();
  layout.reserve(4 * static_cast<size_t>(n));
  for (const size_t* arr : {sendcounts, sdispls, recvcounts, rdispls})
    layout.insert(layout.end(), arr, arr + n);
  a.layout = layout.data();
  return submit(Call{OpKind::kAllToAllv, a, handle, stream, request});
}

}  // namespace

BRAID_API braid_result_t braid_all_to_allv(const void* sendbuf, const size_t* sendcounts,
                                           const size_t* sdispls, void* recvbuf, const size_t* recvcounts,
                                           const size_t* rdispls, braid_dtype_t dtype, braid_comm_t comm,
                                           braid_stream_t stream) {
  return submit_all_to_allv(sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls, dtype, comm, stream,
                            nullptr);
}

BRAID_API braid_result_t braid_iall_to_allv(const void* sendbuf, const size_t* sendcounts,
                                            const size_t* sdispls, void* recvbuf, const size_t* recvcounts,
                                            const size_t* rdispls, braid_dtype_t dtype, braid_comm_t comm,
                                            braid_stream_t stream, braid_request_t* request) {
  if (request_arg(request, comm) != BRAID_SUCCESS) return BRAID_ERR_INVALID_ARGUMENT;
  return submit_all_to_allv(sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls, dtype, comm, stream,
                            request);
}

#define BRAID_ICALL(kind, ...)                                                          \
  do {                                                                                  \
    if (request_arg(request, comm) != BRAID_SUCCESS) return BRAID_ERR_INVALID_ARGUMENT; \
    BRAID_CALL(kind, request, __VA_ARGS__);                                             \
  } while (0)

BRAID_API braid_result_t braid_iall_reduce(const void* sendbuf, void* recvbuf, size_t count,
                                           braid_dtype_t dtype, braid_redop_t op, braid_comm_t comm,
                                           braid_stream_t stream, braid_request_t* request) {
  BRAID_ICALL(OpKind::kAllReduce, sendbuf, recvbuf, count, dtype, op, 0, -1);
}
BRAID_API braid_result_t braid_ibroadcast(const void* sendbuf, void* recvbuf, size_t count,
                                          braid_dtype_t dtype, int root, braid_comm_t comm,
                                          braid_stream_t stream, braid_request_t* request) {
  BRAID_ICALL(OpKind::kBroadcast, sendbuf, recvbuf, count, dtype, BRAID_SUM, root, -1);
}
BRAID_API braid_result_t braid_ireduce(const void* sendbuf, void* recvbuf, size_t count, braid_dtype_t dtype,
                                       braid_redop_t op, int root, braid_comm_t comm, braid_stream_t stream,
                                       braid_request_t* request) {
  BRAID_ICALL(OpKind::kReduce, sendbuf, recvbuf, count, dtype, op, root, -1);
}
BRAID_API braid_result_t braid_iall_gather(const void* sendbuf, void* recvbuf, size_t sendcount,
                                           braid_dtype_t dtype, braid_comm_t comm, braid_stream_t stream,
                                           braid_request_t* request) {
  BRAID_ICALL(OpKind::kAllGather, sendbuf, recvbuf, sendcount, dtype, BRAID_SUM, 0, -1);
}
BRAID_API braid_result_t braid_ireduce_scatter(const void* sendbuf, void* recvbuf, size_t recvcount,
                                               braid_dtype_t dtype, braid_redop_t op, braid_comm_t comm,
                                               braid_stream_t stream, braid_request_t* request) {
  BRAID_ICALL(OpKind::kReduceScatter, sendbuf, recvbuf, recvcount, dtype, op, 0, -1);
}
BRAID_API braid_result_t braid_igather(const void* sendbuf, void* recvbuf, size_t sendcount,
                                       braid_dtype_t dtype, int root, braid_comm_t comm,
                                       braid_stream_t stream, braid_request_t* request) {
  BRAID_ICALL(OpKind::kGather, sendbuf, recvbuf, sendcount, dtype, BRAID_SUM, root, -1);
}
BRAID_API braid_result_t braid_iscatter(const void* sendbuf, void* recvbuf, size_t recvcount,
                                        braid_dtype_t dtype, int root, braid_comm_t comm,
                                        braid_stream_t stream, braid_request_t* request) {
  BRAID_ICALL(OpKind::kScatter, sendbuf, recvbuf, recvcount, dtype, BRAID_SUM, root, -1);
}
BRAID_API braid_result_t braid_iall_to_all(const void* sendbuf, void* recvbuf, size_t count,
                                           braid_dtype_t dtype, braid_comm_t comm, braid_stream_t stream,
                                           braid_request_t* request) {
  BRAID_ICALL(OpKind::kAllToAll, sendbuf, recvbuf, count, dtype, BRAID_SUM, 0, -1);
}
BRAID_API braid_result_t braid_ibarrier(braid_comm_t comm, braid_stream_t stream, braid_request_t* request) {
  BRAID_ICALL(OpKind::kBarrier, nullptr, nullptr, 0, BRAID_UINT8, BRAID_SUM, 0, -1);
}

BRAID_API braid_result_t braid_reduce_local(void* dst, const void* a, const void* b, size_t count,
                                            braid_dtype_t dtype, braid_redop_t op) {
  Status st = check_dtype(dtype);
  if (st) st = check_redop(op, dtype);
  if (st) st = check_count(count, dtype, 1, "count");
  if (st) st = check_buffer(nullptr, dst, count, "dst", "count");
  if (st) st = check_buffer(nullptr, a, count, "a", "count");
  if (st) st = check_buffer(nullptr, b, count, "b", "count");
  // The kernels read and write whole vectors: dst may be a or b exactly,
  // but a partial overlap would read elements already overwritten.
  const size_t bytes = count * dtype_size(dtype);
  auto overlaps_partly = [&](const void* src) {
    const auto d = reinterpret_cast<uintptr_t>(dst), x = reinterpret_cast<uintptr_t>(src);
    return d != x && d < x + bytes && x < d + bytes;
  };
  if (st && count > 0) {
    for (auto [src, name] : {std::pair{a, "a"}, std::pair{b, "b"}})
      if (overlaps_partly(src)) {
        st = Status::invalid_argument(std::string("dst overlaps ") + name +
                                      " partly (it may be the same buffer, or apart from it)");
        break;
      }
  }
  if (!st) return finish(st.with_context("reduce_local"));
  kernels::reduce(dtype, op, dst, a, b, count);
  return BRAID_SUCCESS;
}
