#include "src/core/bootstrap.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "src/core/fork_guard.h"
#include "src/core/logging.h"

namespace braid {
namespace {

constexpr uint32_t kMagic = 0x31445242;  // "BRD1"
constexpr uint16_t kIdVersion = 1;
constexpr uint32_t kKindRootHello = 1;
constexpr uint32_t kKindPeerHello = 2;
constexpr uint32_t kRefusalMagic = 0x31465242;  // "BRF1"
// A connection must finish its handshake this fast, so a silent stranger
// cannot stall the root or a rank's accept.
constexpr double kHandshakeSeconds = 5.0;
// A joined rank waits this much past its own deadline for the root's
// answer: a root that gives up (at its deadline, which started first) then
// gets to say why before the rank stops listening.
constexpr double kRootAnswerGraceSeconds = 2.0;
// Roots of this process telling their joined ranks why they gave up. A rank
// of this process that got such an answer waits for them before returning:
// its caller may exit, which would end the root before the others are told.
std::atomic<int> g_roots_answering{0};

struct RootHello {
  uint32_t magic;
  uint32_t kind;
  uint8_t token[kTokenBytes];
  uint32_t rank;
  uint32_t nranks;
  uint8_t addr[SockAddr::kWireBytes];
};

struct PeerHello {
  uint32_t magic;
  uint32_t kind;
  uint8_t token[kTokenBytes];
  uint32_t rank;
  uint32_t tag;
};

static_assert(sizeof(RootHello) == kRootHelloBytes && sizeof(PeerHello) == kPeerHelloBytes,
              "hello layouts are wire formats");

// The root: one job's rendezvous, then exit.
class RendezvousRoot {
 public:
  RendezvousRoot(int fd, JobToken token, double timeout_s)
      : listen_fd_(fd), token_(token), timeout_s_(timeout_s) {}
  void run();

 private:
  struct Client {
    int fd;
    Deadline handshake;
    RootHello hello;
    size_t got = 0;
  };
  void drop(size_t i, const char* why);
  Status accept_hello(const RootHello& h, int fd);
  void refuse(int fd, const std::string& why);
  void refuse_joined(int rank0_nranks);
  std::string missing_ranks() const;  // "ranks 3, 7 of 8 did not join ..."

