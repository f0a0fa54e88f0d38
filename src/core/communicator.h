// A communicator: the ranks of one job (or of a split of it), their
// transports, the channels the algorithms use, and the engine that runs
// operations. The C API is a thin layer over this class.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "src/algo/collectives.h"
#include "src/algo/window_collectives.h"
#include "src/core/bootstrap.h"
#include "src/core/config.h"
#include "src/core/engine.h"
#include "src/core/setup_cancel.h"
#include "src/core/status.h"
#include "src/topo/topology.h"

namespace braid {

class ShmTransport;
struct PeerInfo;
class TcpTransport;
class StagingPool;
struct StagedCall;
class IpcWindow;
struct CudaDriver;

class Communicator {
 public:
  // Collective: sets up transports among the bootstrap's ranks. `cancel`
  // (a split's) aborts the setup's waits; it is detached before returning.
  static Status create(std::unique_ptr<Bootstrap> bootstrap, const Config& config,
                       std::shared_ptr<Communicator>* out, SetupCancel* cancel = nullptr);
  ~Communicator();

  // Made in the parent of this process's fork(): the child must not use it
  // (its threads do not exist here, and its sockets and shared memory are
  // the parent's).
  bool forked() const;
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  const Config& config() const { return config_; }
  Engine& engine() { return *engine_; }
  // braid_comm_abort: fails every pending operation, a comm_split's
  // exchange and its child's setup on another thread included.
  void abort(const Status& why);
  const std::string& host_of(int rank) const { return hosts_[rank]; }
  // Which transport carries traffic to `peer` ("shm", "tcp", "self").
  const char* transport_to(int peer) const;

  // braid_comm_transport_bytes: what this rank moved through `transport`.
  Status transport_bytes(const char* transport, uint64_t* bytes) const;

  // Collective over this communicator. *out is null for BRAID_SPLIT_NOCOLOR.
  Status split(int color, int key, std::shared_ptr<Communicator>* out);

  // Builds the operation; arguments must already be validated. `algo`
  // other than kAuto runs that algorithm where the tuner would pick.
  // grouped: made between braid_group_start and braid_group_end, so it runs
  // beside the group's other ops even where it blocks.
  // sent_inline: run_inline made the call's sends (Inline::kSent); the op,
  // a direct all_reduce, all_gather or reduce_scatter, or a pairwise
  // all_to_all then, does the rest.
  std::shared_ptr<Op> make_op(OpKind kind, const CollArgs& args, bool async, Algo algo = Algo::kAuto,
                              bool grouped = false, bool sent_inline = false);
  std::shared_ptr<Op> attach_collective(OpKind kind, const CollArgs& args, Algo forced,
                                        std::shared_ptr<Op>& op, bool sent_inline);
  // A blocking call done on the calling thread with no op, where it can be
  // (Engine::run_inline), on shared memory: a broadcast or reduce of one
  // piece over the chain or tree whose pieces are in and whose slots are
  // free; a direct all_reduce, all_gather or reduce_scatter, or an
  // all_to_all, of one piece per message whose slots are free (kSent) and
  // whose peers' messages are in (kDone); a gather or scatter whose rank's
  // part (only sends or only receives) can be done whole. kDone: done,
  // successfully. kNothing: nothing done; make the op. kSent: make the op
  // with sent_inline.
  enum class Inline { kNothing, kDone, kSent };
  Inline run_inline(OpKind kind, const CollArgs& args);
  // Point-to-point messages of this size and up may be read from the
  // sender's memory (make_op); SIZE_MAX where reads lost at init.
  size_t p2p_read_min_bytes() const { return p2p_read_min_bytes_; }
  // A blocking send or receive that run_p2p_inline may do: one piece, below
  // p2p_read_min_bytes, to a peer over shared memory, with no trace and no
  // call checks.
  bool p2p_inline_candidate(OpKind kind, const CollArgs& args) const;
  struct P2pCall {
    OpKind kind;  // kSend or kRecv
    CollArgs args;
    bool done = false;
  };
  // Does on the calling thread, with no op (Engine::run_inline), each send
  // whose peer has a free slot and each receive whose message is in, in
  // each peer's order: a call waits for the earlier ones to the same peer in
  // the same direction. Marks those done; true when all are. A message of
  // another size or tag is left to the receive's op to report.
  bool run_p2p_inline(P2pCall* calls, size_t n);
  // A stream-ordered call (transports/cuda/stream_staging.h), in two steps:
  // the staging it needs (a block taken, copies listed, the stream's context
  // current on this thread), then, once that is enqueued, the op to post.
  // A collective whose buffers are all device memory, on a communicator of
  // one host whose ranks mapped each other's CUDA IPC windows (the first
  // such call sets that up), moves its data device to device: nothing is
  // staged, and the op runs over the window (src/algo/ipc_collectives.h).
  Status prepare_stream_op(OpKind kind, const CollArgs& args, void* stream, StagedCall* call,
                           CollArgs* staged_args);
  std::shared_ptr<Op> make_stream_op(OpKind kind, const CollArgs& staged_args, const StagedCall& call);

