#include "src/core/trace.h"

#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "src/core/engine.h"
#include "src/core/logging.h"

namespace braid {
namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out + "\"";
}

std::string track_name(int tid) {
  if (tid == 0) return "collectives";
  const int peer = (tid - 1) / 2;
  return (tid % 2 == 1 ? "send to rank " : "recv from rank ") + std::to_string(peer);
}

// A length in 32 bits: exact ticks below 2^31 (about a second); above, the
// top bit set and the rest in units of 2^12 ticks, which reaches an hour at
// several GHz. Slow ops and long waits are what a trace is read for.
constexpr uint32_t kCoarseLength = 1u << 31;
constexpr int kCoarseShift = 12;

uint32_t encode_length(uint64_t ticks) {
  if (ticks < kCoarseLength) return static_cast<uint32_t>(ticks);
  const uint64_t coarse = ticks >> kCoarseShift;
  return kCoarseLength | static_cast<uint32_t>(std::min<uint64_t>(coarse, kCoarseLength - 1));
}

uint64_t decode_length(uint32_t v) {
  if ((v & kCoarseLength) == 0) return v;
  return static_cast<uint64_t>(v & ~kCoarseLength) << kCoarseShift;
}

double realtime_us() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) * 1e-3;
}

// Ticks and wall clock read together at start-up; the rate comes from a
// second pair read when converting (the longer apart, the more exact).
struct ClockOrigin {
  uint64_t ticks = trace_ticks();
  double us = realtime_us();
};
const ClockOrigin g_origin;

double us_per_tick() {
#if defined(__x86_64__) || defined(__i386__)
  const uint64_t t = trace_ticks();
  const double us = realtime_us();
  if (t <= g_origin.ticks || us - g_origin.us < 1000.0) {
    // Too close to start-up to measure the rate: measure it over 2 ms once.
    static const double rate = [] {
      const uint64_t t0 = trace_ticks();
      const double u0 = realtime_us();
      double u1;
      do u1 = realtime_us();
      while (u1 - u0 < 2000.0);
      return (u1 - u0) / static_cast<double>(trace_ticks() - t0);
    }();
    return rate;
  }
  return (us - g_origin.us) / static_cast<double>(t - g_origin.ticks);
#else
  return 1e-3;
#endif
}

}  // namespace

double ticks_to_us(uint64_t delta) {
  return static_cast<double>(delta) * us_per_tick();
}

std::unique_ptr<TraceRecorder> TraceRecorder::make(const Config& config, int rank, int nranks) {
  if (config.trace_file.empty()) return nullptr;
  static std::atomic<int> made{0};
  std::string path = expand_path_pattern(config.trace_file.c_str(), rank);
  auto before_extension = [&path](const std::string& tag) {
    const size_t slash = path.rfind('/');
    size_t dot = path.rfind('.');
    if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) dot = path.size();
    path.insert(dot, tag);
  };
  // Without %r (or %p) every rank would write the same file: the last one
  // to finish would be the only trace left.
  const std::string& pattern = config.trace_file;
  if (nranks > 1 && pattern.find("%r") == std::string::npos && pattern.find("%p") == std::string::npos) {
    before_extension("-r" + std::to_string(rank));
    if (rank == 0)
      BRAID_INFO("TRACE", rank, "BRAID_TRACE_FILE has no %%r: each rank writes its own file, e.g. %s",
                 path.c_str());
  }
  if (int k = made.fetch_add(1); k > 0) before_extension("-c" + std::to_string(k));
  std::unique_ptr<TraceRecorder> t(new TraceRecorder());
  t->path_ = path;
  t->rank_ = rank;
  t->nranks_ = nranks;
  t->host_ = config.host_id;
  t->min_wait_ticks_ = static_cast<uint64_t>(config.trace_min_wait_us / us_per_tick());
  t->max_events_ = config.trace_max_events;
  t->map_chunk();  // now, not during the first operation
  t->strings_.push_back("?");
  return t;
}

int TraceRecorder::track_of(const Op& op) {
  if (op.lane == LaneKind::kCollective || op.lane_peer < 0) return 0;
  return 1 + 2 * op.lane_peer + (op.lane == LaneKind::kRecv ? 1 : 0);
}

bool TraceRecorder::room() {
  if (count_ < max_events_) return true;
  if (!dropped_) {
    BRAID_WARN("TRACE", rank_, "trace buffer full (BRAID_TRACE_MAX_EVENTS=%zu): later events are dropped",
               max_events_);
  }
  dropped_ = true;
  return false;
}

TraceRecorder::~TraceRecorder() {
  for (Chunk& c : chunks_) munmap(c.events, kChunkEvents * sizeof(Event));
}

bool TraceRecorder::map_chunk() {
  void* p = mmap(nullptr, kChunkEvents * sizeof(Event), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) {
    if (!dropped_) BRAID_WARN("TRACE", rank_, "no memory for more trace events: later events are dropped");
    dropped_ = true;
    max_events_ = count_;
    return false;
  }
  chunks_.push_back({static_cast<Event*>(p), 0});
  return true;
}

