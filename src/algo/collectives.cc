#include "src/algo/collectives.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cpu/reduce_kernels.h"

namespace braid {
namespace {

inline int mod(int a, int n) {
  return ((a % n) + n) % n;
}

void copy_if_distinct(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes) std::memmove(dst, src, bytes);
}

void finish_avg(const CollArgs& a, void* data, size_t count, int nranks) {
  if (a.op == BRAID_AVG) kernels::divide(a.dtype, data, count, nranks);
}

// Splits [0, total) into n near-equal parts; part k is [begin(k), begin(k+1)).
struct Split {
  size_t total, n, part;
  Split(size_t t, size_t parts) : total(t), n(parts), part((t + parts - 1) / parts) {}
  size_t begin(size_t k) const { return std::min(total, k * part); }
  size_t size(size_t k) const { return begin(k + 1) - begin(k); }
};

}  // namespace

AllReduceKind choose_all_reduce(const Config& config, size_t bytes, size_t piece_bytes, bool peer_reads) {
  switch (config.all_reduce_algo) {
    case AllReduceAlgo::kRing:
      return AllReduceKind::kRing;
    // Direct sends the whole buffer to every peer before receiving, so it is
    // only correct while the buffer fits one slot; beyond that, the ring.
    case AllReduceAlgo::kDirect:
      return bytes <= piece_bytes ? AllReduceKind::kDirect : AllReduceKind::kRing;
    case AllReduceAlgo::kPeerRead:
      return peer_reads ? AllReduceKind::kPeerRead : AllReduceKind::kRing;
    case AllReduceAlgo::kAuto:
      break;
  }
  // Direct: one step, (n-1) copies per rank; cheapest while the buffer is small.
  if (bytes <= config.direct_max_bytes && bytes <= piece_bytes) return AllReduceKind::kDirect;
  // Reading peers' buffers moves each byte the fewest times, once the few
  // small synchronising messages it needs are cheap next to the copy.
  if (peer_reads && bytes >= config.peer_read_min_bytes) return AllReduceKind::kPeerRead;
  return AllReduceKind::kRing;
}

bool use_peer_reads(const Config& config, size_t bytes, bool peer_reads) {
  if (!peer_reads) return false;
  if (config.all_reduce_algo == AllReduceAlgo::kPeerRead) return true;
  return config.all_reduce_algo == AllReduceAlgo::kAuto && bytes >= config.peer_read_min_bytes;
}

bool channel_reads_peers(const Channel& ch) {
  for (int p = 0; p < ch.nranks; ++p)
    if (p != ch.rank && !ch.to(p)->supports_peer_reads()) return false;
  return ch.nranks > 1;
}

Task ring_all_reduce(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = braid_dtype_size(a.dtype);
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  const size_t chunk = std::max<size_t>(1, ch.piece_bytes / esize);  // elements per piece
  const size_t round_elems = chunk * static_cast<size_t>(n);
  if (n == 1) {
    copy_if_distinct(out, in, a.count * esize);
    finish_avg(a, out, a.count, n);
    co_return;
  }
  // Rounds of n pieces keep every connection at one or two pieces in flight:
  // reduce-scatter then all-gather of each round, pipelined piece by piece.
  for (size_t off = 0; off < a.count; off += round_elems) {
    Split seg(std::min(round_elems, a.count - off), static_cast<size_t>(n));
    auto at = [&](int k) { return (off + seg.begin(static_cast<size_t>(mod(k, n)))) * esize; };
    auto len = [&](int k) { return seg.size(static_cast<size_t>(mod(k, n))) * esize; };
    if (len(r) > 0) co_await send_piece(ch, next, in + at(r), len(r));
    for (int s = 1; s < n - 1; ++s)
      if (len(r - s) > 0)
        co_await recv_reduce_send(ch, prev, next, in + at(r - s), len(r - s), a.dtype, a.op);
    if (len(r + 1) > 0)
      co_await recv_reduce_copy_send(ch, prev, next, out + at(r + 1), in + at(r + 1), len(r + 1), a.dtype,
                                     a.op);
    for (int s = 1; s < n - 1; ++s)
      if (len(r - s + 1) > 0) co_await recv_copy_send(ch, prev, next, out + at(r - s + 1), len(r - s + 1));
    if (len(r + 2) > 0) co_await recv_piece(ch, prev, out + at(r + 2), len(r + 2));
  }
  finish_avg(a, out, a.count, n);
}

