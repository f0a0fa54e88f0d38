#include "src/algo/collectives.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "kernels/cpu/reduce_kernels.h"
#include "src/algo/split.h"
#include "src/core/dtype.h"

namespace braid {
namespace {

void copy_if_distinct(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes) std::memmove(dst, src, bytes);
}

void finish_avg(const CollArgs& a, void* data, size_t count, int nranks) {
  if (a.op == BRAID_AVG) kernels::divide(a.dtype, data, data, count, nranks);
}

}  // namespace

bool channel_reads_peers(const Channel& ch) {
  for (int p = 0; p < ch.nranks; ++p)
    if (p != ch.rank && !ch.to(p)->supports_peer_reads()) return false;
  return ch.nranks > 1;
}

Task ring_all_reduce(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype);
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

Task direct_all_reduce(const Channel& ch, CollArgs a, char* scratch, bool sent) {
  const int n = ch.nranks, r = ch.rank;
  const size_t bytes = a.count * dtype_size(a.dtype);
  // Keep our input if accumulating into recvbuf would overwrite it first.
  const void* mine = a.sendbuf;
  if (a.sendbuf == a.recvbuf && r != 0) {
    std::memcpy(scratch, a.sendbuf, bytes);
    mine = scratch;
  }
  if (!sent)
    for (int s = 1; s < n; ++s) co_await send_message(ch, mod(r + s, n), mine, bytes);
  // Every rank reduces in rank order, so all ranks get bit-identical results.
  for (int p = 0; p < n; ++p) {
    if (p == 0) {
      if (r == 0)
        copy_if_distinct(a.recvbuf, mine, bytes);
      else
        co_await recv_message(ch, 0, a.recvbuf, bytes);
    } else if (p == r) {
      // The incoming operand first, as recv_reduce_copy takes it: min and
      // max of +0 and -0 (or of two NaNs) depend on the order.
      kernels::reduce(a.dtype, a.op, a.recvbuf, mine, a.recvbuf, a.count);
    } else {
      co_await recv_reduce_copy(ch, p, a.recvbuf, a.recvbuf, bytes, a.dtype, a.op);
    }
  }
  finish_avg(a, a.recvbuf, a.count, n);
}

bool direct_sends_if_free(const Channel& ch, const void* base, size_t stride, size_t bytes,
                          const CallTag& tag) {
  const int n = ch.nranks, r = ch.rank;
  for (int s = 1; s < n; ++s)
    if (ch.to(mod(r + s, n))->send_slot(bytes) == nullptr) return false;
  for (int s = 1; s < n; ++s) {
    const int p = mod(r + s, n);
    Connection* c = ch.to(p);
    // send_slot again: the room found above.
    c->copy_to_slot(c->send_slot(bytes), static_cast<const char*>(base) + stride * ch.global(p), bytes);
    c->count_moved(bytes);
    c->commit_send(bytes, tag);
  }
  return true;
}

namespace {

// The next message from `c` is in, `bytes` long and sent by the call `tag`
// names (*data: its bytes): one from another call or of another size is
// the op's to report.
bool message_in(Connection* c, size_t bytes, const CallTag& tag, const void** data) {
  size_t got = 0;
  return c->recv_ready(data, &got) && got == bytes && c->recv_tag() == tag;
}

// message_in for every peer.
bool every_message_in(const Channel& ch, size_t bytes, const CallTag& tag) {
  for (int p = 0; p < ch.nranks; ++p) {
    const void* data = nullptr;
    if (p != ch.rank && !message_in(ch.to(p), bytes, tag, &data)) return false;
  }
  return true;
}

// The message every_message_in found from `p`.
const void* message_from(const Channel& ch, int p) {
  const void* data = nullptr;
  size_t got = 0;
  ch.to(p)->recv_ready(&data, &got);
  return data;
}

}  // namespace

// direct_all_reduce's receives and reductions, from the slots.
bool direct_all_reduce_if_ready(const Channel& ch, const CollArgs& a, const void* mine, const CallTag& tag) {
  const int n = ch.nranks, r = ch.rank;
  const size_t bytes = a.count * dtype_size(a.dtype);
  if (!every_message_in(ch, bytes, tag)) return false;
  for (int p = 0; p < n; ++p) {
    const void* data = p == r ? mine : message_from(ch, p);
    if (p == 0)
      copy_if_distinct(a.recvbuf, data, bytes);
    else
      kernels::reduce(a.dtype, a.op, a.recvbuf, data, a.recvbuf, a.count);
    if (p != r) ch.to(p)->release_recv();
  }
  finish_avg(a, a.recvbuf, a.count, n);
  return true;
}

namespace {

// Each peer's block into its place in `out` (block x its rank), this
// rank's from `mine`: the receives of direct_all_gather and of
// pairwise_all_to_all, from the slots.
bool blocks_in_place_if_ready(const Channel& ch, char* out, const void* mine, size_t block,
                              const CallTag& tag) {
  const int n = ch.nranks, r = ch.rank;
  if (!every_message_in(ch, block, tag)) return false;
  copy_if_distinct(out + static_cast<size_t>(ch.global(r)) * block, mine, block);
  for (int s = 1; s < n; ++s) {
    const int p = mod(r - s, n);
    std::memcpy(out + static_cast<size_t>(ch.global(p)) * block, message_from(ch, p), block);
    ch.to(p)->release_recv();
  }
  return true;
}

}  // namespace

bool direct_all_gather_if_ready(const Channel& ch, const CollArgs& a, const CallTag& tag) {
  return blocks_in_place_if_ready(ch, static_cast<char*>(a.recvbuf), a.sendbuf, a.count * dtype_size(a.dtype),
                                  tag);
}

