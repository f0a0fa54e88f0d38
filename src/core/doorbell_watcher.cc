#include "src/core/doorbell_watcher.h"

#include <unistd.h>

namespace braid {

namespace {
// Bounds each sleep so that a lost wake-up (none is expected) costs little.
constexpr int kWatchSliceMs = 100;
}  // namespace

DoorbellWatcher::DoorbellWatcher(Doorbell* bell, int event_fd)
    : bell_(bell), event_fd_(event_fd), thread_([this] { run(); }) {}

DoorbellWatcher::~DoorbellWatcher() {
  stop_.store(true);
  generation_.fetch_add(1);
  futex_wake_all(&generation_, false);
  // Only this process sleeps on its own doorbell: the wake reaches the
  // watcher and, harmlessly, nobody else.
  futex_wake_all(&bell_->seq, true);
  thread_.join();
}

void DoorbellWatcher::arm(uint32_t seen) {
  seen_.store(seen);
  armed_.store(true);
  generation_.fetch_add(1);
  futex_wake_all(&generation_, false);
}

void DoorbellWatcher::disarm() {
  armed_.store(false);
}

void DoorbellWatcher::run() {
  uint32_t handled = 0;
  while (!stop_.load()) {
    futex_wait(&generation_, handled, kWatchSliceMs, false);
    const uint32_t now = generation_.load();
    if (now == handled) continue;
    handled = now;
    const uint32_t seen = seen_.load();
    // A later arm() while this waits reads a seen no older than ours: the
    // seq moving past ours is a ring that arm also waits for.
    while (armed_.load() && !stop_.load() && bell_->seq.load() == seen)
      futex_wait(&bell_->seq, seen, kWatchSliceMs, true);
    if (armed_.load() && !stop_.load()) {
      uint64_t one = 1;
      ssize_t ignored = write(event_fd_, &one, sizeof(one));
      (void)ignored;
    }
  }
}

}  // namespace braid
