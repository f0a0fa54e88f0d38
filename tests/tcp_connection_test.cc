// The tcp connection on its own, over socket pairs in one process: frames
// dealt to several sockets arrive in order, the copying send and receive
// (straight from and into the caller's memory) agree with the slot path
// whatever the socket took, a message that is not the expected one is left
// for the caller to describe, and a peer's abort or exit is reported.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "src/core/config.h"
#include "src/core/socket.h"
#include "transports/tcp/tcp_transport.h"

namespace braid {
namespace {

struct Pair {
  std::unique_ptr<Connection> a, b;
};

Pair connect_pair(int nsockets, size_t slot_bytes, int slots) {
  Config config;
  config.tcp_slot_bytes = slot_bytes;
  config.tcp_slots = slots;
  std::vector<int> left, right;
  for (int k = 0; k < nsockets; ++k) {
    int sv[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    EXPECT_TRUE(set_nonblocking(sv[0], true).is_ok());
    EXPECT_TRUE(set_nonblocking(sv[1], true).is_ok());
    left.push_back(sv[0]);
    right.push_back(sv[1]);
  }
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
void stream_messages(int nsockets) {
  const size_t slot = 64 * 1024;
  Pair p = connect_pair(nsockets, slot, 3);
  std::mt19937 rng(1234 + nsockets);
  const size_t kMessages = 400;
  std::vector<size_t> size(kMessages);
  for (auto& s : size) {
    const unsigned pick = rng() % 4;
    s = pick == 0 ? 0 : pick == 1 ? rng() % 64 : pick == 2 ? slot : rng() % (slot + 1);
  }
  std::vector<uint8_t> src(slot), dst(slot);
  size_t sent = 0, received = 0;
  while (received < kMessages) {
    // Send while slots are free, half of them through send_from.
    for (int burst = 0; burst < 4 && sent < kMessages; ++burst) {
      for (size_t i = 0; i < size[sent]; ++i) src[i] = byte_of(sent, i);
      const CallTag t = tag_of(static_cast<uint32_t>(sent), size[sent]);
      if (sent % 2 == 0) {
        if (!p.a->send_from(src.data(), size[sent], t)) break;
      } else {
        void* s = p.a->send_slot();
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
      std::fill(dst.begin(), dst.end(), 0xee);
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
    }
    ASSERT_TRUE(p.b->progress().is_ok());
  }
  EXPECT_FALSE(p.a->wants_write());
}

TEST(TcpConnection, OneSocketKeepsEveryMessageIntact) {
  stream_messages(1);
}

TEST(TcpConnection, SeveralSocketsKeepTheOrder) {
  stream_messages(3);
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

TEST(TcpConnection, PeerThatClosesIsReported) {
  Pair p = connect_pair(2, 4096, 2);
  p.a.reset();
  Status st = p.b->check_peer(true);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("closed its tcp connection"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace braid
