// The tcp connection on its own, over socket pairs in one process: frames
// dealt to several sockets arrive in order, the copying send and receive
// (straight from and into the caller's memory) agree with the slot path
// whatever the socket took, a message that is not the expected one is left
// for the caller to describe, and a peer's abort or exit is reported.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "src/core/config.h"
#include "src/core/socket.h"
#include "transports/tcp/tcp_transport.h"

namespace braid {
namespace {

struct Pair {
  std::unique_ptr<Connection> a, b;
};

Pair connect_pair(int nsockets, size_t slot_bytes, int slots, size_t read_ahead = Config().tcp_read_ahead) {
  Config config;
  config.tcp_slot_bytes = slot_bytes;
  config.tcp_slots = slots;
  config.tcp_read_ahead = read_ahead;
  std::vector<int> left, right;
  for (int k = 0; k < nsockets; ++k) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0 || !set_nonblocking(sv[0], true) ||
        !set_nonblocking(sv[1], true)) {
      ADD_FAILURE() << "socketpair: " << std::strerror(errno);
      std::abort();
    }
    left.push_back(sv[0]);
    right.push_back(sv[1]);
  }
  return {TcpTransport::adopt(left, 1, "right", config), TcpTransport::adopt(right, 0, "left", config)};
}

// `nsockets` connected TCP socket pairs on 127.0.0.1, non-blocking.
void tcp_socket_pairs(int nsockets, std::vector<int>* left, std::vector<int>* right) {
  int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, nsockets) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ADD_FAILURE() << "listen on 127.0.0.1: " << std::strerror(errno);
    std::abort();
  }
  for (int k = 0; k < nsockets; ++k) {
    int c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c < 0 || connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ADD_FAILURE() << "connect to 127.0.0.1: " << std::strerror(errno);
      std::abort();
    }
    int a = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (a < 0 || !set_nonblocking(a, true) || !set_nonblocking(c, true)) {
      ADD_FAILURE() << "accept: " << std::strerror(errno);
      std::abort();
    }
    left->push_back(c);
    right->push_back(a);
  }
  close(listener);
}

// The same over real TCP sockets on 127.0.0.1, where a reset is a reset
// (socket pairs only know a half-close).
Pair connect_tcp_pair(int nsockets, size_t slot_bytes, int slots) {
  Config config;
  config.tcp_slot_bytes = slot_bytes;
  config.tcp_slots = slots;
  std::vector<int> left, right;
  tcp_socket_pairs(nsockets, &left, &right);
  return {TcpTransport::adopt(left, 1, "right", config), TcpTransport::adopt(right, 0, "left", config)};
}

CallTag tag_of(uint32_t seq, uint64_t count) {
  CallTag t;
  t.seq = seq;
  t.count = count;
  return t;
}

uint8_t byte_of(size_t message, size_t i) {
  return static_cast<uint8_t>(message * 131 + i * 7 + (i >> 9));
}

