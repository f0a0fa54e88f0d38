#include "src/algo/ipc_collectives.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "src/algo/split.h"
#include "src/core/dtype.h"

namespace braid {
namespace {

// Slices of a chunk start 256 bytes apart at least, so that the kernels'
// 16-byte loads and stores line up wherever the buffers do.
constexpr size_t kSliceAlignBytes = 256;

Task fail_with(Status st) {
  FailOp fail{std::move(st)};
  co_await fail;
}

// Done at once when an enqueue succeeded; otherwise fails the op.
Step enqueued(Status st) {
  if (st) return Step();
  return Step(fail_with(std::move(st)));
}

// The end of a phase: this rank's stream ran what was enqueued, then every
// rank got that far.
Task settle(IpcWindow& w) {
  co_await enqueued(w.post_mark());
  co_await Until{w.settled_wait()};
  co_await enqueued(w.stream_error());
}

Task phase_end(const Channel& ch, IpcWindow& w) {
  co_await settle(w);
  co_await sync_all(ch);
}

// Every member's region at `offset` of its input: the sources of a reduction,
// in member order on every rank (so results are the same everywhere).
std::vector<const void*> inputs_at(const Channel& ch, const IpcWindow& w, size_t offset) {
  std::vector<const void*> srcs(ch.nranks);
  for (int p = 0; p < ch.nranks; ++p) srcs[p] = w.input(p) + offset;
  return srcs;
}

// A reducing collective's input into a window: copied, or divided by the
// number of ranks on the way where AVG scales inputs (avg_scales_inputs).
Status input_to_window(IpcWindow& w, const CollArgs& a, int nranks, void* dst, const void* src,
                       size_t bytes) {
  if (avg_scales_inputs(a)) return w.divide(a.dtype, src, dst, bytes / dtype_size(a.dtype), nranks);
  return w.copy(dst, src, bytes);
}

Task reduce_and_finish(IpcWindow& w, const CollArgs& a, const std::vector<const void*>& srcs, void* dst,
                       size_t count, int nranks) {
  co_await enqueued(w.reduce(a.dtype, a.op, srcs, dst, count));
  if (a.op == BRAID_AVG && !avg_scales_inputs(a))
    co_await enqueued(w.divide(a.dtype, dst, dst, count, nranks));
}

// Elements per chunk where this rank's window holds a piece of every
// rank's block.
size_t piece_chunk(const IpcWindow& w, int nranks, size_t esize) {
  const size_t fit = w.region_bytes() / (static_cast<size_t>(nranks) * esize);
  // A whole number of 256-byte units, so every piece (p * bytes into the
  // window, off * esize into the user's blocks) keeps the alignment the
  // kernels' 16-byte path needs: 11,184,808-byte pieces (32 MiB over 3
  // ranks) would send every element after the first piece down the scalar
  // path.
  const size_t unit = std::max<size_t>(1, kSliceAlignBytes / esize);
  return fit >= unit ? fit / unit * unit : std::max<size_t>(1, fit);
}

// Bytes [at, at + bytes) of every member's block of `in` (blocks `block`
// bytes apart) into this rank's window, member p's at p * bytes; the block
// of member `skip` (-1: none) stays out. `reduced`: the blocks are a
// reducing collective's input (input_to_window).
Task pieces_to_window(const Channel& ch, IpcWindow& w, const CollArgs* reduced, const char* in, size_t block,
                      size_t at, size_t bytes, int skip) {
  for (int p = 0; p < ch.nranks; ++p) {
    if (p == skip) continue;
    char* dst = w.input(ch.rank) + p * bytes;
    // Not a conditional expression inside co_await: GCC 12 evaluates both
    // arms there (docs/design.md, "Operations are coroutines").
    Status put;
    if (reduced != nullptr)
      put = input_to_window(w, *reduced, ch.nranks, dst, in + p * block + at, bytes);
    else
      put = w.copy(dst, in + p * block + at, bytes);
    co_await enqueued(std::move(put));
  }
}

// Bytes at `src` of every member's window (this rank's own too, with
// `self`) into that member's block of `out`, at `at`.
Task windows_to_blocks(const Channel& ch, IpcWindow& w, size_t src, char* out, size_t block, size_t at,
                       size_t bytes, bool self) {
  for (int s = self ? 0 : 1; s < ch.nranks; ++s) {
    const int p = mod(ch.rank + s, ch.nranks);
    co_await enqueued(w.copy(out + p * block + at, w.input(p) + src, bytes));
  }
}

}  // namespace

std::unique_ptr<IpcWindow> make_ipc_window(const IpcSetup& setup, int nranks, int rank,
                                           std::string* failure) {
  std::unique_ptr<IpcWindow> w;
  if (Status made = IpcWindow::make(*setup.cu, setup.ctx, setup.region_bytes, nranks, rank, setup.wake,
                                    setup.moved, &w);
      !made) {
    *failure = made.message();
    return nullptr;
  }
  return w;
}

Task ipc_connect(const Channel& ch, IpcSetup setup, IpcWindow* w, std::string failure, bool* connected,
                 std::string* why) {
  const int n = ch.nranks, r = ch.rank;
  IpcWindowRecord mine;
  if (w)
    mine = w->record();
  else
    mine.set_failure("rank " + std::to_string(r) + ": " + failure);
  std::vector<IpcWindowRecord> all(n);
  all[r] = mine;
  for (int s = 1; s < n; ++s)
    co_await exchange(ch, mod(r + s, n), &mine, sizeof(mine), mod(r - s, n), &all[mod(r - s, n)],
                      sizeof(IpcWindowRecord));
  // The verdict: whether this rank has a window and mapped every peer's.
  IpcWindowRecord verdict = mine;
  for (int p = 0; p < n && verdict.ok; ++p) {
    if (p == r) continue;
    if (!all[p].ok) {
      all[p].why[sizeof(all[p].why) - 1] = '\0';
      verdict.set_failure(all[p].why);
    } else {
      if (Status st = w->map_peer(p, all[p], setup.gpu_path_allowed); !st)
        verdict.set_failure("rank " + std::to_string(r) + " could not map rank " + std::to_string(p) +
                            "'s device window: " + st.message());
    }
  }
  std::vector<IpcWindowRecord> verdicts(n);
  verdicts[r] = verdict;
  for (int s = 1; s < n; ++s)
    co_await exchange(ch, mod(r + s, n), &verdict, sizeof(verdict), mod(r - s, n), &verdicts[mod(r - s, n)],
                      sizeof(IpcWindowRecord));
  for (const IpcWindowRecord& v : verdicts) {
    if (v.ok) continue;
    // Every rank gives up in step: unmap, then free once nobody maps ours.
    if (w) w->unmap_peers();
    co_await sync_all(ch);
    if (w) w->peers_unmapped();
    *why = std::string(v.why, strnlen(v.why, sizeof(v.why)));
    co_return;
  }
  *connected = true;
}

Task ipc_disconnect(const Channel& ch, IpcWindow* w) {
  co_await settle(*w);
  w->unmap_peers();
  co_await sync_all(ch);
  w->peers_unmapped();
}

Task ipc_all_reduce(const Channel& ch, IpcWindow& w, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype);
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  const size_t chunk = w.region_bytes() / esize;
  for (size_t off = 0; off < a.count; off += chunk) {
    const size_t len = std::min(chunk, a.count - off);
    const Split slice(len, static_cast<size_t>(n), std::max<size_t>(1, kSliceAlignBytes / esize));
    co_await enqueued(input_to_window(w, a, n, w.input(r), in + off * esize, len * esize));
    co_await phase_end(ch, w);
    // Our slice, reduced from every window into ours; then every slice
    // from its owner's window into the output.
    const size_t b = slice.begin(static_cast<size_t>(r)) * esize;
    co_await reduce_and_finish(w, a, inputs_at(ch, w, b), w.output(r) + b, slice.size(static_cast<size_t>(r)),
                               n);
    co_await phase_end(ch, w);
    for (int s = 0; s < n; ++s) {
      const int p = mod(r + s, n);
      const size_t at = slice.begin(static_cast<size_t>(p)) * esize;
      co_await enqueued(
          w.copy(out + off * esize + at, w.output(p) + at, slice.size(static_cast<size_t>(p)) * esize));
    }
  }
  co_await phase_end(ch, w);
}

