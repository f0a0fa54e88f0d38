// Lets poll() wait on a shared-memory doorbell beside sockets.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#include "src/core/futex.h"

namespace braid {

// poll() cannot watch a futex, so a driver waiting on shm and tcp at once
// had to wake every 100 us to look at shared memory (16% of a core over a
// long wait). While armed, this thread sleeps on the doorbell's futex and
// makes an eventfd readable when it rings, so the driver can sleep in poll()
// on that eventfd and its sockets. A ring then costs one more thread wake-up,
// which is why the engine arms it only for waits that have lasted a while.
class DoorbellWatcher {
 public:
  DoorbellWatcher(Doorbell* bell, int event_fd);
  ~DoorbellWatcher();
  DoorbellWatcher(const DoorbellWatcher&) = delete;
  DoorbellWatcher& operator=(const DoorbellWatcher&) = delete;

  // The caller counted itself among the bell's sleepers and then read `seen`
  // from its seq: a ring after that count changes seq, and the watcher sees it.
  void arm(uint32_t seen);
  void disarm();

 private:
  void run();

  Doorbell* bell_;
  int event_fd_;
  std::atomic<uint32_t> generation_{0};  // futex word: bumped by each arm()
  std::atomic<uint32_t> seen_{0};
  std::atomic<bool> armed_{false};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace braid
