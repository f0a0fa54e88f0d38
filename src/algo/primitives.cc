#include "src/algo/primitives.h"

#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cstring>
#include <string>

#include "kernels/cpu/reduce_kernels.h"
#include "src/core/deadline.h"
#include "src/core/dtype.h"
#include "src/core/logging.h"

namespace braid {

void (*test_hook_before_chunk_copy)(bool) = nullptr;

bool send_counted(Connection* c, const void* src, size_t bytes, const CallTag& tag) {
  if (!c->send_from(src, bytes, tag)) return false;
  c->count_moved(bytes);
  return true;
}

namespace {

struct RecvWait {
  Connection* conn;
  const void* data = nullptr;
  size_t bytes = 0;
};
bool recv_check(void* ctx) {
  auto* w = static_cast<RecvWait*>(ctx);
  return w->conn->recv_ready(&w->data, &w->bytes);
}

struct SendWait {
  Connection* conn;
  size_t bytes;
  void* slot = nullptr;
};
bool send_check(void* ctx) {
  auto* w = static_cast<SendWait*>(ctx);
  w->slot = w->conn->send_slot(w->bytes);
  return w->slot != nullptr;
}

struct BothWait {
  RecvWait r;
  SendWait s;
};
bool both_check(void* ctx) {
  auto* w = static_cast<BothWait*>(ctx);
  // Look at the receive first: it frees a slot upstream soonest.
  bool r = w->r.data != nullptr || recv_check(&w->r);
  bool s = w->s.slot != nullptr || send_check(&w->s);
  return r && s;
}

// A receive into the caller's memory (recv_into); the check is idempotent
// once the message is in.
struct IntoWait {
  Connection* conn;
  void* dst;
  size_t bytes;
  const CallTag* tag;
  Connection::Received got = Connection::Received::kNotYet;
};
bool into_check(void* ctx) {
  auto* w = static_cast<IntoWait*>(ctx);
  if (w->got == Connection::Received::kNotYet) w->got = w->conn->recv_into(w->dst, w->bytes, *w->tag);
  return w->got != Connection::Received::kNotYet;
}
bool slot_free(void* ctx) {
  auto* w = static_cast<SendWait*>(ctx);
  return w->conn->send_slot(w->bytes) != nullptr;
}

Until wait_recv(RecvWait* w, int from) {
  return Until{WaitPoint{recv_check, w, from, "for a message from", {w->conn, nullptr}, {POLLIN, 0}}};
}
Until wait_into(IntoWait* w, int from) {
  return Until{WaitPoint{into_check, w, from, "for a message from", {w->conn, nullptr}, {POLLIN, 0}}};
}
Until wait_slot(SendWait* w, int to) {
  return Until{WaitPoint{slot_free, w, to, "for a free slot toward", {w->conn, nullptr}, {POLLOUT, 0}}};
}
Until wait_both(BothWait* w, int from) {
  return Until{WaitPoint{
      both_check, w, from, "for a message and a free slot, from", {w->r.conn, w->s.conn}, {POLLIN, POLLOUT}}};
}

void commit(Connection* c, size_t bytes) {
  c->count_moved(bytes);
  c->commit_send(bytes, current_op()->tag);
}

// The message that arrived from a peer was sent by the same call as this
// op's, and is the piece this op expects next.
bool usable(const Connection* c, size_t got, size_t want) {
  return got == want && c->recv_tag() == current_op()->tag;
}

// `peer` sent `what` (a piece, a message) of another size than this rank
// expects: counts or dtypes differ between the `ranks` of the call.
Status sizes_differ(const std::string& call, int peer, const char* what, size_t got, size_t want,
                    const char* ranks) {
  return Status(BRAID_ERR_MISMATCH, call + ": rank " + std::to_string(peer) + " sent " + what +
                                        std::to_string(got) + " bytes where " + std::to_string(want) +
                                        " were expected (do " + ranks +
                                        " ranks pass the same count and dtype?)");
}

// Why a message was not usable, naming both calls (a differing call is the
// cause most worth telling; a differing piece size follows from counts or
// dtypes that the tag does not see, such as all_to_allv's).
FailOp unusable(const Channel& ch, int from, const Connection* c, size_t got, size_t want,
                const CallTag* expected = nullptr) {
  Op* op = current_op();
  const CallTag& mine = expected != nullptr ? *expected : op->tag;
  const int me = ch.global(ch.rank), peer = ch.global(from);
  const CallTag& theirs = c->recv_tag();
  const std::string call = std::string(op->name) + " #" + std::to_string(op->seq);
  if (!(theirs == mine)) {
    // A message or all_to_allv block of another size, the call otherwise
    // the same: said in bytes.
    const bool p2p = mine.kind == static_cast<uint8_t>(OpKind::kSend);
    const bool resized = theirs.same_call_as(mine);
    if (resized && p2p)
      return FailOp{sizes_differ(call, peer, "a message of ", theirs.count, mine.count, "both")};
    if (resized && mine.kind == static_cast<uint8_t>(OpKind::kAllToAllv)) {
      return FailOp{Status(BRAID_ERR_MISMATCH,
                           call + ": rank " + std::to_string(peer) + " sent a block of " +
                               std::to_string(theirs.count) + " bytes where " + std::to_string(mine.count) +
                               " were expected (its sendcounts[" + std::to_string(me) +
                               "] and this rank's recvcounts[" + std::to_string(peer) + "] differ)")};
    }
    return FailOp{call_mismatch(me, mine, peer, theirs)};
  }
  return FailOp{sizes_differ(call, peer, "a piece of ", got, want, "all")};
}

// The next message from `from` is not the one expected (kOther).
FailOp unexpected(const Channel& ch, int from, Connection* c, size_t want,
                  const CallTag* expected = nullptr) {
  const void* data = nullptr;
  size_t got = 0;
  (void)c->recv_ready(&data, &got);
  return unusable(ch, from, c, got, want, expected);
}

}  // namespace

Channel Channel::subset(const std::vector<int>& members) const {
  Channel c;
  c.piece_bytes = piece_bytes;
  c.nranks = static_cast<int>(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == rank) c.rank = static_cast<int>(i);
    c.conns.push_back(conns[members[i]]);
    c.ranks.push_back(global(members[i]));
  }
  return c;
}

