#include "src/core/communicator.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>

#include "kernels/cpu/reduce_kernels.h"
#include "src/algo/ipc_collectives.h"
#include "src/core/device_memory.h"
#include "src/core/dtype.h"
#include "src/core/logging.h"
#include "src/topo/topology.h"
#include "transports/cuda/ipc_window.h"
#include "transports/cuda/stream_staging.h"
#include "transports/self/self_connection.h"
#include "transports/shm/shared_memory.h"
#include "transports/shm/shm_transport.h"
#include "transports/tcp/tcp_transport.h"

namespace braid {

// What each rank tells the others at init. Settings that shape the wire
// protocol or the choice of algorithm must agree on every rank.
struct PeerInfo {
  char host[kMaxHostIdBytes + 1];
  int32_t pid;
  int32_t transport;
  uint64_t shm_slot_bytes;
  uint64_t tcp_slot_bytes;
  int32_t shm_slots;
  int32_t tcp_slots;
  int32_t tcp_sockets;
  int32_t cores;
  uint64_t machine;  // the real host (simulated hosts may share one)
  uint64_t algo;     // BRAID_ALGO, encoded
  uint64_t direct_max_bytes;
  uint64_t peer_read_min_bytes;
  uint64_t copy_peer_read_min_bytes;
  uint64_t cuda_chunk_bytes;
  uint64_t window_min_bytes;
  int32_t cuda_ipc;
  int32_t check_calls;
  int32_t tune_probe;
  topo::RankPlacement placement;
};

namespace {

// hwloc discovery reads sysfs and PCI: once per process (per
// BRAID_TOPO_FILE / BRAID_TOPO_NUMA), not once per communicator.
Status host_topology(std::shared_ptr<const topo::HostTopology>* out) {
  static std::mutex mu;
  static std::string key;
  static std::shared_ptr<const topo::HostTopology> cached;
  const char* file = std::getenv("BRAID_TOPO_FILE");
  const char* numa = std::getenv("BRAID_TOPO_NUMA");
  const std::string now = std::string(file ? file : "") + '\n' + (numa ? numa : "");
  std::lock_guard<std::mutex> lock(mu);
  if (cached == nullptr || key != now) {
    auto t = std::make_shared<topo::HostTopology>();
    BRAID_RETURN_IF_ERROR(topo::discover(t.get()));
    cached = std::move(t);
    key = now;
  }
  *out = cached;
  return Status::ok();
}

constexpr int kNumChannels = 2;  // 0: collectives, 1: point-to-point
// How long destroy waits for the peers to unmap this rank's CUDA IPC window.
constexpr double kIpcTeardownSeconds = 10.0;

Status check_same(const std::vector<PeerInfo>& infos, const char* var, auto field) {
  for (size_t r = 1; r < infos.size(); ++r) {
    if (field(infos[r]) != field(infos[0]))
      return Status(BRAID_ERR_MISMATCH, std::string(var) + " differs between ranks: rank 0 has " +
                                            std::to_string(field(infos[0])) + ", rank " + std::to_string(r) +
                                            " has " + std::to_string(field(infos[r])) +
                                            "; set it the same everywhere");
  }
  return Status::ok();
}

}  // namespace

namespace {
// Bumped in the child of every fork(): a communicator made before it belongs
// to the parent (its progress thread, sockets and shared memory).
std::atomic<uint64_t> g_forks{0};
}  // namespace

bool Communicator::forked() const {
  return g_forks.load(std::memory_order_relaxed) != forks_at_creation_;
}

Status Communicator::create(std::unique_ptr<Bootstrap> bootstrap, const Config& config,
                            std::shared_ptr<Communicator>* out, SetupCancel* cancel) {
  static std::once_flag at_fork;
  std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, [] { g_forks.fetch_add(1); }); });
  std::shared_ptr<Communicator> c(new Communicator());
  c->forks_at_creation_ = g_forks.load();
  c->rank_ = bootstrap->rank();
  c->nranks_ = bootstrap->nranks();
  c->config_ = config;
  c->bootstrap_ = std::move(bootstrap);
  c->setup_cancel_ = cancel;
  Status st = c->setup_transports();
  c->setup_cancel_ = nullptr;
  if (cancel != nullptr) {
    // Nothing of c may be reached through cancel once c can be freed.
    cancel->detach_all();
    if (Status why = cancel->why(); !why.is_ok()) st = why;
  }
  if (!st) return st.with_context("rank " + std::to_string(c->rank_) + " setting up transports");
  c->log_summary();
  BRAID_INFO("INIT", c->rank_, "communicator ready: %d ranks, token %s", c->nranks_,
             token_hex(c->bootstrap_->token()).c_str());
  *out = std::move(c);
  return Status::ok();
}

Status Communicator::setup_transports() {
  const Deadline deadline = Deadline::after_seconds(config_.timeout_s);
  BRAID_RETURN_IF_ERROR(host_topology(&topology_));
  PeerInfo mine{};
  mine.placement = topo::placement_of(*topology_, config_.host_id);
  std::strncpy(mine.host, config_.host_id.c_str(), sizeof(mine.host) - 1);
  mine.pid = static_cast<int32_t>(getpid());
  mine.transport = static_cast<int32_t>(config_.transport);
  mine.shm_slot_bytes = config_.shm_slot_bytes;
  mine.tcp_slot_bytes = config_.tcp_slot_bytes;
  mine.shm_slots = config_.shm_slots;
  mine.tcp_slots = config_.tcp_slots;
  mine.tcp_sockets = config_.tcp_sockets;
  mine.cores = static_cast<int32_t>(sysconf(_SC_NPROCESSORS_ONLN));
  mine.machine = topo::host_hash(machine_id());
  mine.algo = config_.algo.encode();
  mine.direct_max_bytes = config_.direct_max_bytes;
  mine.peer_read_min_bytes = config_.peer_read_min_bytes;
  mine.copy_peer_read_min_bytes = config_.copy_peer_read_min_bytes;
  mine.cuda_chunk_bytes = config_.cuda_chunk_bytes;
  mine.window_min_bytes = config_.window_min_bytes;
  mine.cuda_ipc = config_.cuda_ipc ? 1 : 0;
  mine.tune_probe = config_.tune_probe ? 1 : 0;
  mine.check_calls = config_.check_calls ? 1 : 0;
  std::vector<uint8_t> raw;
  BRAID_RETURN_IF_ERROR(bootstrap_->all_gather(&mine, sizeof(mine), &raw, deadline));
  std::vector<PeerInfo> infos(nranks_);
  std::memcpy(infos.data(), raw.data(), raw.size());
  BRAID_RETURN_IF_ERROR(check_same(infos, "BRAID_TRANSPORT", [](const PeerInfo& p) { return p.transport; }));
  BRAID_RETURN_IF_ERROR(
      check_same(infos, "BRAID_SHM_SLOT_BYTES", [](const PeerInfo& p) { return p.shm_slot_bytes; }));
  BRAID_RETURN_IF_ERROR(check_same(infos, "BRAID_SHM_SLOTS", [](const PeerInfo& p) { return p.shm_slots; }));
  BRAID_RETURN_IF_ERROR(
      check_same(infos, "BRAID_TCP_SLOT_BYTES", [](const PeerInfo& p) { return p.tcp_slot_bytes; }));
  BRAID_RETURN_IF_ERROR(check_same(infos, "BRAID_TCP_SLOTS", [](const PeerInfo& p) { return p.tcp_slots; }));
  BRAID_RETURN_IF_ERROR(
      check_same(infos, "BRAID_TCP_SOCKETS", [](const PeerInfo& p) { return p.tcp_sockets; }));
  // Every rank must pick the same algorithm for the same call.
  BRAID_RETURN_IF_ERROR(check_same(infos, "BRAID_ALGO", [](const PeerInfo& p) { return p.algo; }));
  BRAID_RETURN_IF_ERROR(
      check_same(infos, "BRAID_DIRECT_MAX_BYTES", [](const PeerInfo& p) { return p.direct_max_bytes; }));
  BRAID_RETURN_IF_ERROR(check_same(infos, "BRAID_PEER_READ_MIN_BYTES",
                                   [](const PeerInfo& p) { return p.peer_read_min_bytes; }));
  // Set or not, it decides broadcast's and all_gather's threshold (64 KiB unset).
  BRAID_RETURN_IF_ERROR(check_same(infos, "BRAID_PEER_READ_MIN_BYTES (set on some ranks only)",
                                   [](const PeerInfo& p) { return p.copy_peer_read_min_bytes; }));
  // Every rank must offer the same calls registered windows.
  BRAID_RETURN_IF_ERROR(check_same(infos, "BRAID_WINDOW_MIN_BYTES (set on some ranks only, or differing)",
                                   [](const PeerInfo& p) { return p.window_min_bytes; }));
  // Every rank must take CUDA IPC or host staging for the same call.
  BRAID_RETURN_IF_ERROR(check_same(infos, "BRAID_CUDA_IPC", [](const PeerInfo& p) { return p.cuda_ipc; }));
  BRAID_RETURN_IF_ERROR(
      check_same(infos, "BRAID_CUDA_CHUNK_BYTES", [](const PeerInfo& p) { return p.cuda_chunk_bytes; }));
  // The init probe is collective: every rank runs it or none does.
  BRAID_RETURN_IF_ERROR(
      check_same(infos, "BRAID_TUNE_PROBE", [](const PeerInfo& p) { return p.tune_probe; }));
  // A checked call sends a message first: ranks must agree on sending it.
  BRAID_RETURN_IF_ERROR(
      check_same(infos, "BRAID_CHECK_CALLS", [](const PeerInfo& p) { return p.check_calls; }));

  std::vector<int> host_group, tcp_peers;
  one_machine_ = true;
  for (int r = 0; r < nranks_; ++r) {
    infos[r].host[sizeof(infos[r].host) - 1] = '\0';
    hosts_.push_back(infos[r].host);
    placements_.push_back(infos[r].placement);
    if (hosts_[r] != hosts_[0] || infos[r].machine != infos[0].machine) one_machine_ = false;
  }
  for (int r = 0; r < nranks_; ++r) {
    bool same_host = hosts_[r] == hosts_[rank_];
    if (config_.transport == TransportChoice::kShm && !same_host)
      return Status::invalid_argument("BRAID_TRANSPORT=shm, but rank " + std::to_string(r) + " is on host '" +
                                      hosts_[r] + "' and this rank on '" + hosts_[rank_] + "'");
    if (same_host && config_.transport != TransportChoice::kTcp)
      host_group.push_back(r);
    else if (r != rank_)
      tcp_peers.push_back(r);
  }
  if (std::find(host_group.begin(), host_group.end(), rank_) == host_group.end())
    host_group.insert(host_group.begin(), rank_);
  std::sort(host_group.begin(), host_group.end());

  host_ranks_share_memory_ = config_.transport != TransportChoice::kTcp;
  bool shm_unavailable = false;
  Status shm_st =
      ShmTransport::setup(*bootstrap_, host_group, kNumChannels, config_, &shm_, &shm_unavailable);
  if (!shm_st && shm_unavailable && config_.transport == TransportChoice::kAuto) {
    // Every rank saw the failure in the same all-gather, so all switch.
    BRAID_WARN("SHM", rank_, "%s; ranks of one host talk over tcp instead (slower)",
               shm_st.message().c_str());
    for (int r : host_group)
      if (r != rank_) tcp_peers.push_back(r);
    std::sort(tcp_peers.begin(), tcp_peers.end());
    host_group = {rank_};
    host_ranks_share_memory_ = false;
    shm_st = ShmTransport::setup(*bootstrap_, host_group, kNumChannels, config_, &shm_, &shm_unavailable);
  }
  BRAID_RETURN_IF_ERROR(shm_st);
  BRAID_RETURN_IF_ERROR(TcpTransport::setup(*bootstrap_, tcp_peers, hosts_, kNumChannels, config_, &tcp_));

  std::vector<std::vector<Connection*>> peers(nranks_);
  Channel* channels[kNumChannels] = {&coll_channel_, &p2p_channel_};
  for (int ch = 0; ch < kNumChannels; ++ch) {
    Channel& c = *channels[ch];
    c.rank = rank_;
    c.nranks = nranks_;
    // One piece size on every rank and every link, so pieces line up end to end.
    c.piece_bytes = std::min(config_.shm_slot_bytes, config_.tcp_slot_bytes);
    c.conns.assign(nranks_, nullptr);
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_) {
        self_conns_.push_back(std::make_unique<SelfConnection>(config_));
        c.conns[r] = self_conns_.back().get();
        peers[r].push_back(c.conns[r]);
        continue;
      }
      Connection* conn = shm_->connection(ch, r);
      if (conn == nullptr) conn = tcp_->connection(ch, r);
      if (conn == nullptr) return Status::internal("no connection to rank " + std::to_string(r));
      c.conns[r] = conn;
      peers[r].push_back(conn);
    }
  }
  build_schedules(infos);
  BRAID_RETURN_IF_ERROR(choose_slot_copies(host_group, deadline));
  trace_ = TraceRecorder::make(config_, rank_, nranks_);
  engine_ = std::make_unique<Engine>(rank_, config_, peers, shm_->doorbell());
  engine_->set_trace(trace_.get());
  engine_->set_collective_conns(coll_channel_.conns);
  engine_->set_oversubscribed(tuner_.shape().oversubscribed);
  inline_calls_ = inline_p2p_ = trace_ == nullptr && !config_.check_calls;
  p2p_stalled_.assign(2 * static_cast<size_t>(nranks_), 0);
  for (const Connection* c : coll_channel_.conns)
    if (c != nullptr && c->pollable()) inline_calls_ = false;
  // Offering windows costs a call two rounds of messages; where ranks share
  // cores each round waits for them to be scheduled (10 us for 4 ranks on 2
  // cores), so only larger calls gain (bench: -R 1, --env-compare).
  window_min_bytes_ = config_.window_min_bytes != SIZE_MAX ? config_.window_min_bytes
                      : tuner_.shape().oversubscribed      ? size_t{128} << 10
                                                           : size_t{16} << 10;
  // Window outputs are streamed where the call's buffers on all ranks reach
  // twice the host's L3: below, plain stores win because the buffers are
  // still in cache at the next call. On a VM with one 32 MiB L3 (2 ranks,
  // bench -R 1, alternating runs) plain stores were 1.3-2.5x faster at a
  // 24-32 MiB working set (all_gather, broadcast and all_reduce of 8 MiB)
  // and 1.1-1.2x at 48; streaming 1.06x at 64 and 1.1-1.5x from 96. An
  // earlier VM whose L3 went unrecorded streamed all_reduce 1.3-2.6x faster
  // from 8 MiB (32 MiB of buffers): hosts without L3 information assume 16.
  const size_t l3 = topo::l3_bytes_of_host_ranks(*topology_, placements_, rank_);
  window_streaming_bytes_ = 2 * (l3 > 0 ? l3 : size_t{16} << 20);
  ShmTransport* shm = shm_.get();
  TcpTransport* tcp = tcp_.get();
  engine_->set_failure_notifier([this, shm, tcp](const Status& why) {
    // What broke it is the communicator's last error until a later call fails
    // (braid_comm_get_last_error), also where no call failed.
    set_last_error(why.message());
    shm->mark_failed(why);
    tcp->shutdown(why);
  });
  // From here the probe's collectives wait in the engine.
  if (setup_cancel_ != nullptr)
    setup_cancel_->attach([e = engine_.get()](const Status& why) { e->abort(why); });
  // Nobody may send before every rank has its engine (and its slots) ready.
  BRAID_RETURN_IF_ERROR(bootstrap_->barrier(deadline));
  BRAID_RETURN_IF_ERROR(probe_peer_reads(deadline));
  // A read beat two copies through slots from 8-16 KiB on the VM where
  // sends first read (2 ranks, bench/sendrecv_perf). On another,
  // process_vm_readv ran at a third of memcpy's speed and reads lost at
  // every size (a send one way: 1.8-2.3x slower from 64 KiB to 16 MiB), as
  // the probe's broadcast of one rank reading another's buffer found
  // against the chain's slots; there sends take the slots. Every rank
  // decides from the same numbers. BRAID_PEER_READ_MIN_BYTES decides alone.
  p2p_read_min_bytes_ = std::min<size_t>(config_.copy_peer_read_min_bytes, 16 * 1024);
  if (!config_.peer_read_min_set && tuner_.shape().peer_read_vs_ring[static_cast<int>(Coll::kBroadcast)] >= 1)
    p2p_read_min_bytes_ = SIZE_MAX;
  return Status::ok();
}