// Many messages of random sizes (zero, tiny, a full slot), sent and received
// in every combination of the slot and copying paths, with the reader lagging
// so that sockets fill, writes split and payloads arrive in parts.
void stream_messages(int nsockets, int slots, size_t read_ahead = Config().tcp_read_ahead) {
  const size_t slot = 64 * 1024;
  Pair p = connect_pair(nsockets, slot, slots, read_ahead);
  std::mt19937 rng(1234 + nsockets);
  const size_t kMessages = 400;
  std::vector<size_t> size(kMessages);
  for (auto& s : size) {
    const unsigned pick = rng() % 4;
    s = pick == 0 ? 0 : pick == 1 ? rng() % 64 : pick == 2 ? slot : rng() % (slot + 1);
  }
  std::vector<uint8_t> src(slot), dst(slot);
  size_t sent = 0, received = 0;
  bool started = false;  // the receive of message `received` began
  while (received < kMessages) {
    // Send while slots are free, half of them through send_from.
    for (int burst = 0; burst < 4 && sent < kMessages; ++burst) {
      for (size_t i = 0; i < size[sent]; ++i) src[i] = byte_of(sent, i);
      const CallTag t = tag_of(static_cast<uint32_t>(sent), size[sent]);
      if (sent % 2 == 0) {
        if (!p.a->send_from(src.data(), size[sent], t)) break;
      } else {
        void* s = p.a->send_slot(size[sent]);
        if (s == nullptr) break;
        std::memcpy(s, src.data(), size[sent]);
        p.a->commit_send(size[sent], t);
      }
      ++sent;
    }
    ASSERT_TRUE(p.a->progress().is_ok());
    // Receive at most two per round (the reader lags), alternating paths.
    for (int burst = 0; burst < 2 && received < kMessages; ++burst) {
      const size_t want = size[received];
      const CallTag t = tag_of(static_cast<uint32_t>(received), want);
      // Filled once per message: after kNotYet part of it may be in dst.
      if (!started) std::fill(dst.begin(), dst.end(), 0xee);
      started = true;
      if (received % 3 != 0) {
        Connection::Received r = p.b->recv_into(dst.data(), want, t);
        ASSERT_NE(r, Connection::Received::kOther) << "message " << received;
        if (r == Connection::Received::kNotYet) break;
      } else {
        const void* data = nullptr;
        size_t bytes = 0;
        if (!p.b->recv_ready(&data, &bytes)) break;
        ASSERT_EQ(bytes, want) << "message " << received;
        ASSERT_TRUE(p.b->recv_tag() == t) << "message " << received;
        if (bytes) std::memcpy(dst.data(), data, bytes);
        p.b->release_recv();
      }
      for (size_t i = 0; i < want; ++i)
        ASSERT_EQ(dst[i], byte_of(received, i)) << "message " << received << " byte " << i;
      if (want < slot) {
        ASSERT_EQ(dst[want], 0xee) << "message " << received << " wrote past its end";
      }
      ++received;
      started = false;
    }
    ASSERT_TRUE(p.b->progress().is_ok());
  }
  EXPECT_FALSE(p.a->wants_write());
}

TEST(TcpConnection, OneSocketKeepsEveryMessageIntact) {
  stream_messages(1, 3);
}

TEST(TcpConnection, SeveralSocketsKeepTheOrder) {
  stream_messages(3, 3);
}

TEST(TcpConnection, MoreSocketsThanSlotsKeepTheOrder) {
  stream_messages(4, 2);
}

// Reads ahead of none (header, then payload), of less than a header, of a
// few headers, and of more than a slot (every payload through the buffer).
TEST(TcpConnection, AnyReadAheadKeepsEveryMessageIntact) {
  for (size_t ahead : {size_t{0}, size_t{7}, size_t{100}, size_t{200000}}) {
    SCOPED_TRACE("read ahead " + std::to_string(ahead));
    stream_messages(1, 3, ahead);
    stream_messages(3, 2, ahead);
  }
}

// The peer's half of a frame, written raw: the wire format is the header
// (magic "BBDF", payload bytes, the 24-byte call tag) and the payload.
void write_raw(int fd, const void* data, size_t bytes) {
  ASSERT_EQ(write(fd, data, bytes), static_cast<ssize_t>(bytes)) << std::strerror(errno);
}

// An abort frame as a failing rank sends it, cut after `text_bytes` of its text.
void write_abort_frame(int fd, uint32_t code, const std::string& why, size_t text_bytes) {
  const uint32_t abort_header[2] = {0x41444242u, static_cast<uint32_t>(4 + why.size())};
  const CallTag none;
  write_raw(fd, abort_header, sizeof(abort_header));
  write_raw(fd, &none, sizeof(none));
  write_raw(fd, &code, sizeof(code));
  write_raw(fd, why.data(), text_bytes);
}

// A connection reading one socket of a pair whose other end (sv[0]) the
// test writes raw frames into.
std::unique_ptr<Connection> raw_connection(int slots, int sv[2]) {
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0 || !set_nonblocking(sv[1], true)) {
    ADD_FAILURE() << "socketpair: " << std::strerror(errno);
    std::abort();
  }
  Config config;
  config.tcp_slot_bytes = 8192;
  config.tcp_slots = slots;
  return TcpTransport::adopt({sv[1]}, 0, "raw", config);
}

