// fault_times: injects each fault of the failure model into a live job and
// prints, for every rank, how long after the fault its pending call returned
// and with which error. Times are measured, never asserted (the tests assert
// codes and messages); this is the table behind the failure-handling claims.
//
//   fault_times [--ranks 4] [--bytes 16777216] [--timeout 2] [--repeat 3]
//
// Faults: a rank killed with SIGKILL in the middle of an all_reduce (shm and
// tcp; the others waiting in blocking calls or in braid_wait on i-forms);
// ranks calling different collectives; braid_comm_abort from another thread;
// a rank that never calls (the timeout). Each fault runs in a fresh job of
// forked ranks; the fault's moment is written to a page shared by all ranks.
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "tools/launcher/fork_ranks.h"
#include "tools/result_name.h"

namespace {

constexpr int kMaxRanks = 16;

struct Shared {
  std::atomic<int64_t> fault_ns;  // when the fault happened (CLOCK_MONOTONIC, same on one host)
  std::atomic<int64_t> entered_ns[kMaxRanks];
  int64_t returned_ns[kMaxRanks];
  int result[kMaxRanks];
};

int64_t now_ns() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

struct Scenario {
  const char* name;
  const char* transport;  // BRAID_TRANSPORT
  // The body of one rank; returns the braid result of the call that should fail.
  braid_result_t (*body)(braid_comm_t comm, int rank, int nranks, Shared* s, size_t bytes);
  const char* measured_from;
};

// The victim is the last rank: it starts the collective, lets data flow for
// a moment, records the moment and kills itself.
braid_result_t killed(braid_comm_t comm, int rank, int nranks, Shared* s, size_t bytes, bool iform) {
  std::vector<float> buf(bytes / sizeof(float), 1.0f);
  if (rank == nranks - 1) {
    braid_request_t req = nullptr;
    braid_iall_reduce(buf.data(), buf.data(), buf.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr, &req);
    usleep(2000);
    s->fault_ns.store(now_ns());
    raise(SIGKILL);
  }
  braid_result_t r = BRAID_SUCCESS;
  // Several calls: the first may finish before the kill lands.
  for (int i = 0; i < 50 && r == BRAID_SUCCESS; ++i) {
    if (iform) {
      braid_request_t req = nullptr;
      r = braid_iall_reduce(buf.data(), buf.data(), buf.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr,
                            &req);
      if (r == BRAID_SUCCESS) r = braid_wait(&req);
    } else {
      r = braid_all_reduce(buf.data(), buf.data(), buf.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr);
    }
  }
  return r;
}
braid_result_t killed_blocking(braid_comm_t c, int r, int n, Shared* s, size_t b) {
  return killed(c, r, n, s, b, false);
}
braid_result_t killed_iform(braid_comm_t c, int r, int n, Shared* s, size_t b) {
  return killed(c, r, n, s, b, true);
}

// Rank 1 calls all_gather where the others call all_reduce; the fault's
// moment is when the last rank entered its call.
braid_result_t mismatched(braid_comm_t comm, int rank, int, Shared* s, size_t) {
  std::vector<float> in(1024, 1.0f), out(1024 * kMaxRanks);
  braid_barrier(comm, nullptr);
  s->entered_ns[rank].store(now_ns());
  return rank == 1
             ? braid_all_gather(in.data(), out.data(), in.size(), BRAID_FLOAT32, comm, nullptr)
             : braid_all_reduce(in.data(), in.data(), in.size(), BRAID_FLOAT32, BRAID_SUM, comm, nullptr);
}

// Rank 0 aborts its communicator from another thread while every rank waits
// in an all_reduce that rank 1 never joins.
braid_result_t aborted(braid_comm_t comm, int rank, int, Shared* s, size_t) {
  float x = 1;
  braid_barrier(comm, nullptr);
  if (rank == 1) {
    sleep(5);  // never joins in time; the job ends with the abort
    return BRAID_ERR_ABORTED;
  }
  std::thread t;
  if (rank == 0) {
    t = std::thread([comm, s] {
      usleep(200000);
      s->fault_ns.store(now_ns());
      braid_comm_abort(comm);
    });
  }
  braid_result_t r = braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr);
  if (t.joinable()) t.join();
  if (rank == 0) {
    s->returned_ns[0] = now_ns();
    s->result[0] = r;
    _exit(0);  // abort released the handle: no destroy
  }
  return r;
}

