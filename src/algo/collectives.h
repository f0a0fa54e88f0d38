// Collective algorithms, each written once over the channel primitives, so
// every algorithm runs over every transport.
#pragma once

#include <braid/braid.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "src/algo/primitives.h"
#include "src/core/config.h"
#include "src/topo/topology.h"

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
  uint32_t tag = 0;       // point-to-point: checked against the matching call's
};

// A float16 AVG divides each rank's input by the number of ranks before the
// sum, as NCCL does: the sum of n float16 values may pass 65504 where their
// average fits (2 ranks of 40000). Wider floating types keep one division
// at the end, which rounds once. Reducing collectives only.
inline bool avg_scales_inputs(const CollArgs& a) {
  return a.op == BRAID_AVG && a.dtype == BRAID_FLOAT16;
}

// Returns once every rank of the channel has reached the same point (empty
// messages with every peer): phases that read peers' buffers are ordered by it.
Task sync_all(const Channel& ch);

// Every connection of the channel can read peers' memory.
bool channel_reads_peers(const Channel& ch);

Task ring_all_reduce(const Channel& ch, CollArgs a);
// `sent`: the call's sends were made already (direct_sends_if_free, by
// Communicator::run_inline); the op does the rest.
Task direct_all_reduce(const Channel& ch, CollArgs a, char* scratch, bool sent = false);
// The halves of the direct collectives for a call done inline, each done
// whole or not at all (true: done). First the sends, once every peer has a
// free slot: `bytes` from base + stride x (the peer's rank) to each peer.
// Then, once every peer's message of the call `tag` names is in, what the
// op does with them, in the op's order (reductions too: the results are
// the op's to the bit). `mine`: all_reduce's input, or its copy where the
// input is also the output.
bool direct_sends_if_free(const Channel& ch, const void* base, size_t stride, size_t bytes,
                          const CallTag& tag);
bool direct_all_reduce_if_ready(const Channel& ch, const CollArgs& a, const void* mine, const CallTag& tag);
bool direct_all_gather_if_ready(const Channel& ch, const CollArgs& a, const CallTag& tag);
bool direct_reduce_scatter_if_ready(const Channel& ch, const CollArgs& a, const CallTag& tag);
// pairwise_all_to_all's receives, the same way (its sends: direct_sends_if_free).
bool all_to_all_if_ready(const Channel& ch, const CollArgs& a, const CallTag& tag);
// direct_gather and direct_scatter, each rank's part whole or not at all: a
// rank that only sends (gather's non-roots, scatter's root) once every slot
// it needs is free, one that only receives once every message is in.
bool gather_if_ready(const Channel& ch, const CollArgs& a, const CallTag& tag);
bool scatter_if_ready(const Channel& ch, const CollArgs& a, const CallTag& tag);
// Read peers' buffers directly (channel_reads_peers); scratch: 2 * piece_bytes.
Task peer_read_all_reduce(const Channel& ch, CollArgs a, char* scratch);
Task peer_read_reduce_scatter(const Channel& ch, CollArgs a, char* scratch);
Task peer_read_all_gather(const Channel& ch, CollArgs a);
Task peer_read_broadcast(const Channel& ch, CollArgs a);
// Ranks grouped by key(rank), groups in order of first appearance.
template <class Key>
std::vector<std::pair<std::string, std::vector<int>>> group_ranks(const std::vector<int>& ranks, Key key) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r : ranks) {
    const std::string k = key(r);
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == k; });
    if (g == groups.end()) g = groups.insert(groups.end(), {k, {}});
    g->second.push_back(r);
  }
  return groups;
}

// The ranks of each host (hosts in order of first appearance), those of one
// package together and, inside it, those of one NUMA node. Rings and trees
// visit ranks in this order, so they cross between hosts once per host, and
// between sockets twice, whatever order the launcher gave (one NUMA node may
// span both sockets: BIOS node interleaving).
std::vector<std::vector<int>> host_groups(const std::vector<std::string>& host_of_rank,
                                          const std::vector<topo::RankPlacement>& placement_of_rank);

// The binary tree of tree_*: heap order over channel indices, rotated so
// `root` is at position 0 (position p has children 2p+1 and 2p+2).
struct BinaryTree {
  int parent = -1, child[2] = {-1, -1}, children = 0;
  BinaryTree(int rank, int nranks, int root);
  // The chain from `root` through the ranks after it, as a tree whose every
  // node has one child: broadcast's chain runs as one.
  static BinaryTree chain(int rank, int nranks, int root);
  // The chain that starts after `root` and ends at it, each rank the child
  // of the next: reduce's chain runs as one.
  static BinaryTree chain_into(int rank, int nranks, int root);