// A payload whose header arrived before the receive began is read straight
// into the receiver's buffer: half of it shows there before the rest is sent.
TEST(TcpConnection, PayloadIsReadStraightIntoTheReceiversBuffer) {
  int sv[2];
  auto conn = raw_connection(2, sv);
  const CallTag tag = tag_of(3, 4096);
  std::vector<uint8_t> payload(4096);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = byte_of(3, i);
  const uint32_t header[2] = {0x46444242u, static_cast<uint32_t>(payload.size())};
  write_raw(sv[0], header, sizeof(header));
  write_raw(sv[0], &tag, sizeof(tag));
  write_raw(sv[0], payload.data(), payload.size() / 2);
  std::vector<uint8_t> dst(payload.size(), 0);
  EXPECT_EQ(conn->recv_into(dst.data(), dst.size(), tag), Connection::Received::kNotYet);
  for (size_t i = 0; i < payload.size() / 2; ++i)
    ASSERT_EQ(dst[i], payload[i]) << "the first half was not read into the receiver's buffer, byte " << i;
  EXPECT_EQ(dst[payload.size() / 2], 0);
  // Only this receiver continues the payload: progress() leaves it alone.
  write_raw(sv[0], payload.data() + payload.size() / 2, payload.size() / 2);
  ASSERT_TRUE(conn->progress().is_ok());
  EXPECT_EQ(dst[payload.size() / 2], 0);
  EXPECT_EQ(conn->recv_into(dst.data(), dst.size(), tag), Connection::Received::kDone);
  EXPECT_EQ(dst, payload);
  close(sv[0]);
}

// A header that fails the checks breaks the connection for good: a receiver
// that keeps polling (as a collective's wait does until the peer check runs)
// reads nothing more, so the rejected length (far beyond the slot) never
// becomes a read into a slot, and a bad-magic header's payload is never
// handed out as the awaited message.
TEST(TcpConnection, ARejectedHeaderIsNeverReadPast) {
  for (const bool bad_magic : {false, true}) {
    int sv[2];
    auto conn = raw_connection(2, sv);
    const CallTag tag = tag_of(4, 64);
    const uint32_t header[2] = {bad_magic ? 0x12345678u : 0x46444242u, bad_magic ? 64u : 0x7fffffffu};
    write_raw(sv[0], header, sizeof(header));
    write_raw(sv[0], &tag, sizeof(tag));
    std::vector<uint8_t> payload(64 * 1024, 0xab);  // more than a slot of 8 KiB
    write_raw(sv[0], payload.data(), payload.size());
    std::vector<uint8_t> dst(64, 0);
    for (int i = 0; i < 100; ++i)
      ASSERT_EQ(conn->recv_into(dst.data(), dst.size(), tag), Connection::Received::kNotYet) << "poll " << i;
    EXPECT_EQ(dst, std::vector<uint8_t>(64, 0)) << "the rejected frame's payload reached the receiver";
    const Status st = conn->check_peer(false);
    EXPECT_EQ(st.code(), BRAID_ERR_REMOTE);
    EXPECT_NE(st.message().find(bad_magic ? "malformed frame header (bad magic)"
                                          : "malformed frame header (length 2147483647 > slot 8192)"),
              std::string::npos)
        << st.message();
    const void* data = nullptr;
    size_t bytes = 0;
    EXPECT_FALSE(conn->recv_ready(&data, &bytes));
    close(sv[0]);
  }
}