  int listen_fd_;
  JobToken token_;
  double timeout_s_;
  std::vector<Client> pending_;
  // Out of descriptors, accepting waits until fewer connections than then
  // are in their handshake (SIZE_MAX: not out).
  size_t accept_below_ = SIZE_MAX;
  int nranks_ = -1;
  std::vector<int> rank_fd_;
  std::vector<SockAddr> rank_addr_;
  int joined_ = 0;
  std::string last_refusal_;  // why the root last refused a rank of this job
};

void RendezvousRoot::drop(size_t i, const char* why) {
  BRAID_WARN("BOOTSTRAP", -1, "rendezvous root dropped a connection: %s", why);
  close(pending_[i].fd);
  pending_.erase(pending_.begin() + static_cast<long>(i));
}

// Why a rank whose count of ranks is not the job's is refused.
std::string other_count(int rank, int said, int others) {
  return "rank " + std::to_string(rank) + " says the job has " + std::to_string(said) +
         " ranks, others said " + std::to_string(others);
}

Status RendezvousRoot::accept_hello(const RootHello& h, int fd) {
  RootHelloFields f;
  BRAID_RETURN_IF_ERROR(parse_root_hello(reinterpret_cast<const uint8_t*>(&h), sizeof(h), token_, &f));
  // Rank 0's count is the job's. One taken from a rank that came first
  // gives way to it, and the ranks that joined with it are refused: which
  // side is refused must not depend on who connected first.
  // A second rank 0 (a stray, or a launcher's mistake) is refused below as
  // one: the rank 0 that joined first keeps its job.
  if (nranks_ >= 0 && f.rank == 0 && f.nranks != nranks_ && rank_fd_[0] < 0) refuse_joined(f.nranks);
  if (nranks_ < 0) {
    nranks_ = f.nranks;
    rank_fd_.assign(nranks_, -1);
    rank_addr_.resize(nranks_);
  }
  if (f.nranks != nranks_) return Status::invalid_argument(other_count(f.rank, f.nranks, nranks_));
  if (rank_fd_[f.rank] >= 0)
    return Status::invalid_argument("rank " + std::to_string(f.rank) + " joined twice");
  rank_fd_[f.rank] = fd;
  rank_addr_[f.rank] = f.addr;
  ++joined_;
  return Status::ok();
}

void RendezvousRoot::refuse(int fd, const std::string& why) {
  const std::vector<uint8_t> refusal = encode_refusal(why);
  (void)send_all(fd, refusal.data(), refusal.size(), Deadline::after_seconds(kHandshakeSeconds));
  close(fd);
  // The job may still form (the refused one was a stray process), but if
  // it does not, the others learn of this too.
  last_refusal_ = why;
}

void RendezvousRoot::refuse_joined(int rank0_nranks) {
  for (int r = 0; r < nranks_; ++r) {
    if (rank_fd_[r] < 0) continue;
    const std::string why = other_count(r, nranks_, rank0_nranks);
    BRAID_WARN("BOOTSTRAP", -1, "rendezvous root rejected a connection: %s", why.c_str());
    refuse(rank_fd_[r], why);
  }
  nranks_ = -1;
  joined_ = 0;
  rank_fd_.clear();
  rank_addr_.clear();
}

std::string RendezvousRoot::missing_ranks() const {
  if (nranks_ < 0) return "no rank joined the rendezvous";
  std::string list;
  int missing = 0;
  for (int r = 0; r < nranks_; ++r) {
    if (rank_fd_[r] >= 0) continue;
    if (++missing <= 8) list += (list.empty() ? "" : ", ") + std::to_string(r);
  }
  if (missing > 8) list += ", ... (" + std::to_string(missing) + " in all)";
  return (missing == 1 ? "rank " : "ranks ") + list + " of " + std::to_string(nranks_) +
         " did not join the rendezvous";
}

void RendezvousRoot::run() {
  Deadline job_deadline = Deadline::after_seconds(timeout_s_);
  Status gave_up;  // why the ranks that joined get no table
  while (nranks_ < 0 || joined_ < nranks_) {
    if (job_deadline.expired()) {
      gave_up = Status::timeout(missing_ranks() + " within " + std::to_string(static_cast<int>(timeout_s_)) +
                                " s (BRAID_TIMEOUT); are they started, with the same id and nranks?" +
                                (last_refusal_.empty() ? "" : " Refused meanwhile: " + last_refusal_));
      break;
    }
    std::vector<pollfd> fds;
    // Out of descriptors with connections still in their handshake (a flood
    // of silent strangers, say), accepting waits until one of them goes.
    const bool accepting = pending_.size() < accept_below_;
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
    for (auto& c : pending_) fds.push_back({c.fd, POLLIN, 0});
    int rc = poll(fds.data(), fds.size(), job_deadline.remaining_ms(100));
    if (rc < 0 && errno != EINTR) break;
    if (fds[0].revents & POLLIN) {
      int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        guard_socket_from_children(fd);
        accept_below_ = SIZE_MAX;
        pending_.push_back({fd, Deadline::after_seconds(kHandshakeSeconds), {}, 0});
      } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // The connection stays queued and the socket readable: retrying
        // at once would spin. Connections in their handshake finish it or
        // are dropped within the handshake time, freeing descriptors; with
        // none, only joined ranks hold them (one each, until all joined).
        if (pending_.empty()) {
          gave_up = Status::system("the rendezvous root could not accept a connection after " +
                                       std::to_string(joined_) + " ranks joined",
                                   errno);
          break;
        }
        accept_below_ = pending_.size();
      }
    }
    for (size_t i = pending_.size(); i-- > 0;) {
      Client& c = pending_[i];
      if (fds.size() > i + 1 && (fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) {
        ssize_t n =
            recv(c.fd, reinterpret_cast<char*>(&c.hello) + c.got, sizeof(RootHello) - c.got, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          drop(i, "closed before finishing its hello");
          continue;
        }
        if (n > 0) c.got += static_cast<size_t>(n);
        if (c.got == sizeof(RootHello)) {
          int fd = c.fd;
          RootHello h = c.hello;
          pending_.erase(pending_.begin() + static_cast<long>(i));
          if (Status st = accept_hello(h, fd); !st) {
            BRAID_WARN("BOOTSTRAP", -1, "rendezvous root rejected a connection: %s", st.message().c_str());
            // A rank of this job is told why; a stranger is not answered.
            const bool ours = h.magic == kMagic && std::memcmp(h.token, token_.data(), kTokenBytes) == 0;
            if (ours)
              refuse(fd, st.message());
            else
              close(fd);
          }
          continue;
        }
      }
      if (c.handshake.expired()) drop(i, "no complete hello within the handshake time");
    }
  }
  if (!gave_up.is_ok()) {
    BRAID_WARN("BOOTSTRAP", -1, "rendezvous root gave up: %s", gave_up.message().c_str());
    // Each rank that joined learns why, rather than only that the root hung up.
    const std::vector<uint8_t> refusal = encode_refusal(gave_up.message());
    g_roots_answering.fetch_add(1);
    for (int fd : rank_fd_)
      if (fd >= 0)
        (void)send_all(fd, refusal.data(), refusal.size(), Deadline::after_seconds(kHandshakeSeconds));
    g_roots_answering.fetch_sub(1);
  } else if (nranks_ > 0 && joined_ == nranks_) {
    std::vector<uint8_t> reply(root_reply_bytes(nranks_));
    uint32_t hdr[2] = {kMagic, static_cast<uint32_t>(nranks_)};
    std::memcpy(reply.data(), hdr, 8);
    for (int r = 0; r < nranks_; ++r) rank_addr_[r].to_wire(reply.data() + 8 + r * SockAddr::kWireBytes);
    for (int r = 0; r < nranks_; ++r) {
      Status st =
          send_all(rank_fd_[r], reply.data(), reply.size(), Deadline::after_seconds(kHandshakeSeconds));
      if (!st)
        BRAID_WARN("BOOTSTRAP", -1, "rendezvous root could not answer rank %d: %s", r, st.message().c_str());
    }
  }
  for (int fd : rank_fd_)
    if (fd >= 0) close(fd);
  for (auto& c : pending_) close(c.fd);
  close(listen_fd_);
}

}  // namespace