// Rank 1 never calls; the others time out (the fault's moment is their call).
braid_result_t absent(braid_comm_t comm, int rank, int, Shared* s, size_t) {
  float x = 1;
  braid_barrier(comm, nullptr);
  if (rank == 1) {
    sleep(8);
    return BRAID_ERR_TIMEOUT;
  }
  if (rank == 0) s->fault_ns.store(now_ns());
  return braid_all_reduce(&x, &x, 1, BRAID_FLOAT32, BRAID_SUM, comm, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  int nranks = 4, repeat = 3;
  size_t bytes = 16u << 20;
  std::string timeout = "2";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--ranks")
      nranks = std::atoi(argv[i + 1]);
    else if (a == "--bytes")
      bytes = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--timeout")
      timeout = argv[i + 1];
    else if (a == "--repeat")
      repeat = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "fault_times: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (nranks < 3 || nranks > kMaxRanks) {
    std::fprintf(stderr, "fault_times: --ranks must be 3..%d\n", kMaxRanks);
    return 2;
  }
  const Scenario scenarios[] = {
      {"SIGKILL mid all_reduce, blocking", "shm", killed_blocking, "the kill"},
      {"SIGKILL mid all_reduce, blocking", "tcp", killed_blocking, "the kill"},
      {"SIGKILL mid all_reduce, i-form + wait", "shm", killed_iform, "the kill"},
      {"SIGKILL mid all_reduce, i-form + wait", "tcp", killed_iform, "the kill"},
      {"all_gather vs all_reduce", "shm", mismatched, "the last rank's call"},
      {"all_gather vs all_reduce", "tcp", mismatched, "the last rank's call"},
      {"braid_comm_abort from a thread", "shm", aborted, "the abort"},
      {"braid_comm_abort from a thread", "tcp", aborted, "the abort"},
      {"rank 1 never calls (BRAID_TIMEOUT)", "shm", absent, "rank 0's call"},
  };
  auto* s = static_cast<Shared*>(
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  std::printf(
      "# %d ranks, %zu-byte all_reduce, BRAID_TIMEOUT=%s; ms from the fault to each rank's error "
      "(median of %d runs)\n",
      nranks, bytes, timeout.c_str(), repeat);
  std::printf("%-40s %-4s %-22s", "fault", "via", "measured from");
  for (int r = 0; r < nranks; ++r) std::printf("  rank %-4d", r);
  std::printf("  errors\n");
  for (const Scenario& sc : scenarios) {
    std::vector<std::vector<double>> ms(nranks);
    std::string codes;
    for (int rep = 0; rep < repeat; ++rep) {
      new (s) Shared();
      for (int r = 0; r < kMaxRanks; ++r) s->result[r] = -1;
      braid::launcher::LaunchOptions o;
      o.nranks = nranks;
      o.timeout_s = 60;
      o.env = {{"BRAID_TRANSPORT", sc.transport}, {"BRAID_TIMEOUT", timeout}, {"BRAID_DEBUG", "NONE"}};
      braid::launcher::fork_ranks(o, [&](braid_comm_t comm, int rank, int n, const braid_unique_id_t&) {
        braid_result_t res = sc.body(comm, rank, n, s, bytes);
        s->returned_ns[rank] = now_ns();
        s->result[rank] = res;
        return 0;
      });
      int64_t t0 = s->fault_ns.load();
      if (t0 == 0)
        for (int r = 0; r < nranks; ++r) t0 = std::max(t0, s->entered_ns[r].load());
      std::string c;
      for (int r = 0; r < nranks; ++r) {
        const bool is_victim = (sc.body == killed_blocking || sc.body == killed_iform) && r == nranks - 1;
        const bool bystander = (sc.body == aborted || sc.body == absent) && r == 1;
        if (is_victim || bystander || s->result[r] < 0) continue;
        ms[r].push_back(static_cast<double>(s->returned_ns[r] - t0) / 1e6);
        if (rep == 0)
          c += std::string(c.empty() ? "" : ",") +
               braid::result_name(static_cast<braid_result_t>(s->result[r]));
      }
      if (rep == 0) codes = c;
    }
    std::printf("%-40s %-4s %-22s", sc.name, sc.transport, sc.measured_from);
    for (int r = 0; r < nranks; ++r) {
      if (ms[r].empty()) {
        std::printf("  %-9s", "-");
        continue;
      }
      std::sort(ms[r].begin(), ms[r].end());
      std::printf("  %-9.1f", ms[r][ms[r].size() / 2]);
    }
    std::printf("  %s\n", codes.c_str());
    std::fflush(stdout);
  }
  return 0;
}