// Each primitive with a Step does its work in the call when it can (a free
// slot, a usable message already in); otherwise its coroutine, which starts
// by checking again, waits and reports what went wrong.
namespace {

Task send_piece_waiting(const Channel& ch, int to, const void* src, size_t bytes) {
  Connection* c = ch.to(to);
  const CallTag& tag = current_op()->tag;
  SendWait w{c, bytes};
  while (!send_counted(c, src, bytes, tag)) co_await wait_slot(&w, ch.global(to));
}

Task recv_piece_waiting(const Channel& ch, int from, void* dst, size_t bytes) {
  IntoWait w{ch.to(from), dst, bytes, &current_op()->tag};
  if (!into_check(&w)) co_await wait_into(&w, ch.global(from));
  if (w.got == Connection::Received::kOther) {
    FailOp fail = unexpected(ch, from, w.conn, bytes);  // named: see checked_call
    co_await fail;
  }
}

// dst = the received piece (in, usable) op local; frees its slot.
void reduce_received(const RecvWait& w, void* dst, const void* local, size_t bytes, braid_dtype_t dtype,
                     braid_redop_t op) {
  kernels::reduce(dtype, op, dst, w.data, local, bytes / dtype_size(dtype));
  w.conn->release_recv();
}

Task recv_reduce_copy_waiting(const Channel& ch, int from, void* dst, const void* local, size_t bytes,
                              braid_dtype_t dtype, braid_redop_t op) {
  RecvWait w{ch.to(from)};
  if (!recv_check(&w)) co_await wait_recv(&w, ch.global(from));
  if (!usable(w.conn, w.bytes, bytes)) {
    FailOp fail = unusable(ch, from, w.conn, w.bytes, bytes);  // named: see checked_call
    co_await fail;
  }
  reduce_received(w, dst, local, bytes, dtype, op);
}

}  // namespace

