// A point in time by which a wait must end. Every blocking wait in braid
// takes one.
#pragma once

#include <time.h>

#include <chrono>
#include <climits>

namespace braid {

using Clock = std::chrono::steady_clock;

// Deadlines lie tens of milliseconds to minutes ahead, and every operation
// takes one: the kernel's tick clock (CLOCK_MONOTONIC_COARSE, 1 to 4 ms steps)
// is precise enough and costs a fraction of a fine clock read.
struct DeadlineClock {
  using duration = std::chrono::nanoseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<DeadlineClock>;
  static constexpr bool is_steady = true;
  static time_point now() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return time_point(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec));
  }
};

class Deadline {
 public:
  static Deadline after_seconds(double s) {
    Deadline d;
    d.at_ = DeadlineClock::now() +
            std::chrono::duration_cast<DeadlineClock::duration>(std::chrono::duration<double>(s));
    return d;
  }
  static Deadline never() {
    Deadline d;
    d.at_ = DeadlineClock::time_point::max();
    return d;
  }
  // The same deadline moved `s` seconds on (never stays never).
  Deadline later_by(double s) const {
    if (at_ == DeadlineClock::time_point::max()) return *this;
    Deadline d;
    d.at_ = at_ + std::chrono::duration_cast<DeadlineClock::duration>(std::chrono::duration<double>(s));
    return d;
  }
  bool expired() const { return DeadlineClock::now() >= at_; }
  // Milliseconds left, clamped to [0, cap] (for poll / futex timeouts).
  int remaining_ms(int cap = INT_MAX) const {
    if (at_ == DeadlineClock::time_point::max()) return cap;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at_ - DeadlineClock::now()).count();
    if (left < 0) return 0;
    return left > cap ? cap : static_cast<int>(left);
  }
  DeadlineClock::time_point at() const { return at_; }

 private:
  DeadlineClock::time_point at_{};
};

}  // namespace braid
