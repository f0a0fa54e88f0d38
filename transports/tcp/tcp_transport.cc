#include "transports/tcp/tcp_transport.h"

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "src/core/socket.h"

namespace braid {
namespace {

constexpr uint32_t kFrameMagic = 0x46444242;  // "BBDF"
// The last frame a failing rank sends: its braid_result_t and message.
constexpr uint32_t kAbortMagic = 0x41444242;  // "BBDA"
constexpr uint32_t kMaxAbortBytes = 1024;

struct FrameHeader {
  uint32_t magic;
  uint32_t bytes;
  CallTag tag;  // the sending call (unused in abort frames)
};

class TcpConnection : public Connection {
 public:
  TcpConnection(int fd, int peer, const std::string& host, const Config& config)
      : fd_(fd),
        peer_("rank " + std::to_string(peer) + " (host " + host + ")"),
        slot_bytes_(config.tcp_slot_bytes),
        nslots_(static_cast<uint64_t>(config.tcp_slots)) {
    send_buf_.resize(nslots_ * slot_bytes_);
    send_len_.resize(nslots_);
    send_tag_.resize(nslots_);
    recv_buf_.resize(nslots_ * slot_bytes_);
    recv_len_.resize(nslots_);
    recv_tag_.resize(nslots_);
  }
  ~TcpConnection() override { close_fd(&fd_); }

  const char* kind() const override { return "tcp"; }
  size_t slot_bytes() const override { return slot_bytes_; }
  int poll_fd() const override { return fd_; }
  bool wants_write() const override { return written_ < committed_; }

  void* send_slot() override {
    if (committed_ - written_ >= nslots_) {
      (void)progress();
      if (committed_ - written_ >= nslots_) return nullptr;
    }
    return &send_buf_[(committed_ % nslots_) * slot_bytes_];
  }
  void commit_send(size_t bytes, const CallTag& tag) override {
    send_len_[committed_ % nslots_] = bytes;
    send_tag_[committed_ % nslots_] = tag;
    ++committed_;
    (void)progress();  // start writing now: latency matters more than batching here
  }
  bool recv_ready(const void** data, size_t* bytes) override {
    if (filled_ == released_) {
      (void)progress();
      if (filled_ == released_) return false;
    }
    *data = &recv_buf_[(released_ % nslots_) * slot_bytes_];
    *bytes = recv_len_[released_ % nslots_];
    return true;
  }
  const CallTag& recv_tag() const override { return recv_tag_[released_ % nslots_]; }
  void release_recv() override {
    ++released_;
    (void)progress();
  }