namespace {

// Each of `n` values becomes its largest over the ranks (one all-gather):
// every rank then decides from the same numbers.
Status slowest_over_ranks(Bootstrap& bootstrap, float* values, size_t n, Deadline deadline) {
  std::vector<uint8_t> raw;
  BRAID_RETURN_IF_ERROR(bootstrap.all_gather(values, n * sizeof(float), &raw, deadline));
  for (size_t r = 0; r < raw.size() / (n * sizeof(float)); ++r)
    for (size_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, raw.data() + (r * n + i) * sizeof(float), sizeof(v));
      values[i] = std::max(values[i], v);
    }
  return Status::ok();
}

// The init probe's results (slowest rank's times, [collective][reads, ring]),
// kept per process by the shape they were timed on: torch makes a group per
// mesh dimension or pipeline stage, and timing each again cost 130 ms of a
// 145 ms new_group (4 ranks on 2 cores) where gloo takes 2-4 ms.
using ProbeTimes = std::array<float, 8>;
std::mutex g_probe_mu;
std::map<std::vector<uint64_t>, ProbeTimes>& probe_cache() {
  static auto* cache = new std::map<std::vector<uint64_t>, ProbeTimes>();  // outlives static destructors
  return *cache;
}

}  // namespace

// What decides the probe's times: the rank count, where each rank sits
// (NUMA node and package, in rank order; not the core, which an unbound
// process changes), how many ranks share a core, the shm slots and how
// they are copied into, BRAID_ALGO (which collectives are timed) and the
// peer-read thresholds (kept apart, though they change no timed call).
// Equal on every rank. The words themselves are the key (it never leaves
// the process), so no two shapes can share one.
std::vector<uint64_t> Communicator::probe_shape_key() const {
  const JobShape& sh = tuner_.shape();
  std::vector<uint64_t> key = {static_cast<uint64_t>(nranks_),
                               static_cast<uint64_t>(sh.ranks_per_core * 1000),
                               sh.piece_bytes,
                               config_.shm_slot_bytes,
                               static_cast<uint64_t>(config_.shm_slots),
                               slot_streaming_ ? config_.shm_stream_min_bytes : 0,
                               slot_streaming_ ? config_.shm_stream_max_bytes : 0,
                               config_.algo.encode(),
                               sh.peer_read_min_bytes,
                               sh.copy_peer_read_min_bytes};
  for (const topo::RankPlacement& p : placements_) {
    key.push_back(p.host_hash);
    key.push_back(static_cast<uint64_t>(static_cast<uint32_t>(p.numa)) << 32 |
                  static_cast<uint32_t>(p.package));
  }
  return key;
}

