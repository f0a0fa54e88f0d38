// Operations are C++20 coroutines: an algorithm reads as straight-line code
// over the channel primitives, and every place it would wait is a co_await
// that suspends it instead. The engine resumes it when what it waits for is
// ready, so many operations progress on one thread without blocking it.
#pragma once

#include <coroutine>
#include <cstddef>
#include <exception>
#include <utility>

#include "src/core/status.h"

namespace braid {

class Op;
class Connection;

// What a suspended operation is waiting for: a readiness check the engine
// polls, the connections it waits on (for poll() and liveness checks), and a
// description for timeouts and dumps.
struct WaitPoint {
  bool (*ready)(void* ctx) = nullptr;
  void* ctx = nullptr;
  int peer = -1;
  const char* what = "";
  Connection* conn[2] = {nullptr, nullptr};
  short events[2] = {0, 0};  // POLLIN: waiting for a message; POLLOUT: for a free send slot
};

// Initial-exec TLS: a %fs-relative load, where the general model calls into
// the dynamic linker on every access. For the few small variables every call
// touches. A library loaded with dlopen (braid_torch under Python) takes its
// initial-exec TLS from the space glibc keeps for that
// (rtld.optional_static_tls, 512 bytes); braid's need 37.
#define BRAID_FAST_TLS __attribute__((tls_model("initial-exec")))

// The op being resumed on this thread (set by the engine around resume()).
Op*& current_op();
void op_suspend(Op* op, std::coroutine_handle<> leaf, const WaitPoint* wait);
void op_finished(Op* op);

// Coroutine frames come and go with every operation: recycle them through
// small per-thread free lists instead of the general allocator.
void* frame_alloc(size_t bytes);
void frame_free(void* frame, size_t bytes);

// A lazily started coroutine that can be co_awaited by another Task.
class [[nodiscard]] Task {
 public:
  struct promise_type {
    std::coroutine_handle<> continuation;
    Op* top_level_op = nullptr;  // set only on an op's outermost task

    static void* operator new(size_t bytes) { return frame_alloc(bytes); }
    static void operator delete(void* frame, size_t bytes) { frame_free(frame, bytes); }

    Task get_return_object() { return Task(std::coroutine_handle<promise_type>::from_promise(*this)); }
    std::suspend_always initial_suspend() noexcept { return {}; }
    struct FinalAwaiter {
      bool await_ready() noexcept { return false; }
      std::coroutine_handle<> await_suspend(std::coroutine_handle<promise_type> h) noexcept {
        promise_type& p = h.promise();
        if (p.continuation) return p.continuation;
        if (p.top_level_op != nullptr) op_finished(p.top_level_op);
        return std::noop_coroutine();
      }
      void await_resume() noexcept {}
    };
    FinalAwaiter final_suspend() noexcept { return {}; }
    void return_void() {}
    void unhandled_exception() { std::terminate(); }
  };

  Task() = default;
  explicit Task(std::coroutine_handle<promise_type> h) : h_(h) {}
  Task(Task&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  Task& operator=(Task&& o) noexcept {
    if (this != &o) {
      if (h_) h_.destroy();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() {
    if (h_) h_.destroy();
  }

  std::coroutine_handle<promise_type> handle() const { return h_; }

  auto operator co_await() && noexcept {
    struct Awaiter {
      std::coroutine_handle<promise_type> child;
      bool await_ready() noexcept { return !child || child.done(); }
      std::coroutine_handle<> await_suspend(std::coroutine_handle<> parent) noexcept {
        child.promise().continuation = parent;
        return child;
      }
      void await_resume() noexcept {}
    };
    return Awaiter{h_};
  }

 private:
  std::coroutine_handle<promise_type> h_;
};

// What a primitive returns when its work can often be done in the call: a
// step already done (no coroutine frame made), or the coroutine that does
// the rest. co_await it at once, as a Task (a small message's send, or its
// receive when the message is in, then costs no frame).
class [[nodiscard]] Step {
 public:
  Step() = default;  // done: an empty Task, which co_await finds ready
  Step(Task rest) : rest_(std::move(rest)) {}
  // Awaited as its Task; the frame lives until the Step temporary dies.
  auto operator co_await() && noexcept { return std::move(rest_).operator co_await(); }

 private:
  Task rest_;
};

// co_await until(check, ctx, peer, what): suspends until check(ctx) is true.
struct Until {
  WaitPoint wp;
  bool await_ready() { return wp.ready(wp.ctx); }
  void await_suspend(std::coroutine_handle<> h) { op_suspend(current_op(), h, &wp); }
  void await_resume() {}
};

// co_await FailOp{status}: records an error on the current op and suspends it
// for good; the engine then fails the communicator with it.
struct FailOp {
  Status why;
  static bool never(void*);
  WaitPoint wp{never, nullptr, -1, "after an error", {nullptr, nullptr}, {0, 0}};
  bool await_ready() { return false; }
  void await_suspend(std::coroutine_handle<> h);
  void await_resume() {}
};

}  // namespace braid
