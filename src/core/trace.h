// Per-rank timelines of every operation, written as a Chrome / Perfetto trace
// (JSON "traceEvents") when BRAID_TRACE_FILE is set: a begin and an end event
// per operation (name, sequence number, bytes, algorithm, outcome) on one
// track per lane, and the waits on peers inside it that lasted at least
// BRAID_TRACE_MIN_WAIT_US (default 20 us). Timestamps are wall-clock
// microseconds, so tools/braid-trace-merge lines ranks up on one timeline.
// Off, it costs one branch per operation; on, one 32-byte record per
// operation (about 60 ns on this machine) and per long wait.
#pragma once

#include <time.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "src/core/config.h"
#include "src/core/status.h"

namespace braid {

class Op;

// A cheap timestamp for every op (the dump's "running for", the trace):
// the TSC on x86 (about 15 ns, where clock_gettime takes 35), nanoseconds of
// CLOCK_MONOTONIC elsewhere. Traces map ticks to wall-clock microseconds
// (CLOCK_REALTIME), comparable across processes, when they are written.
inline uint64_t trace_ticks() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_ia32_rdtsc();
#else
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
#endif
}
double ticks_to_us(uint64_t delta);

class TraceRecorder {
 public:
  // A recorder when config.trace_file is set, else null. A second
  // communicator of the same process writes "<stem>-c<k><ext>".
  static std::unique_ptr<TraceRecorder> make(const Config& config, int rank, int nranks);

  // Driver thread only. One record per operation, stored when it ends
  // (from op.start_ticks to now); written as a begin and an end event.
  void op_done(const Op& op, uint64_t now, const Status& st);
  void wait(const Op& op, uint64_t start, uint64_t end, int peer, const char* what);

  // Writes the file (at communicator destroy or abort).
  Status write();
  const std::string& path() const { return path_; }

 private:
  // 32 bytes: recording is a store into memory nobody has touched yet, and
  // its cost grows with the size.
  struct Event {
    uint64_t start;  // ticks
    union {
      uint64_t bytes;  // operation
      int64_t peer;    // wait
    };
    uint32_t length;  // ticks (encode_length: coarser past 2^31)
    uint32_t seq;     // low 32 bits
    int32_t tid;
    uint8_t name;    // index into strings_
    uint8_t detail;  // operation: algorithm; wait: what it waited for
    uint8_t is_wait;
    uint8_t ok;
  };
  static_assert(sizeof(Event) == 32, "two events per cache line");
  // Events live in chunks mapped with MAP_POPULATE: recording never takes a
  // page fault (one per 4 KiB would cost more than the rest of the trace).
  struct Chunk {
    Event* events;
    size_t used;
  };
  static constexpr size_t kChunkEvents = 32768;
  // Names and algorithms are static strings: kept once, referred to by index.
  uint8_t intern(const char* s);
  bool room();
  // Maps one more chunk; false (and recording stops) when memory is short.
  bool map_chunk();
  void push(const Event& e);
  static int track_of(const Op& op);

  std::string path_;
  int rank_ = 0, nranks_ = 1;
  std::string host_;
  uint64_t min_wait_ticks_ = 0;
  size_t max_events_ = 4u << 20;
  bool dropped_ = false;
  std::vector<Chunk> chunks_;
  size_t count_ = 0;
  std::vector<const char*> strings_;
  struct Memo {
    const char* s = nullptr;
    uint8_t index = 0;
  };
  Memo memo_[2];  // the last two strings interned
  unsigned memo_next_ = 0;

 public:
  ~TraceRecorder();
};

}  // namespace braid
