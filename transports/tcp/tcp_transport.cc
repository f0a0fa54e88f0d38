#include "transports/tcp/tcp_transport.h"

#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "src/core/logging.h"
#include "src/core/socket.h"

namespace braid {
namespace {

constexpr uint32_t kFrameMagic = 0x46444242;  // "BBDF"
// The last frame a failing rank sends: its braid_result_t and message.
constexpr uint32_t kAbortMagic = 0x41444242;  // "BBDA"
constexpr uint32_t kMaxAbortBytes = 1024;
// How long a failing rank keeps sending what it queued, and its abort frame,
// to a peer before it resets the connection (TcpConnection::shutdown).
constexpr double kShutdownSeconds = 0.2;

struct FrameHeader {
  uint32_t magic;
  uint32_t bytes;
  CallTag tag;  // the sending call (unused in abort frames)
};

// Messages ("frames") are numbered in the order they are committed; frame f
// travels on stream f % K of the K sockets to the peer, so each socket
// carries every K-th frame in order and the receiver knows, from the number
// alone, where the next one arrives. Slots are indexed by frame number on
// both sides.
class TcpConnection : public Connection {
 public:
  TcpConnection(const std::vector<int>& fds, int peer, const std::string& host, const Config& config)
      : peer_("rank " + std::to_string(peer) + " (host " + host + ")"),
        slot_bytes_(config.tcp_slot_bytes),
        nslots_(static_cast<uint64_t>(config.tcp_slots)) {
    for (size_t k = 0; k < fds.size(); ++k) {
      streams_.emplace_back();
      Stream& s = streams_.back();
      s.fd = fds[k];
      s.next_write = s.next_read = k;
      s.ahead.resize(config.tcp_read_ahead);
    }
    send_buf_.resize(nslots_ * slot_bytes_);
    send_len_.resize(nslots_);
    send_tag_.resize(nslots_);
    recv_buf_.resize(nslots_ * slot_bytes_);
    recv_len_.resize(nslots_);
    recv_tag_.resize(nslots_);
    recv_full_.resize(nslots_);
  }
  ~TcpConnection() override {
    for (Stream& s : streams_) close_fd(&s.fd);
  }

  const char* kind() const override { return "tcp"; }
  size_t slot_bytes() const override { return slot_bytes_; }
  bool pollable() const override { return true; }
  // For reading, only the sockets read_stream would read: one whose next
  // frame has no free slot yet stays readable, and would wake poll at once.
  void poll_fds(short events, std::vector<pollfd>* out) const override {
    for (const Stream& s : streams_) {
      const bool wanted = events == POLLIN
                              ? !s.eof && (s.direct != nullptr || s.next_read - released_ < nslots_)
                              : s.next_write < committed_;
      if (wanted) out->push_back({s.fd, events, 0});
    }
  }
  bool wants_write() const override { return written_ < committed_; }
  uint64_t sends_written() const override { return written_; }
  void report_commits(CommitObserver* observer, uint32_t index) override {
    observer_ = observer;
    observer_index_ = index;
  }

  void* send_slot(size_t) override { return slot_free() ? send_at(committed_) : nullptr; }
  void commit_send(size_t bytes, const CallTag& tag) override {
    queue(bytes, tag);
    (void)progress();  // start writing now: latency matters more than batching here
  }

  // A frame whose socket has nothing queued goes out straight from the
  // caller's memory; only what the socket does not take is staged.
  bool send_from(const void* src, size_t bytes, const CallTag& tag) override {
    if (!slot_free()) return false;
    const uint64_t f = queue(bytes, tag);
    const char* p = static_cast<const char*>(src);
    Stream& s = stream(f);
    if (s.next_write != f || !writable()) {
      if (bytes) std::memcpy(send_at(f), p, bytes);
      (void)progress();
      return true;
    }
    if (write_frame(s, p)) return true;
    // Stage the payload bytes the socket did not take.
    const size_t sent = s.write_off > sizeof(FrameHeader) ? s.write_off - sizeof(FrameHeader) : 0;
    if (bytes > sent) std::memcpy(send_at(f) + sent, p + sent, bytes - sent);
    return true;
  }