// A receive into the caller's memory that starts before the message does.
TEST(TcpConnection, ReceiveIntoMemoryBeforeTheMessageArrives) {
  Pair p = connect_pair(2, 1 << 20, 2);
  std::vector<uint8_t> src(1 << 20), dst(1 << 20, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = byte_of(9, i);
  const CallTag t = tag_of(9, src.size());
  EXPECT_EQ(p.b->recv_into(dst.data(), dst.size(), t), Connection::Received::kNotYet);
  ASSERT_TRUE(p.a->send_from(src.data(), src.size(), t));
  src.assign(src.size(), 0);  // send_from keeps no reference to the caller's memory
  Connection::Received r = Connection::Received::kNotYet;
  for (int i = 0; i < 100000 && r == Connection::Received::kNotYet; ++i) {
    ASSERT_TRUE(p.a->progress().is_ok());
    r = p.b->recv_into(dst.data(), dst.size(), t);
  }
  ASSERT_EQ(r, Connection::Received::kDone);
  for (size_t i = 0; i < dst.size(); ++i) ASSERT_EQ(dst[i], byte_of(9, i)) << i;
}

TEST(TcpConnection, AnUnexpectedMessageIsLeftToDescribe) {
  Pair p = connect_pair(2, 4096, 2);
  const char text[] = "hundred";
  ASSERT_TRUE(p.a->send_from(text, sizeof(text), tag_of(5, 8)));
  char dst[64] = {};
  Connection::Received r = Connection::Received::kNotYet;
  for (int i = 0; i < 1000 && r == Connection::Received::kNotYet; ++i)
    r = p.b->recv_into(dst, 16, tag_of(5, 8));  // the wrong size
  ASSERT_EQ(r, Connection::Received::kOther);
  EXPECT_EQ(dst[0], 0) << "a mismatched message must not be copied";
  EXPECT_EQ(p.b->recv_into(dst, sizeof(text), tag_of(6, 8)), Connection::Received::kOther);  // wrong call
  const void* data = nullptr;
  size_t bytes = 0;
  ASSERT_TRUE(p.b->recv_ready(&data, &bytes));
  EXPECT_EQ(bytes, sizeof(text));
  EXPECT_EQ(p.b->recv_tag().seq, 5u);
  EXPECT_EQ(p.b->recv_into(dst, sizeof(text), tag_of(5, 8)), Connection::Received::kDone);
  EXPECT_STREQ(dst, text);
}

TEST(TcpConnection, AbortFrameReachesThePeerOnAnySocket) {
  for (int messages : {0, 1, 2}) {
    Pair p = connect_pair(3, 4096, 4);
    for (int m = 0; m < messages; ++m) ASSERT_TRUE(p.a->send_from("x", 1, tag_of(m, 1)));
    p.a->shutdown(Status(BRAID_ERR_TIMEOUT, "rank 1 waited too long"));
    char dst[4];
    for (int m = 0; m < messages; ++m) {
      Connection::Received r = Connection::Received::kNotYet;
      for (int i = 0; i < 1000 && r == Connection::Received::kNotYet; ++i)
        r = p.b->recv_into(dst, 1, tag_of(m, 1));
      ASSERT_EQ(r, Connection::Received::kDone) << "messages before the abort are still delivered";
    }
    Status st = p.b->check_peer(true);
    EXPECT_EQ(st.code(), BRAID_ERR_TIMEOUT) << st.message();
    EXPECT_NE(st.message().find("rank 1 waited too long"), std::string::npos) << st.message();
  }
}

// Two sockets: frame 0 arrives half on socket 0, and the peer's abort frame
// takes frame 1's place on socket 1. Then the rest of frame 0 arrives
// (`rest_arrives`), or socket 0 ends without it.
void abort_behind_half_a_frame(bool rest_arrives) {
  int a[2], b[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, a), 0);
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, b), 0);
  ASSERT_TRUE(set_nonblocking(a[1], true).is_ok());
  ASSERT_TRUE(set_nonblocking(b[1], true).is_ok());
  Config config;
  config.tcp_slot_bytes = 8192;
  config.tcp_slots = 2;
  auto conn = TcpTransport::adopt({a[1], b[1]}, 0, "raw", config);
  const CallTag tag = tag_of(1, 100);
  std::vector<uint8_t> payload(100, 7);
  const uint32_t header[2] = {0x46444242u, 100};
  write_raw(a[0], header, sizeof(header));
  write_raw(a[0], &tag, sizeof(tag));
  write_raw(a[0], payload.data(), 50);
  const std::string why = "rank 1 ran out of memory";
  write_abort_frame(b[0], BRAID_ERR_SYSTEM, why, why.size());
  std::vector<uint8_t> dst(100, 0);
  EXPECT_EQ(conn->recv_into(dst.data(), dst.size(), tag), Connection::Received::kNotYet);
  EXPECT_TRUE(conn->check_peer(true).is_ok()) << "the abort came before frame 0 was consumed";
  EXPECT_TRUE(conn->peer_failure().is_ok());
  Status st;
  if (rest_arrives) {
    write_raw(a[0], payload.data() + 50, 50);
    EXPECT_EQ(conn->recv_into(dst.data(), dst.size(), tag), Connection::Received::kDone);
    EXPECT_EQ(dst, payload);
    st = conn->check_peer(true);
    EXPECT_EQ(conn->peer_failure().code(), BRAID_ERR_SYSTEM);
  } else {
    close(a[0]);
    a[0] = -1;
    for (int i = 0; i < 100 && st.is_ok(); ++i) {
      // As the engine does: the receive goes on reading, then the peer is checked.
      EXPECT_EQ(conn->recv_into(dst.data(), dst.size(), tag), Connection::Received::kNotYet);
      st = conn->check_peer(true);
    }
  }
  EXPECT_EQ(st.code(), BRAID_ERR_SYSTEM) << st.message();
  EXPECT_NE(st.message().find(why), std::string::npos) << st.message();
  if (a[0] >= 0) close(a[0]);
  close(b[0]);
}

