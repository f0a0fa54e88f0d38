#include "src/algo/window_collectives.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/copy_kernels.h"
#include "kernels/cpu/reduce_kernels.h"
#include "src/algo/split.h"
#include "src/core/dtype.h"
#include "src/core/engine.h"

namespace braid {
namespace {

// Every rank's `mine` into all[rank] (T empty: only every rank got here),
// by direct_all_gather: every message is posted before any is awaited, so
// where ranks share cores one wait for the slowest instead of n - 1 in a row.
template <class T>
Task all_gather_record(const Channel& ch, const T& mine, std::vector<T>* all) {
  all->assign(ch.nranks, T{});
  CollArgs g;
  g.sendbuf = &mine;
  g.recvbuf = all->data();
  g.count = std::is_empty_v<T> ? 0 : sizeof(T);
  g.dtype = BRAID_UINT8;
  co_await direct_all_gather(ch, g);
}

struct Arrived {};

constexpr size_t kScratchBytes = 32 * 1024;

// Where a rank's buffers lie.
struct BufferSpot {
  uint32_t send_window = kNoWindow, recv_window = kNoWindow;
  uint64_t send_off = 0, recv_off = 0;
};

const HostWindow* window_with(const HostWindows& windows, uint32_t id) {
  for (const auto& w : windows)
    if (w->id == id) return w.get();
  return nullptr;
}

// Whether [off, off + len) lies inside [0, total), without overflow.
bool lies_within(uint64_t off, uint64_t len, uint64_t total) {
  return off <= total && len <= total - off;
}

// The window holding [p, p + bytes) on this rank, and the offset there.
void locate(const HostWindows& windows, const void* p, size_t bytes, uint32_t* id, uint64_t* off) {
  const char* c = static_cast<const char*>(p);
  if (c == nullptr || bytes == 0) return;
  for (const auto& w : windows) {
    if (c >= w->local && lies_within(static_cast<uint64_t>(c - w->local), bytes, w->bytes)) {
      *id = w->id;
      *off = static_cast<uint64_t>(c - w->local);
      return;
    }
  }
}

// Rank p's send or receive buffer of `bytes` as mapped here, or null. The
// spot is rank p's word: one that does not lie inside its range is not
// used (every rank reads the same spots and spans, so all decide alike).
char* mapped(const HostWindows& windows, const std::vector<BufferSpot>& spots, int p, bool send,
             size_t bytes) {
  const BufferSpot& s = spots[p];
  const HostWindow* w = window_with(windows, send ? s.send_window : s.recv_window);
  const uint64_t off = send ? s.send_off : s.recv_off;
  if (w == nullptr || !lies_within(off, bytes, w->span[p])) return nullptr;
  return w->at[p] + off;
}

void place(void* dst, const void* src, size_t bytes, bool streaming) {
  if (streaming)
    kernels::copy_streaming(dst, src, bytes);
  else
    std::memcpy(dst, src, bytes);
}

// tmp[0, len) = the reduction, in rank order, of every rank's input at byte
// offset `off` (averaged for AVG).
void reduce_inputs(const CollArgs& a, const std::vector<char*>& in, size_t off, size_t len, char* tmp) {
  kernels::reduce(a.dtype, a.op, tmp, in[0] + off, in[1] + off, len);
  for (size_t p = 2; p < in.size(); ++p) kernels::reduce(a.dtype, a.op, tmp, tmp, in[p] + off, len);
  if (a.op == BRAID_AVG) kernels::divide(a.dtype, tmp, tmp, len, static_cast<int>(in.size()));
}

void count(std::atomic<uint64_t>* moved, uint64_t bytes) {
  moved->store(moved->load(std::memory_order_relaxed) + bytes, std::memory_order_relaxed);
}

// A piece stored into rank p's output, unless p is a peer that failed since
// the call began: it may have returned and reused its buffer, so at most
// the piece being written when it failed lands there.
Status store_into(const Channel& ch, int p, char* dst, const char* src, size_t bytes, bool streaming) {
  if (p != ch.rank)
    if (Status st = ch.to(p)->peer_failure(); !st) return st;
  place(dst, src, bytes, streaming);
  return Status::ok();
}

// Rank r reduces slice r of every rank's input, in rank order (so every
// element is computed once, on one rank, and copied everywhere), and writes
// it into every rank's output. Only rank r touches slice r anywhere, so in
// place is safe: a piece is read everywhere before it is written anywhere.
// Pieces go into peers' outputs through store_into (a slice's worth landed
// in a failed peer's buffer before it).
Status all_reduce_over(const Channel& ch, const CollArgs& a, const std::vector<char*>& in,
                       const std::vector<char*>& out, bool streaming, char* tmp,
                       std::atomic<uint64_t>* moved) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype), chunk = kScratchBytes / esize;
  Split slice(a.count, static_cast<size_t>(n));
  const size_t begin = slice.begin(static_cast<size_t>(r)), end = begin + slice.size(static_cast<size_t>(r));
  for (size_t e = begin; e < end; e += chunk) {
    const size_t len = std::min(chunk, end - e), off = e * esize, bytes = len * esize;
    reduce_inputs(a, in, off, len, tmp);
    for (int s = 0; s < n; ++s) {
      const int p = mod(r + s, n);
      BRAID_RETURN_IF_ERROR(store_into(ch, p, out[p] + off, tmp, bytes, streaming));
    }
    count(moved, 2 * (n - 1) * len * esize);
  }
  return Status::ok();
}