void TraceRecorder::push(const Event& e) {
  if ((chunks_.empty() || chunks_.back().used == kChunkEvents) && !map_chunk()) return;
  Chunk& c = chunks_.back();
  c.events[c.used++] = e;
  ++count_;
  // Fetch the next record's line now, for writing: the store of the next
  // op then hits the cache instead of waiting on memory (the op takes far
  // longer than the fetch).
  if (c.used < kChunkEvents) __builtin_prefetch(&c.events[c.used + (c.used & 1)], 1, 3);
}

uint8_t TraceRecorder::intern(const char* s) {
  // Runs of one operation (and one algorithm) are the common case.
  for (const Memo& m : memo_)
    if (m.s == s) return m.index;
  for (size_t i = 0; i < strings_.size(); ++i) {
    if (strings_[i] == s) {
      memo_[memo_next_++ % 2] = {s, static_cast<uint8_t>(i)};
      return static_cast<uint8_t>(i);
    }
  }
  if (strings_.size() == 255) return 0;  // never: braid has a few dozen names
  strings_.push_back(s);
  return static_cast<uint8_t>(strings_.size() - 1);
}

void TraceRecorder::op_done(const Op& op, uint64_t now, const Status& st) {
  if (!room()) return;
  Event e;
  e.start = op.start_ticks;
  e.bytes = op.bytes;
  e.length = encode_length(now - op.start_ticks);
  e.seq = static_cast<uint32_t>(op.seq);
  e.tid = track_of(op);
  e.name = intern(op.name);
  e.detail = intern(op.algo);
  e.is_wait = 0;
  e.ok = st.is_ok();
  push(e);
}

void TraceRecorder::wait(const Op& op, uint64_t start, uint64_t end, int peer, const char* what) {
  if (end - start < min_wait_ticks_ || !room()) return;
  Event e;
  e.start = start;
  e.peer = peer;
  e.length = encode_length(end - start);
  e.seq = static_cast<uint32_t>(op.seq);
  e.tid = track_of(op);
  e.name = intern("wait");
  e.detail = intern(what);
  e.is_wait = 1;
  e.ok = 1;
  push(e);
}

Status TraceRecorder::write() {
  // One rate for the whole file, so durations and positions agree.
  const double rate = us_per_tick();
  auto at = [&](uint64_t t) {
    return g_origin.us + (static_cast<double>(t) - static_cast<double>(g_origin.ticks)) * rate;
  };
  FILE* f = std::fopen(path_.c_str(), "w");
  if (f == nullptr) {
    return Status::system("BRAID_TRACE_FILE: cannot write the trace to " + path_, errno);
  }
  std::fprintf(f,
               "{\"displayTimeUnit\":\"ns\",\"otherData\":{\"rank\":%d,\"nranks\":%d,\"host\":%s,"
               "\"clock\":\"realtime_us\",\"dropped_events\":%s},\n\"traceEvents\":[\n",
               rank_, nranks_, json_string(host_).c_str(), dropped_ ? "true" : "false");
  std::fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":%s}}",
               rank_, json_string("rank " + std::to_string(rank_) + " (" + host_ + ")").c_str());
  std::fprintf(
      f,
      ",\n{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":%d,\"tid\":0,\"args\":{\"sort_index\":%d}}",
      rank_, rank_);
  std::set<int> tracks;
  for (const Chunk& c : chunks_)
    for (size_t i = 0; i < c.used; ++i) tracks.insert(c.events[i].tid);
  for (int tid : tracks) {
    std::fprintf(f, ",\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":%s}}",
                 rank_, tid, json_string(track_name(tid)).c_str());
  }
  for (size_t k = 0; k < count_; ++k) {
    const Event& e = chunks_[k / kChunkEvents].events[k % kChunkEvents];
    const unsigned long long seq = e.seq;
    if (e.is_wait) {
      std::fprintf(f,
                   ",\n{\"ph\":\"X\",\"name\":\"wait\",\"cat\":\"wait\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,"
                   "\"dur\":%.3f,\"args\":{\"seq\":%llu,\"peer\":%d,\"waiting\":%s}}",
                   rank_, e.tid, at(e.start), static_cast<double>(decode_length(e.length)) * rate, seq,
                   static_cast<int>(e.peer), json_string(strings_[e.detail]).c_str());
      continue;
    }
    const std::string name = json_string(strings_[e.name]);
    std::fprintf(f,
                 ",\n{\"ph\":\"B\",\"name\":%s,\"cat\":\"op\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,"
                 "\"args\":{\"seq\":%llu,\"bytes\":%llu,\"algorithm\":%s}}",
                 name.c_str(), rank_, e.tid, at(e.start), seq, static_cast<unsigned long long>(e.bytes),
                 json_string(strings_[e.detail]).c_str());
    std::fprintf(f,
                 ",\n{\"ph\":\"E\",\"name\":%s,\"cat\":\"op\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,"
                 "\"args\":{\"seq\":%llu,\"ok\":%s}}",
                 name.c_str(), rank_, e.tid, at(e.start + decode_length(e.length)), seq,
                 e.ok ? "true" : "false");
  }

  std::fprintf(f, "\n]}\n");
  const bool failed = std::ferror(f) != 0;
  if (std::fclose(f) != 0 || failed) return Status::system("BRAID_TRACE_FILE: writing " + path_, errno);
  BRAID_INFO("TRACE", rank_, "trace of %zu records written to %s", count_, path_.c_str());
  return Status::ok();
}

}  // namespace braid