// With several sockets an abort can overtake earlier messages still on
// their way on other sockets: it is reported only once they are consumed.
TEST(TcpConnection, AbortWaitsForTheMessagesSentBeforeIt) {
  abort_behind_half_a_frame(true);
}

// A failing peer resets its sockets once its bounded wait for them ends,
// which can cut off a message it sent before its abort frame while the
// frame itself got through on another socket. That message never arrives,
// and the peer's cause, in hand, is what is reported: before, the error
// said only that the peer closed its connection.
TEST(TcpConnection, TheCauseIsReportedWhenAMessageBeforeItIsCutOff) {
  abort_behind_half_a_frame(false);
}

// A peer's failure text is printed as it is reported: bytes that are not
// printable ASCII (an escape sequence, a line break, a NUL) become '?'. An
// abort frame cut short is the peer's failure too, with its cause lost.
TEST(TcpConnection, APeersAbortTextIsMadePrintable) {
  for (bool truncated : {false, true}) {
    int a[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, a), 0);
    ASSERT_TRUE(set_nonblocking(a[1], true).is_ok());
    Config config;
    auto conn = TcpTransport::adopt({a[1]}, 0, "raw", config);
    const std::string why("bad\x1b[31m\nline\0nul", 17);
    write_abort_frame(a[0], BRAID_ERR_SYSTEM, why, truncated ? 5 : why.size());
    Status st;
    for (int i = 0; i < 100 && st.is_ok(); ++i) st = conn->check_peer(true);
    if (truncated) {
      EXPECT_EQ(st.code(), BRAID_ERR_REMOTE) << st.message();
      EXPECT_NE(st.message().find("failed and sent a truncated abort frame"), std::string::npos)
          << st.message();
    } else {
      EXPECT_EQ(st.code(), BRAID_ERR_SYSTEM) << st.message();
      EXPECT_NE(st.message().find("failed: bad?[31m?line?nul"), std::string::npos) << st.message();
    }
    close(a[0]);
  }
}