namespace {

// What both hellos start with: their size, braid's magic, the kind, and this
// job's token.
template <class Hello>
Status read_hello(const uint8_t* in, size_t n, uint32_t kind, const JobToken& token, Hello* h) {
  if (n != sizeof(Hello)) return Status::invalid_argument("a hello of " + std::to_string(n) + " bytes");
  std::memcpy(h, in, sizeof(Hello));
  if (h->magic != kMagic || h->kind != kind) return Status::invalid_argument("not a braid hello");
  if (std::memcmp(h->token, token.data(), kTokenBytes) != 0)
    return Status::invalid_argument("wrong job token (another job, or a stranger)");
  return Status::ok();
}

}  // namespace

Status parse_root_hello(const uint8_t* in, size_t n, const JobToken& token, RootHelloFields* out) {
  RootHello h{};
  BRAID_RETURN_IF_ERROR(read_hello(in, n, kKindRootHello, token, &h));
  if (h.nranks == 0 || h.nranks > static_cast<uint32_t>(kMaxRanks) || h.rank >= h.nranks)
    return Status::invalid_argument("rank " + std::to_string(h.rank) + " of " + std::to_string(h.nranks) +
                                    " is out of range");
  BRAID_RETURN_IF_ERROR(SockAddr::from_wire(h.addr, &out->addr).with_context("the hello's address"));
  out->rank = static_cast<int>(h.rank);
  out->nranks = static_cast<int>(h.nranks);
  return Status::ok();
}

Status parse_peer_hello(const uint8_t* in, size_t n, const JobToken& token, int nranks, int* rank,
                        uint32_t* tag) {
  PeerHello h{};
  BRAID_RETURN_IF_ERROR(read_hello(in, n, kKindPeerHello, token, &h));
  if (h.rank >= static_cast<uint32_t>(nranks))
    return Status::invalid_argument("rank " + std::to_string(h.rank) + " is out of range");
  *rank = static_cast<int>(h.rank);
  *tag = h.tag;
  return Status::ok();
}

size_t root_reply_bytes(int nranks) {
  return 8 + static_cast<size_t>(nranks) * SockAddr::kWireBytes;
}