Task ipc_broadcast(const Channel& ch, IpcWindow& w, CollArgs a) {
  const int r = ch.rank;
  const size_t esize = dtype_size(a.dtype);
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  const size_t chunk = w.region_bytes() / esize;
  for (size_t off = 0; off < a.count; off += chunk) {
    const size_t bytes = std::min(chunk, a.count - off) * esize;
    if (r == a.root) {
      co_await enqueued(w.copy(w.input(r), in + off * esize, bytes));
      co_await enqueued(w.copy(out + off * esize, in + off * esize, bytes));
    }
    co_await phase_end(ch, w);
    if (r != a.root) co_await enqueued(w.copy(out + off * esize, w.input(a.root), bytes));
    co_await phase_end(ch, w);
  }
}

Task ipc_reduce(const Channel& ch, IpcWindow& w, CollArgs a) {
  const int r = ch.rank;
  const size_t esize = dtype_size(a.dtype);
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  const size_t chunk = w.region_bytes() / esize;
  for (size_t off = 0; off < a.count; off += chunk) {
    const size_t len = std::min(chunk, a.count - off);
    co_await enqueued(input_to_window(w, a, ch.nranks, w.input(r), in + off * esize, len * esize));
    co_await phase_end(ch, w);
    if (r == a.root) co_await reduce_and_finish(w, a, inputs_at(ch, w, 0), out + off * esize, len, ch.nranks);
    co_await phase_end(ch, w);
  }
}

