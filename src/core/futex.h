// Futex wait/wake on a 32-bit word, in private or shared (cross-process) memory.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>

namespace braid {

// Sleeps while *word == expected, at most timeout_ms. Spurious returns are fine.
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_ms, bool shared) {
  struct timespec ts = {timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, expected,
          &ts, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word, bool shared) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, INT_MAX,
          nullptr, nullptr, 0);
}

// An event count: waiters sleep until someone rings it. `sleepers` lets the
// ringer skip the syscall when nobody sleeps (the common, fast case).
struct Doorbell {
  std::atomic<uint32_t> seq{0};
  std::atomic<uint32_t> sleepers{0};

  // The ringer publishes its data first; the fence orders that store before
  // the sleepers load (a waiter increments sleepers before its last check),
  // so either the waiter sees the data or we see the waiter. Only then is the
  // shared cache line written and the syscall made.
  void ring(bool shared) {
#if defined(__SANITIZE_THREAD__)
    // TSan does not model fences; a seq_cst read-modify-write orders the same.
    if (sleepers.fetch_add(0, std::memory_order_seq_cst) == 0) return;
#else
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_relaxed) == 0) return;
#endif
    seq.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&seq, shared);
  }
};

}  // namespace braid