Step send_piece(const Channel& ch, int to, const void* src, size_t bytes) {
  if (send_counted(ch.to(to), src, bytes, current_op()->tag)) return {};
  return send_piece_waiting(ch, to, src, bytes);
}

Step recv_piece(const Channel& ch, int from, void* dst, size_t bytes) {
  // A payload the transport left half-read is finished by the coroutine,
  // into the same dst (recv_into's contract).
  IntoWait w{ch.to(from), dst, bytes, &current_op()->tag};
  if (into_check(&w) && w.got == Connection::Received::kDone) return {};
  return recv_piece_waiting(ch, from, dst, bytes);
}

Step recv_reduce_copy(const Channel& ch, int from, void* dst, const void* local, size_t bytes,
                      braid_dtype_t dtype, braid_redop_t op) {
  RecvWait w{ch.to(from)};
  if (!recv_check(&w) || !usable(w.conn, w.bytes, bytes))
    return recv_reduce_copy_waiting(ch, from, dst, local, bytes, dtype, op);
  reduce_received(w, dst, local, bytes, dtype, op);
  return {};
}

Task recv_reduce_send(const Channel& ch, int from, int to, const void* local, size_t bytes,
                      braid_dtype_t dtype, braid_redop_t op) {
  BothWait w{{ch.to(from)}, {ch.to(to), bytes}};
  if (!both_check(&w)) co_await wait_both(&w, ch.global(from));
  if (!usable(w.r.conn, w.r.bytes, bytes)) {
    FailOp fail = unusable(ch, from, w.r.conn, w.r.bytes, bytes);  // named: see checked_call
    co_await fail;
  }
  kernels::reduce(dtype, op, w.s.slot, w.r.data, local, bytes / dtype_size(dtype));
  commit(w.s.conn, bytes);
  w.r.conn->release_recv();
}

Task recv_reduce_copy_send(const Channel& ch, int from, int to, void* dst, const void* local, size_t bytes,
                           braid_dtype_t dtype, braid_redop_t op) {
  co_await recv_reduce_copy(ch, from, dst, local, bytes, dtype, op);
  // Sent from dst: a transport that writes from the caller's memory (tcp)
  // then makes no staging copy.
  co_await send_piece(ch, to, dst, bytes);
}

Task recv_copy_send(const Channel& ch, int from, int to, void* dst, size_t bytes) {
  co_await recv_piece(ch, from, dst, bytes);
  co_await send_piece(ch, to, dst, bytes);
}

namespace {

Task send_pieces(const Channel& ch, int to, const void* src, size_t bytes) {
  const char* p = static_cast<const char*>(src);
  size_t n = num_pieces(bytes, ch.piece_bytes);
  for (size_t i = 0; i < n; ++i) {
    size_t off = i * ch.piece_bytes;
    co_await send_piece(ch, to, p + off, std::min(ch.piece_bytes, bytes - off));
  }
}

Task recv_pieces(const Channel& ch, int from, void* dst, size_t bytes) {
  char* p = static_cast<char*>(dst);
  size_t n = num_pieces(bytes, ch.piece_bytes);
  for (size_t i = 0; i < n; ++i) {
    size_t off = i * ch.piece_bytes;
    co_await recv_piece(ch, from, p + off, std::min(ch.piece_bytes, bytes - off));
  }
}

}  // namespace

// A message of one piece is that piece's task: one coroutine frame fewer on
// the path of every small call.
Step send_message(const Channel& ch, int to, const void* src, size_t bytes) {
  if (bytes <= ch.piece_bytes) return send_piece(ch, to, src, bytes);
  return send_pieces(ch, to, src, bytes);
}