Task ipc_all_gather(const Channel& ch, IpcWindow& w, CollArgs a) {
  const int r = ch.rank;
  const size_t esize = dtype_size(a.dtype), block = a.count * esize;
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  const size_t chunk = w.region_bytes() / esize;
  for (size_t off = 0; off < a.count; off += chunk) {
    const size_t bytes = std::min(chunk, a.count - off) * esize;
    co_await enqueued(w.copy(w.input(r), in + off * esize, bytes));
    co_await phase_end(ch, w);
    co_await windows_to_blocks(ch, w, 0, out, block, off * esize, bytes, true);
    co_await phase_end(ch, w);
  }
}

Task ipc_reduce_scatter(const Channel& ch, IpcWindow& w, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype), block = a.count * esize;
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  const size_t chunk = piece_chunk(w, n, esize);
  for (size_t off = 0; off < a.count; off += chunk) {
    const size_t len = std::min(chunk, a.count - off), bytes = len * esize;
    co_await pieces_to_window(ch, w, &a, in, block, off * esize, bytes, -1);
    co_await phase_end(ch, w);
    co_await reduce_and_finish(w, a, inputs_at(ch, w, r * bytes), out + off * esize, len, n);
    co_await phase_end(ch, w);
  }
}

Task ipc_gather(const Channel& ch, IpcWindow& w, CollArgs a) {
  const int r = ch.rank;
  const size_t esize = dtype_size(a.dtype), block = a.count * esize;
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  const size_t chunk = w.region_bytes() / esize;
  for (size_t off = 0; off < a.count; off += chunk) {
    const size_t bytes = std::min(chunk, a.count - off) * esize;
    // The root's own block goes straight to its place (nothing in place).
    if (r == a.root)
      co_await enqueued(w.copy(out + r * block + off * esize, in + off * esize, bytes));
    else
      co_await enqueued(w.copy(w.input(r), in + off * esize, bytes));
    co_await phase_end(ch, w);
    if (r == a.root) co_await windows_to_blocks(ch, w, 0, out, block, off * esize, bytes, false);
    co_await phase_end(ch, w);
  }
}

Task ipc_scatter(const Channel& ch, IpcWindow& w, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype), block = a.count * esize;
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  // The root's window holds a piece of every other rank's block per chunk.
  const size_t chunk = piece_chunk(w, n, esize);
  for (size_t off = 0; off < a.count; off += chunk) {
    const size_t bytes = std::min(chunk, a.count - off) * esize;
    if (r == a.root) {
      co_await pieces_to_window(ch, w, nullptr, in, block, off * esize, bytes, r);
      co_await enqueued(w.copy(out + off * esize, in + r * block + off * esize, bytes));
    }
    co_await phase_end(ch, w);
    if (r != a.root) co_await enqueued(w.copy(out + off * esize, w.input(a.root) + r * bytes, bytes));
    co_await phase_end(ch, w);
  }
}