// The kernel's cross-memory copies (process_vm_readv) pin every page they
// touch: on one VM they copied at a third of memcpy's speed and the peer
// reads still beat the ring from 256 KiB (they copy each byte fewer
// times); on another (AMD EPYC, 32 MiB of L3, memcpy 4x faster than the
// kernel's copy) they ran 1.3-2.5x slower than the ring from 1 MiB. So each
// collective the tuner may run by reading peers is timed both ways at init
// (peer_read_probe_bytes: 1 MiB, 4 MiB for broadcast where ranks share
// cores), best of 3 turns taken alternately after 1 untimed one (where
// ranks share cores the first calls ran up to 6x slower), the slowest
// rank's time counting. A turn is 4 calls back to back, as a training loop
// or a benchmark makes them, the last 3 timed: one call at a time, 4 ranks
// on 2 cores had the ring's all_gather at 0.65-0.87x the reads' time where
// back to back it took 1.15-1.3x (a ring lets a rank that is done start the
// next call; reads end with every rank's release). 32 calls per
// collective, a few milliseconds with cores to spare, about 70 ms for 4
// ranks on 2 cores.
Status Communicator::probe_peer_reads(Deadline deadline) {
  const JobShape& sh = tuner_.shape();
  if (!sh.peer_reads || nranks_ < 2) return Status::ok();
  constexpr Coll kProbed[] = {Coll::kAllReduce, Coll::kBroadcast, Coll::kAllGather, Coll::kReduceScatter};
  constexpr int kNumProbed = 4, kWarmups = 1, kRounds = 3, kTimedCallsPerTurn = 3;
  auto timed_here = [&](Coll c) {
    return tuner_.forced()[c] == Algo::kAuto &&
           tuner_.can_run(c, Algo::kPeerRead, peer_read_probe_bytes(c, sh));
  };
  const int probed = static_cast<int>(std::count_if(std::begin(kProbed), std::end(kProbed), timed_here));
  if (probed == 0) return Status::ok();
  if (!config_.tune_probe) {
    BRAID_INFO("TUNE", rank_, "peer reads not timed: BRAID_TUNE_PROBE=0; the model's fixed rates stand");
    return Status::ok();
  }
  // [probed collective][peer_read, ring], the slowest rank's; 0: not timed.
  float times_us[kNumProbed][2] = {};
  static_assert(sizeof(times_us) == sizeof(ProbeTimes));
  auto apply = [&](const char* source) {
    JobShape shape = sh;
    for (int i = 0; i < kNumProbed; ++i) {
      const float* slowest = times_us[i];
      if (slowest[0] <= 0 || slowest[1] <= 0) continue;
      const Coll c = kProbed[i];
      shape.peer_read_vs_ring[static_cast<int>(c)] = slowest[0] / slowest[1];
      BRAID_INFO("TUNE", rank_,
                 "%s of %s: %.1f us reading peers, %.1f us on the %s (slowest rank, best of %d%s)",
                 coll_name(c), bytes_text(peer_read_probe_bytes(c, sh)).c_str(), slowest[0], slowest[1],
                 c == Coll::kBroadcast ? "chain" : "ring", kRounds, source);
    }
    tuner_ = Tuner(shape, config_.algo);
  };
  // Where every rank kept the same times from an earlier communicator of
  // this shape, those stand; where any rank lacks them or kept others (from
  // another communicator of the shape, which mixed would match no
  // measurement), all time afresh. One all-gather of each number and its
  // negation gives every rank the largest and smallest.
  const std::vector<uint64_t> key = probe_shape_key();
  constexpr int kTimes = 2 * kNumProbed;
  float kept[1 + 2 * kTimes] = {1.0f};  // [0]: 1 where this rank has none
  {
    std::lock_guard<std::mutex> lock(g_probe_mu);
    auto it = probe_cache().find(key);
    if (it != probe_cache().end()) {
      kept[0] = 0.0f;
      for (int i = 0; i < kTimes; ++i) {
        kept[1 + i] = it->second[i];
        kept[1 + kTimes + i] = -it->second[i];
      }
    }
  }
  BRAID_RETURN_IF_ERROR(slowest_over_ranks(*bootstrap_, kept, std::size(kept), deadline));
  bool all_same = kept[0] == 0.0f;
  for (int i = 0; i < kTimes && all_same; ++i) all_same = kept[1 + i] == -kept[1 + kTimes + i];
  if (all_same) {
    std::memcpy(times_us, kept + 1, sizeof(times_us));
    apply("; timed by an earlier communicator of this shape");
    return Status::ok();
  }
  // Page-aligned, as large buffers from mmap (torch's, the benchmarks') are:
  // heap blocks that malloc reused from an earlier communicator's probe made
  // the ring all_gather time 3-4x its real cost (80 us against 280-330 at
  // 1 MiB, 2 ranks), and later communicators then read peers at 64 KiB
  // where the ring ran 1.6x faster.
  size_t probe_bytes = 0;
  for (Coll c : kProbed) probe_bytes = std::max(probe_bytes, peer_read_probe_bytes(c, sh));
  const size_t probe_floats = (probe_bytes + 4095) / 4096 * 4096 / sizeof(float);
  struct FreeBuffer {
    void operator()(float* p) const { std::free(p); }
  };
  auto page_aligned = [&] {
    return std::unique_ptr<float[], FreeBuffer>(
        static_cast<float*>(std::aligned_alloc(4096, probe_floats * sizeof(float))));
  };
  const auto in_buf = page_aligned(), out_buf = page_aligned();
  if (!in_buf || !out_buf)
    return Status::system("allocating the buffers that time peer reads at init", ENOMEM);
  float* const in = in_buf.get();
  float* const out = out_buf.get();
  std::fill(out, out + probe_floats, 0.0f);  // its pages touched before any timing
  bool budget_checked = false;
  for (int i = 0; i < kNumProbed; ++i) {
    const Coll c = kProbed[i];
    const size_t bytes = peer_read_probe_bytes(c, sh);
    if (!timed_here(c)) continue;
    const size_t count = bytes / sizeof(float) / static_cast<size_t>(nranks_);
    const size_t total = count * static_cast<size_t>(nranks_);
    std::fill(in, in + total, 1.0f);
    CollArgs a;
    a.dtype = BRAID_FLOAT32;
    a.op = BRAID_SUM;
    a.sendbuf = a.recvbuf = in;  // all_reduce and broadcast in place, as DDP calls them
    a.count = total;
    OpKind kind = c == Coll::kAllReduce ? OpKind::kAllReduce : OpKind::kBroadcast;
    if (c == Coll::kAllGather || c == Coll::kReduceScatter) {
      kind = c == Coll::kAllGather ? OpKind::kAllGather : OpKind::kReduceScatter;
      a.recvbuf = out;
      a.count = count;
    }
    double best[2] = {1e30, 1e30};
    for (int round = 0; round < kWarmups + kRounds; ++round) {
      for (int k = 0; k < 2; ++k) {
        // The first call of a turn absorbs the skew the other algorithm left
        // between ranks; the others are timed.
        auto t0 = std::chrono::steady_clock::now();
        for (int call = 0; call <= kTimedCallsPerTurn; ++call) {
          std::shared_ptr<Op> op = make_op(kind, a, false, k == 0 ? Algo::kPeerRead : Algo::kRing);
          op->untraceable = true;
          engine_->post(op);
          BRAID_RETURN_IF_ERROR(engine_->wait(*op).with_context(std::string("timing ") + coll_name(c) +
                                                                " at init (peer reads against the ring)"));
          if (call > 0) continue;
          const auto now = std::chrono::steady_clock::now();
          if (!budget_checked) {
            // The probe takes a tenth of the init timeout at most: its very
            // first call (the slowest rank's, cold, so an overestimate)
            // times the calls to come decides, the same way on every rank:
            // the timeout counted is the shortest any rank has. A sanitizer
            // build with BRAID_TIMEOUT=0.3 spent the whole timeout on the
            // first turns alone.
            budget_checked = true;
            float reduced[2] = {
                static_cast<float>(std::chrono::duration<double, std::micro>(now - t0).count()),
                -static_cast<float>(config_.timeout_s)};
            BRAID_RETURN_IF_ERROR(slowest_over_ranks(*bootstrap_, reduced, 2, deadline));
            const double projected_s =
                1e-6 * reduced[0] * 2 * (kTimedCallsPerTurn + 1) * (kWarmups + kRounds) * probed;
            const double timeout_s = -reduced[1];
            if (projected_s > 0.1 * timeout_s) {
              engine_->restart_collective_seq();
              BRAID_INFO(
                  "TUNE", rank_,
                  "peer reads not timed: about %.2f s at init, over a tenth of the timeout (%.1f s); the "
                  "model's fixed rates stand",
                  projected_s, timeout_s);
              return Status::ok();
            }
          }
          t0 = std::chrono::steady_clock::now();
        }
        const double us =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
            kTimedCallsPerTurn;
        if (round >= kWarmups) best[k] = std::min(best[k], us);
      }
      if (c == Coll::kAllReduce) std::fill(in, in + total, 1.0f);  // sums grow; keep them finite
    }
    times_us[i][0] = static_cast<float>(best[0]);
    times_us[i][1] = static_cast<float>(best[1]);
  }
  // Also the point after which no rank runs a probe any more.
  BRAID_RETURN_IF_ERROR(slowest_over_ranks(*bootstrap_, &times_us[0][0], 2 * kNumProbed, deadline));
  engine_->restart_collective_seq();
  {
    std::lock_guard<std::mutex> lock(g_probe_mu);
    std::memcpy(probe_cache()[key].data(), times_us, sizeof(times_us));
  }
  apply("");
  return Status::ok();
}

// Streaming stores for mid-size shm slot copies: on some machines they
// halve a copy's time (the receiver no longer pulls each line out of the
// sender's cache), on others they double it, so the first two ranks of each
// host time both before the engine takes the connections, and tell the
// other ranks in an all-gather that every rank joins. Plain where ranks
// share cores (the two could not run at once) and wherever BRAID_SHM_STREAM_*
// is set (the band as given).
Status Communicator::choose_slot_copies(const std::vector<int>& host_group, Deadline deadline) {
  struct Verdict {
    uint8_t measured = 0, streaming = 0;
    float plain_us = 0, streaming_us = 0;
  } mine;
  const bool measure = host_group.size() > 1 && !tuner_.shape().oversubscribed;
  if (measure && (rank_ == host_group[0] || rank_ == host_group[1])) {
    const bool sender = rank_ == host_group[0];
    ShmTransport::CopyTimes t;
    Status st = shm_->time_slot_copies(sender ? host_group[1] : host_group[0], sender, kStreamProbeBytes, 9,
                                       *bootstrap_, deadline, &t);
    if (!st) {
      // The partner may be spinning on our next round: a failed flag ends
      // its wait with this reason, where silence would last until the
      // init deadline.
      shm_->mark_failed(st);
      return st;
    }
    mine.measured = sender ? 1 : 0;
    // Streaming must win clearly: a close call is noise, and plain stores
    // are the safe side when ranks later share cores with other work.
    mine.streaming = t.streaming_us < 0.85 * t.plain_us ? 1 : 0;
    mine.plain_us = static_cast<float>(t.plain_us);
    mine.streaming_us = static_cast<float>(t.streaming_us);
  }
  std::vector<uint8_t> raw;
  BRAID_RETURN_IF_ERROR(bootstrap_->all_gather(&mine, sizeof(mine), &raw, deadline));
  if (host_group.size() < 2) return Status::ok();
  Verdict leader;
  std::memcpy(&leader, raw.data() + sizeof(Verdict) * static_cast<size_t>(host_group[0]), sizeof(leader));
  const std::string band =
      bytes_text(config_.shm_stream_min_bytes) + " up to " + bytes_text(config_.shm_stream_max_bytes);
  char measured[160] = "";
  if (leader.measured)
    std::snprintf(measured, sizeof(measured),
                  "; a %s copy between ranks %d and %d took %.2f us plain, %.2f us streaming",
                  bytes_text(kStreamProbeBytes).c_str(), host_group[0], host_group[1], leader.plain_us,
                  leader.streaming_us);
  slot_streaming_ = config_.shm_stream_set || (leader.measured && leader.streaming);
  if (slot_streaming_) shm_->stream_copies(config_.shm_stream_min_bytes, config_.shm_stream_max_bytes);
  if (config_.shm_stream_set) {
    BRAID_INFO("SHM", rank_, "slot copies of %s use streaming stores, as BRAID_SHM_STREAM_*_BYTES say%s",
               band.c_str(), measured);
  } else if (slot_streaming_) {
    BRAID_INFO("SHM", rank_, "slot copies of %s use streaming stores%s", band.c_str(), measured);
  } else if (leader.measured) {
    BRAID_INFO("SHM", rank_, "slot copies use plain stores%s", measured);
  } else {
    BRAID_INFO("SHM", rank_, "slot copies use plain stores: ranks share cores (BRAID_SHM_STREAM_*_BYTES)");
  }
  return Status::ok();
}