// A socket whose next message has no free slot is not polled for reading:
// it stays readable, so poll would return at once and the driver would spin.
TEST(TcpConnection, SocketsWaitingForASlotAreNotPolled) {
  Pair p = connect_pair(2, 4096, 2);
  for (uint32_t m = 0; m < 4; ++m) ASSERT_TRUE(p.a->send_from("abcd", 4, tag_of(m, 4)) || m >= 2);
  // Two slots: messages 0 and 1 fill them; 2 and 3 wait on their sockets.
  for (int i = 0; i < 4 && p.a->wants_write(); ++i) ASSERT_TRUE(p.a->progress().is_ok());
  ASSERT_TRUE(p.b->progress().is_ok());
  std::vector<pollfd> fds;
  p.b->poll_fds(POLLIN, &fds);
  EXPECT_TRUE(fds.empty()) << fds.size() << " sockets polled with both slots taken";
  const void* data = nullptr;
  size_t bytes = 0;
  ASSERT_TRUE(p.b->recv_ready(&data, &bytes));
  p.b->release_recv();  // reads message 2 into the freed slot
  fds.clear();
  p.b->poll_fds(POLLIN, &fds);
  EXPECT_EQ(fds.size(), 0u) << "message 2 arrived; message 3 still has no slot";
  for (int m = 1; m < 4; ++m) {
    ASSERT_TRUE(p.b->recv_ready(&data, &bytes)) << "message " << m;
    EXPECT_EQ(p.b->recv_tag().seq, static_cast<uint32_t>(m));
    p.b->release_recv();
  }
  fds.clear();
  p.b->poll_fds(POLLIN, &fds);
  EXPECT_EQ(fds.size(), 2u) << "with a slot free for each socket's next message, both are polled";
}

// Small messages that are in the socket together come out of it in one
// read: after the first is handed out the socket holds nothing, and the rest
// are delivered from what was read ahead, before the end of the stream the
// peer left behind them is reported.
TEST(TcpConnection, SmallMessagesComeOutOfTheSocketInOneRead) {
  int sv[2];
  auto conn = raw_connection(4, sv);
  for (uint32_t m = 0; m < 3; ++m) {
    const CallTag tag = tag_of(m, 2);
    const uint32_t frame[2] = {0x46444242u, 8};
    const uint64_t payload = 0x1111111111111111ull * (m + 1);
    write_raw(sv[0], frame, sizeof(frame));
    write_raw(sv[0], &tag, sizeof(tag));
    write_raw(sv[0], &payload, sizeof(payload));
  }
  close(sv[0]);
  for (uint32_t m = 0; m < 3; ++m) {
    const void* data = nullptr;
    size_t bytes = 0;
    ASSERT_TRUE(conn->recv_ready(&data, &bytes)) << "message " << m;
    if (m == 0) {
      int left = -1;
      ASSERT_EQ(ioctl(sv[1], FIONREAD, &left), 0);
      EXPECT_EQ(left, 0) << "the first read took only part of what was in the socket";
    }
    ASSERT_EQ(bytes, 8u);
    uint64_t got = 0;
    std::memcpy(&got, data, 8);
    EXPECT_EQ(got, 0x1111111111111111ull * (m + 1)) << "message " << m;
    EXPECT_EQ(conn->recv_tag().seq, m);
    EXPECT_TRUE(conn->check_peer(false).is_ok())
        << "the end reported before message " << m << " was consumed";
    conn->release_recv();
  }
  Status st = conn->check_peer(false);
  EXPECT_NE(st.message().find("closed its tcp connection"), std::string::npos) << st.message();
}

