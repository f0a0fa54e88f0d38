// Rendezvous and the out-of-band channel between the ranks of a communicator.
//
// A root (a thread in the process that made the unique id, or rank 0 under
// init_env) listens on TCP; every rank connects, proves it belongs to the job
// with the random token, and receives every rank's listen address. After that
// the ranks talk among themselves: a ring for small all-gathers and barriers,
// and tagged point-to-point connections that transports ask for. Never on the
// data path.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "src/core/deadline.h"
#include "src/core/setup_cancel.h"
#include "src/core/socket.h"
#include "src/core/status.h"

namespace braid {

constexpr size_t kTokenBytes = 16;
// The most ranks a communicator may have (the rendezvous root's limit).
constexpr int kMaxRanks = 1 << 20;
using JobToken = std::array<uint8_t, kTokenBytes>;

// The decoded braid_unique_id_t.
struct UniqueId {
  SockAddr root;
  JobToken token{};

  void encode(void* out128) const;
  static Status decode(const void* in128, UniqueId* out);
};

JobToken random_token();
std::string token_hex(const JobToken& t, size_t bytes = 4);

// Starts a rendezvous root on `listen_addr` in a detached thread; it serves
// one job (nranks learned from the first valid hello) and then exits, or
// gives up after `timeout_s`. *bound gets the address it listens on.
Status start_rendezvous_root(const SockAddr& listen_addr, const JobToken& token, double timeout_s,
                             SockAddr* bound);

// The handshakes as they arrive on a socket: each parse says why a
// connection's bytes are rejected (a stranger, another job, a truncated or
// garbled message), so the listener can log it and go on. Exposed for the
// tests and the fuzz targets.
struct RootHelloFields {
  int rank = -1;
  int nranks = 0;
  SockAddr addr;
};
constexpr size_t kRootHelloBytes = 52;
constexpr size_t kPeerHelloBytes = 32;
Status parse_root_hello(const uint8_t* in, size_t n, const JobToken& token, RootHelloFields* out);
Status parse_peer_hello(const uint8_t* in, size_t n, const JobToken& token, int nranks, int* rank,
                        uint32_t* tag);
// The root's answer: a header, then every rank's listen address. With
// table == nullptr only the header (the first 8 bytes) is checked.
size_t root_reply_bytes(int nranks);
Status parse_root_reply(const uint8_t* in, size_t n, int nranks, std::vector<SockAddr>* table);
// The root's answer to a hello of this job that it refuses (a rank count
// that differs, a rank that joined twice) in place of the reply: a magic of
// its own, the reason's length, then the reason, so the refused rank can say
// why at once. parse_refusal_header reads an answer's first 8 bytes: a
// refusal sets *refused and *reason_bytes (at most kMaxRefusalBytes), anything
// else is left to parse_root_reply. refusal_reason turns the reason's bytes
// into text, each byte that is not printable ASCII made '?', so a garbled
// frame cannot garble the error or the log.
constexpr size_t kMaxRefusalBytes = 512;
std::vector<uint8_t> encode_refusal(const std::string& why);
Status parse_refusal_header(const uint8_t* in, size_t n, bool* refused, size_t* reason_bytes);
std::string refusal_reason(const uint8_t* in, size_t n);

// Tags for point-to-point bootstrap connections.
enum : uint32_t { kTagRing = 1, kTagTcpTransport = 100 };

class Bootstrap {
 public:
  // Joins through the root named by `id`. `ifname` forces the interface (else
  // the one that reaches the root).
  static Status join(const UniqueId& id, int rank, int nranks, const std::string& ifname, Deadline deadline,
                     std::unique_ptr<Bootstrap>* out);
  // A new listener on this rank's interface, for a communicator made by split.
  Status open_listener(int* fd, SockAddr* addr) const;
  // Builds a bootstrap from known listen addresses (comm split): takes
  // ownership of listen_fd, then connects the ring. It is attached to
  // `cancel` (if any) before it waits; the caller detaches it before it
  // frees it, and on failure from_table does.
  static Status from_table(int rank, const JobToken& token, int listen_fd, const SockAddr& listen_addr,
                           std::vector<SockAddr> table, Deadline deadline, SetupCancel* cancel,
                           std::unique_ptr<Bootstrap>* out);
  ~Bootstrap();

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  const JobToken& token() const { return token_; }
  const SockAddr& listen_address() const { return listen_addr_; }

  // Every rank contributes `bytes` bytes; out gets nranks * bytes in rank order.
  Status all_gather(const void* mine, size_t bytes, std::vector<uint8_t>* out, Deadline deadline);
  Status barrier(Deadline deadline);
  // Fails an exchange in progress on another thread, and every later one,
  // with `why` (braid_comm_abort during a comm_split): its sockets are shut
  // down, which wakes their waits.
  void abort(const Status& why);
  // OK unless aborted; then why (for waits outside the bootstrap that
  // belong to the same setup).
  Status abort_status() const { return aborted_.load(std::memory_order_acquire) ? abort_why_ : Status::ok(); }

  // A fresh connected socket to `peer`, for `tag`; the peer calls
  // accept_from_peer with the same tag. The connector sends a hello with the
  // job token and does not wait for an answer, so rings of connects cannot
  // deadlock; the acceptor drops (and logs) connections without the token.
  // Every rank listens before the root's table names it, so a refused
  // connect means the peer is gone: an error at once, not a retry. The
  // acceptor fails early too where the peer is gone (its listener refuses
  // a probe) or a ring neighbour closed its connection (it failed).
  Status connect_to_peer(int peer, uint32_t tag, Deadline deadline, int* fd);
  Status accept_from_peer(int peer, uint32_t tag, Deadline deadline, int* fd);

 private:
  Bootstrap() = default;
  Status connect_ring(Deadline deadline);
  Status ring_all_gather(const void* mine, size_t bytes, std::vector<uint8_t>* out, Deadline deadline);

  int rank_ = 0;
  int nranks_ = 1;
  JobToken token_{};
  int listen_fd_ = -1;
  SockAddr listen_addr_;
  std::vector<SockAddr> peers_;  // listen address of every rank
  // Atomic: abort() on another thread shuts them down while a split's ring
  // may still be connecting (see connect_ring).
  std::atomic<int> ring_next_fd_{-1};
  std::atomic<int> ring_prev_fd_{-1};
  // Connections accepted while waiting for another (peer, tag).
  std::map<std::pair<int, uint32_t>, int> parked_;
  // Accepted connections whose hello is still arriving: read side by side,
  // so a silent stranger cannot hold up the ranks behind it.
  struct Handshake {
    int fd;
    Deadline deadline;
    std::array<uint8_t, kPeerHelloBytes> hello;
    size_t got;
  };
  std::vector<Handshake> handshakes_;
  Status broken_;  // why an all_gather failed; every later one fails so
  std::atomic<bool> aborting_{false}, aborted_{false};
  Status abort_why_;  // written before aborted_ is set
  // Reads what arrived on handshakes_[i]; parks or drops it once complete,
  // dropped, or out of time. Returns whether it left the list.
  bool advance_handshake(size_t i, bool readable);
  std::mutex mu_;
};

}  // namespace braid