// The channels the algorithms run on and the tuner; every input is the same
// on every rank, so every rank builds the same.
void Communicator::build_schedules(const std::vector<PeerInfo>& infos) {
  const std::vector<std::vector<int>> members = host_groups(hosts_, placements_);
  const int nhosts = static_cast<int>(members.size());
  host_index_.assign(nranks_, 0);
  local_index_.assign(nranks_, 0);
  for (int h = 0; h < nhosts; ++h)
    for (size_t i = 0; i < members[h].size(); ++i) {
      host_index_[members[h][i]] = h;
      local_index_[members[h][i]] = static_cast<int>(i);
    }

  // A ring (and tree) that visits each host's ranks together crosses
  // between hosts once per host, whatever order the launcher gave ranks.
  order_.clear();
  for (const auto& m : members) order_.insert(order_.end(), m.begin(), m.end());
  position_.assign(nranks_, 0);
  for (int i = 0; i < nranks_; ++i) position_[order_[i]] = i;
  ordered_channel_ = coll_channel_.subset(order_);
  if (std::is_sorted(order_.begin(), order_.end())) ordered_channel_.ranks.clear();
  std::vector<int> reversed(order_.size());
  for (size_t i = 0; i < reversed.size(); ++i) reversed[i] = static_cast<int>(reversed.size() - 1 - i);
  mirror_channel_ = ordered_channel_.subset(reversed);

  JobShape shape;
  shape.nranks = nranks_;
  shape.nhosts = nhosts;
  shape.ranks_per_host = static_cast<int>(members[0].size());
  for (int h = 0; h < nhosts; ++h)
    if (members[h].size() != members[0].size()) shape.ranks_per_host = 0;
  if (!host_ranks_share_memory_) shape.without_shared_memory();
  // Oversubscribed: some machine runs more of this job's ranks than it has
  // cores (simulated hosts on one machine count together).
  for (int r = 0; r < nranks_; ++r) {
    const auto same = std::count_if(infos.begin(), infos.end(),
                                    [&](const PeerInfo& p) { return p.machine == infos[r].machine; });
    shape.ranks_per_core =
        std::max(shape.ranks_per_core, static_cast<double>(same) / std::max(1, infos[r].cores));
  }
  shape.oversubscribed = shape.ranks_per_core > 1;
  shape.peer_reads = channel_reads_peers(coll_channel_);
  shape.piece_bytes = coll_channel_.piece_bytes;
  shape.direct_max_bytes = config_.direct_max_bytes;
  shape.peer_read_min_bytes = config_.peer_read_min_bytes;
  shape.copy_peer_read_min_bytes = config_.copy_peer_read_min_bytes;
  if (shape.nhosts > 1 && shape.ranks_per_host > 1) {
    const auto& mine = members[host_index_[rank_]];
    std::vector<int> across;
    for (const auto& m : members) across.push_back(m[local_index_[rank_]]);
    host_channel_ = coll_channel_.subset(mine);
    across_channel_ = coll_channel_.subset(across);
    grid_ = members;
    shape.host_peer_reads = channel_reads_peers(host_channel_);
  }
  tuner_ = Tuner(shape, config_.algo);
}

Communicator::~Communicator() {
  // No op may still run over the IPC window when it goes: after an abort,
  // ops in flight are failed by the driver, which may still be at it. (A
  // communicator whose setup failed has no engine.)
  if (engine_ != nullptr) engine_->drain();
  // Before the engine goes: the streams' host functions wake it, and the
  // IPC teardown is an op of its own.
  disconnect_ipc();
  if (staging_ != nullptr) staging_->shut_down(engine_->timeout_s(), rank_);
  engine_.reset();  // stops the progress thread before transports go away
  tcp_.reset();
  shm_.reset();
  if (trace_) {
    if (Status st = trace_->write(); !st) BRAID_WARN("TRACE", rank_, "%s", st.message().c_str());
  }
}

namespace {

// "1-3,5,7-8" for a sorted list of ranks.
std::string rank_ranges(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace

// BRAID_DEBUG=INFO: what this rank runs with, in a few lines.
void Communicator::log_summary() const {
  if (log_level() < LogLevel::kInfo) return;
  BRAID_INFO("INIT", rank_, "braid %d.%d.%d: rank %d of %d, host %s, pid %d, host kernels %s",
             BRAID_VERSION_MAJOR, BRAID_VERSION_MINOR, BRAID_VERSION_PATCH, rank_, nranks_,
             hosts_[rank_].c_str(), static_cast<int>(getpid()), kernels::active_isa());
  std::vector<int> all(nranks_), peers;
  std::iota(all.begin(), all.end(), 0);
  std::copy_if(all.begin(), all.end(), std::back_inserter(peers), [&](int p) { return p != rank_; });
  std::string transports;
  for (const auto& [kind, ranks] : group_ranks(peers, [&](int p) { return transport_to(p); })) {
    transports += (transports.empty() ? "" : "; ") + kind + " to ranks " + rank_ranges(ranks);
  }
  BRAID_INFO("INIT", rank_, "transports: %s", transports.empty() ? "none (one rank)" : transports.c_str());
  const auto hosts = group_ranks(all, [&](int p) { return hosts_[p]; });
  std::string topo = std::to_string(hosts.size()) + " host(s):";
  for (size_t i = 0; i < hosts.size(); ++i) {
    topo += (i ? ", " : " ") + hosts[i].first + " ranks " + rank_ranges(hosts[i].second);
  }
  BRAID_INFO("TOPO", rank_, "%s", topo.c_str());
  const topo::HostTopology& t = *topology_;
  const std::string from = t.source == "this host" ? "" : " (" + t.source + ")";  // BRAID_TOPO_FILE
  BRAID_INFO("TOPO", rank_,
             "this host%s: %zu package(s), %zu NUMA node(s), %zu cores, %zu GPU(s), %zu NIC(s); rank %d "
             "on NUMA node %d, core %d",
             from.c_str(), t.packages.size(), t.numa_nodes.size(), t.cores.size(), t.gpus.size(),
             t.nics.size(), rank_, placements_[rank_].numa, placements_[rank_].core);
  std::string paths;
  for (const auto& [kind, ranks] : group_ranks(peers, [&](int p) {
         return std::string(topo::path_name(topo::path_between(placements_[rank_], placements_[p])));
       })) {
    paths += (paths.empty() ? "" : "; ") + kind + " to ranks " + rank_ranges(ranks);
  }
  if (!paths.empty()) BRAID_INFO("TOPO", rank_, "paths: %s", paths.c_str());
  for (const std::string& line : tuner_.describe()) BRAID_INFO("TUNE", rank_, "%s", line.c_str());
  BRAID_INFO("TUNE", rank_,
             "gather, scatter direct; all_to_all pairwise; barrier dissemination; piece %s; ring order %s",
             bytes_text(coll_channel_.piece_bytes).c_str(), rank_ranges(order_).c_str());
}

const char* Communicator::transport_to(int peer) const {
  return coll_channel_.conns[peer] ? coll_channel_.conns[peer]->kind() : "none";
}

Status Communicator::transport_bytes(const char* transport, uint64_t* bytes) const {
  if (transport == nullptr)
    return Status::invalid_argument("transport is NULL (shm, tcp, self, cuda_ipc or shm_window)");
  const std::string kind = transport;
  if (kind == "cuda_ipc" || kind == "shm_window") {
    *bytes = (kind == "cuda_ipc" ? ipc_bytes_ : window_bytes_).load(std::memory_order_relaxed);
    return Status::ok();
  }
  if (kind != "shm" && kind != "tcp" && kind != "self")
    return Status::invalid_argument("transport '" + kind +
                                    "' is not one of shm, tcp, self, cuda_ipc, shm_window");
  uint64_t total = 0;
  for (const Channel* ch : {&coll_channel_, &p2p_channel_})
    for (const Connection* c : ch->conns)
      if (c != nullptr && kind == c->kind()) total += c->bytes_moved();
  *bytes = total;
  return Status::ok();
}

void Communicator::set_last_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(error_mu_);
  last_error_ = message;
}

std::string Communicator::last_error() {
  std::lock_guard<std::mutex> lock(error_mu_);
  return last_error_;
}

void Communicator::abort(const Status& why) {
  engine_->abort(why);
  bootstrap_->abort(why);
  std::lock_guard<std::mutex> lock(split_mu_);
  if (split_cancel_ != nullptr) split_cancel_->cancel(why);
}

Status Communicator::split(int color, int key, std::shared_ptr<Communicator>* out) {
  auto cancel = std::make_shared<SetupCancel>();
  {
    std::lock_guard<std::mutex> lock(split_mu_);
    split_cancel_ = cancel;
  }
  Status st = split_once(color, key, cancel.get(), out);
  std::lock_guard<std::mutex> lock(split_mu_);
  split_cancel_.reset();
  // An abort that came after the child was made still fails the split.
  if (Status why = cancel->why(); st && !why.is_ok()) {
    out->reset();
    return why;
  }
  return st;
}

Status Communicator::split_once(int color, int key, SetupCancel* cancel, std::shared_ptr<Communicator>* out) {
  out->reset();
  const Deadline deadline = Deadline::after_seconds(engine_->timeout_s());
  struct SplitInfo {
    int32_t color;
    int32_t key;
    uint8_t addr[SockAddr::kWireBytes];
    uint8_t token[kTokenBytes];
  } mine{};
  int listen_fd = -1;
  SockAddr listen_addr;
  // A rank refusing its color, or unable to open the new communicator's
  // listening socket, still takes part in the exchange, so that every rank
  // fails at once instead of waiting for it until the deadline.
  constexpr int32_t kRefused = INT32_MIN;
  constexpr int32_t kNoListener = INT32_MIN + 1;
  const bool refused = color < 0 && color != BRAID_SPLIT_NOCOLOR;
  mine.color = refused ? kRefused : color;
  mine.key = key;
  Status listener;
  if (color >= 0) {
    listener = bootstrap_->open_listener(&listen_fd, &listen_addr);
    if (listener) {
      listen_addr.to_wire(mine.addr);
      JobToken t = random_token();
      std::memcpy(mine.token, t.data(), kTokenBytes);
    } else {
      mine.color = kNoListener;
    }
  }
  std::vector<uint8_t> raw;
  Status st = bootstrap_->all_gather(&mine, sizeof(mine), &raw, deadline);
  std::vector<SplitInfo> all(nranks_);
  if (st) std::memcpy(all.data(), raw.data(), raw.size());
  for (int r = 0; st && r < nranks_; ++r) {
    if (all[r].color == kRefused) {
      st = r == rank_ ? Status::invalid_argument("color=" + std::to_string(color) +
                                                 " is negative; use BRAID_SPLIT_NOCOLOR to opt out")
                      : Status::invalid_argument("rank " + std::to_string(r) +
                                                 " passed a negative color (its error names it)");
    } else if (all[r].color == kNoListener) {
      st = r == rank_ ? listener.with_context("split: opening the new communicator's listening socket")
                      : Status::remote("split: rank " + std::to_string(r) +
                                       " could not open the new communicator's listening socket (its "
                                       "error names the cause)");
    }
  }
  if (!st || color == BRAID_SPLIT_NOCOLOR) {
    close_fd(&listen_fd);
    return st;
  }
  std::vector<int> members;
  for (int r = 0; r < nranks_; ++r)
    if (all[r].color == color) members.push_back(r);
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[a].key < all[b].key; });
  std::vector<SockAddr> table(members.size());
  int new_rank = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    if (Status bad = SockAddr::from_wire(all[members[i]].addr, &table[i]); !bad) {
      close_fd(&listen_fd);
      return bad.with_context("split: rank " + std::to_string(members[i]) + "'s address");
    }
    if (members[i] == rank_) new_rank = static_cast<int>(i);
  }
  JobToken token;
  std::memcpy(token.data(), all[members[0]].token, kTokenBytes);
  std::unique_ptr<Bootstrap> b;
  BRAID_RETURN_IF_ERROR(
      Bootstrap::from_table(new_rank, token, listen_fd, listen_addr, table, deadline, cancel, &b));
  Config cfg = config_;
  cfg.timeout_s = engine_->timeout_s();
  return create(std::move(b), cfg, out, cancel);
}

