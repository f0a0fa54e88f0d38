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

struct FrameHeader {
  uint32_t magic;
  uint32_t bytes;
};

class TcpConnection : public Connection {
 public:
  TcpConnection(int fd, int peer, const Config& config)
      : fd_(fd),
        peer_(peer),
        slot_bytes_(config.tcp_slot_bytes),
        nslots_(static_cast<uint64_t>(config.tcp_slots)) {
    send_buf_.resize(nslots_ * slot_bytes_);
    send_len_.resize(nslots_);
    recv_buf_.resize(nslots_ * slot_bytes_);
    recv_len_.resize(nslots_);
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
  void commit_send(size_t bytes) override {
    send_len_[committed_ % nslots_] = bytes;
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
  void release_recv() override {
    ++released_;
    (void)progress();
  }

  Status progress() override {
    if (!error_.is_ok()) return error_;
    while (written_ < committed_) {
      uint64_t i = written_ % nslots_;
      FrameHeader h{kFrameMagic, static_cast<uint32_t>(send_len_[i])};
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
    while (filled_ - released_ < nslots_) {
      uint64_t i = filled_ % nslots_;
      ssize_t r;
      if (header_got_ < sizeof(FrameHeader)) {
        r = recv(fd_, reinterpret_cast<char*>(&header_) + header_got_, sizeof(FrameHeader) - header_got_,
                 MSG_DONTWAIT);
        if (r > 0) {
          header_got_ += static_cast<size_t>(r);
          if (header_got_ == sizeof(FrameHeader)) {
            if (header_.magic != kFrameMagic || header_.bytes > slot_bytes_) {
              error_ = Status::remote(
                  "rank " + std::to_string(peer_) + " sent a malformed frame header (bad magic or length " +
                  std::to_string(header_.bytes) + " > slot " + std::to_string(slot_bytes_) + ")");
              return error_;
            }
            payload_got_ = 0;
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
        error_ = Status::remote("rank " + std::to_string(peer_) +
                                " closed its tcp connection (process exited or failed)");
        return error_;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
      return fail("receiving from", errno);
    }
    return Status::ok();
  }

  Status check_peer(bool) override { return progress(); }
  void shutdown() override {
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  }

 private:
  Status fail(const char* what, int err) {
    error_ = Status::remote(std::string("tcp connection ") + what + " rank " + std::to_string(peer_) +
                            " failed: " + std::strerror(err));
    return error_;
  }

  int fd_;
  int peer_;
  size_t slot_bytes_;
  uint64_t nslots_;
  Status error_;
  std::vector<char> send_buf_;
  std::vector<size_t> send_len_;
  uint64_t committed_ = 0, written_ = 0;
  size_t write_off_ = 0;
  std::vector<char> recv_buf_;
  std::vector<size_t> recv_len_;
  uint64_t filled_ = 0, released_ = 0;
  FrameHeader header_{};
  size_t header_got_ = 0, payload_got_ = 0;
};

}  // namespace

Status TcpTransport::setup(Bootstrap& bootstrap, const std::vector<int>& peers, int nchannels,
                           const Config& config, std::unique_ptr<TcpTransport>* out) {
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
      t->conns_.push_back({c, peer, std::make_unique<TcpConnection>(fd, peer, config)});
    }
  }
  for (int peer : peers) {
    if (peer < me) continue;
    for (int c = 0; c < nchannels; ++c) {
      int fd = -1;
      BRAID_RETURN_IF_ERROR(bootstrap.accept_from_peer(peer, kTagTcpTransport + c, deadline, &fd));
      BRAID_RETURN_IF_ERROR(set_nonblocking(fd, true));
      t->conns_.push_back({c, peer, std::make_unique<TcpConnection>(fd, peer, config)});
    }
  }
  *out = std::move(t);
  return Status::ok();
}

TcpTransport::~TcpTransport() = default;

Connection* TcpTransport::connection(int channel, int peer) {
  for (auto& e : conns_)
    if (e.channel == channel && e.peer == peer) return e.conn.get();
  return nullptr;
}

}  // namespace braid
