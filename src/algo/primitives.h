// The channel primitives every algorithm is written with. Each moves one
// piece (at most Channel::piece_bytes) between neighbours, waiting by
// co_await, never by blocking the thread:
//   send, recv, recv_reduce_send, recv_reduce_copy, recv_reduce_copy_send,
//   recv_copy_send, and exchange (send and receive at once, piece by piece).
// A message of n bytes is max(1, ceil(n / piece_bytes)) pieces, so both ends
// agree on the piece boundaries from the count alone.
#pragma once

#include <braid/braid.h>

#include <cstddef>
#include <vector>

#include "src/core/engine.h"
#include "src/core/task.h"
#include "transports/connection.h"

namespace braid {

// The connections an operation uses: one per peer on one channel. A channel
// may cover a subset of the communicator's ranks, in any order (the ranks of
// one host, one rank per host, a ring ordered by host): algorithms see
// indices 0..nranks-1, and waits and errors name the communicator's ranks.
struct Channel {
  int rank = 0;
  int nranks = 1;
  size_t piece_bytes = 0;
  std::vector<Connection*> conns;  // indexed by peer; this rank's entry may be null
  std::vector<int> ranks;          // communicator rank of each index; empty: the same
  Connection* to(int peer) const { return conns[peer]; }
  int global(int peer) const { return ranks.empty() ? peer : ranks[peer]; }
  // The channel over `members` (indices of this channel, this rank among them).
  Channel subset(const std::vector<int>& members) const;
};

inline size_t num_pieces(size_t bytes, size_t piece) {
  return bytes == 0 ? 1 : (bytes + piece - 1) / piece;
}

// Connection::send_from, counting what it sent (false: no slot free,
// nothing sent). For sends made without an op, too (the inline attempts).
bool send_counted(Connection* c, const void* src, size_t bytes, const CallTag& tag);
Step send_piece(const Channel& ch, int to, const void* src, size_t bytes);
Step recv_piece(const Channel& ch, int from, void* dst, size_t bytes);
// dst (this rank's output) = received op local.
Step recv_reduce_copy(const Channel& ch, int from, void* dst, const void* local, size_t bytes,
                      braid_dtype_t dtype, braid_redop_t op);
// to's slot = received op local.
Task recv_reduce_send(const Channel& ch, int from, int to, const void* local, size_t bytes,
                      braid_dtype_t dtype, braid_redop_t op);
// dst = received op local, and dst is sent on.
Task recv_reduce_copy_send(const Channel& ch, int from, int to, void* dst, const void* local, size_t bytes,
                           braid_dtype_t dtype, braid_redop_t op);
// dst = received, and it is sent on.
Task recv_copy_send(const Channel& ch, int from, int to, void* dst, size_t bytes);

// Whole messages of any size, split into pieces.
Step send_message(const Channel& ch, int to, const void* src, size_t bytes);
Step recv_message(const Channel& ch, int from, void* dst, size_t bytes);
// A message copied straight from this rank's buffer into the receiver's
// (where the connection supports peer reads): `to` gets the buffer's
// address, both ends copy chunks of it (see SharedCopy), and the send ends
// once every chunk is in. One copy, where slots copy twice.
Task send_by_offer(const Channel& ch, int to, const void* src, size_t bytes);
// The receiving end, where the sender may have offered: takes the next
// message from `from` if it is the data; if it is an offer, opens it with
// dst, copies its share, and tells `from` once the whole message is in.
Task recv_or_read(const Channel& ch, int from, void* dst, size_t bytes);
// Tests only: when set, each end of an offered send runs it before it
// copies a chunk (a sender after its check of the receiver's failure mark),
// to hold a copy there (tests/failure_test.cc).
extern void (*test_hook_before_chunk_copy)(bool as_sender);

// Sends to `to` and receives from `from` at the same time, piece by piece, so
// rings of exchanges cannot deadlock on full slots.
Task exchange(const Channel& ch, int to, const void* src, size_t send_bytes, int from, void* dst,
              size_t recv_bytes);

}  // namespace braid