namespace {

// What a collective's messages carry; p2p messages carry their size in bytes
// and the caller's tag (their order, not a sequence number, matches them):
// a receive of another size fails on the first piece, where the pieces of a
// message a whole number of pieces longer or shorter lined up before, and
// the rest was taken as the next message.
// Written field by field into the op: building a tag on the stack and
// copying it reads back the byte stores before they land (a stall per call).
void fill_call_tag(CallTag& t, OpKind kind, uint64_t seq, const CollArgs& a) {
  if (kind == OpKind::kSend || kind == OpKind::kRecv || kind == OpKind::kRecvAny) {
    t.kind = static_cast<uint8_t>(OpKind::kSend);
    t.user_tag = a.tag;
    t.count = a.count * dtype_size(a.dtype);
    return;
  }
  t.kind = static_cast<uint8_t>(kind);
  t.seq = static_cast<uint32_t>(seq);
  if (kind == OpKind::kBarrier) return;
  t.count = kind == OpKind::kAllToAllv ? 0 : a.count;
  t.dtype = static_cast<uint8_t>(a.dtype);
  if (kind == OpKind::kAllReduce || kind == OpKind::kReduce || kind == OpKind::kReduceScatter)
    t.op = static_cast<uint8_t>(a.op);
  if (kind == OpKind::kBroadcast || kind == OpKind::kReduce || kind == OpKind::kGather ||
      kind == OpKind::kScatter)
    t.root = a.root;
}

// The bytes an op reads from sendbuf and writes to recvbuf on this rank, and
// where its input sits when it is in place. An address, not a pointer: it
// may lie outside recvbuf (reduce_scatter's in-place input starts before
// it), or be computed from a NULL recvbuf that this rank does not use.
struct Regions {
  size_t in_bytes = 0, out_bytes = 0;
  bool uses_input = true, uses_output = true;
  uintptr_t canonical_in = 0;
};

// Inlined: returned through memory, its fields were stored one by one and
// read back 16 bytes at a time before the stores landed (a stall per call).
inline __attribute__((always_inline)) Regions regions_of(OpKind kind, const CollArgs& a, int rank,
                                                         int nranks) {
  const size_t esize = dtype_size(a.dtype);
  const size_t n = static_cast<size_t>(nranks);
  Regions g;
  g.in_bytes = g.out_bytes = a.count * esize;
  g.canonical_in = reinterpret_cast<uintptr_t>(a.recvbuf);
  switch (kind) {
    case OpKind::kSend:
      g.uses_output = false;
      break;
    case OpKind::kRecv:
    case OpKind::kRecvAny:
      g.uses_input = false;
      break;
    case OpKind::kBarrier:
      g.uses_input = g.uses_output = false;
      g.in_bytes = g.out_bytes = 0;
      break;
    case OpKind::kAllGather:
      g.out_bytes *= n;
      g.canonical_in += rank * g.in_bytes;
      break;
    case OpKind::kReduceScatter:
      g.in_bytes *= n;
      g.canonical_in -= rank * g.out_bytes;
      break;
    case OpKind::kGather:
      g.out_bytes *= n;
      g.canonical_in += rank * g.in_bytes;
      g.uses_output = rank == a.root;
      break;
    case OpKind::kScatter:
      g.in_bytes *= n;
      g.canonical_in -= rank * g.out_bytes;
      g.uses_input = rank == a.root;
      break;
    case OpKind::kAllToAll:
      g.in_bytes *= n;
      g.out_bytes *= n;
      g.canonical_in = 0;
      break;
    case OpKind::kAllToAllv:
      g.in_bytes = g.out_bytes = 0;
      // Only blocks that hold data: an empty block's displacement is not
      // checked against the buffer, and need not lie inside it.
      for (size_t p = 0; p < n; ++p) {
        if (a.layout[p] > 0) g.in_bytes = std::max(g.in_bytes, (a.layout[n + p] + a.layout[p]) * esize);
        if (a.layout[2 * n + p] > 0)
          g.out_bytes = std::max(g.out_bytes, (a.layout[3 * n + p] + a.layout[2 * n + p]) * esize);
      }
      g.canonical_in = 0;
      break;
    case OpKind::kBroadcast:
      g.uses_input = rank == a.root;
      break;
    case OpKind::kReduce:
      g.uses_output = rank == a.root;
      break;
    case OpKind::kAllReduce:
      break;
  }
  return g;
}

// Where the input overlaps the output other than in place: the op copies
// the input first.
bool copies_input_first(const Regions& g, const CollArgs& a) {
  if (!g.uses_input || !g.uses_output) return false;
  const char* in = static_cast<const char*>(a.sendbuf);
  const char* out = static_cast<const char*>(a.recvbuf);
  const bool overlap = in < out + g.out_bytes && out < in + g.in_bytes;
  return overlap && reinterpret_cast<uintptr_t>(in) != g.canonical_in;
}

// The input copied into `copy` as the op starts (divided by `divisor` unless
// it is 0: a float16 AVG's, see avg_scales_inputs), then the algorithm that
// reads the copy.
Task input_copied_first(const void* in, char* copy, size_t bytes, braid_dtype_t dtype, int divisor,
                        Task then) {
  if (divisor != 0)
    kernels::divide(dtype, in, copy, bytes / dtype_size(dtype), divisor);
  else
    std::memcpy(copy, in, bytes);
  co_await std::move(then);
}

// What make_op and make_ipc_op do first: the op keeps all_to_allv's arrays
// (the caller's may go away once the call returns) and learns its size. A
// call with nothing to move gets an empty task, and true is returned: every
// rank passes the same count, so every rank skips together
// (BRAID_CHECK_CALLS still compares the calls).
bool keep_args_or_skip(OpKind kind, Op& op, CollArgs& a, int rank, int nranks, Regions* g) {
  if (kind == OpKind::kAllToAllv) {
    op.layout.assign(a.layout, a.layout + 4 * static_cast<size_t>(nranks));
    a.layout = op.layout.data();
  }
  *g = regions_of(kind, a, rank, nranks);
  op.bytes = std::max(g->in_bytes, g->out_bytes);
  if (a.count != 0 || kind == OpKind::kAllToAllv) return false;
  op.algo = "none";
  op.task = []() -> Task { co_return; }();
  return true;
}

}  // namespace

std::shared_ptr<Op> Communicator::make_op(OpKind kind, const CollArgs& args, bool async, Algo forced,
                                          bool grouped, bool sent_inline) {
  auto op = new_op();
  op->name = op_kind_name(kind);
  op->async = async;
  // args is read where it lies: a copy of the caller's freshly built
  // arguments reads them back 16 bytes at a time before their narrower
  // stores landed (a stall per call). attach_collective copies once.
  const CollArgs& a = args;
  const size_t esize = dtype_size(a.dtype);
  op->bytes = a.count * esize;
  op->algo = "p2p";
  if (kind == OpKind::kRecvAny) {
    fill_call_tag(op->tag, kind, 0, args);
    op->lane = LaneKind::kRecv;
    op->lane_peer = -1;
    op->seq = p2p_recv_seq_.fetch_add(1, std::memory_order_relaxed);
    op->any_source_conns = p2p_channel_.conns;
    op->source_out = a.source;
    const Channel* ch = &p2p_channel_;
    const size_t read_min = p2p_read_min_bytes();
    op->bind = [ch, a, read_min](int peer) {
      CollArgs bound = a;
      bound.peer = peer;
      return p2p_recv(*ch, bound, read_min);
    };
    return op;
  }
  if (kind == OpKind::kSend || kind == OpKind::kRecv) {
    fill_call_tag(op->tag, kind, 0, args);
    op->lane = kind == OpKind::kSend ? LaneKind::kSend : LaneKind::kRecv;
    op->lane_peer = a.peer;
    op->seq = (kind == OpKind::kSend ? p2p_send_seq_ : p2p_recv_seq_).fetch_add(1, std::memory_order_relaxed);
    if (kind == OpKind::kRecv) {
      op->task = p2p_recv(p2p_channel_, a, p2p_read_min_bytes());
      return op;
    }
    // A large send between ranks that read each other's memory lets the
    // receiver read it in place: one copy where slots take two. It then
    // ends only once the receiver has read it, so a send that the slots
    // could hold whole keeps copying unless it is grouped (a group pairs
    // its sends with receives, as NCCL's do): ranks that both send, or
    // isend and wait, before they receive still get through, as with slots
    // (torch's dist.send is an isend and a wait).
    const Connection* c = p2p_channel_.to(a.peer);
    const size_t slot_capacity = static_cast<size_t>(config_.shm_slots) * p2p_channel_.piece_bytes;
    const bool offer = c != nullptr && c->supports_peer_reads() && op->bytes >= p2p_read_min_bytes() &&
                       (grouped || op->bytes > slot_capacity);
    if (offer) op->tag.path = CallTag::kReadPath;
    op->task = p2p_send(p2p_channel_, a, offer);
    return op;
  }
  op->lane = LaneKind::kCollective;
  op->seq = engine_->next_collective_seq();
  fill_call_tag(op->tag, kind, op->seq, args);
  if (kind == OpKind::kBarrier) {
    op->algo = "dissemination";
    op->task = dissemination_barrier(coll_channel_);
    return checked(std::move(op));
  }

  try {
    return attach_collective(kind, a, forced, op, sent_inline);
  } catch (const std::bad_alloc&) {
    // The collective fails here, and with it the communicator: its peers
    // learn why at once rather than wait for this rank until the deadline.
    op->task = []() -> Task { co_return; }();
    op->failure = Status(BRAID_ERR_SYSTEM, std::string(op->name) + " #" + std::to_string(op->seq) +
                                               ": out of memory for its work buffers (" +
                                               bytes_text(a.count * esize) + " per rank)");
    return op;
  }
}