bool gather_if_ready(const Channel& ch, const CollArgs& a, const CallTag& tag) {
  const size_t block = a.count * dtype_size(a.dtype);
  if (ch.rank == a.root)
    return blocks_in_place_if_ready(ch, static_cast<char*>(a.recvbuf), a.sendbuf, block, tag);
  return send_counted(ch.to(a.root), a.sendbuf, block, tag);
}

bool scatter_if_ready(const Channel& ch, const CollArgs& a, const CallTag& tag) {
  const size_t block = a.count * dtype_size(a.dtype);
  if (ch.rank != a.root)
    return ch.to(a.root)->recv_into(a.recvbuf, block, tag) == Connection::Received::kDone;
  if (!direct_sends_if_free(ch, a.sendbuf, block, block, tag)) return false;
  copy_if_distinct(a.recvbuf,
                   static_cast<const char*>(a.sendbuf) + static_cast<size_t>(ch.global(ch.rank)) * block,
                   block);
  return true;
}

bool all_to_all_if_ready(const Channel& ch, const CollArgs& a, const CallTag& tag) {
  const size_t block = a.count * dtype_size(a.dtype);
  return blocks_in_place_if_ready(
      ch, static_cast<char*>(a.recvbuf),
      static_cast<const char*>(a.sendbuf) + static_cast<size_t>(ch.global(ch.rank)) * block, block, tag);
}

// direct_reduce_scatter's receives and reductions, from the slots.
bool direct_reduce_scatter_if_ready(const Channel& ch, const CollArgs& a, const CallTag& tag) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * dtype_size(a.dtype);
  if (!every_message_in(ch, block, tag)) return false;
  copy_if_distinct(a.recvbuf, static_cast<const char*>(a.sendbuf) + static_cast<size_t>(ch.global(r)) * block,
                   block);
  for (int s = 1; s < n; ++s) {
    const int p = mod(r - s, n);
    kernels::reduce(a.dtype, a.op, a.recvbuf, message_from(ch, p), a.recvbuf, a.count);
    ch.to(p)->release_recv();
  }
  finish_avg(a, a.recvbuf, a.count, n);
  return true;
}

std::vector<std::vector<int>> host_groups(const std::vector<std::string>& host,
                                          const std::vector<topo::RankPlacement>& place) {
  std::vector<int> all(host.size());
  std::iota(all.begin(), all.end(), 0);
  std::vector<std::vector<int>> groups;
  for (auto& [name, ranks] : group_ranks(all, [&](int r) { return host[r]; })) {
    // Ranks of one package, then of one NUMA node, next to each other: a ring
    // then crosses between sockets twice, not on every hop.
    std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
      return std::pair(place[a].package, place[a].numa) < std::pair(place[b].package, place[b].numa);
    });
    groups.push_back(std::move(ranks));
  }
  return groups;
}

// ---- binary trees: pieces flow up (reduce) and down (broadcast) ----

BinaryTree::BinaryTree(int r, int n, int root) {
  // Positions and ranks both lie in [0, n): a rotation is one conditional
  // subtraction, not mod()'s divisions (this runs on every call).
  auto rotate = [n](int q) { return q >= n ? q - n : q; };
  const int p = r >= root ? r - root : r - root + n;
  if (p > 0) parent = rotate((p - 1) / 2 + root);
  for (int k = 0; k < 2; ++k)
    if (2 * p + 1 + k < n) child[children++] = rotate(2 * p + 1 + k + root);
}

BinaryTree BinaryTree::chain_into(int r, int n, int root) {
  BinaryTree t;
  const int p = r >= root ? r - root : r - root + n;
  if (p > 0) t.parent = r == n - 1 ? 0 : r + 1;
  if (n > 1 && p != 1) t.child[t.children++] = r == 0 ? n - 1 : r - 1;
  return t;
}

BinaryTree BinaryTree::chain(int r, int n, int root) {
  BinaryTree t;
  const int p = r >= root ? r - root : r - root + n;
  if (p > 0) t.parent = r == 0 ? n - 1 : r - 1;
  if (p < n - 1) t.child[t.children++] = r == n - 1 ? 0 : r + 1;
  return t;
}

bool broadcast_if_ready(const Channel& ch, const BinaryTree& t, const CollArgs& a, const CallTag& tag) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  const char* src = static_cast<const char*>(a.sendbuf);
  Connection* up = t.parent >= 0 ? ch.to(t.parent) : nullptr;
  if (up != nullptr) {
    const void* data = nullptr;
    if (!message_in(up, bytes, tag, &data)) return false;
    src = static_cast<const char*>(data);
  }
  void* slot[2] = {nullptr, nullptr};
  for (int k = 0; k < t.children; ++k)
    if ((slot[k] = ch.to(t.child[k])->send_slot(bytes)) == nullptr) return false;
  for (int k = 0; k < t.children; ++k) {
    Connection* c = ch.to(t.child[k]);
    c->copy_to_slot(slot[k], src, bytes);
    c->count_moved(bytes);
    c->commit_send(bytes, tag);
  }
  copy_if_distinct(a.recvbuf, src, bytes);
  if (up != nullptr) up->release_recv();
  return true;
}