Step recv_message(const Channel& ch, int from, void* dst, size_t bytes) {
  if (bytes <= ch.piece_bytes) return recv_piece(ch, from, dst, bytes);
  return recv_pieces(ch, from, dst, bytes);
}

namespace {

// What a send that offers its buffer sends instead of the data.
struct ReadOffer {
  uint64_t addr;   // the sender's buffer, in its address space
  uint64_t bytes;  // its length
};

// An offered send is copied in chunks of this size, a system call each
// (process_vm_readv or _writev): small enough for both ends to share the
// work, and for the kernel to pin few pages at a time (on the development
// VM one read of 64 MiB ran at 3.1 GB/s, the same in 256 KiB pieces at 5.1).
constexpr size_t kCopyChunk = 256 * 1024;

uint64_t copy_chunks(size_t bytes) {
  return (bytes + kCopyChunk - 1) / kCopyChunk;
}

// Claims chunks of the open offer and copies them until none is left: the
// sender writes them into the receiver's buffer, the receiver reads them.
// `local` is this rank's buffer, `remote` the peer's; *copied counts bytes.
Status copy_claimed_chunks(Connection* c, SharedCopy* sc, bool as_sender, char* local, uint64_t remote,
                           size_t bytes, uint64_t* copied) {
  const uint64_t n = copy_chunks(bytes);
  for (;;) {
    const uint64_t k = sc->next.fetch_add(1, std::memory_order_acq_rel);
    if (k >= n) return Status::ok();
    const size_t off = k * kCopyChunk, len = std::min(kCopyChunk, bytes - off);
    // A receiver that failed may have returned and reused its buffer: no
    // write lands there once its failure is known.
    Status st = as_sender ? c->peer_failure() : Status::ok();
    if (st && test_hook_before_chunk_copy != nullptr) test_hook_before_chunk_copy(as_sender);
    if (st)
      st = as_sender ? c->write_peer(remote + off, local + off, len)
                     : c->read_peer(local + off, remote + off, len);
    if (!st) {
      sc->failed.fetch_add(1, std::memory_order_acq_rel);
      // A peer that failed may have freed its buffer: its failure is the
      // cause worth telling, not the EFAULT that followed.
      Status theirs = c->peer_failure();
      return theirs ? st : theirs;
    }
    *copied += len;
    sc->done.fetch_add(1, std::memory_order_acq_rel);
    if (as_sender) c->wake_peer();  // the receiver waits for every chunk
  }
}

struct OfferWait {
  SharedCopy* sc;
  uint64_t number, chunks;
};
// The offer was copied whole, or is open with chunks left to claim.
bool offer_moves(void* ctx) {
  auto* w = static_cast<OfferWait*>(ctx);
  if (w->sc->finished.load(std::memory_order_acquire) >= w->number) return true;
  return w->sc->opened.load(std::memory_order_acquire) == w->number &&
         w->sc->next.load(std::memory_order_relaxed) < w->chunks;
}

bool every_chunk_copied(void* ctx) {
  auto* w = static_cast<OfferWait*>(ctx);
  return w->sc->done.load(std::memory_order_acquire) >= w->chunks;
}

// Past every chunk number: a claim returns at least this once claims closed.
constexpr uint64_t kClaimsClosed = 1ull << 62;
// How long a failing receive waits for the sender's chunks in flight: a
// chunk takes tens of microseconds, or a few time slices where ranks
// outnumber cores; a sender stopped for longer (a debugger) is left behind.
constexpr double kTakeBackSeconds = 5.0;

struct OpenedOffer {
  Connection* conn;
  SharedCopy* sc;
  uint64_t chunks;
  int rank, sender;  // for the log
};

// A receive that opened an offer fails (its deadline, an abort, another
// peer's failure, a copy that failed): it returns, and its program may
// reuse the buffer at once, so no write of the sender may land after that.
// The sender checks this rank's failure mark before each chunk, but a chunk
// it claimed just before the mark was set may still be on its way: close
// the claims, then wait until each claimed chunk is copied or failed, or
// the sender failed or exited (its driver marks its failure between chunks,
// never during one).
void take_back_buffer(void* ctx) {
  auto* o = static_cast<OpenedOffer*>(ctx);
  SharedCopy* sc = o->sc;
  const uint64_t claimed = std::min(sc->next.exchange(kClaimsClosed, std::memory_order_acq_rel), o->chunks);
  const Deadline until = Deadline::after_seconds(kTakeBackSeconds);
  for (int spins = 0;
       sc->done.load(std::memory_order_acquire) + sc->failed.load(std::memory_order_acquire) < claimed;
       ++spins) {
    if (!o->conn->check_peer(true)) return;
    if (until.expired()) {
      BRAID_WARN("P2P", o->rank,
                 "a failed receive returns while rank %d may still write a chunk into its buffer "
                 "(in %.0f s the sender neither finished the chunk nor failed)",
                 o->sender, kTakeBackSeconds);
      return;
    }
    if (spins < 64) {
      sched_yield();
    } else {
      usleep(50);
    }
  }
}

}  // namespace