Communicator::Inline Communicator::run_inline(OpKind kind, const CollArgs& a) {
  const bool direct_kind = kind == OpKind::kAllReduce || kind == OpKind::kAllGather ||
                           kind == OpKind::kReduceScatter || kind == OpKind::kAllToAll;
  const bool rooted = kind == OpKind::kBroadcast || kind == OpKind::kReduce;
  const bool rooted_direct = kind == OpKind::kGather || kind == OpKind::kScatter;
  if ((!rooted && !direct_kind && !rooted_direct) || !inline_calls_) return Inline::kNothing;
  const size_t esize = dtype_size(a.dtype), bytes = a.count * esize;  // per message
  const Regions g = regions_of(kind, a, rank_, nranks_);
  if (bytes == 0 || bytes > coll_channel_.piece_bytes ||
      std::max(g.in_bytes, g.out_bytes) >= window_min_bytes_ || copies_input_first(g, a))
    return Inline::kNothing;
  CallTag tag;
  fill_call_tag(tag, kind, engine_->collective_seq(), a);
  bool sent = false, done = false;
  // A direct collective: its sends of `bytes` from base + stride x (the
  // peer's rank), once made, then what it does with its peers' messages.
  auto direct = [&](const void* base, size_t stride, auto received) {
    return engine_->run_inline([&] {
      if (!sent) sent = direct_sends_if_free(coll_channel_, base, stride, bytes, tag);
      return sent && received();
    });
  };
  switch (kind) {
    case OpKind::kBroadcast:
    case OpKind::kReduce: {
      const bool broadcast = kind == OpKind::kBroadcast;
      const Algo algo = tuner_.pick(broadcast ? Coll::kBroadcast : Coll::kReduce, bytes);
      if ((algo != Algo::kRing && algo != Algo::kTree) || (!broadcast && avg_scales_inputs(a)))
        return Inline::kNothing;
      // Over the ranks in host order, as attach_collective runs them.
      const Channel& ch = ordered_channel_;
      const int root = position_[a.root];
      const BinaryTree t = algo == Algo::kTree ? BinaryTree(ch.rank, ch.nranks, root)
                           : broadcast         ? BinaryTree::chain(ch.rank, ch.nranks, root)
                                               : BinaryTree::chain_into(ch.rank, ch.nranks, root);
      done = engine_->run_inline(
          [&] { return broadcast ? broadcast_if_ready(ch, t, a, tag) : reduce_if_ready(ch, t, a, tag); });
      break;
    }
    case OpKind::kAllReduce: {
      if (avg_scales_inputs(a) || tuner_.pick_all_reduce(a.count, esize) != Algo::kDirect)
        return Inline::kNothing;
      // Kept as direct_all_reduce keeps it: accumulating overwrites it.
      const void* mine = a.sendbuf;
      if (a.sendbuf == a.recvbuf && rank_ != 0) {
        if (inline_scratch_.size() < bytes) {
          try {
            inline_scratch_.resize(coll_channel_.piece_bytes);
          } catch (const std::bad_alloc&) {
            return Inline::kNothing;  // the op reports it
          }
        }
        std::memcpy(inline_scratch_.data(), a.sendbuf, bytes);
        mine = inline_scratch_.data();
      }
      done = direct(mine, 0, [&] { return direct_all_reduce_if_ready(coll_channel_, a, mine, tag); });
      break;
    }
    case OpKind::kAllGather:
      if (tuner_.pick(Coll::kAllGather, g.out_bytes) != Algo::kDirect) return Inline::kNothing;
      done = direct(a.sendbuf, 0, [&] { return direct_all_gather_if_ready(coll_channel_, a, tag); });
      break;
    case OpKind::kReduceScatter:
      if (avg_scales_inputs(a) || tuner_.pick(Coll::kReduceScatter, g.in_bytes) != Algo::kDirect)
        return Inline::kNothing;
      done = direct(a.sendbuf, bytes, [&] { return direct_reduce_scatter_if_ready(coll_channel_, a, tag); });
      break;
    case OpKind::kGather:
    case OpKind::kScatter:
      done = engine_->run_inline([&] {
        return kind == OpKind::kGather ? gather_if_ready(coll_channel_, a, tag)
                                       : scatter_if_ready(coll_channel_, a, tag);
      });
      break;
    case OpKind::kAllToAll:  // pairwise, whose messages are these
      done = direct(a.sendbuf, bytes, [&] { return all_to_all_if_ready(coll_channel_, a, tag); });
      break;
    default:
      return Inline::kNothing;
  }
  if (!done) return sent ? Inline::kSent : Inline::kNothing;
  engine_->next_collective_seq();
  return Inline::kDone;
}

bool Communicator::p2p_inline_candidate(OpKind kind, const CollArgs& a) const {
  if (!inline_p2p_ || (kind != OpKind::kSend && kind != OpKind::kRecv)) return false;
  const size_t bytes = a.count * dtype_size(a.dtype);
  const Connection* c = p2p_channel_.to(a.peer);
  return c != nullptr && !c->pollable() && bytes <= p2p_channel_.piece_bytes && bytes < p2p_read_min_bytes();
}