  bool recv_ready(const void** data, size_t* bytes) override {
    if (filled_ == released_) {
      (void)progress();
      if (filled_ == released_) return false;
    }
    *data = recv_at(released_);
    *bytes = recv_len_[released_ % nslots_];
    return true;
  }
  const CallTag& recv_tag() const override { return recv_tag_[released_ % nslots_]; }
  void release_recv() override {
    recv_full_[released_ % nslots_] = 0;
    ++released_;
    (void)progress();
  }

  // A payload that has not started arriving is read straight into dst when
  // its header matches; one that already went to a slot is copied from it.
  Received recv_into(void* dst, size_t bytes, const CallTag& tag) override {
    // A broken connection reads nothing more (progress() stops there too):
    // its last header may be the malformed one, whose length must never be
    // read into a slot (check_peer reports the error).
    if (!error_.is_ok()) return Received::kNotYet;
    if (filled_ == released_) {
      Direct d{static_cast<char*>(dst), bytes, &tag};
      Stream& s = stream(released_);
      if (s.direct == nullptr && s.header_got == sizeof(FrameHeader) && s.payload_got == 0) claim(s, &d);
      (void)read_frames(&d);
      if (d.done) return Received::kDone;
      if (filled_ == released_) return Received::kNotYet;
    }
    return Connection::recv_into(dst, bytes, tag);
  }

  // A write that failed because the peer reset the connection stops the
  // writing only: what the peer sent before its reset (its abort frame with
  // the cause, on any socket) is still read, and reported instead.
  Status progress() override {
    if (!error_.is_ok()) return error_;
    for (Stream& s : streams_) {
      while (writable() && s.next_write < committed_ && write_frame(s, send_at(s.next_write))) {
      }
    }
    BRAID_RETURN_IF_ERROR(read_frames(nullptr));
    if (!write_error_.is_ok()) {
      if (peer_failure_.is_ok()) salvage_abort_cause();
      return peer_failure_.is_ok() ? write_error_ : peer_failure_;
    }
    return Status::ok();
  }

  // The end of a stream (or the peer's abort frame) is an error only once
  // the messages before it are consumed: they may show the cause here too.
  // With several sockets the abort may arrive before earlier messages on
  // other sockets: it counts from its own place in the order.
  Status check_peer(bool) override {
    Status st = progress();
    // The cause the peer gave comes before what its exit or its reset did
    // to the sockets (a write into a reset connection fails at once).
    if (!peer_failure_.is_ok() && (released_ >= abort_at_ || !st.is_ok())) return peer_failure_;
    BRAID_RETURN_IF_ERROR(st);
    if (filled_ != released_) return Status::ok();
    // A message before the abort frame that will never arrive (its socket
    // was reset before it got through) leaves the cause in hand to report.
    if (stream(released_).eof && !peer_failure_.is_ok()) return peer_failure_;
    if (stream(released_).eof)
      return Status::remote(peer_ + (stream(released_).reset ? " reset" : " closed") +
                            " its tcp connection (process exited or failed)");
    return Status::ok();
  }
  Status peer_failure() override {
    (void)progress();
    return filled_ >= abort_at_ ? peer_failure_ : Status::ok();
  }
  void shutdown(const Status& why) override {
    TcpConnection* self = this;
    shutdown_connections(&self, 1, why);
  }

