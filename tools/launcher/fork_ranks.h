// Runs a function on N ranks, each a forked process joined by one braid
// communicator. Used by the test suite and by `braid-check -n N`, so both
// exercise real processes over real transports.
#pragma once

#include <braid/braid.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace braid::launcher {

struct LaunchOptions {
  int nranks = 2;
  // Environment set in every rank before the communicator is made.
  std::vector<std::pair<std::string, std::string>> env;
  // Called in each child before the communicator is made (e.g. per-rank env).
  std::function<void(int rank)> per_rank_setup;
  // Wall-clock bound for the whole run; past it every rank is killed.
  double timeout_s = 120.0;
  // When false, fn receives a null communicator and makes its own from `id`.
  bool make_comm = true;
};

struct RankOutcome {
  int rank = -1;
  int exit_code = -1;  // valid when signal == 0
  int signal = 0;      // the signal that ended the rank, 0 if it exited
  bool timed_out = false;
};

struct LaunchResult {
  std::vector<RankOutcome> ranks;
  bool ok() const;
  std::string describe() const;  // one line per failed rank
};

// fn(comm, rank, nranks, id) runs in each child; its return value is the
// child's exit code (0 = success). A failed communicator init exits with 90.
using RankFn = std::function<int(braid_comm_t comm, int rank, int nranks, const braid_unique_id_t& id)>;
LaunchResult fork_ranks(const LaunchOptions& options, const RankFn& fn);

}  // namespace braid::launcher
