// wait_cost: what a rank pays while it waits for a late peer, per kind of
// wait: the CPU it burns per second of waiting, and how long after the
// peer's send the wait returns (the wake-up latency after a long wait).
// A library that spins (Open MPI's shm, NCCL) burns a whole core here; one
// that polls wakes late. Measured, never asserted.
//
//   wait_cost [--waits 40] [--gap-ms 5] [--idle-s 1]
//
// Three ranks; rank 0 waits. Kinds: shm (one peer on rank 0's host), tcp
// (one peer on another simulated host), shm+tcp (both at once: poll() cannot
// see the shm doorbell, the case the doorbell watcher exists for), and
// blocking (braid_recv instead of irecv + wait).
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tools/launcher/fork_ranks.h"

namespace {

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // one clock for every process of the host
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

double cpu_seconds() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);  // every thread of the process: the progress thread too
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

struct Kind {
  const char* name;
  bool from_shm_peer, from_tcp_peer, blocking;
};

struct Result {
  double cpu_ms_per_s;
  double wake_us_median, wake_us_p90;
};

int run_kind(const Kind& kind, int waits, int gap_ms, double idle_s, Result* out) {
  auto* shared = static_cast<Result*>(
      mmap(nullptr, sizeof(Result), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (shared == MAP_FAILED) return 1;
  braid::launcher::LaunchOptions options;
  options.nranks = 3;
  options.timeout_s = 60 + idle_s + waits * gap_ms / 1000.0 * 2;
  options.per_rank_setup = [](int rank) {
    setenv("BRAID_HOST_ID", rank == 2 ? "wait-cost-b" : "wait-cost-a", 1);
  };
  auto result =
      braid::launcher::fork_ranks(options, [&](braid_comm_t comm, int rank, int, const braid_unique_id_t&) {
        const int peers[2] = {kind.from_shm_peer ? 1 : -1, kind.from_tcp_peer ? 2 : -1};
        auto wait_once = [&](int64_t* stamps, int n) -> braid_result_t {
          if (kind.blocking)
            return braid_recv(stamps, 1, BRAID_INT64, peers[0] >= 0 ? peers[0] : peers[1], comm, nullptr);
          braid_request_t requests[2];
          int count = 0;
          for (int i = 0; i < 2; ++i) {
            if (peers[i] < 0) continue;
            braid_result_t r =
                braid_irecv(&stamps[count], 1, BRAID_INT64, peers[i], comm, nullptr, &requests[count]);
            if (r != BRAID_SUCCESS) return r;
            ++count;
          }
          (void)n;
          return braid_wait_all(count, requests);
        };
        const bool sends = (rank == 1 && kind.from_shm_peer) || (rank == 2 && kind.from_tcp_peer);
        int64_t stamps[2];
        // First: one wait of idle_s, for its CPU time.
        if (braid_barrier(comm, nullptr) != BRAID_SUCCESS) return 2;
        if (rank == 0) {
          const double before = cpu_seconds();
          const int64_t start = now_ns();
          if (wait_once(stamps, 2) != BRAID_SUCCESS) return 3;
          shared->cpu_ms_per_s = (cpu_seconds() - before) * 1e3 / ((now_ns() - start) / 1e9);
        } else if (sends) {
          usleep(static_cast<useconds_t>(idle_s * 1e6));
          stamps[0] = now_ns();
          if (braid_send(stamps, 1, BRAID_INT64, 0, comm, nullptr) != BRAID_SUCCESS) return 4;
        }
        // Then: waits of gap_ms each, for the wake-up latency after the send.
        std::vector<double> wake_us;
        for (int i = 0; i < waits; ++i) {
          if (braid_barrier(comm, nullptr) != BRAID_SUCCESS) return 5;
          if (rank == 0) {
            if (wait_once(stamps, 2) != BRAID_SUCCESS) return 6;
            const int64_t now = now_ns();
            const int64_t last = kind.blocking || !(kind.from_shm_peer && kind.from_tcp_peer)
                                     ? stamps[0]
                                     : std::max(stamps[0], stamps[1]);
            wake_us.push_back((now - last) / 1e3);
          } else if (sends) {
            usleep(gap_ms * 1000);
            stamps[0] = now_ns();
            if (braid_send(stamps, 1, BRAID_INT64, 0, comm, nullptr) != BRAID_SUCCESS) return 7;
          }
        }
        if (rank == 0) {
          std::sort(wake_us.begin(), wake_us.end());
          shared->wake_us_median = wake_us[wake_us.size() / 2];
          shared->wake_us_p90 = wake_us[wake_us.size() * 9 / 10];
        }
        return braid_barrier(comm, nullptr) == BRAID_SUCCESS ? 0 : 8;
      });
  *out = *shared;
  munmap(shared, sizeof(Result));
  if (!result.ok()) {
    std::fprintf(stderr, "wait_cost: %s failed:\n%s\n", kind.name, result.describe().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int waits = 40, gap_ms = 5;
  double idle_s = 1.0;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (std::strcmp(argv[i], "--waits") == 0 && has_value) {
      waits = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--gap-ms") == 0 && has_value) {
      gap_ms = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--idle-s") == 0 && has_value) {
      idle_s = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: wait_cost [--waits N (1-10000)] [--gap-ms MS (0-1000)] [--idle-s S (0.1-60)]\n");
      return 2;
    }
  }
  if (waits < 1 || waits > 10000 || gap_ms < 0 || gap_ms > 1000 || !(idle_s >= 0.1 && idle_s <= 60)) {
    std::fprintf(stderr, "wait_cost: --waits must be 1-10000, --gap-ms 0-1000, --idle-s 0.1-60\n");
    return 2;
  }
  const Kind kinds[] = {{"shm", true, false, false},
                        {"tcp", false, true, false},
                        {"shm+tcp", true, true, false},
                        {"blocking shm", true, false, true}};
  std::printf("# rank 0 waits for peers that send late; %d waits of %d ms, one of %.1f s\n", waits, gap_ms,
              idle_s);
  std::printf("%-14s %18s %16s %16s\n", "wait on", "CPU ms per s", "wake us (p50)", "wake us (p90)");
  int failures = 0;
  for (const Kind& kind : kinds) {
    Result r{};
    if (run_kind(kind, waits, gap_ms, idle_s, &r) != 0) {
      ++failures;
      continue;
    }
    std::printf("%-14s %18.1f %16.1f %16.1f\n", kind.name, r.cpu_ms_per_s, r.wake_us_median, r.wake_us_p90);
    std::fflush(stdout);
  }
  return failures == 0 ? 0 : 1;
}
