// Per-rank timelines of every operation, written as a Chrome / Perfetto trace
// (JSON "traceEvents") when BRAID_TRACE_FILE is set: a begin and an end event
// per operation (name, sequence number, bytes, algorithm, outcome) on one
// track per lane, and the waits on peers inside it that lasted at least
// BRAID_TRACE_MIN_WAIT_US (default 20 us). Timestamps are wall-clock
// microseconds, so tools/braid-trace-merge lines ranks up on one timeline.
// Off, it costs one branch per operation.
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

  // Driver thread only.
  void begin(const Op& op, uint64_t now);
  void end(const Op& op, uint64_t now, const Status& st);
  void wait(const Op& op, uint64_t start, uint64_t end, int peer, const char* what);

  // Writes the file (at communicator destroy or abort).
  Status write();
  const std::string& path() const { return path_; }

 private:
  struct Event {
    char phase;  // 'B', 'E', 'X'
    int tid;
    uint64_t ts, dur;  // ticks
    const char* name;
    uint64_t seq;
    size_t bytes;
    const char* algo;
    int peer;
    const char* what;
    bool ok;
  };
  bool room();
  static int track_of(const Op& op);

  std::string path_;
  int rank_ = 0, nranks_ = 1;
  std::string host_;
  uint64_t min_wait_ticks_ = 0;
  size_t max_events_ = 4u << 20;
  bool dropped_ = false;
  std::vector<Event> events_;
};

}  // namespace braid