 private:
  BinaryTree() = default;
};
// scratch: one piece (tree, for partial sums at inner nodes) or the whole
// buffer (recursive doubling, for the partner's data).
Task tree_all_reduce(const Channel& ch, CollArgs a, char* scratch);
// `mirror`: the same ranks in reverse order (the second tree); scratch: two
// pieces.
Task double_tree_all_reduce(const Channel& ch, const Channel& mirror, CollArgs a, char* scratch);
Task tree_broadcast(const Channel& ch, CollArgs a);
// A broadcast of one piece over `t`, done at once where it can be: where
// this rank's piece has arrived (sent by the call `tag` names) and every
// child has a free slot, it is sent on and copied out, and true returned;
// otherwise nothing is done. No op, no coroutine: what a small blocking
// call on an idle engine costs (Communicator::run_inline).
bool broadcast_if_ready(const Channel& ch, const BinaryTree& t, const CollArgs& a, const CallTag& tag);
Task tree_reduce(const Channel& ch, CollArgs a, char* scratch);
// A reduce of one piece over `t`, done at once where it can be: where every
// child's piece has arrived (sent by the call `tag` names) and the parent
// has a free slot, this rank's sum goes up (or into the root's output) and
// true is returned; otherwise nothing is done (Communicator::run_inline).
bool reduce_if_ready(const Channel& ch, const BinaryTree& t, const CollArgs& a, const CallTag& tag);
Task recursive_doubling_all_reduce(const Channel& ch, CollArgs a, char* scratch);
// scratch: the whole buffer (the partner's data, folded ranks too).
Task rabenseifner_all_reduce(const Channel& ch, CollArgs a, char* scratch);
// `host`: this host's ranks; `across`: the ranks with this rank's index on
// every host; `host_reads`: `host` can read peers' memory (scratch: 2 pieces).
Task hierarchical_all_reduce(const Channel& all, const Channel& host, const Channel& across, CollArgs a,
                             bool host_reads, char* scratch);
// Rooted collectives in two levels; the root is the rank at index
// `root_index` of host `root_host` (`across` holds one rank per host).
Task hierarchical_broadcast(const Channel& host, const Channel& across, CollArgs a, int root_host,
                            int root_index);
// scratch: the buffer's bytes (a host's partial result).
Task hierarchical_reduce(const Channel& all, const Channel& host, const Channel& across, CollArgs a,
                         int root_host, int root_index, char* scratch);
Task chain_broadcast(const Channel& ch, CollArgs a);
Task chain_reduce(const Channel& ch, CollArgs a);
// Where member k of a channel keeps its block (as a communicator-ordered
// buffer is laid out, say), for rings that visit members in another order.
using BlockAt = std::function<char*(int member)>;
using ConstBlockAt = std::function<const char*(int member)>;
// Every member's block to every member. This rank's is at its place, or at
// own (then copied to its place on the way).
Task ring_gather_blocks(const Channel& ch, size_t block, BlockAt at, const void* own = nullptr);
// This rank's block, reduced over the members (op applied as is: no AVG).
Task ring_reduce_blocks(const Channel& ch, size_t count, braid_dtype_t dtype, braid_redop_t op,
                        ConstBlockAt in, char* out);
// Blocks in communicator rank order on any channel (a host-ordered one
// crosses between hosts once per host).
Task ring_all_gather(const Channel& ch, CollArgs a);
Task ring_reduce_scatter(const Channel& ch, CollArgs a);
// One step: every block straight to its destination (each at most a piece).
Task direct_all_gather(const Channel& ch, CollArgs a, bool sent = false);
Task direct_reduce_scatter(const Channel& ch, CollArgs a, bool sent = false);
// grid[h][j]: the communicator rank at index j on host h (every host alike).
using HostGrid = std::vector<std::vector<int>>;
Task hierarchical_all_gather(const Channel& host, const Channel& across, const HostGrid& grid, CollArgs a);
// scratch: one block per host.
Task hierarchical_reduce_scatter(const Channel& host, const Channel& across, const HostGrid& grid, CollArgs a,
                                 char* scratch);
Task direct_gather(const Channel& ch, CollArgs a);
Task direct_scatter(const Channel& ch, CollArgs a);
// `sent`: every block went out already (Communicator::run_inline).
Task pairwise_all_to_all(const Channel& ch, CollArgs a, bool sent = false);
Task pairwise_all_to_allv(const Channel& ch, CollArgs a);
Task dissemination_barrier(const Channel& ch);

// BRAID_CHECK_CALLS=1: every rank sends its call's tag to every other before
// `body` runs; any difference fails the op with BRAID_ERR_MISMATCH naming
// both sides, on every rank, before a byte of data moves (the tag on every
// message catches a mismatch only once a message arrives).
Task checked_call(const Channel& ch, CallTag mine, Task body);
// Point-to-point. offer_read: the receiver reads the buffer from this
// rank's memory (send_by_offer); a receive of read_min_bytes or more takes
// either form.
Task p2p_send(const Channel& ch, CollArgs a, bool offer_read);
Task p2p_recv(const Channel& ch, CollArgs a, size_t read_min_bytes);

}  // namespace braid
