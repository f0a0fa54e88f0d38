// Lets braid_comm_abort on a communicator reach a child that braid_comm_split
// is still setting up on another thread: the child's bootstrap and engine
// are attached here as they are made, and a cancel aborts whatever is
// attached then and whatever is attached after it.
#pragma once

#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "src/core/status.h"

namespace braid {

class SetupCancel {
 public:
  using Abort = std::function<void(const Status&)>;

  // Aborts what is attached, and what will be, with `why` (the first wins).
  void cancel(const Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!why_.is_ok()) return;
    why_ = why;
    for (const Abort& a : attached_) a(why_);
  }
  // `abort` must stay callable until detach_all(), which its owner calls
  // before freeing what it aborts.
  void attach(Abort abort) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!why_.is_ok()) abort(why_);
    attached_.push_back(std::move(abort));
  }
  void detach_all() {
    std::lock_guard<std::mutex> lock(mu_);
    attached_.clear();
  }
  // OK until cancelled; then why.
  Status why() const {
    std::lock_guard<std::mutex> lock(mu_);
    return why_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<Abort> attached_;
  Status why_;
};

}  // namespace braid