namespace {

// One piece of a tree reduction: `acc` (piece-sized, this node's partial
// result) = in op children's pieces, sent up toward the root; the root's
// result lands in `out`.
// Tree and arguments by value, as tree_broadcast_piece's (below).
Task tree_reduce_piece(const Channel& ch, BinaryTree t, CollArgs a, size_t off, size_t len, char* out,
                       char* scratch) {
  const char* in = static_cast<const char*>(a.sendbuf);
  // Where this node's partial sum is built: the output at the root, the
  // caller's scratch (one piece) elsewhere.
  char* acc = t.parent < 0 ? out + off : scratch;
  if (t.children == 0) {
    if (t.parent < 0)
      copy_if_distinct(acc, in + off, len);
    else
      co_await send_piece(ch, t.parent, in + off, len);
  } else if (t.children == 1 && t.parent >= 0) {
    co_await recv_reduce_send(ch, t.child[0], t.parent, in + off, len, a.dtype, a.op);
  } else {
    co_await recv_reduce_copy(ch, t.child[0], acc, in + off, len, a.dtype, a.op);
    if (t.children == 2) {
      if (t.parent < 0)
        co_await recv_reduce_copy(ch, t.child[1], acc, acc, len, a.dtype, a.op);
      else
        co_await recv_reduce_send(ch, t.child[1], t.parent, acc, len, a.dtype, a.op);
    }
  }
}

// One piece of a tree broadcast, from the root down into every rank's
// `piece`. The root sends from `src` (its input) and then copies it to
// `piece`: one read of the buffer, while the piece is in cache. Elsewhere
// src is unused.
// The tree is taken by value: a single-piece broadcast returns this
// coroutine as the op's task (below), past the frame that built the tree.
Task tree_broadcast_piece(const Channel& ch, BinaryTree t, char* piece, const char* src, size_t len) {
  if (t.parent < 0) {
    for (int k = 0; k < t.children; ++k) co_await send_piece(ch, t.child[k], src, len);
    copy_if_distinct(piece, src, len);
  } else if (t.children == 0) {
    co_await recv_piece(ch, t.parent, piece, len);
  } else {
    co_await recv_copy_send(ch, t.parent, t.child[0], piece, len);
    if (t.children == 2) co_await send_piece(ch, t.child[1], piece, len);
  }
}

size_t reduce_piece_bytes(const Channel& ch, braid_dtype_t dtype) {
  const size_t esize = dtype_size(dtype);
  return ch.piece_bytes / esize * esize;
}

Task tree_reduce_piece_by_piece(const Channel& ch, BinaryTree t, CollArgs a, char* out, char* scratch) {
  const size_t bytes = a.count * dtype_size(a.dtype), piece = reduce_piece_bytes(ch, a.dtype);
  for (size_t off = 0; off < bytes; off += piece)
    co_await tree_reduce_piece(ch, t, a, off, std::min(piece, bytes - off), out, scratch);
}

// One piece is that piece's coroutine, as in tree_broadcast_pieces.
Task tree_reduce_pieces(const Channel& ch, const BinaryTree& t, const CollArgs& a, char* out, char* scratch) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  if (bytes > 0 && bytes <= reduce_piece_bytes(ch, a.dtype))
    return tree_reduce_piece(ch, t, a, 0, bytes, out, scratch);
  return tree_reduce_piece_by_piece(ch, t, a, out, scratch);
}

Task tree_broadcast_piece_by_piece(const Channel& ch, BinaryTree t, char* buf, const char* src,
                                   size_t bytes) {
  for (size_t off = 0; off < bytes; off += ch.piece_bytes)
    co_await tree_broadcast_piece(ch, t, buf + off, src + off, std::min(ch.piece_bytes, bytes - off));
}

// A broadcast of one piece is that piece's coroutine: no loop frame above
// it, which a small call would pay for on every rank.
Task tree_broadcast_pieces(const Channel& ch, const BinaryTree& t, char* buf, const char* src, size_t bytes) {
  if (bytes > 0 && bytes <= ch.piece_bytes) return tree_broadcast_piece(ch, t, buf, src, bytes);
  return tree_broadcast_piece_by_piece(ch, t, buf, src, bytes);
}

}  // namespace

Task tree_all_reduce(const Channel& ch, CollArgs a, char* scratch) {
  char* out = static_cast<char*>(a.recvbuf);
  const size_t bytes = a.count * dtype_size(a.dtype);
  co_await tree_reduce_pieces(ch, BinaryTree(ch.rank, ch.nranks, 0), a, out, scratch);
  if (ch.rank == 0) finish_avg(a, out, a.count, ch.nranks);
  co_await tree_broadcast_pieces(ch, BinaryTree(ch.rank, ch.nranks, 0), out, out, bytes);
}

// Two trees, each carrying half of the buffer: the heap tree over the
// channel's order, and the same tree over the reversed order, whose inner
// nodes are the first tree's leaves. Every rank then forwards about as much
// as a leaf of one tree plus an inner node of the other, instead of all of
// it through the inner nodes of one tree. Pieces of the two trees alternate
// in one order on every rank (A0 B0 A1 B1 ...), so a connection that both
// trees use sees their messages in the same order at both ends.
Task double_tree_all_reduce(const Channel& ch, const Channel& mirror, CollArgs a, char* scratch) {
  const size_t esize = dtype_size(a.dtype), piece = reduce_piece_bytes(ch, a.dtype);
  char* out = static_cast<char*>(a.recvbuf);
  const size_t half = a.count / 2;
  CollArgs first = a, second = a;
  first.count = half;
  second.count = a.count - half;
  second.sendbuf = static_cast<const char*>(a.sendbuf) + half * esize;
  second.recvbuf = out + half * esize;
  const BinaryTree ta(ch.rank, ch.nranks, 0), tb(mirror.rank, mirror.nranks, 0);
  const size_t a_bytes = first.count * esize, b_bytes = second.count * esize;
  char* b_out = static_cast<char*>(second.recvbuf);
  char* b_scratch = scratch + std::min(piece, a_bytes);  // after the first tree's largest piece
  for (size_t off = 0; off < std::max(a_bytes, b_bytes); off += piece) {
    if (off < a_bytes)
      co_await tree_reduce_piece(ch, ta, first, off, std::min(piece, a_bytes - off), out, scratch);
    if (off < b_bytes)
      co_await tree_reduce_piece(mirror, tb, second, off, std::min(piece, b_bytes - off), b_out, b_scratch);
  }
  if (ta.parent < 0) finish_avg(a, out, first.count, ch.nranks);
  if (tb.parent < 0) finish_avg(a, b_out, second.count, ch.nranks);
  for (size_t off = 0; off < std::max(a_bytes, b_bytes); off += piece) {
    if (off < a_bytes)
      co_await tree_broadcast_piece(ch, ta, out + off, out + off, std::min(piece, a_bytes - off));
    if (off < b_bytes)
      co_await tree_broadcast_piece(mirror, tb, b_out + off, b_out + off, std::min(piece, b_bytes - off));
  }
}