// Rank r copies slice r of the root's input `src` into every output that
// lacks it (the root's own too, out of place), a chunk at a time, so the
// ranks share the n - 1 copies of the buffer, as bench/ceiling's threads
// do, where each receiver copying all of it left the root idle. Starting
// after this rank, ranks write different outputs at once, through
// store_into. The root's copy into its own output is not counted: it
// crosses no process.
Status broadcast_over(const Channel& ch, const CollArgs& a, const char* src, const std::vector<char*>& out,
                      bool streaming, std::atomic<uint64_t>* moved) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype);
  Split slice(a.count, static_cast<size_t>(n));
  const size_t begin = slice.begin(static_cast<size_t>(r)) * esize;
  const size_t end = begin + slice.size(static_cast<size_t>(r)) * esize;
  for (size_t off = begin; off < end; off += kScratchBytes) {
    const size_t len = std::min(kScratchBytes, end - off);
    for (int s = 1; s <= n; ++s) {
      const int p = mod(r + s, n);
      if (out[p] == src) continue;  // the root, in place
      BRAID_RETURN_IF_ERROR(store_into(ch, p, out[p] + off, src + off, len, streaming));
      if (p != r || r != a.root) count(moved, len);
    }
  }
  return Status::ok();
}

// This rank's block: the reduction of block `rank` of every rank's input.
void reduce_scatter_over(const Channel& ch, const CollArgs& a, const std::vector<char*>& in, char* out,
                         char* tmp, std::atomic<uint64_t>* moved) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype), chunk = kScratchBytes / esize;
  const size_t block = a.count * esize;
  for (size_t e = 0; e < a.count; e += chunk) {
    const size_t len = std::min(chunk, a.count - e), off = r * block + e * esize;
    reduce_inputs(a, in, off, len, tmp);
    std::memcpy(out + e * esize, tmp, len * esize);
  }
  count(moved, (n - 1) * block);
}

}  // namespace

void WindowRecord::set_failure(const std::string& reason, bool by_user) {
  ok = 0;
  user_error = by_user ? 1 : 0;
  std::snprintf(why, sizeof(why), "%s", reason.c_str());
}

PeerMapping::~PeerMapping() {
  munmap(base, bytes);
}