bool Communicator::run_p2p_inline(P2pCall* calls, size_t n) {
  size_t left = 0;
  for (size_t i = 0; i < n; ++i) left += !calls[i].done;
  return engine_->run_inline([&] {
    const uint64_t attempt = ++p2p_attempt_;
    for (size_t i = 0; i < n && left > 0; ++i) {
      P2pCall& call = calls[i];
      const bool send = call.kind == OpKind::kSend;
      uint64_t& stalled = p2p_stalled_[2 * static_cast<size_t>(call.args.peer) + !send];
      if (call.done || stalled == attempt) continue;
      Connection* c = p2p_channel_.to(call.args.peer);
      const size_t bytes = call.args.count * dtype_size(call.args.dtype);
      CallTag tag;
      fill_call_tag(tag, call.kind, 0, call.args);
      if (send ? send_counted(c, call.args.sendbuf, bytes, tag)
               : c->recv_into(call.args.recvbuf, bytes, tag) == Connection::Received::kDone) {
        call.done = true;
        --left;
        // Counted as an op's would be, so that errors and dumps number later
        // calls alike whether or not these ran inline. Not a locked add: a
        // count another thread's make_op takes at the same moment may be
        // lost, which only shifts a number in a message.
        std::atomic<uint64_t>& seq = send ? p2p_send_seq_ : p2p_recv_seq_;
        seq.store(seq.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      } else {
        stalled = attempt;
      }
    }
    return left == 0;
  });
}

// make_op's collective part: the algorithm's task and its buffers. Leaves
// `op` as it was where an allocation fails (std::bad_alloc).
std::shared_ptr<Op> Communicator::attach_collective(OpKind kind, const CollArgs& args, Algo forced,
                                                    std::shared_ptr<Op>& op, bool sent_inline) {
  CollArgs a = args;
  auto pick = [&](Coll c, size_t bytes) { return forced != Algo::kAuto ? forced : tuner_.pick(c, bytes); };
  const size_t esize = dtype_size(a.dtype);
  Regions g;
  if (keep_args_or_skip(kind, *op, a, rank_, nranks_, &g)) return checked(std::move(op));
  const size_t in_bytes = g.in_bytes, out_bytes = g.out_bytes;
  // The algorithm reads a copy of the input, made when the op starts (a
  // stream op's input is written by the stream's earlier work, or staged,
  // only by then): where the input overlaps the output other than in place,
  // and for a float16 AVG, whose copy is divided by the number of ranks.
  const void* copied_input = nullptr;
  bool divided = false;
  if (copies_input_first(g, a)) copied_input = a.sendbuf;
  const bool reducing =
      kind == OpKind::kAllReduce || kind == OpKind::kReduce || kind == OpKind::kReduceScatter;
  if (reducing && avg_scales_inputs(a) && in_bytes > 0) {
    copied_input = a.sendbuf;
    divided = true;
    a.op = BRAID_SUM;
  }
  if (copied_input != nullptr) {
    op->input_copy.reset(new char[in_bytes]);  // not zeroed: written whole as the op starts
    a.sendbuf = op->input_copy.get();
  }
  switch (kind) {
    case OpKind::kAllReduce:
      op->task = all_reduce_task(
          op.get(), a, forced != Algo::kAuto ? forced : tuner_.pick_all_reduce(a.count, esize), sent_inline);
      break;
    case OpKind::kBroadcast:
    case OpKind::kReduce: {
      const Coll c = kind == OpKind::kBroadcast ? Coll::kBroadcast : Coll::kReduce;
      const Algo algo = pick(c, a.count * esize);
      op->algo = algo == Algo::kRing ? "chain" : algo_name(algo);
      // Peer reads exist for broadcast only (the tuner never offers them for
      // reduce): a reduce must never fall into the broadcast here.
      if (algo == Algo::kPeerRead && c == Coll::kBroadcast) {
        op->task = peer_read_broadcast(coll_channel_, a);
        break;
      }
      if (algo == Algo::kHierarchical) {
        const int root_host = host_index_[a.root], root_index = local_index_[a.root];
        if (c == Coll::kBroadcast) {
          op->task = hierarchical_broadcast(host_channel_, across_channel_, a, root_host, root_index);
        } else {
          if (rank_ != a.root) op->work.resize(in_bytes);
          op->task = hierarchical_reduce(ordered_channel_, host_channel_, across_channel_, a, root_host,
                                         root_index, op->work.data());
        }
        break;
      }
      // Chains and trees run in host order: the root's place in it.
      CollArgs o = a;
      o.root = position_[a.root];
      if (c == Coll::kReduce && algo == Algo::kTree)
        op->work.resize(std::min(coll_channel_.piece_bytes, in_bytes));
      if (c == Coll::kBroadcast)
        op->task =
            algo == Algo::kTree ? tree_broadcast(ordered_channel_, o) : chain_broadcast(ordered_channel_, o);
      else
        op->task = algo == Algo::kTree ? tree_reduce(ordered_channel_, o, op->work.data())
                                       : chain_reduce(ordered_channel_, o);
      break;
    }
    case OpKind::kAllGather: {
      const Algo algo = pick(Coll::kAllGather, out_bytes);
      op->algo = algo_name(algo);
      if (algo == Algo::kPeerRead) {
        op->task = peer_read_all_gather(coll_channel_, a);
      } else if (algo == Algo::kDirect) {
        op->task = direct_all_gather(coll_channel_, a, sent_inline);
      } else if (algo == Algo::kHierarchical) {
        op->task = hierarchical_all_gather(host_channel_, across_channel_, grid_, a);
      } else {
        op->algo = "ring";
        op->task = ring_all_gather(ordered_channel_, a);
      }
      break;
    }
    case OpKind::kReduceScatter: {
      const Algo algo = pick(Coll::kReduceScatter, in_bytes);
      op->algo = algo_name(algo);
      if (algo == Algo::kPeerRead) {
        op->work.resize(2 * std::min(coll_channel_.piece_bytes, out_bytes));
        op->task = peer_read_reduce_scatter(coll_channel_, a, op->work.data());
      } else if (algo == Algo::kDirect) {
        op->task = direct_reduce_scatter(coll_channel_, a, sent_inline);
      } else if (algo == Algo::kHierarchical) {
        op->work.resize(out_bytes * grid_.size());
        op->task = hierarchical_reduce_scatter(host_channel_, across_channel_, grid_, a, op->work.data());
      } else {
        op->algo = "ring";
        op->task = ring_reduce_scatter(ordered_channel_, a);
      }
      break;
    }
    case OpKind::kGather:
      op->algo = "direct";
      op->task = direct_gather(coll_channel_, a);
      break;
    case OpKind::kScatter:
      op->algo = "direct";
      op->task = direct_scatter(coll_channel_, a);
      break;
    case OpKind::kAllToAll:
      op->algo = "pairwise";
      op->task = pairwise_all_to_all(coll_channel_, a, sent_inline);
      break;
    case OpKind::kAllToAllv:
      op->algo = "pairwise";
      op->task = pairwise_all_to_allv(coll_channel_, a);
      break;
    default:
      break;
  }
  offer_windows(kind, *op, a);
  if (copied_input != nullptr)
    op->task = input_copied_first(copied_input, op->input_copy.get(), in_bytes, a.dtype,
                                  divided ? nranks_ : 0, std::move(op->task));
  return checked(std::move(op));
}

void Communicator::offer_windows(OpKind kind, Op& op, const CollArgs& a) {
  Coll c;
  switch (kind) {
    case OpKind::kAllReduce:
      c = Coll::kAllReduce;
      break;
    case OpKind::kBroadcast:
      c = Coll::kBroadcast;
      break;
    case OpKind::kAllGather:
      c = Coll::kAllGather;
      break;
    case OpKind::kReduceScatter:
      c = Coll::kReduceScatter;
      break;
    default:
      return;
  }
  if (op.bytes < window_min_bytes_) return;  // the larger of input and output
  std::shared_ptr<const HostWindows> windows;
  {
    std::lock_guard<std::mutex> lock(windows_mu_);
    windows = windows_;
  }
  if (windows == nullptr) return;
  op.task =
      window_or(coll_channel_, *windows, c, a, std::move(op.task), window_streaming_bytes_, &window_bytes_);
}

bool Communicator::windows_possible() const {
  return one_machine_ && nranks_ > 1 && channel_reads_peers(coll_channel_);
}

Status Communicator::register_window(void* buf, size_t bytes) {
  WindowRecord mine;
  SharedAllocation alloc;
  char* p = static_cast<char*>(buf);
  const std::string who = "rank " + std::to_string(rank_) + ": ";
  if (buf == nullptr) {
    mine.set_failure(who + "buf is NULL", true);
  } else if (bytes == 0) {
    mine.set_failure(who + "bytes is 0", true);
  } else if (!retain_shared(buf, bytes, &alloc)) {
    char addr[64];
    std::snprintf(addr, sizeof(addr), "%p", buf);
    mine.set_failure(who + "buf " + addr + " (" + std::to_string(bytes) +
                         " bytes) does not lie in memory from braid_mem_alloc",
                     true);
  } else {
    mine.ok = 1;
    mine.fd = alloc.fd;
    mine.alloc_bytes = alloc.bytes;
    mine.offset = static_cast<uint64_t>(p - alloc.base);
    mine.range_bytes = bytes;
    mine.alloc_serial = alloc.serial;
  }
  auto w = std::make_shared<HostWindow>();
  w->local = p;
  w->bytes = bytes;
  if (mine.ok) {
    // retain_shared pinned it: until the window is gone braid_mem_free
    // refuses the memory, so its memfd stays open while peers take it.
    w->on_release = [base = alloc.base] { shared_release(base); };
  }
  auto keep_unshared = [&](const std::string& why) {
    std::lock_guard<std::mutex> lock(windows_mu_);
    unshared_.push_back(std::move(w));
    BRAID_INFO("SHM", rank_, "comm_register: %s kept, but collectives take their usual path: %s",
               bytes_text(bytes).c_str(), why.c_str());
    return Status::ok();
  };
  // Windows need every rank on this host, reading each other's memory;
  // elsewhere a registration is this rank's alone.
  if (!windows_possible()) {
    if (!mine.ok) return Status::invalid_argument(mine.why);
    return keep_unshared("windows need every rank on one host, reading each other's memory");
  }
  {
    std::lock_guard<std::mutex> lock(windows_mu_);
    w->id = next_window_id_++;
  }
  std::shared_ptr<Op> op = make_setup_op("comm_register", "window", kWindowRegisterTag);
  WindowVerdict verdict;
  op->task = window_connect(coll_channel_, mine, &peer_mappings_, w.get(), &verdict);
  engine_->post(op);
  BRAID_RETURN_IF_ERROR(engine_->wait(*op));
  if (verdict.outcome == WindowVerdict::kRefused) return Status::invalid_argument(verdict.why);
  if (verdict.outcome == WindowVerdict::kUnmappable) return keep_unshared(verdict.why);
  std::lock_guard<std::mutex> lock(windows_mu_);
  auto next = std::make_shared<HostWindows>(windows_ ? *windows_ : HostWindows{});
  next->push_back(std::move(w));
  windows_ = std::move(next);
  return Status::ok();
}

Status Communicator::deregister_window(void* buf) {
  std::shared_ptr<const HostWindow> found;
  bool collective = false;
  {
    std::lock_guard<std::mutex> lock(windows_mu_);
    // A registration every rank kept unshared is undone on each alone.
    for (auto it = unshared_.begin(); it != unshared_.end(); ++it) {
      if (buf != nullptr && (*it)->local == buf) {
        unshared_.erase(it);
        return Status::ok();
      }
    }
    // Every rank made the same registration attempts, so all agree on this.
    collective = next_window_id_ > 0;
    if (windows_)
      for (const auto& w : *windows_)
        if (w->local == buf) found = w;
  }
  char addr[64];
  std::snprintf(addr, sizeof(addr), "%p", buf);
  const Status unknown =
      buf == nullptr
          ? Status::invalid_argument("buf is NULL")
          : Status::invalid_argument(std::string("buf ") + addr + " is not registered on this comm");
  if (!collective) return unknown;
  // Every rank joins, even one that names no window: the others learn it
  // and fail alike instead of waiting for it.
  std::shared_ptr<Op> op = make_setup_op("comm_deregister", "window", kWindowDeregisterTag);
  std::string why;
  op->task = window_disconnect(coll_channel_, found ? found->id : kNoWindow, &why);
  engine_->post(op);
  BRAID_RETURN_IF_ERROR(engine_->wait(*op));
  // Ranks that disagree all hear of it first, this one too if its own
  // buffer was not registered.
  if (!why.empty())
    return Status(BRAID_ERR_MISMATCH, found ? why : why + " (here: " + unknown.message() + ")");
  if (!found) return unknown;
  // The window goes once no call holds it (none does once this op ran:
  // earlier calls on the lane are done), which frees the peers' mappings
  // and lets braid_mem_free take the memory.
  std::lock_guard<std::mutex> lock(windows_mu_);
  auto next = std::make_shared<HostWindows>();
  for (const auto& w : *windows_)
    if (w != found) next->push_back(w);
  windows_ = next->empty() ? nullptr : std::move(next);
  return Status::ok();
}

Task Communicator::all_reduce_task(Op* op, const CollArgs& a, Algo algo, bool sent_inline) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  op->algo = algo_name(algo);
  switch (algo) {
    case Algo::kDirect:
      // In place, every rank but 0 must keep its input while it accumulates.
      if (a.sendbuf == a.recvbuf && rank_ != 0) op->work.resize(bytes);
      return direct_all_reduce(coll_channel_, a, op->work.data(), sent_inline);
    case Algo::kPeerRead:
      op->work.resize(2 * std::min(coll_channel_.piece_bytes, bytes));
      return peer_read_all_reduce(coll_channel_, a, op->work.data());
    case Algo::kTree:
      op->work.resize(std::min(coll_channel_.piece_bytes, bytes));
      return tree_all_reduce(ordered_channel_, a, op->work.data());
    case Algo::kRecursiveDoubling:
      op->work.resize(bytes);
      return recursive_doubling_all_reduce(ordered_channel_, a, op->work.data());
    case Algo::kDoubleTree:
      op->work.resize(2 * std::min(coll_channel_.piece_bytes, bytes));
      return double_tree_all_reduce(ordered_channel_, mirror_channel_, a, op->work.data());
    case Algo::kRabenseifner:
      op->work.resize(bytes);
      return rabenseifner_all_reduce(ordered_channel_, a, op->work.data());
    case Algo::kHierarchical: {
      const bool host_reads = tuner_.hierarchical_reads_peers(bytes);
      if (host_reads) op->work.resize(2 * std::min(coll_channel_.piece_bytes, bytes));
      return hierarchical_all_reduce(ordered_channel_, host_channel_, across_channel_, a, host_reads,
                                     op->work.data());
    }
    case Algo::kRing:
    case Algo::kAuto:
      break;
  }
  op->algo = "ring";
  return ring_all_reduce(ordered_channel_, a);
}