namespace {

// Not a coroutine: it hands back its pieces' task (one frame fewer). On one
// rank the root's tree has no children, so the piece only copies.
Task broadcast_down(const Channel& ch, const BinaryTree& t, const CollArgs& a) {
  char* out = static_cast<char*>(a.recvbuf);
  const char* src = ch.rank == a.root ? static_cast<const char*>(a.sendbuf) : out;
  return tree_broadcast_pieces(ch, t, out, src, a.count * dtype_size(a.dtype));
}

}  // namespace

Task tree_broadcast(const Channel& ch, CollArgs a) {
  return broadcast_down(ch, BinaryTree(ch.rank, ch.nranks, a.root), a);
}

// The tree broadcast's pieces over the chain's tree: the root sends each
// piece on and copies it to its output while it is in cache, every other
// rank copies it out and sends it on, the last only copies it out.
Task chain_broadcast(const Channel& ch, CollArgs a) {
  return broadcast_down(ch, BinaryTree::chain(ch.rank, ch.nranks, a.root), a);
}

namespace {

Task tree_reduce_over(const Channel& ch, BinaryTree t, CollArgs a, char* scratch) {
  co_await tree_reduce_pieces(ch, t, a, static_cast<char*>(a.recvbuf), scratch);
  if (t.parent < 0) finish_avg(a, a.recvbuf, a.count, ch.nranks);
}

}  // namespace

Task tree_reduce(const Channel& ch, CollArgs a, char* scratch) {
  return tree_reduce_over(ch, BinaryTree(ch.rank, ch.nranks, a.root), a, scratch);
}

// The tree reduction over the chain's tree: the first rank after the root
// sends its input on, every other rank adds what came in to its own and
// sends that on, the root adds the last into its output. No node has two
// children, so no scratch.
Task chain_reduce(const Channel& ch, CollArgs a) {
  return tree_reduce_over(ch, BinaryTree::chain_into(ch.rank, ch.nranks, a.root), a, nullptr);
}

bool reduce_if_ready(const Channel& ch, const BinaryTree& t, const CollArgs& a, const CallTag& tag) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  const void* piece[2] = {nullptr, nullptr};
  for (int k = 0; k < t.children; ++k)
    if (!message_in(ch.to(t.child[k]), bytes, tag, &piece[k])) return false;
  Connection* up = t.parent >= 0 ? ch.to(t.parent) : nullptr;
  void* acc = up != nullptr ? up->send_slot(bytes) : a.recvbuf;
  if (acc == nullptr) return false;
  // In tree_reduce_piece's order: the first child's piece with this rank's
  // input, then the second child's with that (into the slot, where the op
  // goes through a piece of scratch: the same values).
  if (t.children == 0) {
    if (up != nullptr)
      up->copy_to_slot(acc, a.sendbuf, bytes);
    else
      copy_if_distinct(acc, a.sendbuf, bytes);
  }
  const void* local = a.sendbuf;
  for (int k = 0; k < t.children; ++k) {
    kernels::reduce(a.dtype, a.op, acc, piece[k], local, a.count);
    local = acc;
  }
  for (int k = 0; k < t.children; ++k) ch.to(t.child[k])->release_recv();
  if (up != nullptr) {
    up->count_moved(bytes);
    up->commit_send(bytes, tag);
  } else {
    finish_avg(a, a.recvbuf, a.count, ch.nranks);
  }
  return true;
}

// ---- recursive doubling: log2(n) exchanges of the whole buffer ----

namespace {

int largest_power_of_two(int n) {
  int p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  return p2;
}

// Ranks beyond the largest power of two p2 hand their data to the rank p2
// below them and wait there for the result (fold_out); the ranks below p2
// start from their input, their partner's added in. scratch: the buffer.
Task fold_in(const Channel& ch, const CollArgs& a, int p2, char* scratch) {
  const int n = ch.nranks, r = ch.rank;
  const size_t bytes = a.count * dtype_size(a.dtype);
  char* out = static_cast<char*>(a.recvbuf);
  if (r >= p2) {
    co_await send_message(ch, r - p2, a.sendbuf, bytes);
    co_await recv_message(ch, r - p2, out, bytes);
    co_return;
  }
  copy_if_distinct(out, a.sendbuf, bytes);
  if (r + p2 < n) {
    co_await recv_message(ch, r + p2, scratch, bytes);
    kernels::reduce(a.dtype, a.op, out, out, scratch, a.count);
  }
}

// The result back to the folded rank, if this rank has one.
Task fold_out(const Channel& ch, const CollArgs& a, int p2) {
  if (ch.rank + p2 < ch.nranks)
    co_await send_message(ch, ch.rank + p2, a.recvbuf, a.count * dtype_size(a.dtype));
}

}  // namespace

Task recursive_doubling_all_reduce(const Channel& ch, CollArgs a, char* scratch) {
  const int n = ch.nranks, r = ch.rank;
  const size_t bytes = a.count * dtype_size(a.dtype);
  char* out = static_cast<char*>(a.recvbuf);
  const int p2 = largest_power_of_two(n);
  co_await fold_in(ch, a, p2, scratch);
  if (r >= p2) co_return;
  for (int mask = 1; mask < p2; mask <<= 1) {
    const int partner = r ^ mask;
    co_await exchange(ch, partner, out, bytes, partner, scratch, bytes);
    // The lower rank's operand first, on both sides: bit-identical results
    // even for operations that are not commutative in every bit (NaN in min).
    if (r < partner)
      kernels::reduce(a.dtype, a.op, out, out, scratch, a.count);
    else
      kernels::reduce(a.dtype, a.op, out, scratch, out, a.count);
  }
  finish_avg(a, out, a.count, n);
  co_await fold_out(ch, a, p2);
}