Task direct_all_reduce(const Channel& ch, CollArgs a, char* scratch) {
  const int n = ch.nranks, r = ch.rank;
  const size_t bytes = a.count * braid_dtype_size(a.dtype);
  // Keep our input if accumulating into recvbuf would overwrite it first.
  const void* mine = a.sendbuf;
  if (a.sendbuf == a.recvbuf && r != 0) {
    std::memcpy(scratch, a.sendbuf, bytes);
    mine = scratch;
  }
  for (int s = 1; s < n; ++s) co_await send_message(ch, mod(r + s, n), mine, bytes);
  // Every rank reduces in rank order, so all ranks get bit-identical results.
  for (int p = 0; p < n; ++p) {
    if (p == 0) {
      if (r == 0)
        copy_if_distinct(a.recvbuf, mine, bytes);
      else
        co_await recv_message(ch, 0, a.recvbuf, bytes);
    } else if (p == r) {
      kernels::reduce(a.dtype, a.op, a.recvbuf, a.recvbuf, mine, a.count);
    } else {
      co_await recv_reduce_copy(ch, p, a.recvbuf, a.recvbuf, bytes, a.dtype, a.op);
    }
  }
  finish_avg(a, a.recvbuf, a.count, n);
}

// ---- algorithms that read peers' buffers directly (shm: process_vm_readv) ----

namespace {

struct PeerBuffers {
  uint64_t send, recv;  // addresses in the peer's process
};

// Every rank learns every rank's buffer addresses.
Task exchange_buffers(const Channel& ch, const CollArgs& a, std::vector<PeerBuffers>* all) {
  const int n = ch.nranks, r = ch.rank;
  const PeerBuffers mine{reinterpret_cast<uint64_t>(a.sendbuf), reinterpret_cast<uint64_t>(a.recvbuf)};
  all->assign(n, PeerBuffers{});
  (*all)[r] = mine;
  for (int s = 1; s < n; ++s)
    co_await exchange(ch, mod(r + s, n), &mine, sizeof(mine), mod(r - s, n), &(*all)[mod(r - s, n)],
                      sizeof(PeerBuffers));
}

// Returns once every rank has reached the same point (empty messages with
// every peer): phases that read peers' buffers are ordered by it.
Task sync_all(const Channel& ch) {
  const int n = ch.nranks, r = ch.rank;
  for (int s = 1; s < n; ++s) co_await exchange(ch, mod(r + s, n), nullptr, 0, mod(r - s, n), nullptr, 0);
}

Task read_from(const Channel& ch, int peer, void* dst, uint64_t remote, size_t bytes) {
  if (bytes == 0) co_return;
  Status st = ch.to(peer)->read_peer(dst, remote, bytes);
  if (!st) {
    FailOp fail{st};  // named: see checked_call
    co_await fail;
  }
}

// out[0, count) = the reduction, in rank order, of every rank's `count`
// elements at byte offset `in_off` of its sendbuf (ours at `own_in`). Rank
// order is the same everywhere, so results are bit-identical on all ranks.
// scratch: 2 * piece_bytes.
Task reduce_reading_peers(const Channel& ch, const CollArgs& a, const std::vector<PeerBuffers>& addr,
                          const char* own_in, size_t in_off, char* out, size_t count, char* scratch) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = braid_dtype_size(a.dtype);
  const size_t chunk = std::max<size_t>(1, ch.piece_bytes / esize);  // elements per read
  char* tmp = scratch;                                               // a peer's chunk
  char* mine = scratch + chunk * esize;                              // our own chunk, when out overwrites it
  for (size_t e = 0; e < count; e += chunk) {
    const size_t len = std::min(chunk, count - e), bytes = len * esize, off = e * esize;
    const char* own = own_in + off;
    if (own == out + off && r != 0) {
      std::memcpy(mine, own, bytes);  // out is about to take rank 0's data
      own = mine;
    }
    for (int p = 0; p < n; ++p) {
      const char* src = own;
      if (p != r) {
        char* dst = p == 0 ? out + off : tmp;
        co_await read_from(ch, p, dst, addr[p].send + in_off + off, bytes);
        src = dst;
      }
      if (p == 0) {
        copy_if_distinct(out + off, src, bytes);
      } else {
        kernels::reduce(a.dtype, a.op, out + off, out + off, src, len);
      }
    }
  }
}

}  // namespace

