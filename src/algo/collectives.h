// Collective algorithms, each written once over the channel primitives, so
// every algorithm runs over every transport.
#pragma once

#include <braid/braid.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "src/algo/primitives.h"
#include "src/core/config.h"

namespace braid {

struct CollArgs {
  const void* sendbuf = nullptr;
  void* recvbuf = nullptr;
  size_t count = 0;  // per the C API's convention for the collective
  braid_dtype_t dtype = BRAID_FLOAT32;
  braid_redop_t op = BRAID_SUM;
  int root = 0;
  int peer = -1;  // point-to-point
  // all_to_allv: 4 * nranks entries (sendcounts, sdispls, recvcounts,
  // rdispls, in elements), owned by the op.
  const size_t* layout = nullptr;
  int* source = nullptr;  // receive from any source: where the sender's rank goes
};

// The all_reduce algorithm for this size (BRAID_ALGO overrides).
enum class AllReduceKind { kRing, kDirect, kPeerRead };
// `peer_reads`: every connection of the channel can read peers' memory.
AllReduceKind choose_all_reduce(const Config& config, size_t bytes, size_t piece_bytes, bool peer_reads);
bool channel_reads_peers(const Channel& ch);

Task ring_all_reduce(const Channel& ch, CollArgs a);
Task direct_all_reduce(const Channel& ch, CollArgs a, char* scratch);
// Read peers' buffers directly (channel_reads_peers); scratch: 2 * piece_bytes.
Task peer_read_all_reduce(const Channel& ch, CollArgs a, char* scratch);
Task peer_read_reduce_scatter(const Channel& ch, CollArgs a, char* scratch);
Task peer_read_all_gather(const Channel& ch, CollArgs a);
Task peer_read_broadcast(const Channel& ch, CollArgs a);
// Whether a bandwidth collective of `bytes` should read peers directly.
bool use_peer_reads(const Config& config, size_t bytes, bool peer_reads);
Task chain_broadcast(const Channel& ch, CollArgs a);
Task chain_reduce(const Channel& ch, CollArgs a);
Task ring_all_gather(const Channel& ch, CollArgs a);
Task ring_reduce_scatter(const Channel& ch, CollArgs a);
Task direct_gather(const Channel& ch, CollArgs a);
Task direct_scatter(const Channel& ch, CollArgs a);
Task pairwise_all_to_all(const Channel& ch, CollArgs a);
Task pairwise_all_to_allv(const Channel& ch, CollArgs a);
Task dissemination_barrier(const Channel& ch);

// What a rank called, as BRAID_CHECK_CALLS compares it across ranks.
struct CallDescriptor {
  char name[24];  // "all_reduce", ...
  uint64_t seq;
  uint64_t count;           // 0 for all_to_allv (its counts may differ by rank)
  int32_t dtype, op, root;  // -1 where the collective has none
};
// BRAID_CHECK_CALLS=1: every rank sends its descriptor to every other before
// `body` runs; any difference fails the op with BRAID_ERR_MISMATCH naming
// both sides, on every rank, before a byte of data moves.
Task checked_call(const Channel& ch, CallDescriptor mine, Task body);
Task p2p_send(const Channel& ch, CollArgs a);
Task p2p_recv(const Channel& ch, CollArgs a);

}  // namespace braid
