// libFuzzer target: the handshake parsers, fed what a stranger, another job
// or a broken peer could send -- the hello the rendezvous root reads, the
// hello a rank's listener reads, the root's answer a rank reads (a reply or a
// refusal) -- and the unique ids users pass in. The first byte picks the parser. Each must accept
// only well-formed messages of this job and reject the rest with a message;
// never crash or read past what arrived.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "src/core/bootstrap.h"

namespace {

// A fixed token: libFuzzer learns it from the comparisons and then explores
// what lies behind it (ranks, addresses).
const braid::JobToken kToken = {0x62, 0x72, 0x61, 0x69, 0x64, 0x2d, 0x66, 0x75,
                                0x7a, 0x7a, 0x2d, 0x74, 0x6f, 0x6b, 0x65, 0x6e};

void expect_message(const braid::Status& st) {
  if (!st && st.message().empty()) abort();  // every rejection says why
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t* in = data + 1;
  const size_t n = size - 1;
  // Copies, so ASan sees reads past the end of exactly what arrived.
  std::vector<uint8_t> msg(in, in + n);
  switch (data[0] % 5) {
    case 0: {
      braid::RootHelloFields f;
      braid::Status st = braid::parse_root_hello(msg.data(), msg.size(), kToken, &f);
      expect_message(st);
      if (st && (f.rank < 0 || f.rank >= f.nranks)) abort();
      break;
    }
    case 1: {
      const int nranks = n > 0 ? 1 + msg[0] % 64 : 1;
      int rank = -1;
      uint32_t tag = 0;
      braid::Status st =
          braid::parse_peer_hello(msg.data() + (n > 0), msg.size() - (n > 0), kToken, nranks, &rank, &tag);
      expect_message(st);
      if (st && (rank < 0 || rank >= nranks)) abort();
      break;
    }
    case 2: {
      const int nranks = n > 0 ? 1 + msg[0] % 16 : 1;
      std::vector<uint8_t> reply(msg.begin() + (n > 0), msg.end());
      std::vector<braid::SockAddr> table;
      expect_message(
          braid::parse_root_reply(reply.data(), std::min<size_t>(reply.size(), 8), nranks, nullptr));
      braid::Status st = braid::parse_root_reply(reply.data(), reply.size(), nranks, &table);
      expect_message(st);
      if (st && table.size() != static_cast<size_t>(nranks)) abort();
      break;
    }
    case 4: {
      bool refused = false;
      size_t reason_bytes = 0;
      braid::Status st = braid::parse_refusal_header(msg.data(), msg.size(), &refused, &reason_bytes);
      expect_message(st);
      if (!st || !refused) break;
      if (reason_bytes > braid::kMaxRefusalBytes) abort();
      const size_t have = std::min(reason_bytes, msg.size() - 8);
      const std::string why = braid::refusal_reason(msg.data() + 8, have);
      if (why.size() != have) abort();
      for (char ch : why)
        if (ch < 0x20 || ch > 0x7e) abort();  // nothing unprintable reaches a message
      break;
    }
    case 3: {
      uint8_t id[128] = {};
      if (n > 0) std::memcpy(id, msg.data(), std::min<size_t>(n, sizeof(id)));
      braid::UniqueId u;
      expect_message(braid::UniqueId::decode(id, &u));
      break;
    }
  }
  return 0;
}