Task peer_read_all_reduce(const Channel& ch, CollArgs a, char* scratch) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = braid_dtype_size(a.dtype);
  char* out = static_cast<char*>(a.recvbuf);
  std::vector<PeerBuffers> addr;
  co_await exchange_buffers(ch, a, &addr);
  // 1. Reduce our slice; 2. wait until every slice is final; 3. copy the
  // other slices from their owners' outputs; 4. nobody reuses its buffers
  // while another rank still reads them.
  Split slice(a.count, static_cast<size_t>(n));
  const size_t begin = slice.begin(static_cast<size_t>(r)), len = slice.size(static_cast<size_t>(r));
  co_await reduce_reading_peers(ch, a, addr, static_cast<const char*>(a.sendbuf) + begin * esize,
                                begin * esize, out + begin * esize, len, scratch);
  finish_avg(a, out + begin * esize, len, n);
  co_await sync_all(ch);
  for (int s = 1; s < n; ++s) {
    const int p = mod(r + s, n);
    const size_t off = slice.begin(static_cast<size_t>(p)) * esize;
    co_await read_from(ch, p, out + off, addr[p].recv + off, slice.size(static_cast<size_t>(p)) * esize);
  }
  co_await sync_all(ch);
}

Task peer_read_reduce_scatter(const Channel& ch, CollArgs a, char* scratch) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * braid_dtype_size(a.dtype);
  std::vector<PeerBuffers> addr;
  co_await exchange_buffers(ch, a, &addr);
  co_await reduce_reading_peers(ch, a, addr, static_cast<const char*>(a.sendbuf) + r * block, r * block,
                                static_cast<char*>(a.recvbuf), a.count, scratch);
  finish_avg(a, a.recvbuf, a.count, n);
  co_await sync_all(ch);
}

Task peer_read_all_gather(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * braid_dtype_size(a.dtype);
  char* out = static_cast<char*>(a.recvbuf);
  std::vector<PeerBuffers> addr;
  co_await exchange_buffers(ch, a, &addr);
  copy_if_distinct(out + r * block, a.sendbuf, block);
  for (int s = 1; s < n; ++s) {
    const int p = mod(r + s, n);
    co_await read_from(ch, p, out + p * block, addr[p].send, block);
  }
  co_await sync_all(ch);
}

Task peer_read_broadcast(const Channel& ch, CollArgs a) {
  const size_t bytes = a.count * braid_dtype_size(a.dtype);
  std::vector<PeerBuffers> addr;
  co_await exchange_buffers(ch, a, &addr);
  if (ch.rank == a.root) {
    copy_if_distinct(a.recvbuf, a.sendbuf, bytes);
  } else {
    co_await read_from(ch, a.root, a.recvbuf, addr[a.root].send, bytes);
  }
  co_await sync_all(ch);
}

