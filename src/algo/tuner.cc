#include "src/algo/tuner.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include "src/core/logging.h"

namespace braid {
namespace {

constexpr Coll kColls[kNumTunedColls] = {Coll::kAllReduce, Coll::kBroadcast, Coll::kReduce, Coll::kAllGather,
                                         Coll::kReduceScatter};

// Link constants, calibrated with bench/tune_sweep.py on the 2-core
// development VM (docs/design.md, "The tuner"). Absolute values move with
// the machine; their ratios decide where one algorithm overtakes another.
// Oversubscribed (more ranks than cores), a message waits for its receiver
// to be scheduled: step costs grow with ranks per core.
constexpr LinkCost kShm{0.7, 1.0 / 4300};   // one hop through a shm slot
constexpr LinkCost kTcp{12.0, 1.0 / 1000};  // loopback TCP through poll()
constexpr double kShmAlphaPerRankPerCore = 3.0, kShmBytesPerUsOversubscribed = 1700;
constexpr double kTcpAlphaPerRankPerCore = 12.5, kTcpBytesPerUsOversubscribed = 800;
constexpr double kPeerReadBytesPerUs = 2800;  // process_vm_readv without fast string copies
constexpr double kPeerReadBytesPerUsOversubscribed = 1700;
constexpr double kPeerReadAllReducePerRankPerCore = 0.4;  // its byte cost against the ring's, oversubscribed
// all_reduce's peer reads on ranks with cores of their own: each finished
// piece is written straight into every peer's output while in cache, and
// the schedule has two rounds of messages, plus a write per peer and piece.
// 2 ranks on the VM moved 1.2-1.4x the ring's bytes per microsecond from
// 256 KiB to 32 MiB, in place and out.
constexpr double kPeerReadAllReduceBytesPerUs = 5400;
// Message latencies per peer the peer-read models were fitted with where
// ranks share cores (reduce_scatter keeps it everywhere: never re-measured).
constexpr double kPeerReadFittedRounds = 5;
constexpr double kPeerReadAllReduceRounds = 4;  // message latencies per peer: 2 rounds and the writes
// A broadcast's peer reads where ranks share cores: their time against a
// chain's, and a fixed cost per peer, fitted to the sweeps cited there.
constexpr double kPeerReadBroadcastOfChain = 0.8, kPeerReadBroadcastPeerUs = 15;
// A coroutine frame more on a call's path (made, resumed, freed).
constexpr double kFrameUs = 0.05;
// Posting one more message in the same step (direct sends n-1 at once).
constexpr double kShmMessageUs = 0.3, kShmMessageUsPerRankPerCore = 1.5;
constexpr double kTcpMessageUs = 5.0, kTcpMessageUsPerRankPerCore = 6.0;
// A ring step on one oversubscribed host, against the model's step cost:
// each of the 2(n-1) steps waits on one neighbour, and the more ranks share
// a core, the likelier that neighbour is descheduled. Fitted to
// bench/tune_sweep.py (8 B all_reduce on the VM): a ring step cost 0.43 of
// a recursive-doubling exchange at 2 ranks per core and 0.64 at 4, where a
// flat step cost made it 0.5 at both. Never below the flat step:
// at 2 ranks per core that one puts the switch from direct at 32 KiB, as
// measured.
constexpr double kRingStepPerRankPerCore = 0.3;
// An all_reduce's pairwise exchange (recursive doubling and halving) needs
// both partners running at once: two steps' latency, but 1.4 where ranks
// share cores, as partners are often running already (4 and 8 ranks on 2
// cores, 3 sweeps: an exchange cost 1.2 and 1.6 ring steps; at 2 steps the
// model kept recursive doubling off 8 ranks on 2 simulated hosts at 32 KiB,
// where it ran 1.47x faster than the hierarchical schedule).
constexpr double kPairSteps = 2, kPairStepsOversubscribed = 1.4;
// A direct all_reduce copies each peer's buffer out and reduces it in: 1.2
// of a byte each. On one host whose ranks share cores it posts a message in
// 0.6 us per rank per core (the broadcast hop's 1.5 is a wait for the
// receiver, which direct overlaps across peers) and its bytes cost 0.9: in
// the sweeps above it beat every other algorithm up to 32 KiB on 4 ranks
// (1.37x the ring at 32 KiB) and up to 8 KiB on 8.
constexpr double kDirectByteWork = 1.2, kDirectByteWorkOversubscribed = 0.9;
constexpr double kDirectMessageUsPerRankPerCore = 0.6;
// A tree all_reduce's pipeline fill on one host whose ranks share cores:
// while a level waits, the other ranks' copies keep the cores busy, and
// below one piece its time grew 2.2x (4 ranks) and 2.6x (8) the buffer's
// byte cost, where a full fill prices 4x and 6x and kept the tree from 8
// ranks' 16-128 KiB, which it ran 1.1-1.3x faster than any other.
constexpr double kTreeFillOversubscribed = 0.15;
constexpr double kWholePieceTcpByte = 0.6;  // recursive doubling's exchange against a ring step, per byte
// Broadcast and reduce pass each piece one way, down a chain or a tree: a
// hop costs one message's latency, where a ring step above waits on both
// neighbours. Fitted to bench/tune_sweep.py --collective broadcast|reduce
// (4 and 8 ranks on 1 and 2 simulated hosts); with the ring step's
// constants the model priced chains 3-10x too high and picked trees and
// hierarchical schedules up to 2x slower.
constexpr double kHopShmUs = 0.3, kHopTcpUs = 3.0;
constexpr double kHopCopyBytesPerUs = 20000, kHopReduceBytesPerUs = 10000, kHopTcpBytesPerUs = 2000;
constexpr double kTcpHopWork = 2;     // a TCP hop copies at both ends: sender and receiver
constexpr double kTreeLevelHops = 3;  // a tree level serves two children, one after the other
constexpr double kTreeByteFactor = 1.5;
constexpr double kHierPhaseUs = 2;  // a hierarchical schedule's second phase starts when the first ends

// A one-way hop's cost per byte: over TCP across hosts, else through shm,
// where a reduce also combines what it passes on.
double hop_beta(bool across, bool reduces) {
  return 1.0 / (across ? kHopTcpBytesPerUs : reduces ? kHopReduceBytesPerUs : kHopCopyBytesPerUs);
}

struct Name {
  const char* text;
  Algo algo;
};
constexpr Name kNames[] = {
    {"ring", Algo::kRing},
    {"chain", Algo::kRing},
    {"direct", Algo::kDirect},
    {"peer_read", Algo::kPeerRead},
    {"tree", Algo::kTree},
    {"rd", Algo::kRecursiveDoubling},
    {"recursive_doubling", Algo::kRecursiveDoubling},
    {"hier", Algo::kHierarchical},
    {"hierarchical", Algo::kHierarchical},
    {"rabenseifner", Algo::kRabenseifner},
    {"rhd", Algo::kRabenseifner},
    {"dbtree", Algo::kDoubleTree},
    {"double_tree", Algo::kDoubleTree},
};

bool has_algo(Coll c, Algo a) {
  const auto& list = algos_of(c);
  return std::find(list.begin(), list.end(), a) != list.end();
}

std::string algo_list(Coll c) {
  std::string out;
  for (Algo a : algos_of(c)) out += (out.empty() ? "" : ", ") + std::string(algo_name(a));
  return out;
}

std::string trim(std::string s) {
  const char* ws = " \t";
  s.erase(0, s.find_first_not_of(ws));
  s.erase(s.find_last_not_of(ws) + 1);
  return s;
}

Status bad_spec(const std::string& spec, const std::string& why) {
  return Status::invalid_argument("BRAID_ALGO='" + spec + "': " + why +
                                  " (e.g. BRAID_ALGO=ring or BRAID_ALGO='all_reduce:tree;broadcast:chain')");
}

}  // namespace

const char* coll_name(Coll c) {
  static constexpr const char* kNames[kNumTunedColls] = {"all_reduce", "broadcast", "reduce", "all_gather",
                                                         "reduce_scatter"};
  return kNames[static_cast<int>(c)];
}

const char* algo_name(Algo a) {
  // Indexed by Algo.
  static constexpr const char* kAlgoNames[] = {"auto", "ring", "direct",       "peer_read", "tree",
                                               "rd",   "hier", "rabenseifner", "dbtree"};
  return kAlgoNames[static_cast<int>(a)];
}

const std::vector<Algo>& algos_of(Coll c) {
  static const std::vector<Algo> all_reduce = {
      Algo::kDirect, Algo::kRecursiveDoubling, Algo::kRabenseifner, Algo::kRing,
      Algo::kTree,   Algo::kDoubleTree,        Algo::kPeerRead,     Algo::kHierarchical};
  static const std::vector<Algo> rooted = {Algo::kRing, Algo::kTree, Algo::kPeerRead, Algo::kHierarchical};
  static const std::vector<Algo> reduce = {Algo::kRing, Algo::kTree, Algo::kHierarchical};
  static const std::vector<Algo> gather_scatter = {Algo::kDirect, Algo::kRing, Algo::kPeerRead,
                                                   Algo::kHierarchical};
  switch (c) {
    case Coll::kAllReduce:
      return all_reduce;
    case Coll::kBroadcast:
      return rooted;
    case Coll::kReduce:
      return reduce;
    case Coll::kAllGather:
    case Coll::kReduceScatter:
      break;
  }
  return gather_scatter;
}

uint64_t AlgoChoice::encode() const {
  uint64_t v = 0;
  for (int i = 0; i < kNumTunedColls; ++i) v |= static_cast<uint64_t>(forced[i]) << (8 * i);
  return v;
}

Status parse_algo_spec(const std::string& spec, AlgoChoice* out) {
  *out = AlgoChoice{};
  // Names in any case, as other BRAID_ variables take theirs.
  auto find_algo = [](std::string name, Algo* a) {
    for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    for (const Name& n : kNames)
      if (name == n.text) {
        *a = n.algo;
        return true;
      }
    return name == "auto" ? (*a = Algo::kAuto, true) : false;
  };
  const std::string whole = trim(spec);
  if (whole.empty()) return Status::ok();
  if (whole.find(':') == std::string::npos) {
    // One name for every collective that has that algorithm.
    Algo a;
    if (!find_algo(whole, &a)) {
      std::string names = "auto";
      for (const Name& n : kNames) names += std::string(", ") + n.text;
      return bad_spec(spec, "unknown algorithm '" + whole + "' (one of " + names + "; collective:algorithm" +
                                (whole.find('=') != std::string::npos ? " takes ':', not '='" : " pairs") +
                                " for one collective)");
    }
    bool used = a == Algo::kAuto;
    for (Coll c : kColls)
      if (has_algo(c, a)) {
        out->forced[static_cast<int>(c)] = a;
        used = true;
      }
    if (!used) return bad_spec(spec, "no collective has algorithm '" + whole + "'");
    return Status::ok();
  }
  std::array<bool, kNumTunedColls> named{};
  size_t pos = 0;
  while (pos <= whole.size()) {
    size_t end = whole.find_first_of(";,", pos);
    if (end == std::string::npos) end = whole.size();
    const std::string entry = trim(whole.substr(pos, end - pos));
    pos = end + 1;
    if (entry.empty()) continue;
    const size_t colon = entry.find(':');
    if (colon == std::string::npos) return bad_spec(spec, "'" + entry + "' is not collective:algorithm");
    std::string cname = trim(entry.substr(0, colon));
    const std::string aname = trim(entry.substr(colon + 1));
    for (char& ch : cname) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    const Coll* c =
        std::find_if(std::begin(kColls), std::end(kColls), [&](Coll x) { return cname == coll_name(x); });
    if (c == std::end(kColls))
      return bad_spec(spec, "unknown collective '" + cname +
                                "' (all_reduce, broadcast, reduce, all_gather or reduce_scatter)");
    Algo a;
    if (!find_algo(aname, &a) || (a != Algo::kAuto && !has_algo(*c, a)))
      return bad_spec(spec, std::string(coll_name(*c)) + " has no algorithm '" + aname + "' (choose " +
                                algo_list(*c) + ")");
    // Which of two would hold is a guess the user should not have to make.
    if (named[static_cast<int>(*c)]) return bad_spec(spec, std::string(coll_name(*c)) + " is named twice");
    named[static_cast<int>(*c)] = true;
    out->forced[static_cast<int>(*c)] = a;
  }
  return Status::ok();
}

Tuner::Tuner(const JobShape& shape, const AlgoChoice& forced) : shape_(shape), forced_(forced) {
  for (Coll c : kColls)
    for (int k = 0; k < kBuckets; ++k) table_[static_cast<int>(c)][k] = choose(c, size_t{1} << k);
}

LinkCost Tuner::intra() const {
  if (!shape_.oversubscribed) return kShm;
  return {kShmAlphaPerRankPerCore * shape_.ranks_per_core, crowding() / kShmBytesPerUsOversubscribed};
}

double Tuner::crowding() const {
  // The oversubscribed byte rates were fitted at 2 ranks per core; with
  // more, each rank's copies get a smaller share of a core. Latencies grow
  // with ranks per core on their own (kShmAlphaPerRankPerCore), and with
  // only those growing, 8 ranks on 2 cores kept each latency-bound
  // all_reduce one or two sizes too long: direct at 8 KiB ran 1.3-1.4x
  // recursive doubling's time, recursive doubling at 32 KiB 1.3-1.6x
  // Rabenseifner's, Rabenseifner at 64 KiB 1.1-2x the ring's
  // (bench/tune_sweep.py, 4 sweeps).
  return shape_.oversubscribed ? std::max(1.0, shape_.ranks_per_core / 2) : 1.0;
}

LinkCost Tuner::inter() const {
  if (!shape_.oversubscribed) return kTcp;
  return {kTcpAlphaPerRankPerCore * shape_.ranks_per_core, 1.0 / kTcpBytesPerUsOversubscribed};
}

bool Tuner::can_run(Coll c, Algo a, size_t bytes) const {
  const JobShape& s = shape_;
  switch (a) {
    case Algo::kAuto:
      return false;
    case Algo::kRing:
    case Algo::kTree:
      return true;
    case Algo::kDirect:
      // It posts to every peer before receiving: one piece (the whole
      // buffer; all_gather and reduce_scatter send less) at most.
      return (c == Coll::kAllReduce || c == Coll::kAllGather || c == Coll::kReduceScatter) &&
             bytes <= s.piece_bytes;
    case Algo::kRecursiveDoubling:
    case Algo::kRabenseifner:
    case Algo::kDoubleTree:
      return c == Coll::kAllReduce;
    case Algo::kPeerRead:
      return s.peer_reads && c != Coll::kReduce;
    case Algo::kHierarchical:
      return s.nhosts > 1 && s.ranks_per_host > 1;
  }
  return false;
}

double Tuner::predict_us(Coll c, Algo a, size_t bytes) const {
  if (!can_run(c, a, bytes)) return -1;
  const JobShape& sh = shape_;
  // Measured beats modelled: the kernel's cross-memory copies ran 1.2-1.4x
  // the ring's speed on one VM and 0.4-0.75x on another (a CPU whose
  // memcpy is fast and whose caches hold the buffers), which no fixed rate
  // fits both ways.
  const double timed = sh.peer_read_vs_ring[static_cast<int>(c)];
  if (a == Algo::kPeerRead && timed > 0 && !(c == Coll::kBroadcast && sh.oversubscribed)) {
    const double scaled = timed * predict_us(c, Algo::kRing, bytes);
    // Where ranks share cores, a read's rounds of messages wait for ranks
    // to be scheduled, fixed costs that weigh more below the size it was
    // timed at than the ratio says: 8 ranks on 2 cores read 1.9x slower
    // than the ring at 256 KiB all_reduce where the 1 MiB ratio had them
    // even. There the model must agree that reads win.
    if (!sh.oversubscribed || bytes >= peer_read_probe_bytes(c, sh)) return scaled;
    return std::max(scaled, modelled_us(c, a, bytes));
  }
  return modelled_us(c, a, bytes);
}

double Tuner::modelled_us(Coll c, Algo a, size_t bytes) const {
  const JobShape& sh = shape_;
  const double timed = sh.peer_read_vs_ring[static_cast<int>(c)];
  const double n = sh.nranks, S = static_cast<double>(bytes);
  if (n <= 1) return 0;
  const bool multi = sh.nhosts > 1, over = sh.oversubscribed;
  const LinkCost in = intra(), out = inter(), l = flat();
  // Ranks of one host that a host-ordered schedule keeps together.
  const double L = multi ? std::max(1, sh.ranks_per_host) : n;
  // A direct send's message, and a byte of its reduction, on one host whose
  // ranks share cores are priced apart (kDirectMessageUsPerRankPerCore).
  const bool crowded_host = over && !multi;
  const double msg_in =
      !over
          ? kShmMessageUs
          : (crowded_host ? kDirectMessageUsPerRankPerCore : kShmMessageUsPerRankPerCore) * sh.ranks_per_core;
  const double msg_out = over ? kTcpMessageUsPerRankPerCore * sh.ranks_per_core : kTcpMessageUs;
  const double reduce_work = crowded_host ? kDirectByteWorkOversubscribed : kDirectByteWork;
  // Untimed peer reads (braid-topo's table, or a job init did not time)
  // copy at the fixed rate of the VM the model was fitted on.
  const double pr_beta = peer_read_beta();
  const double depth = std::floor(std::log2(n));  // levels below a binary tree's root
  // Recursive doubling and halving pair ranks 1, 2, 4, ... apart among the
  // largest power of two p2: steps below Li stay inside a host when hosts
  // hold equal powers of two.
  const int p2 = 1 << static_cast<int>(depth);
  const int Li = multi && sh.ranks_per_host > 0 && (sh.ranks_per_host & (sh.ranks_per_host - 1)) == 0
                     ? sh.ranks_per_host
                     : (multi ? 1 : p2);
  // An exchange needs both partners running at once.
  const double pair_alpha = (over ? kPairStepsOversubscribed : kPairSteps) * in.alpha_us;
  // A pipelined binary tree all_reduce: inner nodes take two children's
  // pieces and pass on one, and back. The pipeline fills over depth - 1
  // pieces each way, so a buffer of one piece crosses every level whole
  // (8 ranks, 256 KiB: 2.3x the ring's time on the VM, where the model
  // without the fill chose the tree); on one host whose ranks share cores,
  // the fill is mostly hidden (kTreeFillOversubscribed).
  const double fill = crowded_host ? kTreeFillOversubscribed : 1;
  const double tree_us =
      2 * depth * l.alpha_us +
      2 * (S + fill * (depth - 1) * std::min(S, static_cast<double>(sh.piece_bytes))) * l.beta_us_per_byte;
  switch (c) {
    case Coll::kAllReduce:
      switch (a) {
        case Algo::kDirect:
          // All messages leave in one step; each is copied out and reduced in.
          return l.alpha_us + (L - 1) * (msg_in + reduce_work * S * in.beta_us_per_byte) +
                 (n - L) * (msg_out + reduce_work * S * out.beta_us_per_byte);
        case Algo::kRecursiveDoubling: {
          const bool pow2 = p2 == sh.nranks;
          double t = pow2 ? 0 : 2 * (l.alpha_us + S * l.beta_us_per_byte);  // the fold in and out
          // A step across hosts sends and receives S at once; inside a
          // host the same process also copies in and reduces out: 2 S.
          // Across hosts, a piece exchanged whole costs loopback TCP 0.6 of
          // a ring step's byte (whose chunks are n times smaller): 4 ranks
          // on 4 hosts, 256 KiB, rd took 323 us where the ring took 561.
          // Beyond one piece the reduction waits for the whole exchange
          // and reads both buffers from memory, where a ring reduces each
          // piece as it arrives: on 2 ranks over TCP rd ran 2-4x slower
          // than the ring from 2 MiB (1.0-1.2x up to 1 MiB).
          const double unpipelined = std::max(0.0, S - static_cast<double>(sh.piece_bytes));
          for (int mask = 1; mask < p2; mask <<= 1)
            t += mask < Li
                     ? pair_alpha + 2 * S * in.beta_us_per_byte
                     : out.alpha_us + (kWholePieceTcpByte * S + (2 - kWholePieceTcpByte) * unpipelined) *
                                          out.beta_us_per_byte;
          return t;
        }
        case Algo::kRabenseifner: {
          // At partner distance `mask`, halving exchanges S * mask / p2 and
          // then reduces it (as recursive doubling does the whole buffer);
          // doubling exchanges the same straight into place.
          double t = p2 == sh.nranks ? 0 : 2 * (l.alpha_us + S * l.beta_us_per_byte);
          for (int mask = 1; mask < p2; mask <<= 1) {
            const double part = S * mask / p2;
            t += mask < Li ? 2 * pair_alpha + 3 * part * in.beta_us_per_byte
                           : 2 * out.alpha_us + 3 * part * out.beta_us_per_byte;
          }
          return t;
        }
        case Algo::kRing: {
          const double step =
              over && !multi ? std::max(1.0, kRingStepPerRankPerCore * sh.ranks_per_core) : 1.0;
          return 2 * (n - 1) * step * l.alpha_us + 2 * (n - 1) / n * S * l.beta_us_per_byte;
        }
        case Algo::kDoubleTree:
          // In theory two thirds of a single tree's inner-node traffic; on
          // the 2-core VM (4 ranks, bench/all_reduce_perf) it ran 1.2-1.8x
          // slower than the tree at every size, so the model gives it the
          // tree's bytes and one more step: forced only (BRAID_ALGO=dbtree)
          // until a machine's sweep shows it ahead.
          return tree_us + 2 * l.alpha_us;
        case Algo::kTree:
          return tree_us;
        case Algo::kPeerRead: {
          // Where ranks share cores, every copy takes turns on them: a peer
          // read copies each byte once where a ring step copies it into a
          // slot and out, but each phase waits for every peer, and a wait
          // grows with the ranks per core. Against the ring from 1 MiB
          // (bench/tune_sweep.py, 3 sweeps): 0.77-0.91 of its time at 2
          // ranks per core, 0.9-1.5x at 4.
          if (!over)
            return kPeerReadAllReduceRounds * (n - 1) * in.alpha_us +
                   2 * (n - 1) / n * S / kPeerReadAllReduceBytesPerUs;
          // Fitted at 2 and 4 ranks per core; fewer than 2 keep 2's share.
          const double read_beta =
              in.beta_us_per_byte * std::max(2.0, sh.ranks_per_core) * kPeerReadAllReducePerRankPerCore;
          return 10 * (n - 1) * in.alpha_us + 2 * (n - 1) / n * S * read_beta;
        }
        case Algo::kHierarchical: {
          const double H = sh.nhosts;
          const double in_beta = hierarchical_reads_peers(bytes) ? pr_beta : in.beta_us_per_byte;
          return 2 * L * in.alpha_us + 2 * (L - 1) / L * S * in_beta + 2 * (H - 1) * out.alpha_us +
                 2 * (H - 1) / H * (S / L) * out.beta_us_per_byte;
        }
        case Algo::kAuto:
          break;
      }
      break;
    case Coll::kBroadcast:
    case Coll::kReduce: {
      const bool reduces = c == Coll::kReduce;
      const int H = sh.nhosts;
      switch (a) {
        case Algo::kRing: {
          // The chain visits hosts in order: a broadcast from a host's first
          // rank crosses H - 1 host boundaries; a reduce starts after the
          // root and ends at it, crossing H.
          // (One rank per host: n - 1 hops, every one across.)
          const int hops_out = multi ? std::min(sh.nranks - 1, reduces ? H : H - 1) : 0;
          return chain_us(sh.nranks - 1 - hops_out, hops_out, S, reduces, 1);
        }
        case Algo::kTree: {
          // Levels pay the network's costs across hosts (a binary tree over
          // host-ordered ranks crosses hosts on most levels). Where ranks
          // wait to be scheduled, a broadcast level costs one such wait: the
          // parent posts both children's pieces and goes on, and they wake
          // on their cores together (8 ranks on 2 cores: the tree ran
          // 1.1-2.2x faster than the chain from 8 B to 128 KiB, in two
          // sweeps); a reduce's parent still takes its children in turn.
          const double hop = multi ? kHopTcpUs : shm_hop_us();
          const double level_hops = over && !multi && !reduces ? 1 : kTreeLevelHops;
          const double beta = hop_beta(multi, reduces);
          const double first = std::min(S, static_cast<double>(sh.piece_bytes));
          const double path = depth * (level_hops * hop + 2 * kTreeByteFactor * first * beta) +
                              2 * kTreeByteFactor * (S - first) * beta;
          return std::max(path, (n - 1) * S * beta * (multi ? kTcpHopWork : 1) / cores());
        }
        case Algo::kPeerRead:
          if (over && !multi && !reduces) {
            // Where ranks share cores, receivers' reads take turns on them
            // as a chain's hops do, so a read is priced against the chain:
            // on the VM (bench/tune_sweep.py, 3 sweeps of 4 and 8 ranks)
            // the reads took 0.7-0.95 of the chain's time from 4 MiB, were
            // mixed at 1-2 MiB and lost below, at 4 and at 8 ranks alike:
            // the fixed cost per peer does not grow with ranks per core.
            // Where init timed both, the share of the chain is what makes
            // the model give the measured ratio at the probe's size.
            double of_chain = kPeerReadBroadcastOfChain;
            if (timed > 0) {
              const double probed = static_cast<double>(peer_read_probe_bytes(c, sh));
              const double chain = chain_us(sh.nranks - 1, 0, probed, false, 1);
              of_chain = std::max(0.0, timed - (n - 1) * kPeerReadBroadcastPeerUs / chain);
            }
            return (n - 1) * kPeerReadBroadcastPeerUs + of_chain * chain_us(sh.nranks - 1, 0, S, false, 1);
          }
          return peer_read_rounds() * (n - 1) * in.alpha_us + S * pr_beta;
        case Algo::kHierarchical:
          // A chain across hosts and chains inside them (in parallel), one
          // phase after the other.
          return chain_us(0, H - 1, S, reduces, 1) + chain_us(static_cast<int>(L) - 1, 0, S, reduces, H) +
                 kHierPhaseUs;
        default:
          break;
      }
      break;
    }
    case Coll::kAllGather:
    case Coll::kReduceScatter:
      // A ring all_gather copies each block twice per hop (out of the slot,
      // into the next rank's) where reading peers copies it once; a ring
      // reduce_scatter reduces each block into the next slot in one pass.
      // On the VM (bench/tune_sweep.py, 2 and 4 ranks) peer reads ran up to
      // 2.6x faster from 1 MiB and were mixed at 256 KiB.
      if (a == Algo::kRing)
        return (n - 1) * l.alpha_us + (c == Coll::kAllGather ? 2 : 1) * (n - 1) / n * S * l.beta_us_per_byte;
      if (a == Algo::kDirect) {
        // With one peer, direct's message is the ring's one step (the same
        // primitives), in one coroutine frame where the ring nests two: on
        // 2 ranks direct ran 0.04-0.13 us faster from 8 B to 8 KiB. Its
        // reduction is the slower one (f) all the same: reduce_scatter
        // through direct took 1.06x the ring's at 16 KiB, 1.14x at 64 KiB.
        const double b = S / n, f = c == Coll::kReduceScatter ? 1.2 : 1.0;
        if (n == 2) return predict_us(c, Algo::kRing, bytes) - kFrameUs + (f - 1) * b * in.beta_us_per_byte;
        // As direct all_reduce, with a block of S / n per message: one wait
        // where the ring has n - 1 in a row, and n - 1 messages posted.
        // Where ranks share cores reduce_scatter's reduction costs what
        // all_reduce's does (4 ranks on 2 cores: direct reduce_scatter ran
        // 1.2x faster than the ring at 128 KiB, 3 runs, where 1.2 of a byte
        // priced it out).
        const double work = c == Coll::kReduceScatter ? reduce_work : f;
        return l.alpha_us + (L - 1) * (msg_in + work * b * in.beta_us_per_byte) +
               (n - L) * (msg_out + work * b * out.beta_us_per_byte);
      }
      if (a == Algo::kPeerRead)
        return (c == Coll::kAllGather ? peer_read_rounds() : kPeerReadFittedRounds) * (n - 1) * in.alpha_us +
               (n - 1) / n * S * pr_beta;
      if (a == Algo::kHierarchical) {
        // A ring across hosts of one block each, then a ring inside the
        // host per host's worth of blocks (reduce_scatter: the reverse).
        const double H = sh.nhosts, b = S / n;
        return (H - 1) * (out.alpha_us + b * out.beta_us_per_byte) +
               H * (L - 1) * (in.alpha_us + b * in.beta_us_per_byte);
      }
      break;
  }
  return -1;
}

size_t peer_read_probe_bytes(Coll c, const JobShape& shape) {
  return c == Coll::kBroadcast && shape.oversubscribed ? 4u << 20 : 1u << 20;
}

double Tuner::peer_read_rounds() const {
  // A copy that reads peers exchanges addresses, reads, and waits until
  // nobody reads its buffers: two rounds of messages, as fixed costs of 2
  // ranks with cores of their own measured (1.4 us). Where ranks share
  // cores, the fitted 5: every round waits for ranks to be scheduled.
  return shape_.oversubscribed ? kPeerReadFittedRounds : 2;
}

double Tuner::cores() const {
  return shape_.nranks / std::max(1.0, shape_.ranks_per_core);
}

double Tuner::shm_hop_us() const {
  // On one host whose ranks outnumber its cores, a hop waits for its
  // receiver to be scheduled, as a direct message does. Simulated hosts
  // sharing a machine keep the fitted hop: their small broadcasts swung
  // between sweeps (chain 0.6x to 1.6x the hierarchical schedule's time).
  const JobShape& s = shape_;
  return s.oversubscribed && s.nhosts <= 1 ? kShmMessageUsPerRankPerCore * s.ranks_per_core : kHopShmUs;
}

double Tuner::chain_us(int hops_in, int hops_out, double bytes, bool reduces, int parallel) const {
  if (hops_in + hops_out <= 0) return 0;
  const double in_beta = hop_beta(false, reduces), out_beta = hop_beta(true, reduces);
  // The first piece crosses every hop; the rest follow at the slowest
  // hop's pace. Oversubscribed, every rank's copies also share the cores.
  const double first = std::min(bytes, static_cast<double>(shape_.piece_bytes));
  const double path = hops_in * (shm_hop_us() + first * in_beta) + hops_out * (kHopTcpUs + first * out_beta) +
                      (bytes - first) * (hops_out > 0 ? out_beta : in_beta);
  const double work = parallel * bytes * (hops_in * in_beta + kTcpHopWork * hops_out * out_beta) / cores();
  return std::max(path, work);
}

bool Tuner::hierarchical_reads_peers(size_t bytes) const {
  // Where reading a peer's memory copies faster than passing slots.
  return shape_.host_peer_reads && bytes >= shape_.peer_read_min_bytes &&
         peer_read_beta() < intra().beta_us_per_byte;
}

double Tuner::peer_read_beta() const {
  // Crowding slows reads as it slows slots.
  return shape_.oversubscribed ? crowding() / kPeerReadBytesPerUsOversubscribed : 1.0 / kPeerReadBytesPerUs;
}

size_t Tuner::peer_read_min(Coll c) const {
  // Copies gain from a peer read sooner than reductions, which read every
  // peer piece by piece: from 64 KiB, 2 ranks broadcast 1.2-1.6x faster by
  // reading than through a chain's slots, and all_gather 1.1-1.5x faster
  // than direct sends and 1.3-1.9x than the ring.
  return c == Coll::kBroadcast || c == Coll::kAllGather ? shape_.copy_peer_read_min_bytes
                                                        : shape_.peer_read_min_bytes;
}

bool Tuner::direct_within_bound(Coll c, size_t bytes) const {
  // A gather's messages are blocks: on 8 ranks sharing 2 cores, direct
  // all_gather and reduce_scatter ran 1.3-2x faster than the ring at 32 and
  // 128 KiB (blocks of 4 and 16 KiB), which a bound on the whole buffer
  // never let the model consider; on 4 ranks they were even at 128 KiB.
  const size_t message = c == Coll::kAllGather || c == Coll::kReduceScatter
                             ? bytes / static_cast<size_t>(std::max(1, shape_.nranks))
                             : bytes;
  return message <= shape_.direct_max_bytes;
}

// On every call: a table lookup, and the exact checks the table's power of
// two cannot stand for.
Algo Tuner::pick(Coll c, size_t bytes) const {
  const int k = bytes == 0 ? 0 : std::min(kBuckets - 1, 63 - __builtin_clzll(bytes));
  const Algo a = table_[static_cast<int>(c)][k];
  // A threshold inside the bucket: peer reads may be allowed above it where
  // the bucket's 2^k was below it.
  const size_t low = bytes == 0 ? 0 : size_t{1} << k, read_min = peer_read_min(c);
  const bool reads_begin_inside = low < read_min && bytes >= read_min;
  const bool exact =
      !reads_begin_inside &&
      (a != Algo::kDirect ||
       (bytes <= shape_.piece_bytes && (direct_within_bound(c, bytes) || forced_[c] == Algo::kDirect))) &&
      (a != Algo::kPeerRead || bytes >= read_min || forced_[c] == Algo::kPeerRead);
  return exact ? a : choose(c, bytes);
}

Algo Tuner::choose(Coll c, size_t bytes) const {
  // A lone rank only copies its input, whatever the algorithm; the ring's
  // copy needs no work buffer (recursive doubling's is the call's size).
  if (shape_.nranks <= 1) return Algo::kRing;
  const Algo forced = forced_[c];
  if (forced != Algo::kAuto && can_run(c, forced, bytes)) return forced;
  return cheapest(c, bytes, 0);
}

Algo Tuner::pick_all_reduce(size_t count, size_t elem_bytes) const {
  const size_t bytes = count * elem_bytes;
  const Algo a = pick(Coll::kAllReduce, bytes);
  const size_t L = static_cast<size_t>(std::max(1, shape_.ranks_per_host));
  if (a != Algo::kHierarchical || forced_[Coll::kAllReduce] == Algo::kHierarchical || count % L == 0)
    return a;
  // 2 hosts x 2 ranks, 65540 bytes: hierarchical took 104 us, recursive
  // doubling 70 (65536 bytes: 63 and 62).
  return cheapest(Coll::kAllReduce, bytes,
                  predict_us(Coll::kAllReduce, Algo::kRing, (count % L) * elem_bytes));
}

Algo Tuner::cheapest(Coll c, size_t bytes, double hier_extra_us) const {
  Algo best = Algo::kRing;
  double best_us = std::numeric_limits<double>::infinity();
  for (Algo a : algos_of(c)) {
    // The measured thresholds bound the model where it is least accurate.
    if (a == Algo::kDirect && !direct_within_bound(c, bytes)) continue;
    if (a == Algo::kPeerRead && bytes < peer_read_min(c)) continue;
    double t = predict_us(c, a, bytes);
    if (t >= 0 && a == Algo::kHierarchical) t += hier_extra_us;
    if (t >= 0 && t < best_us) {
      best_us = t;
      best = a;
    }
  }
  return best;
}

std::vector<std::string> Tuner::describe() const {
  std::vector<std::string> lines;
  for (Coll c : kColls) {
    std::string line = std::string(coll_name(c)) + ": ";
    if (forced_[c] != Algo::kAuto)
      line += std::string(algo_name(forced_[c])) + " (BRAID_ALGO) where it runs; ";
    // Switches lie between powers of two too (pick's exact bounds come from
    // settings, and the model decides inside a bucket where those bounds
    // rule the table's entry out), sometimes two in one bucket: sampled at
    // 64ths of each power of two, then each switch found exactly.
    size_t at = 1;  // the largest size known to take `prev`
    Algo prev = pick(c, at);
    line += algo_name(prev);
    for (size_t b = 1; b < (size_t{1} << 30); b *= 2) {
      const size_t step = std::max<size_t>(1, b / 64);
      for (size_t x = b + step; x <= 2 * b; x += step) {
        while (pick(c, x) != prev) {  // each switch in (at, x]
          size_t lo = at, hi = x;
          while (hi - lo > 1) {
            const size_t mid = lo + (hi - lo) / 2;
            (pick(c, mid) == prev ? lo : hi) = mid;
          }
          prev = pick(c, hi);
          line += " < " + bytes_text(hi) + " <= " + algo_name(prev);
          at = hi;
        }
        at = x;
      }
    }
    lines.push_back(line);
  }
  return lines;
}

}  // namespace braid