Task ipc_all_to_all(const Channel& ch, IpcWindow& w, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype), block = a.count * esize;
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  // This rank's window holds, per chunk, one piece of the block for every
  // rank, at that rank's index; its own block is copied across directly.
  const size_t chunk = piece_chunk(w, n, esize);
  for (size_t off = 0; off < a.count; off += chunk) {
    const size_t bytes = std::min(chunk, a.count - off) * esize;
    co_await pieces_to_window(ch, w, nullptr, in, block, off * esize, bytes, r);
    co_await enqueued(w.copy(out + r * block + off * esize, in + r * block + off * esize, bytes));
    co_await phase_end(ch, w);
    co_await windows_to_blocks(ch, w, r * bytes, out, block, off * esize, bytes, false);
    co_await phase_end(ch, w);
  }
}

Task ipc_all_to_allv(const Channel& ch, IpcWindow& w, CollArgs a) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype), un = static_cast<size_t>(n);
  const size_t *scount = a.layout, *sdispl = a.layout + un, *rcount = a.layout + 2 * un,
               *rdispl = a.layout + 3 * un;
  const char* in = static_cast<const char*>(a.sendbuf);
  char* out = static_cast<char*>(a.recvbuf);
  // The windows carry no sizes, and every rank must run as many chunks: each
  // tells every peer what it sends it and its longest block, and checks
  // what it is sent against what it expects (a ring would find out from
  // the message size).
  struct Plan {
    uint64_t to_you, longest;
  };
  uint64_t local = 0;
  for (size_t p = 0; p < un; ++p) local = std::max<uint64_t>(local, std::max(scount[p], rcount[p]));
  uint64_t longest = local;
  for (int s = 1; s < n; ++s) {
    const int to = mod(r + s, n), from = mod(r - s, n);
    Plan mine{scount[to], local}, theirs{};
    co_await exchange(ch, to, &mine, sizeof(mine), from, &theirs, sizeof(theirs));
    if (theirs.to_you != rcount[from]) {
      const Op* op = current_op();
      co_await fail_with(Status(
          BRAID_ERR_MISMATCH, std::string(op->name) + " #" + std::to_string(op->seq) + ": rank " +
                                  std::to_string(ch.global(from)) + " sends " +
                                  std::to_string(theirs.to_you) + " elements to rank " +
                                  std::to_string(ch.global(r)) + ", whose recvcounts[" +
                                  std::to_string(ch.global(from)) + "] is " + std::to_string(rcount[from])));
    }
    longest = std::max(longest, theirs.longest);
  }
  // Per chunk, elements [off, off + piece) of every block.
  const size_t piece = piece_chunk(w, n, esize);
  auto part = [piece](size_t count, size_t off) { return off >= count ? 0 : std::min(piece, count - off); };
  for (size_t off = 0; off < longest; off += piece) {
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      co_await enqueued(w.copy(w.input(r) + p * piece * esize, in + (sdispl[p] + off) * esize,
                               part(scount[p], off) * esize));
    }
    co_await enqueued(w.copy(out + (rdispl[r] + off) * esize, in + (sdispl[r] + off) * esize,
                             part(rcount[r], off) * esize));
    co_await phase_end(ch, w);
    for (int s = 1; s < n; ++s) {
      const int p = mod(r + s, n);
      co_await enqueued(w.copy(out + (rdispl[p] + off) * esize, w.input(p) + r * piece * esize,
                               part(rcount[p], off) * esize));
    }
    co_await phase_end(ch, w);
  }
}

Task ipc_with_input_copy(const Channel& ch, IpcWindow& w, CollArgs a, size_t in_bytes, char* copy,
                         Task (*run)(const Channel&, IpcWindow&, CollArgs)) {
  co_await enqueued(w.copy(copy, a.sendbuf, in_bytes));
  a.sendbuf = copy;
  co_await run(ch, w, a);
}

}  // namespace braid
