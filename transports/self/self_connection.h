// A rank's connection to itself (send/recv to self, as NCCL allows): a FIFO
// of messages in process memory, holding as many bytes as the other
// transports' slots do (BRAID_SHM_SLOTS slots) and, like shm, packing small
// messages (up to kMessagesPerSlot per slot's worth): five 4-byte sends to
// itself before a receive waited for their deadline when each took a slot.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <vector>

#include "src/core/config.h"
#include "transports/connection.h"

namespace braid {

class SelfConnection : public Connection {
 public:
  static constexpr size_t kMessagesPerSlot = 64;

  explicit SelfConnection(const Config& config)
      : slot_bytes_(std::min(config.shm_slot_bytes, config.tcp_slot_bytes)),
        capacity_bytes_(static_cast<size_t>(config.shm_slots) * slot_bytes_),
        capacity_messages_(static_cast<size_t>(config.shm_slots) * kMessagesPerSlot) {}

  const char* kind() const override { return "self"; }
  size_t slot_bytes() const override { return slot_bytes_; }
  void* send_slot(size_t bytes) override {
    if (queue_.size() >= capacity_messages_ || queued_bytes_ + bytes > capacity_bytes_) return nullptr;
    const size_t want = std::max<size_t>(bytes, 1);
    if (staging_.size() < want && !spare_.empty()) {  // reuse a released message's memory
      staging_ = std::move(spare_.back());
      spare_.pop_back();
    }
    if (staging_.size() < want) staging_.resize(want);
    return staging_.data();
  }
  void commit_send(size_t bytes, const CallTag& tag) override {
    queued_bytes_ += bytes;
    queue_.push_back(Message{std::move(staging_), bytes, tag});
    staging_ = {};
  }
  bool recv_ready(const void** data, size_t* bytes) override {
    if (queue_.empty()) return false;
    *data = queue_.front().data.data();
    *bytes = queue_.front().bytes;
    return true;
  }
  const CallTag& recv_tag() const override { return queue_.front().tag; }
  void release_recv() override {
    queued_bytes_ -= queue_.front().bytes;
    // A steady stream of pieces allocates nothing (a fresh 256 KiB buffer is
    // an mmap and its page faults).
    if (spare_.size() < kSpares) spare_.push_back(std::move(queue_.front().data));
    queue_.pop_front();
  }
  Status progress() override { return Status::ok(); }
  Status check_peer(bool) override { return Status::ok(); }

 private:
  struct Message {
    std::vector<char> data;
    size_t bytes;
    CallTag tag;
  };
  const size_t slot_bytes_, capacity_bytes_, capacity_messages_;
  static constexpr size_t kSpares = 8;
  std::vector<char> staging_;             // the next message, until committed
  std::vector<std::vector<char>> spare_;  // released messages' memory
  std::deque<Message> queue_;
  size_t queued_bytes_ = 0;
};

}  // namespace braid