  Status progress() override {
    if (!error_.is_ok()) return error_;
    while (written_ < committed_) {
      uint64_t i = written_ % nslots_;
      FrameHeader h{kFrameMagic, static_cast<uint32_t>(send_len_[i]), send_tag_[i]};
      size_t total = sizeof(h) + send_len_[i];
      iovec iov[2];
      int n = 0;
      if (write_off_ < sizeof(h)) {
        iov[n++] = {reinterpret_cast<char*>(&h) + write_off_, sizeof(h) - write_off_};
        iov[n++] = {&send_buf_[i * slot_bytes_], send_len_[i]};
      } else {
        iov[n++] = {&send_buf_[i * slot_bytes_ + (write_off_ - sizeof(h))], total - write_off_};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = n;
      ssize_t w = sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        return fail("sending to", errno);
      }
      write_off_ += static_cast<size_t>(w);
      if (write_off_ == total) {
        write_off_ = 0;
        ++written_;
      }
    }
    while (!eof_ && filled_ - released_ < nslots_) {
      uint64_t i = filled_ % nslots_;
      ssize_t r;
      if (header_got_ < sizeof(FrameHeader)) {
        r = recv(fd_, reinterpret_cast<char*>(&header_) + header_got_, sizeof(FrameHeader) - header_got_,
                 MSG_DONTWAIT);
        if (r > 0) {
          header_got_ += static_cast<size_t>(r);
          if (header_got_ == sizeof(FrameHeader)) {
            if (header_.magic == kAbortMagic && header_.bytes >= 4 && header_.bytes <= kMaxAbortBytes) {
              BRAID_RETURN_IF_ERROR(read_abort_frame());
              break;
            }
            if (header_.magic != kFrameMagic || header_.bytes > slot_bytes_) {
              error_ = Status::remote(peer_ + " sent a malformed frame header (bad magic or length " +
                                      std::to_string(header_.bytes) + " > slot " +
                                      std::to_string(slot_bytes_) + ")");
              return error_;
            }
            payload_got_ = 0;
            recv_tag_[i] = header_.tag;
            if (header_.bytes == 0) {
              recv_len_[i] = 0;
              header_got_ = 0;
              ++filled_;
            }
          }
          continue;
        }
      } else {
        r = recv(fd_, &recv_buf_[i * slot_bytes_ + payload_got_], header_.bytes - payload_got_, MSG_DONTWAIT);
        if (r > 0) {
          payload_got_ += static_cast<size_t>(r);
          if (payload_got_ == header_.bytes) {
            recv_len_[i] = header_.bytes;
            header_got_ = 0;
            ++filled_;
          }
          continue;
        }
      }
      if (r == 0) {
        // End of stream is an error only once the messages before it are
        // consumed (check_peer): they may carry the cause the peer saw.
        eof_ = true;
        break;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
      return fail("receiving from", errno);
    }
    return Status::ok();
  }

  // The end of the stream (or the peer's abort frame) is an error only once
  // the messages before it are consumed: they may show the cause here too.
  Status check_peer(bool) override {
    BRAID_RETURN_IF_ERROR(progress());
    if (filled_ != released_) return Status::ok();
    if (!peer_failure_.is_ok()) return peer_failure_;
    if (eof_) return Status::remote(peer_ + " closed its tcp connection (process exited or failed)");
    return Status::ok();
  }
  Status peer_failure() override {
    (void)progress();
    return peer_failure_;
  }
  // After what is queued, send an abort frame with the cause (best effort: a
  // full socket skips it), then half-close so the peer reads both.
  void shutdown(const Status& why) override {
    if (fd_ < 0 || shut_) return;
    shut_ = true;
    (void)progress();
    if (written_ == committed_ && error_.is_ok() && !why.is_ok()) {
      std::string text = why.message().substr(0, kMaxAbortBytes - 4);
      uint32_t code = static_cast<uint32_t>(why.code());
      FrameHeader h{kAbortMagic, static_cast<uint32_t>(4 + text.size()), {}};
      std::string frame(reinterpret_cast<const char*>(&h), sizeof(h));
      frame.append(reinterpret_cast<const char*>(&code), 4);
      frame += text;
      (void)send_all(fd_, frame.data(), frame.size(), Deadline::after_seconds(0.05));
    }
    ::shutdown(fd_, SHUT_WR);
  }

 private:
  // Reads the rest of an abort frame (small; waits briefly for it).
  Status read_abort_frame() {
    std::vector<char> body(header_.bytes);
    Status st = recv_all(fd_, body.data(), body.size(), Deadline::after_seconds(1));
    if (!st) {
      error_ = st.with_context(peer_ + " sent a truncated abort frame");
      return error_;
    }
    uint32_t code = 0;
    std::memcpy(&code, body.data(), 4);
    if (code == 0 || code > BRAID_ERR_IN_PROGRESS) code = BRAID_ERR_REMOTE;
    peer_failure_ = Status(static_cast<braid_result_t>(code),
                           peer_ + " failed: " + std::string(body.data() + 4, body.size() - 4));
    eof_ = true;  // nothing valid follows an abort frame
    header_got_ = 0;
    return Status::ok();
  }

  Status fail(const char* what, int err) {
    error_ = Status::remote(std::string("tcp connection ") + what + " " + peer_ +
                            " failed: " + std::strerror(err));
    return error_;
  }

  int fd_;
  std::string peer_;  // "rank 3 (host node7)", as errors name it
  size_t slot_bytes_;
  uint64_t nslots_;
  Status error_;
  bool eof_ = false;
  bool shut_ = false;
  Status peer_failure_;  // from the peer's abort frame
  std::vector<char> send_buf_;
  std::vector<size_t> send_len_;
  std::vector<CallTag> send_tag_;
  uint64_t committed_ = 0, written_ = 0;
  size_t write_off_ = 0;
  std::vector<char> recv_buf_;
  std::vector<size_t> recv_len_;
  std::vector<CallTag> recv_tag_;
  uint64_t filled_ = 0, released_ = 0;
  FrameHeader header_{};
  size_t header_got_ = 0, payload_got_ = 0;
};

}  // namespace

Status TcpTransport::setup(Bootstrap& bootstrap, const std::vector<int>& peers,
                           const std::vector<std::string>& hosts, int nchannels, const Config& config,
                           std::unique_ptr<TcpTransport>* out) {
  std::unique_ptr<TcpTransport> t(new TcpTransport());
  const int me = bootstrap.rank();
  const Deadline deadline = Deadline::after_seconds(config.timeout_s);
  // Lower ranks accept, higher ranks connect; connects do not wait for the
  // acceptor, so the order cannot deadlock.
  for (int peer : peers) {
    if (peer > me) continue;
    for (int c = 0; c < nchannels; ++c) {
      int fd = -1;
      BRAID_RETURN_IF_ERROR(bootstrap.connect_to_peer(peer, kTagTcpTransport + c, deadline, &fd));
      BRAID_RETURN_IF_ERROR(set_nonblocking(fd, true));
      t->conns_.push_back({c, peer, adopt(fd, peer, hosts[peer], config)});
    }
  }
  for (int peer : peers) {
    if (peer < me) continue;
    for (int c = 0; c < nchannels; ++c) {
      int fd = -1;
      BRAID_RETURN_IF_ERROR(bootstrap.accept_from_peer(peer, kTagTcpTransport + c, deadline, &fd));
      BRAID_RETURN_IF_ERROR(set_nonblocking(fd, true));
      t->conns_.push_back({c, peer, adopt(fd, peer, hosts[peer], config)});
    }
  }
  *out = std::move(t);
  return Status::ok();
}

std::unique_ptr<Connection> TcpTransport::adopt(int fd, int peer, const std::string& host,
                                                const Config& config) {
  return std::make_unique<TcpConnection>(fd, peer, host, config);
}

TcpTransport::~TcpTransport() = default;

Connection* TcpTransport::connection(int channel, int peer) {
  for (auto& e : conns_)
    if (e.channel == channel && e.peer == peer) return e.conn.get();
  return nullptr;
}

}  // namespace braid
