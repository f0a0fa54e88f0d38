// The tuner: which algorithm runs a collective of a given size on a given
// job shape. Each candidate's time is predicted by a latency + bandwidth
// model (alpha per step, beta per byte, per kind of link), and the cheapest
// candidate that can run wins. BRAID_ALGO forces a choice per collective.
// Every rank builds the same tuner from the same all-gathered facts, so
// every rank picks the same algorithm for the same call.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "src/core/status.h"

namespace braid {

enum class Coll { kAllReduce, kBroadcast, kReduce, kAllGather, kReduceScatter };
constexpr int kNumTunedColls = 5;
const char* coll_name(Coll c);

enum class Algo : uint8_t {
  kAuto,
  kRing,               // pipelined ring (chain for rooted collectives)
  kDirect,             // every rank sends to every rank in one step
  kPeerRead,           // read peers' buffers directly (shm, cross-memory attach)
  kTree,               // pipelined binary tree
  kRecursiveDoubling,  // log2(n) exchanges of the whole buffer
  kHierarchical,       // inside each host, across hosts, inside again
  kRabenseifner,       // recursive halving reduce-scatter, recursive doubling all-gather
  kDoubleTree,         // two binary trees, each carrying half (each rank a leaf in one)
};
const char* algo_name(Algo a);

// BRAID_ALGO: "ring" (every collective that has it), or per collective
// "all_reduce:rd;broadcast:tree". Entries are kAuto where nothing is forced.
struct AlgoChoice {
  std::array<Algo, kNumTunedColls> forced{};
  Algo operator[](Coll c) const { return forced[static_cast<int>(c)]; }
  uint64_t encode() const;  // to compare across ranks
};
Status parse_algo_spec(const std::string& spec, AlgoChoice* out);

// The algorithms each collective has, in the order the docs list them.
const std::vector<Algo>& algos_of(Coll c);

// The facts the choice depends on; the same on every rank.
struct JobShape {
  int nranks = 1;
  int nhosts = 1;
  int ranks_per_host = 1;        // 0 when hosts hold different numbers of ranks
  bool peer_reads = false;       // every rank can read every other's memory (one host, shm)
  bool host_peer_reads = false;  // ranks of one host can read each other's memory
  bool oversubscribed = false;   // more ranks on one machine than it has cores
  double ranks_per_core = 1;     // the most on any machine (simulated hosts share one)
  size_t piece_bytes = 256 * 1024;
  size_t direct_max_bytes = 32 * 1024;          // BRAID_DIRECT_MAX_BYTES
  size_t peer_read_min_bytes = 256 * 1024;      // BRAID_PEER_READ_MIN_BYTES: reductions
  size_t copy_peer_read_min_bytes = 64 * 1024;  // broadcast and all_gather (the same variable sets both)
  // A peer-read call's time over the ring's (broadcast: the chain's), [Coll],
  // timed at init on one host (Communicator::probe_peer_reads; 0: not
  // measured) for peer_read_probe_bytes(). Where set, it prices that
  // collective's peer reads: alone where each rank has a core and from that
  // size up, else with the model's fixed rates too (Tuner::predict_us).
  std::array<double, kNumTunedColls> peer_read_vs_ring{};

  // The ranks of one host talk over tcp (BRAID_TRANSPORT=tcp, or shm could
  // not be set up): to the cost model a host is the ranks that share
  // memory, so each rank is one, every link is priced as tcp, and the
  // hierarchical schedules (whose gain is shm inside a host) do not run.
  void without_shared_memory() {
    nhosts = nranks;
    ranks_per_host = 1;
    peer_reads = host_peer_reads = false;
  }
};

// The buffer the init probe times `c` with: 1 MiB, but 4 MiB for a
// broadcast whose ranks share cores, where reads overtake the chain.
size_t peer_read_probe_bytes(Coll c, const JobShape& shape);

// Cost of one message step and of each byte, on one kind of link.
struct LinkCost {
  double alpha_us;
  double beta_us_per_byte;
};

class Tuner {
 public:
  Tuner() = default;
  Tuner(const JobShape& shape, const AlgoChoice& forced);

  // The algorithm for `bytes` (the per-rank buffer of all_reduce, broadcast
  // and reduce; the whole output of all_gather; the whole input of
  // reduce_scatter).
  Algo pick(Coll c, size_t bytes) const;
  // pick() for an all_reduce of `count` elements of `elem_bytes`: where the
  // count does not divide among a host's ranks, the hierarchical schedule
  // reduces the leftover elements with a flat ring after the rest, a cost
  // the per-size table (built at powers of two, which divide) leaves out.
  Algo pick_all_reduce(size_t count, size_t elem_bytes) const;
  // The model's choice, evaluated afresh (pick() looks it up per power of two).
  Algo choose(Coll c, size_t bytes) const;
  // Whether `a` can run this call on this job (forced choices that cannot
  // fall back to the model's pick).
  bool can_run(Coll c, Algo a, size_t bytes) const;
  // Whether the hierarchical all_reduce's phases inside a host should read
  // peers' memory rather than pass pieces through slots.
  bool hierarchical_reads_peers(size_t bytes) const;
  // Whether BRAID_DIRECT_MAX_BYTES lets the model consider direct here: it
  // bounds one message (all_reduce's whole buffer, all_gather's and
  // reduce_scatter's block of bytes / nranks).
  bool direct_within_bound(Coll c, size_t bytes) const;
  // The smallest buffer `c` reads from peers (BRAID_PEER_READ_MIN_BYTES).
  size_t peer_read_min(Coll c) const;
  // Message latencies per peer that broadcast's and all_gather's peer reads pay.
  double peer_read_rounds() const;
  // Predicted time in microseconds; negative when `a` cannot run.
  double predict_us(Coll c, Algo a, size_t bytes) const;

  const JobShape& shape() const { return shape_; }
  const AlgoChoice& forced() const { return forced_; }
  // One line per collective: where each algorithm takes over, e.g.
  // "all_reduce: direct < 16 KiB <= ring < 256 KiB <= peer_read".
  std::vector<std::string> describe() const;

 private:
  LinkCost intra() const;
  LinkCost inter() const;
  LinkCost flat() const { return shape_.nhosts > 1 ? inter() : intra(); }
  // The cheapest algorithm that can run, the hierarchical one's prediction
  // raised by `hier_extra_us`.
  Algo cheapest(Coll c, size_t bytes, double hier_extra_us) const;
  // The cores the job's ranks share (the ranks, when each has its own).
  double cores() const;
  // How much more a byte costs each rank for sharing its core with more
  // ranks than the oversubscribed rates were fitted with (1 up to there).
  double crowding() const;
  // A peer read's fixed cost per byte (where init timed no peer reads).
  double peer_read_beta() const;
  // predict_us without the timed ratio's scaling of the ring: peer reads at
  // the model's fixed rates (an oversubscribed broadcast's still splits its
  // timed cost its own way).
  double modelled_us(Coll c, Algo a, size_t bytes) const;
  // The latency of one one-way hop through shm (chains and trees).
  double shm_hop_us() const;
  // A pipelined one-way chain (broadcast, reduce) of hops inside hosts and
  // across them; `parallel` such chains run at once on the job's cores.
  double chain_us(int hops_in, int hops_out, double bytes, bool reduces, int parallel) const;

  JobShape shape_;
  AlgoChoice forced_;
  // choose() at each power of two: [collective][floor(log2(bytes))].
  static constexpr int kBuckets = 48;
  std::array<std::array<Algo, kBuckets>, kNumTunedColls> table_{};
};

}  // namespace braid