// A failing rank sends its abort frame, then resets its sockets. A peer
// whose next write meets the reset still reads the frame (on whichever
// socket it came) and reports the cause, not the reset; the failed rank's
// own later writes name its own failure, not the peer.
TEST(TcpConnection, AWriteIntoAResetConnectionReportsThePeersCause) {
  for (int nsockets : {1, 3}) {
    SCOPED_TRACE("sockets: " + std::to_string(nsockets));
    Pair p = connect_tcp_pair(nsockets, 4096, 4);
    ASSERT_TRUE(p.b->send_from("x", 1, tag_of(0, 1)));  // never read: the reset drops it
    p.a->shutdown(Status(BRAID_ERR_TIMEOUT, "rank 1 waited too long"));
    Status st;
    for (uint32_t m = 1; m < 100 && st.is_ok(); ++m) {
      (void)p.b->send_from("y", 1, tag_of(m, 1));  // lands on each socket in turn
      st = p.b->progress();
      if (st.is_ok()) usleep(1000);
    }
    EXPECT_EQ(st.code(), BRAID_ERR_TIMEOUT) << st.message();
    EXPECT_NE(st.message().find("rank 1 waited too long"), std::string::npos) << st.message();
    st = p.b->check_peer(true);
    EXPECT_EQ(st.code(), BRAID_ERR_TIMEOUT) << st.message();
    (void)p.a->send_from("z", 1, tag_of(1, 1));
    st = p.a->progress();
    EXPECT_EQ(st.code(), BRAID_ERR_TIMEOUT) << st.message();
    EXPECT_NE(st.message().find("shut down by this rank"), std::string::npos) << st.message();
    EXPECT_EQ(st.message().find("failed or exited"), std::string::npos) << st.message();
  }
}

// The same when every receive slot toward the peer is taken (this rank has
// not consumed what it sent): the abort frame sits behind those frames, and
// a write meets the reset first. The cause is still what is reported.
TEST(TcpConnection, TheCauseIsFoundBehindFramesNoSlotIsFreeFor) {
  for (int nsockets : {1, 3}) {
    SCOPED_TRACE("sockets: " + std::to_string(nsockets));
    Pair p = connect_tcp_pair(nsockets, 4096, 4);
    for (uint32_t m = 0; m < 8; ++m) ASSERT_TRUE(p.a->send_from("x", 1, tag_of(m, 1)));  // 4 slots, 8 frames
    ASSERT_TRUE(p.a->progress().is_ok());
    usleep(10000);
    ASSERT_TRUE(p.b->progress().is_ok());  // fills b's slots; nothing is released
    p.a->shutdown(Status(BRAID_ERR_TIMEOUT, "rank 1 waited too long"));
    Status st;
    for (uint32_t m = 0; m < 100 && st.is_ok(); ++m) {
      (void)p.b->send_from("y", 1, tag_of(m, 2));
      st = p.b->progress();
      if (st.is_ok()) usleep(1000);
    }
    EXPECT_EQ(st.code(), BRAID_ERR_TIMEOUT) << st.message();
    EXPECT_NE(st.message().find("rank 1 waited too long"), std::string::npos) << st.message();
  }
}

// After a write met the peer's reset, the search for its cause reads past
// frames no slot is free for. A frame it stopped inside (the rest still on
// its way) is never delivered, neither with its first bytes missing nor as
// another call's message: the stream ends there.
TEST(TcpConnection, AFrameTheCauseSearchReadIntoIsNotDelivered) {
  std::vector<int> raw, mine;
  tcp_socket_pairs(2, &raw, &mine);
  Config config;
  config.tcp_slot_bytes = 4096;
  config.tcp_slots = 2;
  auto conn = TcpTransport::adopt(mine, 0, "raw", config);
  // Frame k travels on socket k % 2: frames 0 and 1 fill both slots, frame
  // 2 arrives half on socket 0.
  auto frame_start = [&](int fd, uint32_t seq, uint32_t bytes) {
    const uint32_t header[2] = {0x46444242u, bytes};
    const CallTag tag = tag_of(seq, bytes);
    write_raw(fd, header, sizeof(header));
    write_raw(fd, &tag, sizeof(tag));
  };
  std::vector<uint8_t> payload(1000);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = byte_of(2, i);
  frame_start(raw[0], 0, 1);
  write_raw(raw[0], "a", 1);
  frame_start(raw[1], 1, 1);
  write_raw(raw[1], "b", 1);
  frame_start(raw[0], 2, 1000);
  write_raw(raw[0], payload.data(), 500);
  // The peer resets socket 1: a write there fails.
  const linger reset{1, 0};
  ASSERT_EQ(setsockopt(raw[1], SOL_SOCKET, SO_LINGER, &reset, sizeof(reset)), 0);
  close(raw[1]);
  Status st;
  for (uint32_t m = 0; m < 100 && st.is_ok(); ++m) {
    (void)conn->send_from("y", 1, tag_of(m, 1));
    st = conn->progress();
    if (st.is_ok()) usleep(1000);
  }
  ASSERT_FALSE(st.is_ok()) << "no write met the reset";
  // The rest of frame 2 arrives, and frames 0 and 1 free their slots.
  write_raw(raw[0], payload.data() + 500, 500);
  char got[2] = {0, 0};
  EXPECT_EQ(conn->recv_into(&got[0], 1, tag_of(0, 1)), Connection::Received::kDone);
  EXPECT_EQ(conn->recv_into(&got[1], 1, tag_of(1, 1)), Connection::Received::kDone);
  EXPECT_EQ(std::string(got, 2), "ab");
  std::vector<uint8_t> dst(1000, 0);
  for (int i = 0; i < 50; ++i) {
    // kOther before: the frame arrived in a slot under the previous
    // frame's tag (the search had read its header), a call mismatch.
    ASSERT_EQ(conn->recv_into(dst.data(), dst.size(), tag_of(2, 1000)), Connection::Received::kNotYet);
    usleep(1000);
  }
  EXPECT_FALSE(conn->check_peer(true).is_ok());
  close(raw[0]);
}