Status parse_root_reply(const uint8_t* in, size_t n, int nranks, std::vector<SockAddr>* table) {
  uint32_t hdr[2] = {0, 0};
  if (n < sizeof(hdr)) return Status::remote("the rendezvous root's answer is truncated");
  std::memcpy(hdr, in, sizeof(hdr));
  if (hdr[0] != kMagic || static_cast<int>(hdr[1]) != nranks)
    return Status::remote("the rendezvous root answered with a bad header (another job on that port?)");
  if (table == nullptr) return Status::ok();
  if (n != root_reply_bytes(nranks))
    return Status::remote("the rendezvous root's answer has the wrong length");
  table->assign(static_cast<size_t>(nranks), SockAddr());
  for (int r = 0; r < nranks; ++r) {
    Status st = SockAddr::from_wire(in + sizeof(hdr) + r * SockAddr::kWireBytes, &(*table)[r]);
    if (!st) return st.with_context("the rendezvous root's address of rank " + std::to_string(r));
  }
  return Status::ok();
}

std::vector<uint8_t> encode_refusal(const std::string& why) {
  const uint32_t len = static_cast<uint32_t>(std::min<size_t>(why.size(), kMaxRefusalBytes));
  std::vector<uint8_t> out(8 + len);
  const uint32_t hdr[2] = {kRefusalMagic, len};
  std::memcpy(out.data(), hdr, 8);
  std::memcpy(out.data() + 8, why.data(), len);
  return out;
}

Status parse_refusal_header(const uint8_t* in, size_t n, bool* refused, size_t* reason_bytes) {
  *refused = false;
  *reason_bytes = 0;
  uint32_t hdr[2] = {0, 0};
  if (n < sizeof(hdr)) return Status::remote("the rendezvous root's answer is truncated");
  std::memcpy(hdr, in, sizeof(hdr));
  if (hdr[0] != kRefusalMagic) return Status::ok();
  if (hdr[1] > kMaxRefusalBytes)
    return Status::remote("the rendezvous root's refusal announces " + std::to_string(hdr[1]) +
                          " bytes of reason, more than the " + std::to_string(kMaxRefusalBytes) +
                          " a root sends");
  *refused = true;
  *reason_bytes = hdr[1];
  return Status::ok();
}

std::string refusal_reason(const uint8_t* in, size_t n) {
  return printable_text(reinterpret_cast<const char*>(in), std::min<size_t>(n, kMaxRefusalBytes));
}

void UniqueId::encode(void* out128) const {
  uint8_t* p = static_cast<uint8_t*>(out128);
  std::memset(p, 0, 128);
  std::memcpy(p, &kMagic, 4);
  std::memcpy(p + 4, &kIdVersion, 2);
  root.to_wire(p + 8);
  std::memcpy(p + 8 + SockAddr::kWireBytes, token.data(), kTokenBytes);
}

Status UniqueId::decode(const void* in128, UniqueId* out) {
  const uint8_t* p = static_cast<const uint8_t*>(in128);
  uint32_t magic = 0;
  uint16_t version = 0;
  std::memcpy(&magic, p, 4);
  std::memcpy(&version, p + 4, 2);
  if (magic != kMagic || version != kIdVersion)
    return Status::invalid_argument(
        "id is not a braid unique id (bad magic or version); make it with braid_get_unique_id");
  UniqueId u;
  Status st = SockAddr::from_wire(p + 8, &u.root);
  if (!st) return st.with_context("id");
  std::memcpy(u.token.data(), p + 8 + SockAddr::kWireBytes, kTokenBytes);
  *out = u;
  return Status::ok();
}

JobToken random_token() {
  JobToken t{};
  size_t got = 0;
  while (got < t.size()) {
    const ssize_t n = getrandom(t.data() + got, t.size() - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      break;  // never clears: a kernel without getrandom, or a seccomp filter that refuses it
    }
  }
  if (got < t.size()) {
    const int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    while (fd >= 0 && got < t.size()) {
      const ssize_t n = read(fd, t.data() + got, t.size() - got);
      if (n > 0) {
        got += static_cast<size_t>(n);
      } else if (n == 0 || errno != EINTR) {
        break;
      }
    }
    if (fd >= 0) close(fd);
  }
  if (got < t.size()) {
    // No source of randomness at all. A token keeps other jobs' strays
    // out; one drawn from the clocks and the pid still tells jobs apart.
    BRAID_WARN("BOOTSTRAP", -1,
               "neither getrandom nor /dev/urandom is available (%s): the job token is "
               "drawn from the clock and the pid",
               std::strerror(errno));
    uint64_t x = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                 (static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) << 1) ^
                 (static_cast<uint64_t>(getpid()) << 40) ^ reinterpret_cast<uintptr_t>(&t);
    for (; got < t.size(); ++got) {
      x += 0x9e3779b97f4a7c15ull;  // splitmix64
      uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      t[got] = static_cast<uint8_t>(z ^ (z >> 31));
    }
  }
  return t;
}