Task chain_broadcast(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t bytes = a.count * braid_dtype_size(a.dtype);
  const int pos = mod(r - a.root, n);
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  char* out = static_cast<char*>(a.recvbuf);
  if (r == a.root) copy_if_distinct(a.recvbuf, a.sendbuf, bytes);
  if (n == 1) co_return;
  for (size_t off = 0; off < bytes; off += ch.piece_bytes) {
    size_t len = std::min(ch.piece_bytes, bytes - off);
    if (pos == 0)
      co_await send_piece(ch, next, out + off, len);
    else if (pos == n - 1)
      co_await recv_piece(ch, prev, out + off, len);
    else
      co_await recv_copy_send(ch, prev, next, out + off, len);
  }
}

Task chain_reduce(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = braid_dtype_size(a.dtype), bytes = a.count * esize;
  // The chain starts after the root and ends at it.
  const int pos = mod(r - a.root - 1, n);
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  if (n == 1) {
    copy_if_distinct(out, in, bytes);
  } else {
    const size_t piece = ch.piece_bytes / esize * esize;
    for (size_t off = 0; off < bytes; off += piece) {
      size_t len = std::min(piece, bytes - off);
      if (pos == 0)
        co_await send_piece(ch, next, in + off, len);
      else if (pos == n - 1)
        co_await recv_reduce_copy(ch, prev, out + off, in + off, len, a.dtype, a.op);
      else
        co_await recv_reduce_send(ch, prev, next, in + off, len, a.dtype, a.op);
    }
  }
  if (r == a.root) finish_avg(a, out, a.count, n);
}

Task ring_all_gather(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * braid_dtype_size(a.dtype);
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  char* out = static_cast<char*>(a.recvbuf);
  copy_if_distinct(out + r * block, a.sendbuf, block);
  if (n == 1) co_return;
  auto blk = [&](int k) { return out + static_cast<size_t>(mod(k, n)) * block; };
  for (size_t off = 0; off < block; off += ch.piece_bytes) {
    size_t len = std::min(ch.piece_bytes, block - off);
    co_await send_piece(ch, next, blk(r) + off, len);
    for (int s = 1; s < n - 1; ++s) co_await recv_copy_send(ch, prev, next, blk(r - s) + off, len);
    co_await recv_piece(ch, prev, blk(r + 1) + off, len);
  }
}

Task ring_reduce_scatter(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = braid_dtype_size(a.dtype), block = a.count * esize;
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  auto blk = [&](int k) { return in + static_cast<size_t>(mod(k, n)) * block; };
  if (n == 1) {
    copy_if_distinct(out, in, block);
  } else {
    // Block b's partial sum starts at rank b+1 and ends, complete, at rank b.
    const size_t piece = ch.piece_bytes / esize * esize;
    for (size_t off = 0; off < block; off += piece) {
      size_t len = std::min(piece, block - off);
      co_await send_piece(ch, next, blk(r - 1) + off, len);
      for (int s = 1; s < n - 1; ++s)
        co_await recv_reduce_send(ch, prev, next, blk(r - s - 1) + off, len, a.dtype, a.op);
      co_await recv_reduce_copy(ch, prev, out + off, blk(r) + off, len, a.dtype, a.op);
    }
  }
  finish_avg(a, out, a.count, n);
}

Task direct_gather(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * braid_dtype_size(a.dtype);
  char* out = static_cast<char*>(a.recvbuf);
  if (r != a.root) {
    co_await send_message(ch, a.root, a.sendbuf, block);
    co_return;
  }
  copy_if_distinct(out + r * block, a.sendbuf, block);
  for (int p = 0; p < n; ++p)
    if (p != r) co_await recv_message(ch, p, out + p * block, block);
}

Task direct_scatter(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * braid_dtype_size(a.dtype);
  const char* in = static_cast<const char*>(a.sendbuf);
  if (r != a.root) {
    co_await recv_message(ch, a.root, a.recvbuf, block);
    co_return;
  }
  for (int s = 1; s < n; ++s) {
    int p = mod(r + s, n);
    co_await send_message(ch, p, in + p * block, block);
  }
  copy_if_distinct(a.recvbuf, in + r * block, block);
}