  // Tells the peers of `n` connections that this rank failed and leaves them
  // nothing to wait for: what is queued goes out, then an abort frame with
  // the cause on the socket the next frame would take, then every socket is
  // reset. A peer reads what arrived before the reset (the frame too); a peer
  // blocked writing to this rank fails at once. A half-close left such a
  // peer waiting for its timeout whenever this rank's FIN queued behind bytes
  // the peer had not read (its slots full of messages not received yet),
  // since nothing here reads any more. All connections share one bound of
  // kShutdownSeconds, which only a peer that does not read uses up: its
  // bytes would not be read anyway.
  static void shutdown_connections(TcpConnection* const* conns, size_t n, const Status& why) {
    const Deadline deadline = Deadline::after_seconds(kShutdownSeconds);
    std::vector<TcpConnection*> active;
    for (size_t i = 0; i < n; ++i) {
      if (conns[i]->shut_) continue;
      conns[i]->shut_ = true;
      conns[i]->start_abort_frame(why);
      active.push_back(conns[i]);
    }
    for (;;) {
      std::vector<pollfd> fds;
      for (TcpConnection* c : active) c->flush_step(&fds);
      if (fds.empty() || deadline.expired()) break;
      (void)::poll(fds.data(), fds.size(), deadline.remaining_ms(10));
    }
    // A reset drops whatever the peer has not acknowledged: wait for that.
    while (!deadline.expired()) {
      bool unacked = false;
      for (TcpConnection* c : active) unacked |= c->unacknowledged();
      if (!unacked) break;
      (void)::poll(nullptr, 0, 1);
    }
    for (TcpConnection* c : active) c->reset(why);
  }

 private:
  struct Stream {
    int fd = -1;
    uint64_t next_write = 0, next_read = 0;  // frame numbers, this stream's residue mod K
    size_t write_off = 0;                    // of frame next_write: header and payload bytes written
    FrameHeader header{};                    // of frame next_read
    size_t header_got = 0, payload_got = 0;
    char* direct = nullptr;  // where frame next_read's payload goes, if not its slot
    bool eof = false;
    bool reset = false;  // the end was the peer's reset
    // A read for a header or a short rest of a payload asks the socket for up
    // to its size (BRAID_TCP_READ_AHEAD) into this buffer, so a small
    // message (header and payload), or several, cost one recv instead of two
    // each; longer payloads are read straight to where they go. Bytes read
    // ahead of where they go: [ahead_at, ahead_end).
    std::vector<char> ahead;
    size_t ahead_at = 0, ahead_end = 0;
  };
  // A receiver's buffer that the next payload may be read into.
  struct Direct {
    char* dst;
    size_t bytes;
    const CallTag* tag;
    bool done = false;
  };

  Stream& stream(uint64_t frame) { return streams_[frame % streams_.size()]; }
  bool writable() const { return error_.is_ok() && write_error_.is_ok(); }