std::string token_hex(const JobToken& t, size_t bytes) {
  static const char* kHex = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < bytes && i < t.size(); ++i) {
    s += kHex[t[i] >> 4];
    s += kHex[t[i] & 15];
  }
  return s;
}

Status start_rendezvous_root(const SockAddr& listen_addr, const JobToken& token, double timeout_s,
                             SockAddr* bound) {
  int fd = -1;
  BRAID_RETURN_IF_ERROR(listen_on(listen_addr, 1024, &fd, bound));
  std::thread([fd, token, timeout_s] { RendezvousRoot(fd, token, timeout_s).run(); }).detach();
  return Status::ok();
}

Bootstrap::~Bootstrap() {
  for (std::atomic<int>* ring : {&ring_next_fd_, &ring_prev_fd_}) {
    int fd = ring->exchange(-1);
    close_fd(&fd);
  }
  close_fd(&listen_fd_);
  for (auto& [key, fd] : parked_) close(fd);
  for (Handshake& h : handshakes_) close(h.fd);
}

Status Bootstrap::join(const UniqueId& id, int rank, int nranks, const std::string& ifname, Deadline deadline,
                       std::unique_ptr<Bootstrap>* out) {
  std::unique_ptr<Bootstrap> b(new Bootstrap());
  b->rank_ = rank;
  b->nranks_ = nranks;
  b->token_ = id.token;
  SockAddr local;
  if (!ifname.empty()) {
    BRAID_RETURN_IF_ERROR(choose_local_address(ifname, &local));
  } else {
    BRAID_RETURN_IF_ERROR(local_address_toward(id.root, &local));
  }
  local.set_port(0);
  BRAID_RETURN_IF_ERROR(listen_on(local, 1024, &b->listen_fd_, &b->listen_addr_));

  int fd = -1;
  Status st = connect_to(id.root, deadline, &fd);
  if (!st) return st.with_context("rank " + std::to_string(rank) + " joining the rendezvous root");
  RootHello h{};
  h.magic = kMagic;
  h.kind = kKindRootHello;
  std::memcpy(h.token, id.token.data(), kTokenBytes);
  h.rank = static_cast<uint32_t>(rank);
  h.nranks = static_cast<uint32_t>(nranks);
  b->listen_addr_.to_wire(h.addr);
  st = send_all(fd, &h, sizeof(h), deadline);
  // The header first: a wrong one (another job) must not make us wait for
  // a table that never comes.
  std::vector<uint8_t> reply(root_reply_bytes(nranks));
  const Deadline answer_deadline = deadline.later_by(kRootAnswerGraceSeconds);
  if (st) st = recv_all(fd, reply.data(), 8, answer_deadline);
  bool refused = false;
  size_t reason_bytes = 0;
  if (st) st = parse_refusal_header(reply.data(), 8, &refused, &reason_bytes);
  if (st && refused) {
    std::vector<uint8_t> why(reason_bytes);
    st = recv_all(fd, why.data(), why.size(), answer_deadline);
    close(fd);
    const Deadline others_told = Deadline::after_seconds(kHandshakeSeconds);
    while (g_roots_answering.load() > 0 && !others_told.expired())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!st)
      return st.with_context("rank " + std::to_string(rank) + " reading the rendezvous root's refusal");
    return Status::invalid_argument("the rendezvous root at " + id.root.str() + " refused rank " +
                                    std::to_string(rank) + ": " + refusal_reason(why.data(), why.size()));
  }
  if (st) st = parse_root_reply(reply.data(), 8, nranks, nullptr);
  if (st) st = recv_all(fd, reply.data() + 8, reply.size() - 8, answer_deadline);
  if (st) st = parse_root_reply(reply.data(), reply.size(), nranks, &b->peers_);
  close(fd);
  if (!st)
    return st.with_context("rank " + std::to_string(rank) + " waiting for the rendezvous root at " +
                           id.root.str() + " (do all " + std::to_string(nranks) +
                           " ranks use the same id and nranks?)");
  BRAID_RETURN_IF_ERROR(b->connect_ring(deadline));
  *out = std::move(b);
  return Status::ok();
}