Status PeerMappings::map(Connection* to_peer, int peer, const WindowRecord& theirs,
                         std::shared_ptr<const PeerMapping>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = live_.begin(); it != live_.end();)
    it = it->second.expired() ? live_.erase(it) : std::next(it);
  std::weak_ptr<const PeerMapping>& slot = live_[{peer, theirs.alloc_serial}];
  if (auto m = slot.lock()) {
    *out = std::move(m);
    return Status::ok();
  }
  char* base = nullptr;
  BRAID_RETURN_IF_ERROR(to_peer->map_peer_memory(theirs.fd, theirs.alloc_bytes, &base));
  auto m = std::make_shared<const PeerMapping>(base, theirs.alloc_bytes);
  slot = m;
  *out = std::move(m);
  return Status::ok();
}

Task window_connect(const Channel& ch, WindowRecord mine, PeerMappings* mappings, HostWindow* w,
                    WindowVerdict* verdict) {
  const int n = ch.nranks, r = ch.rank;
  std::vector<WindowRecord> all;
  co_await all_gather_record(ch, mine, &all);
  w->at.assign(n, nullptr);
  w->at[r] = w->local;
  w->span.assign(n, 0);
  for (int p = 0; p < n; ++p) w->span[p] = p == r ? w->bytes : all[p].range_bytes;
  // This rank's verdict: whether every rank's argument was good and it
  // mapped every peer's range.
  WindowRecord mapped = mine;
  for (int p = 0; p < n && mapped.ok; ++p) {
    if (p == r) continue;
    if (!all[p].ok) {
      all[p].why[sizeof(all[p].why) - 1] = '\0';
      mapped.set_failure(all[p].why, true);
      break;
    }
    if (!lies_within(all[p].offset, all[p].range_bytes, all[p].alloc_bytes)) {
      mapped.set_failure("rank " + std::to_string(ch.global(p)) + "'s registration record is out of range (" +
                             std::to_string(all[p].range_bytes) + " bytes at offset " +
                             std::to_string(all[p].offset) + " of an allocation of " +
                             std::to_string(all[p].alloc_bytes) + ")",
                         false);
      break;
    }
    std::shared_ptr<const PeerMapping> m;
    if (Status st = mappings->map(ch.to(p), ch.global(p), all[p], &m); !st) {
      mapped.set_failure("rank " + std::to_string(ch.global(r)) + " could not map rank " +
                             std::to_string(ch.global(p)) + "'s registered memory: " + st.message(),
                         false);
      break;
    }
    w->at[p] = m->base + all[p].offset;
    w->maps.push_back(std::move(m));
  }
  std::vector<WindowRecord> verdicts;
  co_await all_gather_record(ch, mapped, &verdicts);
  const WindowRecord* first = nullptr;  // a bad argument first, else a failed mapping
  for (const WindowRecord& v : verdicts)
    if (!v.ok && (first == nullptr || (v.user_error && !first->user_error))) first = &v;
  if (first == nullptr) {
    verdict->outcome = WindowVerdict::kMapped;
    co_return;
  }
  w->maps.clear();
  verdict->outcome = first->user_error ? WindowVerdict::kRefused : WindowVerdict::kUnmappable;
  verdict->why = std::string(first->why, strnlen(first->why, sizeof(first->why)));
}

HostWindow::~HostWindow() {
  if (on_release) on_release();
}

Task window_disconnect(const Channel& ch, uint32_t id, std::string* why) {
  std::vector<uint32_t> ids;
  co_await all_gather_record(ch, id, &ids);
  auto name = [](uint32_t i) {
    return i == kNoWindow ? std::string("a buffer it had not registered") : "window #" + std::to_string(i);
  };
  for (int p = 0; p < ch.nranks; ++p) {
    if (ids[p] == ids[0]) continue;
    *why = "ranks deregistered different buffers: rank " + std::to_string(ch.global(0)) + " " + name(ids[0]) +
           ", rank " + std::to_string(ch.global(p)) + " " + name(ids[p]);
    co_return;
  }
}