Status Communicator::prepare_stream_op(OpKind kind, const CollArgs& args, void* stream, StagedCall* call,
                                       CollArgs* staged_args) {
  const CudaDriver* cu = nullptr;
  BRAID_RETURN_IF_ERROR(cuda_driver(&cu));
  StreamContext context(*cu, stream);
  BRAID_RETURN_IF_ERROR(context.status());
  // Captured into a graph, the staging copies, host functions and waits
  // would be recorded instead of run, and the op would wait for a stream
  // that never gets there; replayed later, they would touch freed blocks.
  if (cu->stream_is_capturing != nullptr) {
    int capture = 0;
    if (CUresult r = cu->stream_is_capturing(stream, &capture); r != 0)
      return cu->error("cuStreamIsCapturing", r);
    if (capture != 0)
      return Status::unsupported(
          "the stream is being captured into a CUDA graph; braid's stream-ordered operations wait for "
          "host-side progress and cannot be captured: call it outside the capture");
  }
  const Regions g = regions_of(kind, args, rank_, nranks_);
  {
    std::lock_guard<std::mutex> lock(staging_mu_);
    if (staging_ == nullptr) staging_ = new StagingPool([e = engine_.get()] { e->wake_if_sleeping(); });
  }
  call->cu = cu;
  call->stream = stream;
  call->pool = staging_;
  if (ipc_candidate(kind)) {
    std::lock_guard<std::mutex> lock(ipc_mu_);
    if (ipc_state_ == IpcState::kUntried) BRAID_RETURN_IF_ERROR(connect_ipc(*cu, context.context()));
    // Every buffer this rank passes is memory of the window's device and
    // context (the kernels, launched in that context, write outputs in
    // place; another context's allocation is not mapped there, even on the
    // same GPU). A rank that decides otherwise than its peers is caught by
    // the tag's path (BRAID_ERR_MISMATCH).
    auto on_window_device = [&](bool used, size_t bytes, const void* p) {
      DevicePlace where;
      return !used || bytes == 0 ||
             (device_memory_place(p, &where) && where.ordinal == ipc_->device() &&
              where.context == ipc_->context());
    };
    if (ipc_state_ == IpcState::kUsable && ipc_->context() == context.context() &&
        on_window_device(g.uses_input, g.in_bytes, args.sendbuf) &&
        on_window_device(g.uses_output, g.out_bytes, args.recvbuf)) {
      // Only the stream's flags: it waits while the op runs over the window.
      call->device_ipc = true;
      *staged_args = args;
      // An input that overlaps its output other than in place is copied
      // aside first, into scratch allocated now (see IpcWindow::scratch).
      const char* in = static_cast<const char*>(args.sendbuf);
      const char* out = static_cast<const char*>(args.recvbuf);
      // (all_to_allv's count is 0: its extents say whether it moves data.)
      if (g.in_bytes > 0 && g.out_bytes > 0 && g.uses_input && g.uses_output &&
          reinterpret_cast<uintptr_t>(in) != g.canonical_in && in < out + g.out_bytes &&
          out < in + g.in_bytes)
        BRAID_RETURN_IF_ERROR(ipc_->scratch(g.in_bytes, &call->ipc_input_copy));
      return staging_->take(*cu, context.context(), 0, &call->block);
    }
  }
  // Device and managed buffers are staged through the block; host buffers
  // the op uses where they are, once the stream reached it (the driver
  // would copy between host buffers at once, out of stream order).
  const bool stage_in = g.uses_input && g.in_bytes > 0 && is_stream_staged_memory(args.sendbuf);
  const bool stage_out = g.uses_output && g.out_bytes > 0 && is_stream_staged_memory(args.recvbuf);
  const size_t in_bytes = stage_in ? g.in_bytes : 0;
  const size_t out_at = (in_bytes + 127) / 128 * 128;
  const size_t out_bytes = stage_out ? g.out_bytes : 0;
  BRAID_RETURN_IF_ERROR(staging_->take(*cu, context.context(), out_at + out_bytes, &call->block));
  char* data = call->block->data;
  // A staged input sits at 0, a staged output after it, laid out as in the
  // user's buffers (all_to_allv's displacements hold).
  CollArgs s = args;
  if (stage_in) s.sendbuf = data;
  if (stage_out) s.recvbuf = data + out_at;
  *staged_args = s;
  if (stage_in) call->inputs.push_back({0, in_bytes, args.sendbuf});
  if (stage_out && kind == OpKind::kAllToAllv) {
    // Only the blocks received: the bytes between them are the caller's.
    const size_t n = static_cast<size_t>(nranks_), esize = dtype_size(args.dtype);
    for (size_t p = 0; p < n; ++p) {
      const size_t at = args.layout[3 * n + p] * esize, bytes = args.layout[2 * n + p] * esize;
      if (bytes > 0) call->outputs.push_back({out_at + at, bytes, static_cast<char*>(args.recvbuf) + at});
    }
  } else if (stage_out) {
    call->outputs.push_back({out_at, out_bytes, args.recvbuf});
  }
  return Status::ok();
}

std::shared_ptr<Op> Communicator::make_stream_op(OpKind kind, const CollArgs& staged_args,
                                                 const StagedCall& call) {
  // Driven by the progress thread or whichever caller waits: the call
  // itself returns at once, like an i-operation.
  std::shared_ptr<Op> op = call.device_ipc ? make_ipc_op(kind, staged_args, call.ipc_input_copy)
                                           : make_op(kind, staged_args, true);
  StagingBlock* b = call.block;
  if (kind == OpKind::kRecvAny) {
    op->bind = [b, bind = std::move(op->bind)](int peer) { return stream_staged(b, bind(peer)); };
  } else {
    op->task = stream_staged(b, std::move(op->task));
  }
  op->on_complete = &StagingPool::op_completed;
  op->on_complete_ctx = b;
  if (call.device_ipc) {
    // Failed half way, the op may have copies left on the internal stream
    // that write the user's outputs: they run before the user's stream
    // goes on (on success the stream is idle by then).
    struct Release {
      IpcWindow* window;
      StagingBlock* block;
      static void run(void* p) {
        auto* r = static_cast<Release*>(p);
        if (!r->window->drain_stream())
          BRAID_WARN(
              "CUDA", r->window->rank(),
              "a failed CUDA IPC operation's copies did not finish within 10 s; its stream goes on, and "
              "they may still write into its output buffers");
        StagingPool::op_completed(r->block);
      }
    };
    auto release = std::make_shared<Release>(Release{ipc_.get(), b});
    op->on_complete = &Release::run;
    op->on_complete_ctx = release.get();
    op->on_complete_state = std::move(release);
  }
  return op;
}

std::shared_ptr<Op> Communicator::checked(std::shared_ptr<Op> op) {
  if (!config_.check_calls) return op;
  op->task = checked_call(coll_channel_, op->tag, std::move(op->task));
  return op;
}

bool Communicator::ipc_candidate(OpKind kind) const {
  if (!config_.cuda_ipc || !one_machine_ || nranks_ < 2) return false;
  switch (kind) {
    case OpKind::kAllReduce:
    case OpKind::kBroadcast:
    case OpKind::kReduce:
    case OpKind::kAllGather:
    case OpKind::kReduceScatter:
    case OpKind::kGather:
    case OpKind::kScatter:
    case OpKind::kAllToAll:
    case OpKind::kAllToAllv:
      return true;
    default:
      return false;
  }
}

std::shared_ptr<Op> Communicator::make_setup_op(const char* name, const char* algo, uint8_t tag_kind) {
  std::shared_ptr<Op> op = new_op();
  op->name = name;
  op->algo = algo;
  op->async = true;
  op->lane = LaneKind::kCollective;
  op->seq = engine_->next_collective_seq();
  op->tag.kind = tag_kind;
  op->tag.seq = static_cast<uint32_t>(op->seq);
  return op;
}

Status Communicator::connect_ipc(const CudaDriver& cu, void* ctx) {
  std::shared_ptr<Op> op = make_setup_op("cuda_ipc_setup", "cuda_ipc", kIpcConnectTag);
  std::string why;
  IpcSetup setup{&cu, ctx, config_.cuda_chunk_bytes, [e = engine_.get()] { e->wake_if_sleeping(); },
                 &ipc_bytes_};
  // Two GPUs' ranks read each other's memory only over a path the topology
  // (or BRAID_CUDA_P2P_LEVEL) accepts.
  setup.gpu_path_allowed = [topology = topology_, level = config_.cuda_p2p_level](const std::string& mine,
                                                                                  const std::string& theirs) {
    std::string path, why;
    if (topo::p2p_allowed(*topology, level ? &*level : nullptr, mine, theirs, &path, &why))
      return Status::ok();
    return Status::unsupported(why);
  };
  std::string failure;
  std::unique_ptr<IpcWindow> window =
      make_ipc_window(setup, coll_channel_.nranks, coll_channel_.rank, &failure);
  bool connected = false;
  op->task = ipc_connect(coll_channel_, setup, window.get(), std::move(failure), &connected, &why);
  engine_->post(op);
  // A window not kept is freed here, on this thread, once the op is done
  // (see ipc_connect): the engine's driver must not wait for streams.
  BRAID_RETURN_IF_ERROR(engine_->wait(*op).with_context("setting up CUDA IPC between the ranks"));
  if (connected) ipc_ = std::move(window);
  window.reset();
  if (ipc_ != nullptr) {
    ipc_state_ = IpcState::kUsable;
    BRAID_INFO("CUDA", rank_, "device collectives over CUDA IPC: a window of 2 x %s on CUDA device %d",
               bytes_text(ipc_->region_bytes()).c_str(), ipc_->device());
    return Status::ok();
  }
  ipc_state_ = IpcState::kUnusable;
  // Once per communicator, from one rank: every rank has the same reason.
  if (rank_ == 0)
    BRAID_WARN("CUDA", rank_,
               "device collectives go through pinned host memory (host staging), not CUDA IPC: %s "
               "(BRAID_CUDA_IPC=0 skips trying)",
               why.c_str());
  return Status::ok();
}

std::shared_ptr<Op> Communicator::make_ipc_op(OpKind kind, const CollArgs& args, char* input_copy) {
  std::shared_ptr<Op> op = new_op();
  op->name = op_kind_name(kind);
  op->algo = "cuda_ipc";
  op->async = true;
  op->lane = LaneKind::kCollective;
  op->seq = engine_->next_collective_seq();
  fill_call_tag(op->tag, kind, op->seq, args);
  op->tag.path = CallTag::kDevicePath;
  CollArgs a = args;
  Regions g;
  if (keep_args_or_skip(kind, *op, a, rank_, nranks_, &g)) return checked(std::move(op));
  IpcWindow& w = *ipc_;
  const Channel& ch = coll_channel_;
  Task (*run)(const Channel&, IpcWindow&, CollArgs) = nullptr;
  switch (kind) {
    case OpKind::kAllReduce:
      run = ipc_all_reduce;
      break;
    case OpKind::kBroadcast:
      run = ipc_broadcast;
      break;
    case OpKind::kReduce:
      run = ipc_reduce;
      break;
    case OpKind::kAllGather:
      run = ipc_all_gather;
      break;
    case OpKind::kReduceScatter:
      run = ipc_reduce_scatter;
      break;
    case OpKind::kGather:
      run = ipc_gather;
      break;
    case OpKind::kScatter:
      run = ipc_scatter;
      break;
    case OpKind::kAllToAll:
      run = ipc_all_to_all;
      break;
    default:  // kAllToAllv: ipc_candidate admits no other kind
      run = ipc_all_to_allv;
      break;
  }
  op->task =
      input_copy != nullptr ? ipc_with_input_copy(ch, w, a, g.in_bytes, input_copy, run) : run(ch, w, a);
  return checked(std::move(op));
}

void Communicator::disconnect_ipc() {
  std::lock_guard<std::mutex> lock(ipc_mu_);
  if (ipc_ == nullptr) return;
  std::shared_ptr<Op> op = make_setup_op("cuda_ipc_teardown", "cuda_ipc", kIpcDisconnectTag);
  // Destroy is local: peers that do not destroy theirs soon leave this
  // rank's window allocated (the teardown says so), not this call hanging.
  engine_->set_timeout_s(std::min(engine_->timeout_s(), kIpcTeardownSeconds));
  op->task = ipc_disconnect(coll_channel_, ipc_.get());
  engine_->post(op);
  (void)engine_->wait(*op);
  ipc_.reset();  // on this thread, not the engine's driver (see ipc_connect)
}

}  // namespace braid