Status Bootstrap::open_listener(int* fd, SockAddr* addr) const {
  SockAddr local = listen_addr_;
  local.set_port(0);
  return listen_on(local, 1024, fd, addr);
}

Status Bootstrap::from_table(int rank, const JobToken& token, int listen_fd, const SockAddr& listen_addr,
                             std::vector<SockAddr> table, Deadline deadline, SetupCancel* cancel,
                             std::unique_ptr<Bootstrap>* out) {
  std::unique_ptr<Bootstrap> b(new Bootstrap());
  b->rank_ = rank;
  b->nranks_ = static_cast<int>(table.size());
  b->token_ = token;
  b->listen_fd_ = listen_fd;
  b->listen_addr_ = listen_addr;
  b->peers_ = std::move(table);
  if (cancel != nullptr) cancel->attach([raw = b.get()](const Status& why) { raw->abort(why); });
  Status st = b->connect_ring(deadline);
  if (!st) {
    if (cancel != nullptr) cancel->detach_all();
    Status why = b->abort_status();
    return why.is_ok() ? st : why;
  }
  *out = std::move(b);
  return Status::ok();
}

Status Bootstrap::connect_ring(Deadline deadline) {
  if (nranks_ == 1) return Status::ok();
  int next = (rank_ + 1) % nranks_;
  int prev = (rank_ + nranks_ - 1) % nranks_;
  // An abort on another thread stores aborted_ and then reads the fds; here
  // each fd is stored and then aborted_ read: one side sees the other, so
  // no connection made during an abort is left open to wait on.
  auto keep = [this](std::atomic<int>* slot, int fd) {
    slot->store(fd);
    if (aborted_.load()) shutdown(fd, SHUT_RDWR);
  };
  int fd = -1;
  BRAID_RETURN_IF_ERROR(connect_to_peer(next, kTagRing, deadline, &fd));
  keep(&ring_next_fd_, fd);
  BRAID_RETURN_IF_ERROR(accept_from_peer(prev, kTagRing, deadline, &fd));
  keep(&ring_prev_fd_, fd);
  return abort_status();
}

Status Bootstrap::connect_to_peer(int peer, uint32_t tag, Deadline deadline, int* fd_out) {
  int fd = -1;
  Status st = connect_to(peers_[peer], deadline, &fd, /*retry_refused=*/false, &aborted_);
  if (!st && aborted_.load()) return abort_why_;
  if (!st)
    return st.with_context("rank " + std::to_string(rank_) + " connecting to rank " + std::to_string(peer));
  PeerHello h{kMagic, kKindPeerHello, {}, static_cast<uint32_t>(rank_), tag};
  std::memcpy(h.token, token_.data(), kTokenBytes);
  st = send_all(fd, &h, sizeof(h), deadline);
  if (!st) {
    close(fd);
    // A peer that gave up between our connect and hello resets the
    // connection: say so, as the other ways of seeing a peer go do.
    return st.with_context("rank " + std::to_string(rank_) + " handshake with rank " + std::to_string(peer) +
                           " at " + peers_[peer].str() +
                           " (it closed the connection: it exited or gave up; its own error says why)");
  }
  *fd_out = fd;
  return Status::ok();
}