Task send_by_offer(const Channel& ch, int to, const void* src, size_t bytes) {
  Connection* c = ch.to(to);
  SharedCopy* sc = c->shared_copy(true);
  OfferWait w{sc, c->number_offer_sent(), copy_chunks(bytes)};
  const ReadOffer offer{reinterpret_cast<uint64_t>(src), bytes};
  co_await send_piece(ch, to, &offer, sizeof(offer));
  for (;;) {
    if (!offer_moves(&w))
      co_await Until{
          WaitPoint{offer_moves, &w, ch.global(to), "for its buffer to be copied by", {c, nullptr}, {0, 0}}};
    if (sc->finished.load(std::memory_order_acquire) >= w.number) co_return;
    // The receiver opened it: help copy while chunks are left.
    uint64_t written = 0;
    Status st = copy_claimed_chunks(c, sc, true, static_cast<char*>(const_cast<void*>(src)),
                                    sc->dst.load(std::memory_order_relaxed), bytes, &written);
    c->count_moved(written);
    if (!st) {
      FailOp fail{st};  // named: see checked_call
      co_await fail;
    }
  }
}

Task recv_or_read(const Channel& ch, int from, void* dst, size_t bytes) {
  RecvWait rw{ch.to(from)};
  if (!recv_check(&rw)) co_await wait_recv(&rw, ch.global(from));
  Connection* c = rw.conn;
  if (c->recv_tag().path != CallTag::kReadPath) {
    co_await recv_message(ch, from, dst, bytes);  // it sent the data
    co_return;
  }
  Op* op = current_op();
  CallTag expected = op->tag;
  expected.path = CallTag::kReadPath;
  // A size that differs is named below, in bytes.
  if (!c->recv_tag().same_call_as(expected) || rw.bytes != sizeof(ReadOffer)) {
    FailOp fail{call_mismatch(ch.global(ch.rank), expected, ch.global(from), c->recv_tag())};
    co_await fail;
  }
  ReadOffer offer;
  std::memcpy(&offer, rw.data, sizeof(offer));
  c->release_recv();
  if (offer.bytes != bytes) {
    FailOp fail{sizes_differ(op->name, ch.global(from), "", offer.bytes, bytes, "both")};
    co_await fail;
  }
  SharedCopy* sc = c->shared_copy(false);
  OfferWait w{sc, c->number_offer_taken(), copy_chunks(bytes)};
  // A sender that failed (a timeout, an abort) may have handed its buffer
  // back to its program, which may reuse it: it marks itself failed before
  // that, so a failure seen after the copy may have spoiled the data.
  Status st = c->peer_failure();
  OpenedOffer opened{c, sc, w.chunks, ch.global(ch.rank), ch.global(from)};
  if (st) {
    sc->dst.store(reinterpret_cast<uint64_t>(dst), std::memory_order_relaxed);
    sc->next.store(0, std::memory_order_relaxed);
    sc->done.store(0, std::memory_order_relaxed);
    sc->failed.store(0, std::memory_order_relaxed);
    assert(op->before_failing == nullptr);  // one offered receive per op
    op->before_failing = take_back_buffer;
    op->before_failing_ctx = &opened;
    sc->opened.store(w.number, std::memory_order_release);
    c->wake_peer();  // a sender asleep on the offer helps
    uint64_t read = 0;
    st = copy_claimed_chunks(c, sc, false, static_cast<char*>(dst), offer.addr, bytes, &read);
    c->count_moved(read);
  }
  if (!st) {
    FailOp fail{st};  // named: see checked_call
    co_await fail;
  }
  if (!every_chunk_copied(&w))
    co_await Until{WaitPoint{
        every_chunk_copied, &w, ch.global(from), "for its share of the copy from", {c, nullptr}, {0, 0}}};
  if (st = c->peer_failure(); !st) {
    FailOp fail{st};  // named: see checked_call
    co_await fail;
  }
  op->before_failing = nullptr;  // every chunk is in: the sender writes no more
  sc->finished.store(w.number, std::memory_order_release);
  c->wake_peer();
}