// A reset without an abort frame (a rank that died) is reported as such
// once the messages sent before it are consumed.
TEST(TcpConnection, AResetWithoutACauseIsReportedAfterTheMessagesBeforeIt) {
  Pair p = connect_tcp_pair(1, 4096, 4);
  ASSERT_TRUE(p.a->send_from("x", 1, tag_of(0, 1)));
  ASSERT_TRUE(p.b->send_from("y", 1, tag_of(0, 1)));  // never read: a's close resets
  usleep(10000);
  p.a.reset();  // closing with unread bytes resets the connection
  char dst[1] = {0};
  Connection::Received r = Connection::Received::kNotYet;
  for (int i = 0; i < 1000 && r == Connection::Received::kNotYet; ++i)
    r = p.b->recv_into(dst, 1, tag_of(0, 1));
  ASSERT_EQ(r, Connection::Received::kDone) << "the message sent before the reset is still delivered";
  EXPECT_EQ(dst[0], 'x');
  Status st;
  for (int i = 0; i < 1000 && st.is_ok(); ++i) st = p.b->check_peer(true);
  EXPECT_NE(st.message().find("rank 0 (host left) reset its tcp connection"), std::string::npos)
      << st.message();
}

TEST(TcpConnection, PeerThatClosesIsReported) {
  Pair p = connect_pair(2, 4096, 2);
  p.a.reset();
  Status st = p.b->check_peer(true);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("closed its tcp connection"), std::string::npos) << st.message();
}

// Fixed buffers where the kernel's caps allow them (it reports twice the
// size asked, its bookkeeping included); above the caps, or 0, the socket
// keeps what it had and the kernel goes on autotuning it.
TEST(TcpConnection, SocketBuffersAreFixedOnlyWithinTheKernelsCaps) {
  const size_t cap = socket_buffer_limit();
  ASSERT_GT(cap, 4096u) << "cannot read net.core.rmem_max / wmem_max";
  auto buffers = [](int fd) {
    int snd = 0, rcv = 0;
    socklen_t len = sizeof(int);
    getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &snd, &len);
    len = sizeof(int);
    getsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcv, &len);
    return std::make_pair(snd, rcv);
  };
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  const auto before = buffers(fd);
  EXPECT_FALSE(set_socket_buffers(fd, 0));
  EXPECT_FALSE(set_socket_buffers(fd, cap + 1));
  EXPECT_EQ(buffers(fd), before) << "a refused size leaves the socket alone";
  const size_t want = std::min<size_t>(cap, 1u << 20);
  EXPECT_TRUE(set_socket_buffers(fd, want));
  EXPECT_EQ(buffers(fd), std::make_pair(static_cast<int>(2 * want), static_cast<int>(2 * want)));
  close(fd);
}

}  // namespace
}  // namespace braid