Task window_or(const Channel& ch, HostWindows windows, Coll c, CollArgs a, Task otherwise,
               size_t streaming_min_bytes, std::atomic<uint64_t>* moved) {
  const int n = ch.nranks, r = ch.rank;
  const size_t esize = dtype_size(a.dtype);
  const size_t block = a.count * esize;  // all_gather: sent; reduce_scatter: received
  const size_t in_bytes = c == Coll::kReduceScatter ? block * n : block;
  const size_t out_bytes = c == Coll::kAllGather ? block * n : block;
  BufferSpot mine;
  locate(windows, a.sendbuf, in_bytes, &mine.send_window, &mine.send_off);
  locate(windows, a.recvbuf, out_bytes, &mine.recv_window, &mine.recv_off);
  std::vector<BufferSpot> spots;
  // Also the start line: once it is done, every rank's input is ready.
  co_await all_gather_record(ch, mine, &spots);
  // A peer that failed since it sent its spot (timed out waiting for a
  // third, aborted) may have returned, and its buffers are its user's
  // again: no load or store goes to them. A failure after this point
  // is found at the closing round, as in any collective.
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    if (Status st = ch.to(p)->peer_failure(); !st) co_await FailOp{std::move(st)};
  }
  std::vector<char*> in(n), out(n);
  bool direct = true;
  // A broadcast whose outputs are all mapped too shares its copies out.
  bool shared_copies = c == Coll::kBroadcast;
  for (int p = 0; p < n; ++p) {
    const bool reads_input = c != Coll::kBroadcast || p == a.root;
    if (reads_input) direct = direct && (in[p] = mapped(windows, spots, p, true, in_bytes)) != nullptr;
    if (c == Coll::kAllReduce)
      direct = direct && (out[p] = mapped(windows, spots, p, false, out_bytes)) != nullptr;
    if (shared_copies) shared_copies = (out[p] = mapped(windows, spots, p, false, out_bytes)) != nullptr;
  }
  if (!direct) {
    co_await std::move(otherwise);
    co_return;
  }
  current_op()->algo = "window";
  char* mine_out = static_cast<char*>(a.recvbuf);
  // The call's buffers on every rank together (an input inside the output
  // counted once, a broadcast's input on the root only): from
  // streaming_min_bytes on, outputs are written with streaming stores.
  const bool in_place = c == Coll::kAllGather ? static_cast<const char*>(a.sendbuf) == mine_out + r * block
                                              : a.sendbuf == a.recvbuf;
  const size_t inputs = c == Coll::kBroadcast ? block : (in_place ? 0 : n * in_bytes);
  const bool streaming = n * out_bytes + inputs >= streaming_min_bytes;
  // Reductions go through a piece that stays in cache.
  std::vector<char> scratch(c == Coll::kAllReduce || c == Coll::kReduceScatter ? kScratchBytes : 0);
  switch (c) {
    case Coll::kAllReduce:
      // In place, every output line was just read as input: it is in cache.
      if (Status st = all_reduce_over(ch, a, in, out, streaming && !in_place, scratch.data(), moved); !st)
        co_await FailOp{std::move(st)};
      break;
    case Coll::kReduceScatter:
      reduce_scatter_over(ch, a, in, mine_out, scratch.data(), moved);
      break;
    case Coll::kAllGather:
      for (int s = 0; s < n; ++s) {
        const int p = mod(r + s, n);
        if (mine_out + p * block != in[p]) place(mine_out + p * block, in[p], block, streaming);
      }
      count(moved, (n - 1) * block);
      break;
    default:  // broadcast
      if (shared_copies) {
        if (Status st = broadcast_over(ch, a, in[a.root], out, streaming, moved); !st)
          co_await FailOp{std::move(st)};
        break;
      }
      if (mine_out != in[a.root]) place(mine_out, in[a.root], block, streaming);
      if (r != a.root) count(moved, block);
      break;
  }
  // Nobody returns (and reuses its buffers) while another rank still reads
  // or writes them.
  std::vector<Arrived> arrived;
  co_await all_gather_record(ch, Arrived{}, &arrived);
}

}  // namespace braid
