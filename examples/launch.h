// What the example programs share: their two flags, and one communicator over
// all ranks from mpirun (Open MPI carries braid's id) or from the torchrun
// environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK).
#pragma once

#include <braid/braid.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "bench/mpi_comm.h"

namespace braid::examples {

struct Launch {
  int steps = 200;
  int batch = 256;  // global rows per step
  bool used_mpi = false;
  braid_comm_t comm = nullptr;
  int rank = 0, nranks = 1;

  // Parses --steps / --batch and makes the communicator; prints why and
  // returns false when either fails.
  bool start(int* argc, char*** argv, const char* prog) {
    for (int i = 1; i < *argc; ++i) {
      const std::string a = (*argv)[i];
      if ((a == "--steps" || a == "--batch") && i + 1 < *argc) {
        (a == "--steps" ? steps : batch) = std::atoi((*argv)[++i]);
      } else {
        std::fprintf(stderr, "usage: %s [--steps N] [--batch N]\n", prog);
        return false;
      }
    }
    used_mpi = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
    braid_result_t r;
    if (used_mpi) {
      MPI_Init(argc, argv);
      r = braid_bench::braid_comm_from_mpi(MPI_COMM_WORLD, &comm);
    } else {
      r = braid_comm_init_env(&comm);
    }
    if (r != BRAID_SUCCESS) {
      std::fprintf(stderr, "%s: making the communicator: %s\n", prog, braid_get_last_error());
      return false;
    }
    braid_comm_rank(comm, &rank);
    braid_comm_size(comm, &nranks);
    if (steps <= 0 || batch <= 0 || batch % nranks != 0) {
      std::fprintf(stderr, "%s: --steps must be > 0 and --batch a positive multiple of %d\n", prog, nranks);
      return false;
    }
    return true;
  }

  const char* launcher() const { return used_mpi ? "mpirun" : "env://"; }

  void finish() {
    braid_comm_destroy(comm);
    if (used_mpi) MPI_Finalize();
  }
};

}  // namespace braid::examples
