// A rank's connection to itself (send/recv to self, as NCCL allows): the same
// slot FIFO as the other transports, in process memory.
#pragma once

#include <cstdint>
#include <vector>

#include "src/core/config.h"
#include "transports/connection.h"

namespace braid {

class SelfConnection : public Connection {
 public:
  explicit SelfConnection(const Config& config)
      : slot_bytes_(std::min(config.shm_slot_bytes, config.tcp_slot_bytes)),
        nslots_(static_cast<uint64_t>(config.shm_slots)),
        buf_(nslots_ * slot_bytes_),
        len_(nslots_),
        tag_(nslots_) {}

  const char* kind() const override { return "self"; }
  size_t slot_bytes() const override { return slot_bytes_; }
  void* send_slot(size_t) override {
    return sent_ - released_ >= nslots_ ? nullptr : &buf_[(sent_ % nslots_) * slot_bytes_];
  }
  void commit_send(size_t bytes, const CallTag& tag) override {
    tag_[sent_ % nslots_] = tag;
    len_[sent_++ % nslots_] = bytes;
  }
  bool recv_ready(const void** data, size_t* bytes) override {
    if (released_ == sent_) return false;
    *data = &buf_[(released_ % nslots_) * slot_bytes_];
    *bytes = len_[released_ % nslots_];
    return true;
  }
  const CallTag& recv_tag() const override { return tag_[released_ % nslots_]; }
  void release_recv() override { ++released_; }
  Status progress() override { return Status::ok(); }
  Status check_peer(bool) override { return Status::ok(); }

 private:
  size_t slot_bytes_;
  uint64_t nslots_;
  std::vector<char> buf_;
  std::vector<size_t> len_;
  std::vector<CallTag> tag_;
  uint64_t sent_ = 0, released_ = 0;
};

}  // namespace braid