Task exchange(const Channel& ch, int to, const void* src, size_t send_bytes, int from, void* dst,
              size_t recv_bytes) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  const size_t piece = ch.piece_bytes;
  const size_t nsend = num_pieces(send_bytes, piece), nrecv = num_pieces(recv_bytes, piece);
  // all_to_allv's blocks differ in size from pair to pair, so each message
  // carries its own: pieces of a block of another size could otherwise
  // line up with the ones expected, and the rest be taken as the next
  // message.
  CallTag tag = current_op()->tag, recv_tag = tag;
  if (tag.kind == static_cast<uint8_t>(OpKind::kAllToAllv)) {
    tag.count = send_bytes;
    recv_tag.count = recv_bytes;
  }
  Connection* out = ch.to(to);
  size_t sent = 0, received = 0;
  struct Both {
    IntoWait r;
    SendWait s;
  } w{{ch.to(from), nullptr, 0, &recv_tag}, {out, 0}};
  auto aim = [&] {  // the receive of piece `received`
    size_t off = received * piece;
    w.r.dst = d + off;
    w.r.bytes = std::min(piece, recv_bytes - off);
    w.r.got = Connection::Received::kNotYet;
  };
  if (nrecv > 0) aim();
  while (sent < nsend || received < nrecv) {
    bool moved = false;
    if (received < nrecv && into_check(&w.r)) {
      if (w.r.got == Connection::Received::kOther) {
        FailOp fail = unexpected(ch, from, w.r.conn, w.r.bytes, &recv_tag);  // named: see checked_call
        co_await fail;
      }
      if (++received < nrecv) aim();
      moved = true;
    }
    if (sent < nsend) {
      size_t off = sent * piece, len = std::min(piece, send_bytes - off);
      w.s.bytes = len;  // what the waits below ask room for
      if (send_counted(out, s + off, len, tag)) {
        ++sent;
        moved = true;
      }
    }
    if (moved) continue;
    // Wake when either side can move: whichever is still owed.
    if (received < nrecv && sent < nsend) {
      co_await Until{WaitPoint{[](void* ctx) {
                                 auto* b = static_cast<Both*>(ctx);
                                 return into_check(&b->r) || slot_free(&b->s);
                               },
                               &w,
                               ch.global(from),
                               "to exchange with",
                               {w.r.conn, out},
                               {POLLIN, POLLOUT}}};
    } else if (received < nrecv) {
      co_await wait_into(&w.r, ch.global(from));
    } else {
      co_await wait_slot(&w.s, ch.global(to));
    }
  }
}

}  // namespace braid