// Rabenseifner: reduce-scatter by recursive halving, then all-gather by
// recursive doubling, over the largest power of two p2 of ranks (the others
// fold in and out as in recursive_doubling_all_reduce). Each rank moves
// 2 (p2 - 1) / p2 of the buffer in 2 log2(p2) steps: recursive doubling's
// few steps with the ring's bytes.
Task rabenseifner_all_reduce(const Channel& ch, CollArgs a, char* scratch) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype);
  char* out = static_cast<char*>(a.recvbuf);
  const int p2 = largest_power_of_two(n);
  co_await fold_in(ch, a, p2, scratch);
  if (r >= p2) co_return;
  // Block b of p2 covers elements [first(b), first(b + 1)).
  const Split blocks(a.count, static_cast<size_t>(p2));
  auto first = [&](int b) { return blocks.begin(static_cast<size_t>(b)); };
  auto at = [&](int b) { return out + first(b) * esize; };
  auto span = [&](int lo, int hi) { return (first(hi) - first(lo)) * esize; };
  // Halving: keep the half of the blocks on this rank's side of `mask`,
  // send the other half to the partner, reduce the partner's copy of ours.
  int lo = 0, hi = p2;
  for (int mask = p2 / 2; mask >= 1; mask >>= 1) {
    const int partner = r ^ mask, mid = (lo + hi) / 2;
    const bool lower = (r & mask) == 0;
    const int keep_lo = lower ? lo : mid, keep_hi = lower ? mid : hi;
    const int give_lo = lower ? mid : lo, give_hi = lower ? hi : mid;
    co_await exchange(ch, partner, at(give_lo), span(give_lo, give_hi), partner, scratch,
                      span(keep_lo, keep_hi));
    const size_t elems = first(keep_hi) - first(keep_lo);
    // The lower rank's operand first, on both sides (see recursive doubling).
    if (r < partner)
      kernels::reduce(a.dtype, a.op, at(keep_lo), at(keep_lo), scratch, elems);
    else
      kernels::reduce(a.dtype, a.op, at(keep_lo), scratch, at(keep_lo), elems);
    lo = keep_lo;
    hi = keep_hi;
  }
  // This rank now holds block r, fully reduced; finish it before sharing.
  finish_avg(a, at(lo), first(hi) - first(lo), n);
  // Doubling: swap ranges with partners 1, 2, 4, ... apart.
  for (int mask = 1; mask < p2; mask <<= 1) {
    const int partner = r ^ mask;
    const int their_lo = lo ^ mask, their_hi = their_lo + (hi - lo);
    co_await exchange(ch, partner, at(lo), span(lo, hi), partner, at(their_lo), span(their_lo, their_hi));
    lo = std::min(lo, their_lo);
    hi = lo + 2 * mask;
  }
  co_await fold_out(ch, a, p2);
}

// ---- hierarchical: inside each host, across hosts, inside again ----

Task hierarchical_all_reduce(const Channel& all, const Channel& host, const Channel& across, CollArgs a,
                             bool host_reads, char* scratch) {
  const size_t esize = dtype_size(a.dtype);
  const int L = host.nranks, me = host.rank;
  const size_t block = a.count / static_cast<size_t>(L), head = block * static_cast<size_t>(L);
  char* out = static_cast<char*>(a.recvbuf);
  const char* in = static_cast<const char*>(a.sendbuf);
  const braid_redop_t op = a.op == BRAID_AVG ? BRAID_SUM : a.op;
  if (block > 0) {
    char* mine = out + me * block * esize;
    // 1. Each rank of a host ends with the host's sum of one block ...
    CollArgs rs = a;
    rs.sendbuf = in;
    rs.recvbuf = mine;
    rs.count = block;
    rs.op = op;
    // Blocks by position in the buffer, not by rank.
    const size_t bb = block * esize;
    if (host_reads)
      co_await peer_read_reduce_scatter(host, rs, scratch);
    else
      co_await ring_reduce_blocks(
          host, block, a.dtype, op, [in, bb](int k) { return in + k * bb; }, mine);
    // 2. ... which it all-reduces with the ranks holding that block on the
    // other hosts (each host's link carries 1/L of the data per rank) ...
    CollArgs ar = rs;
    ar.sendbuf = ar.recvbuf = mine;
    co_await ring_all_reduce(across, ar);
    if (a.op == BRAID_AVG) kernels::divide(a.dtype, mine, mine, block, all.nranks);
    // 3. ... and the host's ranks share their blocks.
    CollArgs ag = a;
    ag.sendbuf = mine;
    ag.recvbuf = out;
    ag.count = block;
    if (host_reads)
      co_await peer_read_all_gather(host, ag);
    else
      co_await ring_gather_blocks(host, bb, [out, bb](int k) { return out + k * bb; });
  }
  if (head < a.count) {
    // The few elements that do not divide among a host's ranks.
    CollArgs tail = a;
    tail.sendbuf = in + head * esize;
    tail.recvbuf = out + head * esize;
    tail.count = a.count - head;
    co_await ring_all_reduce(all, tail);
  }
}