bool Bootstrap::advance_handshake(size_t i, bool readable) {
  Handshake& h = handshakes_[i];
  const char* dropped = nullptr;
  if (readable) {
    ssize_t n = recv(h.fd, h.hello.data() + h.got, h.hello.size() - h.got, MSG_DONTWAIT);
    if (n > 0) h.got += static_cast<size_t>(n);
    // A connection closed before any byte is a peer's liveness probe (or a
    // port scan): nothing to report.
    if (n == 0) dropped = h.got == 0 ? "" : "closed before finishing its hello";
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) dropped = std::strerror(errno);
  }
  if (dropped == nullptr && h.got == h.hello.size()) {
    int from = -1;
    uint32_t their_tag = 0;
    Status st = parse_peer_hello(h.hello.data(), h.hello.size(), token_, nranks_, &from, &their_tag);
    if (!st) {
      BRAID_WARN("BOOTSTRAP", rank_, "dropped a connection with a bad handshake: %s", st.message().c_str());
      close(h.fd);
    } else if (Status blocking = set_nonblocking(h.fd, false); !blocking) {
      BRAID_WARN("BOOTSTRAP", rank_, "dropped rank %d's connection: %s", from, blocking.message().c_str());
      close(h.fd);
    } else if (!parked_.try_emplace({from, their_tag}, h.fd).second) {
      // A rank connects once per tag, so a second hello for a (rank, tag)
      // that already waits is not one this rank will take: it is closed,
      // and the first connection's descriptor is kept.
      BRAID_WARN("BOOTSTRAP", rank_, "dropped a second connection from rank %d for tag %u", from, their_tag);
      close(h.fd);
    }
    handshakes_.erase(handshakes_.begin() + static_cast<long>(i));
    return true;
  }
  if (dropped == nullptr && h.deadline.expired()) dropped = "no complete hello within the handshake time";
  if (dropped == nullptr) return false;
  if (*dropped != '\0')
    BRAID_WARN("BOOTSTRAP", rank_, "dropped a connection with a bad or missing handshake: %s", dropped);
  close(h.fd);
  handshakes_.erase(handshakes_.begin() + static_cast<long>(i));
  return true;
}

Status Bootstrap::accept_from_peer(int peer, uint32_t tag, Deadline deadline, int* fd_out) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto waiting = [&] {
    return "rank " + std::to_string(rank_) + " waiting for rank " + std::to_string(peer) + " to connect";
  };
  // Whether the peer still listens: a connect it refuses means it is gone.
  // The first after a short wait (the peer may just be slow), then each second.
  struct Probe {
    int fd = -1;
    Deadline next = Deadline::after_seconds(0.2);
    ~Probe() {
      if (fd >= 0) close(fd);
    }
  } probe;
  auto gone = [&] {
    return Status::remote(waiting() + ": its listener at " + peers_[peer].str() +
                          " refuses connections (it exited or gave up; its own error says why)");
  };
  for (;;) {
    if (auto it = parked_.find({peer, tag}); it != parked_.end()) {
      *fd_out = it->second;
      parked_.erase(it);
      return Status::ok();
    }
    if (aborted_.load(std::memory_order_acquire)) return abort_why_;
    if (deadline.expired()) return Status::timeout(waiting() + ": timed out");
    if (probe.next.expired()) {
      if (probe.fd >= 0) close(probe.fd);  // unanswered: try afresh
      probe.fd = socket(peers_[peer].family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      guard_socket_from_children(probe.fd);
      if (probe.fd >= 0 && connect(probe.fd, peers_[peer].sa(), peers_[peer].len) != 0 &&
          errno != EINPROGRESS) {
        const bool refused = errno == ECONNREFUSED;
        close(probe.fd);
        probe.fd = -1;
        if (refused) return gone();
      }
      probe.next = Deadline::after_seconds(1.0);
    }
    std::vector<pollfd> fds;
    fds.push_back({listen_fd_, POLLIN, 0});
    // A ring neighbour that failed (or died) closes its end: its error
    // reaches the rest of the job along the ring.
    const int ring[2] = {ring_prev_fd_, ring_next_fd_};
    for (int fd : ring) fds.push_back({fd, POLLRDHUP, 0});  // fd -1: ignored by poll
    fds.push_back({probe.fd, POLLOUT, 0});
    const size_t first_handshake = fds.size();
    for (const Handshake& h : handshakes_) fds.push_back({h.fd, POLLIN, 0});
    const int rc = poll(fds.data(), fds.size(), deadline.remaining_ms(100));
    if (rc < 0 && errno != EINTR) return Status::system("poll", errno).with_context(waiting());
    // In order of arrival: of two hellos for one (rank, tag), the first is kept.
    std::vector<bool> readable(handshakes_.size(), false);
    for (size_t i = 0; rc > 0 && i < readable.size(); ++i)
      readable[i] = (fds[first_handshake + i].revents & (POLLIN | POLLHUP | POLLERR)) != 0;
    for (size_t i = 0, k = 0; k < readable.size(); ++k)
      if (!advance_handshake(i, readable[k])) ++i;
    if (rc <= 0) continue;
    for (int k = 0; k < 2; ++k) {
      if (ring[k] >= 0 && (fds[1 + k].revents & (POLLRDHUP | POLLHUP | POLLERR))) {
        const int neighbour = k == 0 ? (rank_ + nranks_ - 1) % nranks_ : (rank_ + 1) % nranks_;
        return Status::remote(waiting() + ": rank " + std::to_string(neighbour) +
                              ", a bootstrap ring neighbour, closed its connection (it exited or failed; "
                              "its own error says why)");
      }
    }
    if (probe.fd >= 0 && fds[3].revents != 0) {
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(probe.fd, SOL_SOCKET, SO_ERROR, &err, &len);
      close(probe.fd);
      probe.fd = -1;
      if (err == ECONNREFUSED) return gone();
    }
    if (fds[0].revents & POLLIN) {
      for (;;) {
        int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd >= 0) {
          guard_socket_from_children(fd);
          set_nodelay(fd);
          handshakes_.push_back({fd, Deadline::after_seconds(kHandshakeSeconds), {}, 0});
          continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) break;
        return Status::system("accept", errno).with_context(waiting());
      }
    }
  }
}

