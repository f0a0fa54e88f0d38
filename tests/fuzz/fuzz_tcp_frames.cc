// libFuzzer target: whatever a peer (or a stranger that got past the
// handshake) could send on a braid tcp connection -- frame headers with any
// magic, length and tag, payloads, abort frames, truncation anywhere --
// arrives on a real TcpConnection through a socket pair. The connection must
// hand out only messages that fit a slot, or fail with an error; never
// crash, read out of bounds, or loop without end.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "src/core/config.h"
#include "src/core/socket.h"
#include "transports/tcp/tcp_transport.h"

namespace {

braid::Config small_config() {
  braid::Config c;
  c.tcp_slot_bytes = 4096;  // small slots: oversized frames are easy to reach
  c.tcp_slots = 4;
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const braid::Config config = small_config();
  if (size > 64 * 1024) return 0;  // stays below the socket buffer: one write, then EOF
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) abort();
  size_t off = 0;
  while (off < size) {
    ssize_t n = write(sv[1], data + off, size - off);
    if (n <= 0) abort();
    off += static_cast<size_t>(n);
  }
  close(sv[1]);
  if (!braid::set_nonblocking(sv[0], true)) abort();
  auto conn = braid::TcpTransport::adopt({sv[0]}, 1, "fuzz", config);
  uint64_t sum = 0;
  // A receiver waiting for the seeds' message (32 bytes, all_reduce #3 of
  // 8 float32 sum): matching frames are read straight into `dst`, the path
  // that skips the slots (and that a rejected header once reached).
  braid::CallTag want_tag;
  want_tag.count = 8;
  want_tag.seq = 3;
  want_tag.kind = 3;
  want_tag.dtype = 0;
  want_tag.op = 0;
  std::vector<uint8_t> dst(32);
  // Every round consumes what arrived; the input is finite, so a correct
  // connection reaches an error (EOF, a bad frame) or runs out of bytes.
  for (int round = 0; round < 4 * 1024; ++round) {
    if (conn->recv_into(dst.data(), dst.size(), want_tag) == braid::Connection::Received::kDone)
      for (uint8_t b : dst) sum += b;
    const void* msg = nullptr;
    size_t bytes = 0;
    while (conn->recv_ready(&msg, &bytes)) {
      if (bytes > conn->slot_bytes()) abort();
      const auto* p = static_cast<const uint8_t*>(msg);
      for (size_t i = 0; i < bytes; ++i) sum += p[i];  // ASan checks every byte handed out
      sum += conn->recv_tag().seq;
      conn->release_recv();
    }
    if (!conn->progress() || !conn->check_peer(false)) {
      // A waiting receiver polls a few more times before its peer check
      // sees the error: a broken connection must read nothing more.
      for (int i = 0; i < 4; ++i)
        if (conn->recv_into(dst.data(), dst.size(), want_tag) == braid::Connection::Received::kDone) abort();
      break;
    }
  }
  return sum == 1 ? 1 : 0;  // keeps `sum` alive; libFuzzer ignores the value
}
