// A Connection moves messages one way each between this rank and one peer,
// through a bounded set of slots (flow control is "no free slot"). Every
// algorithm is written over this interface, so it runs over every transport:
//   sender:   send_slot(n) -> fill n <= slot_bytes() bytes -> commit_send(n, tag)
//   receiver: recv_ready(&data, &n) -> recv_tag() -> read or reduce from data
//             -> release_recv()
// A slot may live in the peer's memory (shm), so a reduction can write its
// result straight into the next hop's slot without an extra copy.
// All calls are non-blocking; the engine decides when to wait and how.
#pragma once

#include <poll.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "src/core/status.h"

namespace braid {

// What the sending rank's operation is, carried with every message: a rank
// that receives a message sent by a different call (another collective, a
// count, dtype, op or root that differs, an operation further along) fails
// with BRAID_ERR_MISMATCH naming both calls, instead of using the bytes.
struct CallTag {
  uint64_t count = 0;               // elements; bytes for p2p and all_to_allv's messages
  uint32_t seq = 0;                 // collective sequence number (low 32 bits); 0 for p2p
  int32_t root = -1;                // -1 where the call has none
  uint8_t kind = 0;                 // OpKind
  uint8_t dtype = 0xff, op = 0xff;  // 0xff where the call has none
  uint8_t path = 0;                 // kHostPath, kDevicePath (device memory through CUDA IPC) or kReadPath
  uint32_t user_tag = 0;            // point-to-point: the caller's tag (braid_send_tagged)
  // kReadPath: a send whose receiver reads the data from the sender's memory.
  static constexpr uint8_t kHostPath = 0, kDevicePath = 1, kReadPath = 2;
  bool operator==(const CallTag& o) const {
    return count == o.count && seq == o.seq && root == o.root && kind == o.kind && dtype == o.dtype &&
           op == o.op && path == o.path && user_tag == o.user_tag;
  }
  // Equal but perhaps for count: the same call, where a p2p message or an
  // all_to_allv block carries its own size (its receive names a size that
  // differs in bytes).
  bool same_call_as(const CallTag& o) const {
    CallTag resized = *this;
    resized.count = o.count;
    return resized == o;
  }
};
static_assert(sizeof(CallTag) == 24, "CallTag travels in slot and frame headers");

// One offered send, copied by its two ends in chunks: the receiver opens it
// (its buffer's address, the counts reset, then `opened` set to the offer's
// number); then each end claims the next chunk and copies it (the sender
// writes it into the receiver's buffer, the receiver reads it) until none
// is left; the receiver, once every chunk is done, sets `finished`, which
// ends the send. Offers are numbered from 1 on each connection, in order.
// A receive that fails closes the claims and waits until every claimed
// chunk is copied or failed: no write lands in its buffer after it returned.
// Lives in memory both processes map.
struct SharedCopy {
  std::atomic<uint64_t> opened;    // the offer being copied
  std::atomic<uint64_t> finished;  // the last offer copied whole
  std::atomic<uint64_t> dst;       // the receiver's buffer, in its address space
  std::atomic<uint64_t> next;      // the next chunk to claim
  std::atomic<uint64_t> done;      // chunks copied
  std::atomic<uint64_t> failed;    // chunks whose copy failed
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "SharedCopy is shared between processes");

// Told of each frame a connection commits (see report_commits).
class CommitObserver {
 public:
  virtual void committed(uint32_t connection_index, uint64_t frames_committed) = 0;

 protected:
  ~CommitObserver() = default;
};

class Connection {
 public:
  virtual ~Connection() = default;

  virtual const char* kind() const = 0;  // "shm", "tcp"
  virtual size_t slot_bytes() const = 0;

  // Room for a message of `bytes` (<= slot_bytes()), or nullptr while every
  // slot is in flight. Asking again before the commit returns the same room;
  // the commit must pass the same size. (The size lets shm pack small
  // messages several to a slot.)
  virtual void* send_slot(size_t bytes) = 0;
  virtual void commit_send(size_t bytes, const CallTag& tag) = 0;

  // The oldest message that arrived and is not released yet, and the tag it
  // was sent with (valid once recv_ready returned true).
  virtual bool recv_ready(const void** data, size_t* bytes) = 0;
  virtual const CallTag& recv_tag() const = 0;
  virtual void release_recv() = 0;

  // Copying forms of the above, for a message that starts or ends in the
  // caller's memory. A transport that can move bytes between its wire and
  // that memory directly (tcp: the socket reads into and writes from it)
  // skips the staging slot.
  // send_from: false while no slot is free (nothing sent). It keeps no
  // reference to src: the caller may change it at once.
  virtual bool send_from(const void* src, size_t bytes, const CallTag& tag);
  // How send_from's default fills a slot (shm: streaming stores for some sizes).
  virtual void copy_to_slot(void* slot, const void* src, size_t bytes) { std::memcpy(slot, src, bytes); }
  // recv_into: kDone once the next message was `bytes` long, carried `tag`
  // and is now in dst (released); kOther when the next message is something
  // else (left unreleased, for recv_ready/recv_tag to describe). After
  // kNotYet, part of the message may already be in dst: call again with the
  // same dst, and leave it alone, until kDone or kOther.
  enum class Received { kNotYet, kDone, kOther };
  virtual Received recv_into(void* dst, size_t bytes, const CallTag& tag);

