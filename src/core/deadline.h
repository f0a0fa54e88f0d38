// A point in time by which a wait must end. Every blocking wait in braid
// takes one.
#pragma once

#include <chrono>
#include <climits>

namespace braid {

using Clock = std::chrono::steady_clock;

class Deadline {
 public:
  static Deadline after_seconds(double s) {
    Deadline d;
    d.at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
    return d;
  }
  static Deadline never() {
    Deadline d;
    d.at_ = Clock::time_point::max();
    return d;
  }
  bool expired() const { return Clock::now() >= at_; }
  // Milliseconds left, clamped to [0, cap] (for poll / futex timeouts).
  int remaining_ms(int cap = INT_MAX) const {
    if (at_ == Clock::time_point::max()) return cap;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at_ - Clock::now()).count();
    if (left < 0) return 0;
    return left > cap ? cap : static_cast<int>(left);
  }
  Clock::time_point at() const { return at_; }

 private:
  Clock::time_point at_{};
};

}  // namespace braid