Task pairwise_all_to_all(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * braid_dtype_size(a.dtype);
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  copy_if_distinct(out + r * block, in + r * block, block);
  // Step s pairs us with r+s (send) and r-s (receive): every rank sends and
  // receives once per step.
  for (int s = 1; s < n; ++s) {
    int to = mod(r + s, n), from = mod(r - s, n);
    co_await exchange(ch, to, in + to * block, block, from, out + from * block, block);
  }
}

Task pairwise_all_to_allv(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t es = braid_dtype_size(a.dtype);
  const size_t *scount = a.layout, *sdispl = a.layout + n, *rcount = a.layout + 2 * n,
               *rdispl = a.layout + 3 * n;
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  copy_if_distinct(out + rdispl[r] * es, in + sdispl[r] * es, rcount[r] * es);
  // Same schedule as all_to_all; a receive checks that the sender's block
  // has the size this rank expects.
  for (int s = 1; s < n; ++s) {
    int to = mod(r + s, n), from = mod(r - s, n);
    co_await exchange(ch, to, in + sdispl[to] * es, scount[to] * es, from, out + rdispl[from] * es,
                      rcount[from] * es);
  }
}

Task dissemination_barrier(const Channel& ch) {
  const int n = ch.nranks, r = ch.rank;
  for (int k = 1; k < n; k <<= 1) co_await exchange(ch, mod(r + k, n), nullptr, 0, mod(r - k, n), nullptr, 0);
}

Task p2p_send(const Channel& ch, CollArgs a) {
  co_await send_message(ch, a.peer, a.sendbuf, a.count * braid_dtype_size(a.dtype));
}

Task p2p_recv(const Channel& ch, CollArgs a) {
  co_await recv_message(ch, a.peer, a.recvbuf, a.count * braid_dtype_size(a.dtype));
}

}  // namespace braid

namespace braid {
namespace {

std::string describe(const CallDescriptor& d) {
  std::string s = std::string(d.name) + "(count " + std::to_string(d.count);
  if (d.dtype >= 0) s += std::string(", ") + braid_dtype_name(static_cast<braid_dtype_t>(d.dtype));
  if (d.op >= 0) s += std::string(", ") + braid_redop_name(static_cast<braid_redop_t>(d.op));
  if (d.root >= 0) s += ", root " + std::to_string(d.root);
  return s + ")";
}

Status mismatch_status(const CallDescriptor& mine, int r, const CallDescriptor& theirs, int p) {
  return Status(BRAID_ERR_MISMATCH, "call mismatch at collective #" + std::to_string(mine.seq) + ": rank " +
                                        std::to_string(r) + " called " + describe(mine) + ", rank " +
                                        std::to_string(p) + " called " + describe(theirs) +
                                        " (BRAID_CHECK_CALLS)");
}

bool same_call(const CallDescriptor& a, const CallDescriptor& b) {
  return std::strncmp(a.name, b.name, sizeof a.name) == 0 && a.seq == b.seq && a.count == b.count &&
         a.dtype == b.dtype && a.op == b.op && a.root == b.root;
}

}  // namespace

Task checked_call(const Channel& ch, CallDescriptor mine, Task body) {
  const int n = ch.nranks, r = ch.rank;
  std::vector<CallDescriptor> theirs(static_cast<size_t>(n));
  for (int s = 1; s < n; ++s) {
    co_await exchange(ch, mod(r + s, n), &mine, sizeof mine, mod(r - s, n), &theirs[mod(r - s, n)],
                      sizeof mine);
  }
  int differs = -1;
  for (int p = 0; p < n && differs < 0; ++p) {
    if (p != r && !same_call(theirs[p], mine)) differs = p;
  }
  if (differs >= 0) {
    // Named, not a temporary of the co_await operand: built there, with GCC 12
    // its Status was released twice when the op's frame was destroyed at that
    // suspension (ASan: use after free).
    FailOp fail{mismatch_status(mine, r, theirs[differs], differs)};
    co_await fail;
  }
  co_await std::move(body);
}

}  // namespace braid