  // braid_comm_register / braid_comm_deregister, collective. On a
  // communicator of one host whose ranks read each other's memory, every
  // rank maps every other's registered range, and collectives whose buffers
  // lie in those ranges move data straight between them
  // (src/algo/window_collectives.h). Elsewhere a registration is kept but
  // changes nothing.
  Status register_window(void* buf, size_t bytes);
  Status deregister_window(void* buf);

  void set_last_error(const std::string& message);
  std::string last_error();

 private:
  Communicator() = default;
  Status setup_transports();
  Status split_once(int color, int key, SetupCancel* cancel, std::shared_ptr<Communicator>* out);
  void build_schedules(const std::vector<PeerInfo>& infos);
  Status choose_slot_copies(const std::vector<int>& host_group, Deadline deadline);
  static constexpr size_t kStreamProbeBytes = 64 * 1024;  // inside the default streaming band
  // Times each collective that may read peers (all_reduce, broadcast,
  // all_gather, reduce_scatter) against its ring or chain, on one host, and
  // gives the tuner the ratios (JobShape::peer_read_vs_ring). Collective:
  // every rank calls it at init.
  Status probe_peer_reads(Deadline deadline);
  std::vector<uint64_t> probe_shape_key() const;
  Task all_reduce_task(Op* op, const CollArgs& a, Algo algo, bool sent_inline);
  void log_summary() const;
  // With BRAID_CHECK_CALLS, runs the op's task behind a comparison of calls.
  std::shared_ptr<Op> checked(std::shared_ptr<Op> op);
  // CUDA IPC (see prepare_stream_op): whether `kind` could take it here, the
  // collective setup (blocking, at the first such call; ipc_mu_ held), the
  // op over the window, and the teardown at destroy.
  bool ipc_candidate(OpKind kind) const;
  Status connect_ipc(const CudaDriver& cu, void* ctx);
  // input_copy: scratch for an input that overlaps its output (or null).
  std::shared_ptr<Op> make_ipc_op(OpKind kind, const CollArgs& args, char* input_copy);
  void disconnect_ipc();
  // The op of a registration or deregistration: a collective of its own.
  std::shared_ptr<Op> make_setup_op(const char* name, const char* algo, uint8_t tag_kind);
  // Wraps the task of an all_reduce, broadcast, all_gather or
  // reduce_scatter in window_or where windows may carry it.
  void offer_windows(OpKind kind, Op& op, const CollArgs& a);
  // Whether windows can work here: every rank on this host, each able to
  // read every other's memory. The same on every rank.
  bool windows_possible() const;