// All_gather in two levels: the ranks at one index on every host gather
// each other's blocks across hosts, then each host shares what its ranks
// gathered, one ring per host's worth of blocks. Every rank sends its own
// block over the network once per other host, so all of a host's ranks share
// the slow links instead of the ring's one crossing.
Task hierarchical_all_gather(const Channel& host, const Channel& across, const HostGrid& grid, CollArgs a) {
  const size_t block = a.count * dtype_size(a.dtype);
  char* out = static_cast<char*>(a.recvbuf);
  auto at = [out, block](int global) { return out + static_cast<size_t>(global) * block; };
  co_await ring_gather_blocks(
      across, block, [&](int k) { return at(across.global(k)); }, a.sendbuf);
  for (size_t h = 0; h < grid.size(); ++h)
    co_await ring_gather_blocks(host, block, [&](int j) { return at(grid[h][j]); });
}

// Reduce_scatter in two levels: inside each host, one ring per host's
// blocks leaves each rank with its host's partial sum of the block of the
// rank at its index on that host (scratch: one block per host); across
// hosts, the ranks at one index reduce-scatter those partial sums.
Task hierarchical_reduce_scatter(const Channel& host, const Channel& across, const HostGrid& grid, CollArgs a,
                                 char* scratch) {
  const size_t block = a.count * dtype_size(a.dtype);
  const char* in = static_cast<const char*>(a.sendbuf);
  const braid_redop_t op = a.op == BRAID_AVG ? BRAID_SUM : a.op;
  for (size_t h = 0; h < grid.size(); ++h) {
    co_await ring_reduce_blocks(
        host, a.count, a.dtype, op, [&](int j) { return in + static_cast<size_t>(grid[h][j]) * block; },
        scratch + h * block);
  }
  co_await ring_reduce_blocks(
      across, a.count, a.dtype, op, [&](int k) { return scratch + static_cast<size_t>(k) * block; },
      static_cast<char*>(a.recvbuf));
  finish_avg(a, a.recvbuf, a.count, host.nranks * across.nranks);
}

// Broadcast: across hosts among the ranks at the root's index in their
// host, then inside every host from that rank. Each byte crosses the network
// once per host, and the chains inside hosts run in parallel.
Task hierarchical_broadcast(const Channel& host, const Channel& across, CollArgs a, int root_host,
                            int root_index) {
  if (host.rank == root_index) {
    CollArgs x = a;
    x.root = root_host;
    co_await chain_broadcast(across, x);
  }
  CollArgs in = a;
  in.sendbuf = a.recvbuf;  // the host's copy arrived there
  in.root = root_index;
  co_await chain_broadcast(host, in);
}

// Reduce: inside every host to the rank at the root's index, then across
// hosts to the root. scratch: the buffer's bytes, for the host's partial
// result on ranks other than the root.
Task hierarchical_reduce(const Channel& all, const Channel& host, const Channel& across, CollArgs a,
                         int root_host, int root_index, char* scratch) {
  const bool is_root = host.rank == root_index && across.rank == root_host;
  char* partial = is_root ? static_cast<char*>(a.recvbuf) : scratch;
  CollArgs in = a;
  in.op = a.op == BRAID_AVG ? BRAID_SUM : a.op;
  in.recvbuf = partial;
  in.root = root_index;
  co_await chain_reduce(host, in);
  if (host.rank == root_index) {
    CollArgs x = in;
    x.sendbuf = partial;
    x.recvbuf = is_root ? a.recvbuf : scratch;
    x.root = root_host;
    co_await chain_reduce(across, x);
  }
  if (is_root) finish_avg(a, a.recvbuf, a.count, all.nranks);
}

Task sync_all(const Channel& ch) {
  const int n = ch.nranks, r = ch.rank;
  for (int s = 1; s < n; ++s) co_await exchange(ch, mod(r + s, n), nullptr, 0, mod(r - s, n), nullptr, 0);
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

// Moves `bytes` between this rank's `local` and `peer`'s address `remote`
// without the peer's help (shm: cross-memory attach): a read into `local`,
// or with `write` a write from it.
Task peer_copy(const Channel& ch, int peer, bool write, void* local, uint64_t remote, size_t bytes) {
  if (bytes == 0) co_return;
  Connection* c = ch.to(peer);
  // A peer that failed may have returned from this call and reused the
  // buffer: no write lands there once its failure is known.
  Status st = write ? c->peer_failure() : Status::ok();
  if (st) st = write ? c->write_peer(remote, local, bytes) : c->read_peer(local, remote, bytes);
  if (st) c->count_moved(bytes);
  if (!st) {
    FailOp fail{st};  // named: see checked_call
    co_await fail;
  }
}

Task read_from(const Channel& ch, int peer, void* dst, uint64_t remote, size_t bytes) {
  return peer_copy(ch, peer, false, dst, remote, bytes);
}

Task write_to(const Channel& ch, int peer, uint64_t remote, const void* src, size_t bytes) {
  return peer_copy(ch, peer, true, const_cast<void*>(src), remote, bytes);
}

// out[0, count) = the reduction, in rank order, of every rank's `count`
// elements at byte offset `in_off` of its sendbuf (ours at `own_in`). Rank
// order is the same everywhere, so results are bit-identical on all ranks.
// With `push` (all_reduce: out is slice `in_off` of recvbuf), each finished
// piece is averaged if AVG and written to the same place in every peer's
// recvbuf. scratch: 2 * piece_bytes.
Task reduce_reading_peers(const Channel& ch, const CollArgs& a, const std::vector<PeerBuffers>& addr,
                          const char* own_in, size_t in_off, char* out, size_t count, char* scratch,
                          bool push = false) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype);
  const size_t chunk = std::max<size_t>(1, ch.piece_bytes / esize);  // elements per read
  char* tmp = scratch;                                               // a peer's chunk
  char* mine = scratch + std::min(chunk, count) * esize;             // our own chunk, when out overwrites it
  for (size_t e = 0; e < count; e += chunk) {
    const size_t len = std::min(chunk, count - e), bytes = len * esize, off = e * esize;
    const char* own = own_in + off;
    if (own == out + off && r != 0) {
      std::memcpy(mine, own, bytes);  // out is about to take rank 0's data
      own = mine;
    }
    // Rank 0's data is the first operand in place: the first reduction
    // reads it where it is and writes out once, with no copy before it.
    const char* acc = nullptr;
    for (int p = 0; p < n; ++p) {
      const char* src = own;
      if (p != r) {
        char* dst = p == 0 ? out + off : tmp;
        co_await read_from(ch, p, dst, addr[p].send + in_off + off, bytes);
        src = dst;
      }
      if (p == 0) {
        acc = src;
      } else {
        kernels::reduce(a.dtype, a.op, out + off, acc, src, len);
        acc = out + off;
      }
    }
    copy_if_distinct(out + off, acc, bytes);  // n == 1 only
    if (push) {
      // The finished piece, still in cache, goes straight to its place in
      // every peer's output: only this rank reads or writes that place.
      finish_avg(a, out + off, len, n);
      for (int s = 1; s < n; ++s) {
        const int p = mod(r + s, n);
        co_await write_to(ch, p, addr[p].recv + in_off + off, out + off, bytes);
      }
    }
  }
}

}  // namespace