  // The abort frame, sent once all queued frames are written.
  void start_abort_frame(const Status& why) {
    if (why.is_ok()) return;
    const std::string text = why.message().substr(0, kMaxAbortBytes - 4);
    const uint32_t code = static_cast<uint32_t>(why.code());
    FrameHeader h{kAbortMagic, static_cast<uint32_t>(4 + text.size()), {}};
    abort_frame_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    abort_frame_.append(reinterpret_cast<const char*>(&code), 4);
    abort_frame_ += text;
  }
  // Writes what it can of the queued frames, then of the abort frame, without
  // waiting; adds the sockets it still has to write to `fds`.
  void flush_step(std::vector<pollfd>* fds) {
    if (written_ < committed_) {
      if (!progress().is_ok() || !writable()) return;  // the peer is gone: nothing to tell it
      if (written_ < committed_) return poll_fds(POLLOUT, fds);
    }
    if (abort_sent_ == abort_frame_.size() || !writable()) return;
    const int fd = stream(committed_).fd;
    ssize_t w = ::send(fd, abort_frame_.data() + abort_sent_, abort_frame_.size() - abort_sent_,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) abort_sent_ += static_cast<size_t>(w);
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return;
    if (abort_sent_ < abort_frame_.size()) fds->push_back({fd, POLLOUT, 0});
  }
  // Whether some socket still holds bytes the peer's kernel has not
  // acknowledged while the peer can still take them (established).
  bool unacknowledged() const {
    if (!writable()) return false;
    for (const Stream& s : streams_) {
      tcp_info info{};
      socklen_t len = sizeof(info);
      int queued = 0;
      if (s.fd < 0 || getsockopt(s.fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0 ||
          info.tcpi_state != TCP_ESTABLISHED)
        continue;
      if (ioctl(s.fd, SIOCOUTQ, &queued) == 0 && queued > 0) return true;
    }
    return false;
  }
  // connect() to AF_UNSPEC disconnects a TCP socket, with a reset while it
  // is established, and keeps the descriptor (closed at destroy). Later
  // writes here fail with this rank's own cause, not the peer's.
  void reset(const Status& why) {
    sockaddr unspec{};
    unspec.sa_family = AF_UNSPEC;
    for (Stream& s : streams_)
      if (s.fd >= 0 && ::connect(s.fd, &unspec, sizeof(unspec)) != 0) ::shutdown(s.fd, SHUT_RDWR);
    if (error_.is_ok())
      error_ = Status(why.is_ok() ? BRAID_ERR_ABORTED : why.code(),
                      "tcp connection with " + peer_ + " shut down by this rank" +
                          (why.is_ok() ? std::string() : ": " + why.message()));
  }
  char* send_at(uint64_t frame) { return &send_buf_[(frame % nslots_) * slot_bytes_]; }
  char* recv_at(uint64_t frame) { return &recv_buf_[(frame % nslots_) * slot_bytes_]; }

  // Whether frame committed_ has a free slot (after writing what can be).
  bool slot_free() {
    if (committed_ - written_ < nslots_) return true;
    (void)progress();
    return committed_ - written_ < nslots_;
  }
  // Commits the next frame's length and call; returns its number.
  uint64_t queue(size_t bytes, const CallTag& tag) {
    send_len_[committed_ % nslots_] = bytes;
    send_tag_[committed_ % nslots_] = tag;
    const uint64_t frame = committed_++;
    if (observer_ != nullptr) observer_->committed(observer_index_, committed_);
    return frame;
  }

  // Writes what is left of frame s.next_write (from s.write_off on), its
  // payload at `payload`: the slot, or the caller's memory. True once the
  // frame is written; false when the socket takes no more or failed (error_).
  bool write_frame(Stream& s, const char* payload) {
    const uint64_t f = s.next_write;
    const size_t len = send_len_[f % nslots_];
    FrameHeader h{kFrameMagic, static_cast<uint32_t>(len), send_tag_[f % nslots_]};
    const size_t total = sizeof(h) + len;
    while (s.write_off < total) {
      iovec iov[2];
      int n = 0;
      if (s.write_off < sizeof(h)) {
        iov[n++] = {reinterpret_cast<char*>(&h) + s.write_off, sizeof(h) - s.write_off};
        iov[n++] = {const_cast<char*>(payload), len};
      } else {
        iov[n++] = {const_cast<char*>(payload) + (s.write_off - sizeof(h)), total - s.write_off};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = n;
      ssize_t w = sendmsg(s.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
          write_error_ = describe("sending to", errno);
        return false;
      }
      s.write_off += static_cast<size_t>(w);
    }
    wrote(s);
    return true;
  }

  // Frame s.next_write is written: the contiguous count moves to the oldest
  // frame some stream still owes.
  void wrote(Stream& s) {
    s.write_off = 0;
    s.next_write += streams_.size();
    uint64_t oldest = committed_;
    for (const Stream& t : streams_) oldest = std::min(oldest, t.next_write);
    written_ = oldest;
  }

  // Frame s.next_read is complete in its slot, or (direct) in the receiver's
  // buffer, which consumes it at once.
  void arrived(Stream& s, bool direct) {
    const uint64_t f = s.next_read;
    s.header_got = s.payload_got = 0;
    s.direct = nullptr;
    s.next_read += streams_.size();
    if (direct) {
      ++released_;
      ++filled_;
    } else {
      recv_len_[f % nslots_] = s.header.bytes;
      recv_full_[f % nslots_] = 1;
    }
    while (filled_ - released_ < nslots_ && recv_full_[filled_ % nslots_]) ++filled_;
  }

  // Points the payload of the header s just read at d's buffer when it is
  // the message d waits for (the next to consume, not in a slot).
  void claim(Stream& s, Direct* d) {
    if (d != nullptr && s.next_read == released_ && filled_ == released_ && s.header.bytes > 0 &&
        s.header.bytes == d->bytes && s.header.tag == *d->tag)
      s.direct = d->dst;
  }

  // Reads frames into free slots, or into d's buffer (claim), from every
  // socket until each has no more (or no free slot). A payload being read into a receiver's
  // buffer is continued only by that receiver: the buffer is the caller's,
  // valid only during its recv_into.
  Status read_frames(Direct* d) {
    for (Stream& s : streams_) {
      BRAID_RETURN_IF_ERROR(read_stream(s, d));
      if (d != nullptr && d->done) break;  // one message per receiver call
    }
    return Status::ok();
  }

  Status read_stream(Stream& s, Direct* d) {
    while (!s.eof) {
      ssize_t r;
      if (s.direct != nullptr) {
        if (d == nullptr) break;
        if (d->dst != s.direct) {
          error_ =
              Status::internal("tcp connection with " + peer_ +
                               ": a receive into a new buffer while a payload was half read into another");
          return error_;
        }
        r = take(s, s.direct + s.payload_got, s.header.bytes - s.payload_got);
        if (r > 0) {
          s.payload_got += static_cast<size_t>(r);
          if (s.payload_got == s.header.bytes) {
            arrived(s, true);
            d->done = true;
            break;
          }
          continue;
        }
      } else if (s.next_read - released_ >= nslots_) {
        break;  // its slot is still taken
      } else if (s.header_got < sizeof(FrameHeader)) {
        r = take(s, reinterpret_cast<char*>(&s.header) + s.header_got, sizeof(FrameHeader) - s.header_got);
        if (r > 0) {
          s.header_got += static_cast<size_t>(r);
          if (s.header_got == sizeof(FrameHeader)) {
            if (s.header.magic == kAbortMagic && s.header.bytes >= 4 && s.header.bytes <= kMaxAbortBytes) {
              BRAID_RETURN_IF_ERROR(read_abort_frame(s));
              break;
            }
            if (s.header.magic != kFrameMagic || s.header.bytes > slot_bytes_) {
              error_ = Status::remote(peer_ + " sent a malformed frame header (" +
                                      (s.header.magic != kFrameMagic
                                           ? std::string("bad magic")
                                           : "length " + std::to_string(s.header.bytes) + " > slot " +
                                                 std::to_string(slot_bytes_)) +
                                      ")");
              return error_;
            }
            recv_tag_[s.next_read % nslots_] = s.header.tag;
            if (s.header.bytes == 0)
              arrived(s, false);
            else
              claim(s, d);
          }
          continue;
        }
      } else {
        r = take(s, recv_at(s.next_read) + s.payload_got, s.header.bytes - s.payload_got);
        if (r > 0) {
          s.payload_got += static_cast<size_t>(r);
          if (s.payload_got == s.header.bytes) arrived(s, false);
          continue;
        }
      }
      if (r == 0) {
        // End of stream is an error only once the messages before it are
        // consumed (check_peer): they may carry the cause the peer saw.
        s.eof = true;
        break;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
      // A reset ends the stream too, after every byte sent before it was
      // read: the peer's abort frame, on this socket or another, may still
      // tell why (a failing rank resets its sockets after sending it).
      if (errno == ECONNRESET || !peer_failure_.is_ok()) {
        s.eof = true;
        s.reset = errno == ECONNRESET;
        break;
      }
      return fail("receiving from", errno);
    }
    return Status::ok();
  }

  // Up to `want` (> 0) bytes of the stream into dst: first what an earlier
  // read took ahead, else from the socket, as recv() returns (0: the end of
  // the stream; -1 with errno). A want shorter than the buffer reads ahead.
  static ssize_t take(Stream& s, char* dst, size_t want) {
    if (s.ahead_at == s.ahead_end) {
      if (want >= s.ahead.size()) return recv(s.fd, dst, want, MSG_DONTWAIT);
      ssize_t r = recv(s.fd, s.ahead.data(), s.ahead.size(), MSG_DONTWAIT);
      if (r <= 0) return r;
      s.ahead_at = 0;
      s.ahead_end = static_cast<size_t>(r);
    }
    const size_t n = std::min(want, s.ahead_end - s.ahead_at);
    std::memcpy(dst, s.ahead.data() + s.ahead_at, n);
    s.ahead_at += n;
    return static_cast<ssize_t>(n);
  }

  // After a write met the peer's reset: its abort frame, with the cause, may
  // sit behind frames no receive slot is free for. The connection is over,
  // so this reads past them (their payloads are dropped) to find it. A
  // stream it read from is over too: the frame it stopped in (or the next)
  // must not be delivered with bytes missing.
  void salvage_abort_cause() {
    char sink[4096];
    for (Stream& s : streams_) {
      if (s.eof || s.direct != nullptr) continue;
      bool read_some = false, give_up = false;
      while (peer_failure_.is_ok() && !s.eof && !give_up) {
        ssize_t r;
        if (s.header_got < sizeof(FrameHeader)) {
          r = take(s, reinterpret_cast<char*>(&s.header) + s.header_got, sizeof(FrameHeader) - s.header_got);
          if (r > 0 && (s.header_got += static_cast<size_t>(r)) == sizeof(FrameHeader)) {
            if (s.header.magic == kAbortMagic && s.header.bytes >= 4 && s.header.bytes <= kMaxAbortBytes) {
              (void)read_abort_frame(s);  // ends the stream
              return;
            }
            give_up = s.header.magic != kFrameMagic || s.header.bytes > slot_bytes_;  // nothing to find
            s.payload_got = 0;
            if (s.header.bytes == 0) s.header_got = 0;
          }
        } else {
          r = take(s, sink, std::min(sizeof(sink), s.header.bytes - s.payload_got));
          if (r > 0 && (s.payload_got += static_cast<size_t>(r)) == s.header.bytes)
            s.header_got = s.payload_got = 0;
        }
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) s.eof = true;
        if (r <= 0) break;
        read_some = true;
      }
      if (read_some) s.eof = true;
      if (give_up) return;
    }
  }

  // Reads the rest of an abort frame (small; waits briefly for it).
  Status read_abort_frame(Stream& s) {
    std::vector<char> body(s.header.bytes);
    // What was read ahead comes first (one take empties it or fills body).
    const size_t got = s.ahead_at < s.ahead_end ? static_cast<size_t>(take(s, body.data(), body.size())) : 0;
    Status st = recv_all(s.fd, body.data() + got, body.size() - got, Deadline::after_seconds(1));
    if (!st) {
      // The peer failed either way; its cause is lost, not late.
      error_ = Status::remote(peer_ + " failed and sent a truncated abort frame (" + st.message() + ")");
      return error_;
    }
    uint32_t code = 0;
    std::memcpy(&code, body.data(), 4);
    if (code == 0 || code > BRAID_ERR_IN_PROGRESS) code = BRAID_ERR_REMOTE;
    peer_failure_ = Status(static_cast<braid_result_t>(code),
                           peer_ + " failed: " + printable_text(body.data() + 4, body.size() - 4));
    abort_at_ = s.next_read;
    s.eof = true;  // nothing valid follows an abort frame
    s.header_got = 0;
    return Status::ok();
  }

  Status describe(const char* what, int err) const {
    const char* why = err == ECONNRESET || err == EPIPE ? " (it failed or exited)" : "";
    return Status::remote(std::string("tcp connection ") + what + " " + peer_ +
                          " failed: " + std::strerror(err) + why);
  }
  Status fail(const char* what, int err) {
    error_ = describe(what, err);
    return error_;
  }

  std::string peer_;  // "rank 3 (host node7)", as errors name it
  size_t slot_bytes_;
  uint64_t nslots_;
  std::vector<Stream> streams_;
  Status error_;        // reading (and so everything) stopped
  Status write_error_;  // writing stopped: the peer reset the connection
  bool shut_ = false;
  std::string abort_frame_;  // while shutting down
  size_t abort_sent_ = 0;
  Status peer_failure_;             // from the peer's abort frame
  uint64_t abort_at_ = UINT64_MAX;  // the frame number the abort took (all before it were sent)
  std::vector<char> send_buf_;
  std::vector<size_t> send_len_;
  std::vector<CallTag> send_tag_;
  uint64_t committed_ = 0, written_ = 0;  // frames; written_: all before it are the kernel's
  CommitObserver* observer_ = nullptr;
  uint32_t observer_index_ = 0;
  std::vector<char> recv_buf_;
  std::vector<size_t> recv_len_;
  std::vector<CallTag> recv_tag_;
  std::vector<char> recv_full_;         // per slot: a complete frame waits in it
  uint64_t filled_ = 0, released_ = 0;  // frames; filled_: all before it have arrived
};

}  // namespace

Status TcpTransport::setup(Bootstrap& bootstrap, const std::vector<int>& peers,
                           const std::vector<std::string>& hosts, int nchannels, const Config& config,
                           std::unique_ptr<TcpTransport>* out) {
  std::unique_ptr<TcpTransport> t(new TcpTransport());
  const int me = bootstrap.rank();
  const Deadline deadline = Deadline::after_seconds(config.timeout_s);
  // Lower ranks accept, higher ranks connect; connects do not wait for the
  // acceptor, so the order cannot deadlock. Each (channel, socket) pair has
  // its own handshake tag.
  const int nsockets = config.tcp_sockets;
  // Autotuned buffers left a connection in a slow state for its whole life
  // now and then: 2 ranks on loopback, 4 MiB all_reduce, 1.95 ms per call in
  // 5 of 36 communicators against 1.05-1.25 ms in the rest; fixed at 4 MiB,
  // none of 36 was slow and the others ran as fast.
  int fixed = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int peer : peers) {
      if (pass == 0 ? peer > me : peer < me) continue;
      for (int c = 0; c < nchannels; ++c) {
        std::vector<int> fds;
        for (int k = 0; k < nsockets; ++k) {
          int fd = -1;
          const uint32_t tag = kTagTcpTransport + static_cast<uint32_t>(c * nsockets + k);
          Status st = pass == 0 ? bootstrap.connect_to_peer(peer, tag, deadline, &fd)
                                : bootstrap.accept_from_peer(peer, tag, deadline, &fd);
          if (st) st = set_nonblocking(fd, true);
          if (st && set_socket_buffers(fd, config.tcp_buffer_bytes)) ++fixed;
          if (!st) {
            for (int& open : fds) close_fd(&open);
            close_fd(&fd);
            return st;
          }
          fds.push_back(fd);
        }
        t->conns_.push_back({c, peer, adopt(fds, peer, hosts[peer], config)});
      }
    }
  }
  if (!t->conns_.empty()) {
    const std::string how = fixed > 0 ? "fixed at " + bytes_text(config.tcp_buffer_bytes)
                                      : "autotuned by the kernel (BRAID_TCP_BUFFER_BYTES 0 or above "
                                        "net.core.rmem_max / wmem_max)";
    BRAID_INFO("INIT", me, "tcp socket buffers: %s", how.c_str());
  }
  *out = std::move(t);
  return Status::ok();
}

std::unique_ptr<Connection> TcpTransport::adopt(const std::vector<int>& fds, int peer,
                                                const std::string& host, const Config& config) {
  return std::make_unique<TcpConnection>(fds, peer, host, config);
}

TcpTransport::~TcpTransport() = default;

void TcpTransport::shutdown(const Status& why) {
  std::vector<TcpConnection*> all;
  for (auto& e : conns_) all.push_back(static_cast<TcpConnection*>(e.conn.get()));
  TcpConnection::shutdown_connections(all.data(), all.size(), why);
}

Connection* TcpTransport::connection(int channel, int peer) {
  for (auto& e : conns_)
    if (e.channel == channel && e.peer == peer) return e.conn.get();
  return nullptr;
}

}  // namespace braid