  int rank_ = 0;
  int nranks_ = 1;
  Config config_;
  uint64_t forks_at_creation_ = 0;
  std::unique_ptr<Bootstrap> bootstrap_;
  std::vector<std::string> hosts_;
  std::shared_ptr<const topo::HostTopology> topology_;  // this host
  std::vector<topo::RankPlacement> placements_;         // every rank's, from init
  std::unique_ptr<ShmTransport> shm_;
  std::unique_ptr<TcpTransport> tcp_;
  std::vector<std::unique_ptr<Connection>> self_conns_;  // send/recv to self, per channel
  Channel coll_channel_;                                 // channel 0: collectives
  Channel p2p_channel_;                                  // channel 1: point-to-point
  std::vector<int> order_;        // ranks grouped by host: the order of rings and trees
  std::vector<int> position_;     // each rank's index in order_
  Channel ordered_channel_;       // coll_channel_ in order_
  Channel mirror_channel_;        // ordered_channel_ reversed: the double tree's second tree
  Channel host_channel_;          // this host's ranks (hierarchical schedules)
  Channel across_channel_;        // one rank per host, this rank's index on each
  std::vector<int> host_index_;   // each rank's host (order of first appearance)
  std::vector<int> local_index_;  // each rank's index among its host's ranks
  HostGrid grid_;                 // the ranks of each host (when hosts hold alike)
  Tuner tuner_;
  std::unique_ptr<TraceRecorder> trace_;  // BRAID_TRACE_FILE, written at destroy
  std::unique_ptr<Engine> engine_;
  std::mutex staging_mu_;
  StagingPool* staging_ = nullptr;  // made by the first stream-ordered call; ended by shut_down
  bool one_machine_ = false;        // every rank on this host and machine
  // run_inline may run here: no connection of the collectives is tcp (whose
  // commits the driver must still write), no trace, no call checks.
  bool inline_calls_ = false;
  std::vector<char> inline_scratch_;  // an in-place direct all_reduce's input, kept
  bool inline_p2p_ = false;           // no trace, no call checks
  size_t p2p_read_min_bytes_ = SIZE_MAX;
  // run_p2p_inline's record of the peers and directions whose next call
  // could not be done in this attempt: entry 2 x peer + (receive), equal to
  // the attempt's number.
  std::vector<uint64_t> p2p_stalled_;
  uint64_t p2p_attempt_ = 0;
  // Ranks of one host talk over shm (not under BRAID_TRANSPORT=tcp, nor
  // where shm could not be set up): the same on every rank.
  bool host_ranks_share_memory_ = true;
  enum class IpcState { kUntried, kUsable, kUnusable };
  std::mutex ipc_mu_;
  IpcState ipc_state_ = IpcState::kUntried;
  std::unique_ptr<IpcWindow> ipc_;
  std::atomic<uint64_t> ipc_bytes_{0};  // read from peers' windows (transport_bytes "cuda_ipc")
  // Registered ranges (register_window), replaced whole on every change so
  // a call takes a snapshot with one copy. Null while there are none.
  std::mutex windows_mu_;
  std::shared_ptr<const HostWindows> windows_;
  PeerMappings peer_mappings_;                               // the peers' allocations that windows_ lie in
  std::vector<std::shared_ptr<const HostWindow>> unshared_;  // registered where windows cannot work
  uint32_t next_window_id_ = 0;
  size_t window_min_bytes_ = 0;            // BRAID_WINDOW_MIN_BYTES or its default for this job
  size_t window_streaming_bytes_ = 0;      // see window_or
  bool slot_streaming_ = false;            // shm slot copies stream (choose_slot_copies)
  std::atomic<uint64_t> window_bytes_{0};  // transport_bytes "shm_window"
  std::mutex error_mu_;
  std::string last_error_;
  // The child a comm_split on some thread is setting up, for abort().
  std::mutex split_mu_;
  std::shared_ptr<SetupCancel> split_cancel_;
  SetupCancel* setup_cancel_ = nullptr;  // this communicator's own, while create() runs
  // Only for dumps and traces; atomic since any thread may post p2p.
  std::atomic<uint64_t> p2p_send_seq_{0};
  std::atomic<uint64_t> p2p_recv_seq_{0};
};

}  // namespace braid