Status Bootstrap::all_gather(const void* mine, size_t bytes, std::vector<uint8_t>* out, Deadline deadline) {
  // A ring exchange that failed part way leaves bytes in flight: a later
  // one would read them as its own.
  if (!broken_.is_ok()) return broken_;
  Status st =
      aborted_.load(std::memory_order_acquire) ? abort_why_ : ring_all_gather(mine, bytes, out, deadline);
  if (!st && aborted_.load(std::memory_order_acquire)) st = abort_why_;
  if (!st) broken_ = Status(st.code(), "the bootstrap ring failed earlier: " + st.message());
  return st;
}

void Bootstrap::abort(const Status& why) {
  if (aborting_.exchange(true)) return;
  abort_why_ = why;
  aborted_.store(true);
  for (int fd : {ring_next_fd_.load(), ring_prev_fd_.load(), listen_fd_})
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

Status Bootstrap::ring_all_gather(const void* mine, size_t bytes, std::vector<uint8_t>* out,
                                  Deadline deadline) {
  out->assign(bytes * nranks_, 0);
  if (bytes) std::memcpy(out->data() + bytes * rank_, mine, bytes);
  // Ring: at step s pass on the block that originated s ranks back.
  // Errors name the neighbour: a rank that died closes its sockets, and a
  // rank that failed for another reason closes them too, so the survivors'
  // messages point along the ring to where it broke.
  const int next = (rank_ + 1) % nranks_, prev = (rank_ + nranks_ - 1) % nranks_;
  const auto to_next = [&] { return "bootstrap all_gather, sending to rank " + std::to_string(next); };
  const auto from_prev = [&] { return "bootstrap all_gather, receiving from rank " + std::to_string(prev); };
  for (int s = 0; s < nranks_ - 1; ++s) {
    int send_block = (rank_ - s + nranks_) % nranks_;
    int recv_block = (rank_ - s - 1 + nranks_) % nranks_;
    uint64_t len = bytes, peer_len = 0;
    BRAID_RETURN_IF_ERROR(send_all(ring_next_fd_, &len, sizeof(len), deadline).with_context(to_next()));
    if (bytes)
      BRAID_RETURN_IF_ERROR(
          send_all(ring_next_fd_, out->data() + bytes * send_block, bytes, deadline).with_context(to_next()));
    BRAID_RETURN_IF_ERROR(
        recv_all(ring_prev_fd_, &peer_len, sizeof(peer_len), deadline).with_context(from_prev()));
    if (peer_len != bytes)
      return Status(BRAID_ERR_MISMATCH, "bootstrap all_gather: rank " + std::to_string(rank_) +
                                            " contributes " + std::to_string(bytes) +
                                            " bytes, its ring neighbour " + std::to_string(peer_len));
    if (bytes)
      BRAID_RETURN_IF_ERROR(recv_all(ring_prev_fd_, out->data() + bytes * recv_block, bytes, deadline)
                                .with_context(from_prev()));
  }
  return Status::ok();
}

Status Bootstrap::barrier(Deadline deadline) {
  std::vector<uint8_t> ignored;
  uint8_t b = 0;
  return all_gather(&b, 1, &ignored, deadline);
}

}  // namespace braid