Task peer_read_all_reduce(const Channel& ch, CollArgs a, char* scratch) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype);
  char* out = static_cast<char*>(a.recvbuf);
  std::vector<PeerBuffers> addr;
  co_await exchange_buffers(ch, a, &addr);
  // Every rank reduces its slice and writes each finished piece into every
  // rank's output; then nobody reuses its buffers while another rank still
  // reads or writes them.
  Split slice(a.count, static_cast<size_t>(n));
  const size_t begin = slice.begin(static_cast<size_t>(r)), len = slice.size(static_cast<size_t>(r));
  co_await reduce_reading_peers(ch, a, addr, static_cast<const char*>(a.sendbuf) + begin * esize,
                                begin * esize, out + begin * esize, len, scratch, true);
  co_await sync_all(ch);
}

Task peer_read_reduce_scatter(const Channel& ch, CollArgs a, char* scratch) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * dtype_size(a.dtype);
  std::vector<PeerBuffers> addr;
  co_await exchange_buffers(ch, a, &addr);
  co_await reduce_reading_peers(ch, a, addr, static_cast<const char*>(a.sendbuf) + r * block, r * block,
                                static_cast<char*>(a.recvbuf), a.count, scratch);
  finish_avg(a, a.recvbuf, a.count, n);
  co_await sync_all(ch);
}

Task peer_read_all_gather(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * dtype_size(a.dtype);
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
  const int n = ch.nranks;
  const size_t bytes = a.count * dtype_size(a.dtype);
  std::vector<PeerBuffers> addr;
  co_await exchange_buffers(ch, a, &addr);
  // In place, the root writes the first n-th of every receiver's buffer
  // while the receivers read the rest: otherwise its core would wait idle,
  // and every rank moves (n-1)/n of the buffer. Out of place, its own copy
  // is already as much as a receiver's read.
  const bool root_in_place = addr[a.root].send == addr[a.root].recv;
  const size_t share = root_in_place ? bytes / static_cast<size_t>(n) / 64 * 64 : 0;
  if (ch.rank == a.root) {
    for (int s = 1; s < n; ++s) {
      const int p = mod(a.root + s, n);
      co_await write_to(ch, p, addr[p].recv, a.sendbuf, share);
    }
    copy_if_distinct(a.recvbuf, a.sendbuf, bytes);
  } else {
    co_await read_from(ch, a.root, static_cast<char*>(a.recvbuf) + share, addr[a.root].send + share,
                       bytes - share);
  }
  co_await sync_all(ch);
}

Task ring_gather_blocks(const Channel& ch, size_t block, BlockAt at, const void* own) {
  const int n = ch.nranks, r = ch.rank;
  const char* mine = own ? static_cast<const char*>(own) : at(r);
  if (n == 1) {
    copy_if_distinct(at(r), mine, block);
    co_return;
  }
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  auto blk = [&](int k) { return at(mod(k, n)); };
  for (size_t off = 0; off < block; off += ch.piece_bytes) {
    size_t len = std::min(ch.piece_bytes, block - off);
    // The own block goes out from the input and into place piece by piece,
    // while the piece is in cache: it is read from memory once, not twice.
    co_await send_piece(ch, next, mine + off, len);
    copy_if_distinct(blk(r) + off, mine + off, len);
    for (int s = 1; s < n - 1; ++s) co_await recv_copy_send(ch, prev, next, blk(r - s) + off, len);
    co_await recv_piece(ch, prev, blk(r + 1) + off, len);
  }
}

Task ring_all_gather(const Channel& ch, CollArgs a) {
  const size_t block = a.count * dtype_size(a.dtype);
  char* out = static_cast<char*>(a.recvbuf);
  // Blocks sit in communicator rank order, whatever order the ring visits.
  auto at = [&ch, out, block](int k) { return out + static_cast<size_t>(ch.global(k)) * block; };
  co_await ring_gather_blocks(ch, block, at, a.sendbuf);
}

Task ring_reduce_blocks(const Channel& ch, size_t count, braid_dtype_t dtype, braid_redop_t op,
                        ConstBlockAt in, char* out) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(dtype), block = count * esize;
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  auto blk = [&](int k) { return in(mod(k, n)); };
  if (n == 1) {
    copy_if_distinct(out, blk(0), block);
    co_return;
  }
  // Block b's partial sum starts at rank b+1 and ends, complete, at rank b.
  const size_t piece = ch.piece_bytes / esize * esize;
  for (size_t off = 0; off < block; off += piece) {
    size_t len = std::min(piece, block - off);
    co_await send_piece(ch, next, blk(r - 1) + off, len);
    for (int s = 1; s < n - 1; ++s)
      co_await recv_reduce_send(ch, prev, next, blk(r - s - 1) + off, len, dtype, op);
    co_await recv_reduce_copy(ch, prev, out + off, blk(r) + off, len, dtype, op);
  }
}