  // Moves bytes for transports that need the CPU to (tcp). An error means the
  // connection is dead; it names the peer and the cause.
  virtual Status progress() = 0;
  // Cheap liveness check used while blocked on this peer (peer process gone,
  // peer marked itself failed). `thorough` also makes syscalls.
  virtual Status check_peer(bool thorough) = 0;
  // Only what the peer said about itself: it marked itself failed (shm) or
  // sent its abort frame (tcp). Cheap; checked on every peer while blocked,
  // since a failed peer breaks every collective, whoever is waited on.
  virtual Status peer_failure() { return Status::ok(); }
  // Whether readiness is told by file descriptors (tcp), to poll with
  // poll_fds; otherwise (shm) by the doorbell.
  virtual bool pollable() const { return false; }
  // Appends the descriptors whose `events` (POLLIN, or POLLOUT for pending
  // writes) would let this connection move.
  virtual void poll_fds(short /*events*/, std::vector<pollfd>* /*out*/) const {}
  virtual bool wants_write() const { return false; }
  // Frames the kernel has so far (tcp, counted as report_commits numbers
  // them; 0 where a commit is delivered at once).
  virtual uint64_t sends_written() const { return 0; }
  // Where a connection whose commits are delivered later (tcp) reports each
  // one, naming itself by `index`: the engine charges the frame to the op
  // that is running, which then waits for that frame and no other.
  virtual void report_commits(CommitObserver* /*observer*/, uint32_t /*index*/) {}
  // Zero-copy path: copies `bytes` from the peer process's address `remote`
  // into `dst` without the peer's help (shm: cross-memory attach). Only valid
  // where supports_peer_reads() is true.
  virtual bool supports_peer_reads() const { return false; }
  virtual Status read_peer(void* /*dst*/, uint64_t /*remote*/, size_t /*bytes*/) {
    return Status::unsupported("this transport cannot read a peer's memory");
  }
  // The other way, under the same condition: `bytes` from `src` to the peer
  // process's address `remote`.
  virtual Status write_peer(uint64_t /*remote*/, const void* /*src*/, size_t /*bytes*/) {
    return Status::unsupported("this transport cannot write a peer's memory");
  }

  // A send that offers its buffer instead of sending it (send_by_offer,
  // where supports_peer_reads() is true) is copied by both ends together,
  // through the SharedCopy of the connection's direction from sender to
  // receiver: `as_sender` picks this rank's side of it. Null where the
  // transport has none.
  virtual SharedCopy* shared_copy(bool /*as_sender*/) { return nullptr; }
  // Wakes the peer if it sleeps waiting (a SharedCopy moved).
  virtual void wake_peer() {}
  // The number of this rank's next offer to the peer, and of the peer's
  // next offer this rank takes (counted by the driving thread).
  uint64_t number_offer_sent() { return ++offers_sent_; }
  uint64_t number_offer_taken() { return ++offers_taken_; }

  // Maps the peer's braid_mem_alloc memory whose memfd is `fd` there,
  // `bytes` long (shm, where supports_peer_reads() is true).
  virtual Status map_peer_memory(int /*fd*/, size_t /*bytes*/, char** /*out*/) {
    return Status::unsupported("this transport cannot map a peer's memory");
  }

  // Tells the peer this side failed and why (after what was already sent),
  // then stops sending. The peer reports the same code.
  virtual void shutdown(const Status& /*why*/) {}

  // Payload bytes this rank moved through this connection: sent, or read
  // from the peer's memory (braid_comm_transport_bytes). Counted by the
  // driving thread (one at a time), read from any thread.
  void count_moved(size_t bytes) {
    moved_.store(moved_.load(std::memory_order_relaxed) + bytes, std::memory_order_relaxed);
  }
  uint64_t bytes_moved() const { return moved_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> moved_{0};
  uint64_t offers_sent_ = 0, offers_taken_ = 0;
};

inline bool Connection::send_from(const void* src, size_t bytes, const CallTag& tag) {
  void* slot = send_slot(bytes);
  if (slot == nullptr) return false;
  if (bytes) copy_to_slot(slot, src, bytes);
  commit_send(bytes, tag);
  return true;
}

inline Connection::Received Connection::recv_into(void* dst, size_t bytes, const CallTag& tag) {
  const void* data = nullptr;
  size_t got = 0;
  if (!recv_ready(&data, &got)) return Received::kNotYet;
  if (got != bytes || !(recv_tag() == tag)) return Received::kOther;
  if (bytes) std::memcpy(dst, data, bytes);
  release_recv();
  return Received::kDone;
}

}  // namespace braid
