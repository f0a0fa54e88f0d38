#include "tools/launcher/fork_ranks.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

namespace braid::launcher {
namespace {

// Shared between the children: rank 0 publishes the unique id here.
struct SharedBlock {
  std::atomic<int> published;  // 1: id is set; -1: rank 0 ended without one
  braid_unique_id_t id;
};

[[noreturn]] void run_child(const LaunchOptions& options, const RankFn& fn, SharedBlock* shared, int rank) {
  for (const auto& [name, value] : options.env) setenv(name.c_str(), value.c_str(), 1);
  if (options.per_rank_setup) options.per_rank_setup(rank);
  if (rank == 0) {
    braid_unique_id_t id;
    if (braid_get_unique_id(&id) != BRAID_SUCCESS) {
      std::fprintf(stderr, "rank 0: braid_get_unique_id failed: %s\n", braid_get_last_error());
      _exit(91);  // the launcher tells the others when it reaps this rank
    }
    shared->id = id;
    shared->published.store(1, std::memory_order_release);
  } else {
    int published;
    while ((published = shared->published.load(std::memory_order_acquire)) == 0) {
      struct timespec ts = {0, 200 * 1000};
      nanosleep(&ts, nullptr);
    }
    if (published < 0) {
      std::fprintf(stderr, "rank %d: rank 0 ended without a unique id to share\n", rank);
      _exit(93);
    }
  }
  braid_comm_t comm = nullptr;
  if (options.make_comm) {
    braid_result_t r = braid_comm_init_rank(&comm, options.nranks, shared->id, rank);
    if (r != BRAID_SUCCESS) {
      std::fprintf(stderr, "rank %d: braid_comm_init_rank failed: %s\n", rank, braid_get_last_error());
      _exit(90);
    }
  }
  int code = fn(comm, rank, options.nranks, shared->id);
  if (comm != nullptr && braid_comm_destroy(comm) != BRAID_SUCCESS && code == 0) {
    std::fprintf(stderr, "rank %d: braid_comm_destroy failed: %s\n", rank, braid_get_last_error());
    code = 92;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(code);
}

}  // namespace

bool LaunchResult::ok() const {
  for (const auto& r : ranks)
    if (r.timed_out || r.signal != 0 || r.exit_code != 0) return false;
  return !ranks.empty();
}

std::string LaunchResult::describe() const {
  std::string out;
  for (const auto& r : ranks) {
    if (r.timed_out) {
      out += "rank " + std::to_string(r.rank) + ": killed after the launch timeout\n";
    } else if (r.signal != 0) {
      out += "rank " + std::to_string(r.rank) + ": died of signal " + std::to_string(r.signal) + " (" +
             strsignal(r.signal) + ")\n";
    } else if (r.exit_code != 0) {
      out += "rank " + std::to_string(r.rank) + ": exit code " + std::to_string(r.exit_code) + "\n";
    }
  }
  return out;
}

LaunchResult fork_ranks(const LaunchOptions& options, const RankFn& fn) {
  LaunchResult result;
  void* mem = mmap(nullptr, sizeof(SharedBlock), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return result;
  auto* shared = new (mem) SharedBlock();
  shared->published.store(0);

  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(options.nranks, -1);
  result.ranks.resize(options.nranks);
  for (int r = 0; r < options.nranks; ++r) {
    result.ranks[r].rank = r;
    pid_t pid = fork();
    if (pid == 0) run_child(options, fn, shared, r);
    pids[r] = pid;
  }

  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(options.timeout_s);
  int remaining = options.nranks;
  for (int r = 0; r < options.nranks; ++r)
    if (pids[r] < 0) --remaining;
  while (remaining > 0) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < options.nranks; ++r) {
        if (pids[r] != pid) continue;
        if (WIFEXITED(status)) result.ranks[r].exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) result.ranks[r].signal = WTERMSIG(status);
        // Whatever ended rank 0 before it shared the id, the others stop waiting.
        if (r == 0) {
          int none = 0;
          shared->published.compare_exchange_strong(none, -1);
        }
        pids[r] = -1;
        --remaining;
      }
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < options.nranks; ++r) {
        if (pids[r] <= 0) continue;
        kill(pids[r], SIGKILL);
        waitpid(pids[r], &status, 0);
        result.ranks[r].timed_out = true;
        pids[r] = -1;
        --remaining;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  munmap(mem, sizeof(SharedBlock));
  return result;
}

}  // namespace braid::launcher