Task ring_reduce_scatter(const Channel& ch, CollArgs a) {
  const size_t block = a.count * dtype_size(a.dtype);
  const char* in = static_cast<const char*>(a.sendbuf);
  co_await ring_reduce_blocks(
      ch, a.count, a.dtype, a.op,
      [&ch, in, block](int k) { return in + static_cast<size_t>(ch.global(k)) * block; },
      static_cast<char*>(a.recvbuf));
  finish_avg(a, a.recvbuf, a.count, ch.nranks);
}

// Every rank sends its block to every other in one step and takes theirs:
// one wait on the slowest peer instead of the ring's n - 1 in a row, which
// is what small calls pay for when ranks wait to be scheduled.
Task direct_all_gather(const Channel& ch, CollArgs a, bool sent) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * dtype_size(a.dtype);
  char* out = static_cast<char*>(a.recvbuf);
  auto at = [&ch, out, block](int k) { return out + static_cast<size_t>(ch.global(k)) * block; };
  if (!sent)
    for (int s = 1; s < n; ++s) co_await send_message(ch, mod(r + s, n), a.sendbuf, block);
  copy_if_distinct(at(r), a.sendbuf, block);
  for (int s = 1; s < n; ++s) {
    const int p = mod(r - s, n);
    co_await recv_message(ch, p, at(p), block);
  }
}

// Every rank sends each peer that peer's block in one step and reduces what
// it receives into its own. In place, the own block is recvbuf: it is
// reduced into itself first, before anything arrives in it.
Task direct_reduce_scatter(const Channel& ch, CollArgs a, bool sent) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * dtype_size(a.dtype);
  const char* in = static_cast<const char*>(a.sendbuf);
  auto blk = [&ch, in, block](int k) { return in + static_cast<size_t>(ch.global(k)) * block; };
  for (int s = 1; s < n && !sent; ++s) {
    const int p = mod(r + s, n);
    co_await send_message(ch, p, blk(p), block);
  }
  copy_if_distinct(a.recvbuf, blk(r), block);
  for (int s = 1; s < n; ++s)
    co_await recv_reduce_copy(ch, mod(r - s, n), a.recvbuf, a.recvbuf, block, a.dtype, a.op);
  finish_avg(a, a.recvbuf, a.count, n);
}

Task direct_gather(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * dtype_size(a.dtype);
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
  const size_t block = a.count * dtype_size(a.dtype);
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

Task pairwise_all_to_all(const Channel& ch, CollArgs a, bool sent) {
  const int n = ch.nranks, r = ch.rank;
  const size_t block = a.count * dtype_size(a.dtype);
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  copy_if_distinct(out + r * block, in + r * block, block);
  // Step s pairs us with r+s (send) and r-s (receive): every rank sends and
  // receives once per step.
  for (int s = 1; s < n; ++s) {
    int to = mod(r + s, n), from = mod(r - s, n);
    if (sent)
      co_await recv_message(ch, from, out + from * block, block);
    else
      co_await exchange(ch, to, in + to * block, block, from, out + from * block, block);
  }
}

Task pairwise_all_to_allv(const Channel& ch, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t es = dtype_size(a.dtype);
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

Task p2p_send(const Channel& ch, CollArgs a, bool offer_read) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  if (offer_read)
    co_await send_by_offer(ch, a.peer, a.sendbuf, bytes);
  else
    co_await send_message(ch, a.peer, a.sendbuf, bytes);
}

Task p2p_recv(const Channel& ch, CollArgs a, size_t read_min_bytes) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  // Whether the sender offered its buffer shows in its first message: it
  // offers only at read_min_bytes and up, where this side is told so.
  if (bytes >= read_min_bytes && ch.to(a.peer)->supports_peer_reads()) {
    co_await recv_or_read(ch, a.peer, a.recvbuf, bytes);
    co_return;
  }
  co_await recv_message(ch, a.peer, a.recvbuf, bytes);
}

}  // namespace braid

namespace braid {
namespace {

Status mismatch_status(const CallTag& mine, int r, const CallTag& theirs, int p) {
  return Status(BRAID_ERR_MISMATCH, "call mismatch: rank " + std::to_string(r) + " called " +
                                        describe_call(mine) + ", rank " + std::to_string(p) + " called " +
                                        describe_call(theirs) + " (BRAID_CHECK_CALLS)");
}

}  // namespace

Task checked_call(const Channel& ch, CallTag mine, Task body) {
  const int n = ch.nranks, r = ch.rank;
  // The tags themselves travel under a tag every rank agrees on, so the
  // comparison below, not the check on every message, reports a difference.
  Op* op = current_op();
  op->tag = CallTag{};
  op->tag.kind = kCallCheckTag;
  op->tag.seq = mine.seq;
  std::vector<CallTag> theirs(static_cast<size_t>(n));
  for (int s = 1; s < n; ++s) {
    co_await exchange(ch, mod(r + s, n), &mine, sizeof mine, mod(r - s, n), &theirs[mod(r - s, n)],
                      sizeof mine);
  }
  int differs = -1;
  for (int p = 0; p < n && differs < 0; ++p) {
    if (p != r && !(theirs[p] == mine)) differs = p;
  }
  if (differs >= 0) {
    // Named, not a temporary of the co_await operand: built there, with GCC 12
    // its Status was released twice when the op's frame was destroyed at that
    // suspension (ASan: use after free).
    FailOp fail{mismatch_status(mine, ch.global(r), theirs[differs], ch.global(differs))};
    co_await fail;
  }
  op->tag = mine;
  co_await std::move(body);
}

}  // namespace braid
