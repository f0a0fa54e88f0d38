// A braid communicator over the ranks of an MPI communicator: MPI launches
// the processes and carries braid's unique id from rank 0, nothing more.
#pragma once

#include <braid/braid.h>

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstring>

namespace braid_bench {

// Collective over `mpi`. When rank 0 cannot make the id every rank returns
// its error (BRAID_ERR_REMOTE on the others) instead of waiting forever.
inline braid_result_t braid_comm_from_mpi(MPI_Comm mpi, braid_comm_t* comm) {
  int rank = 0, nranks = 1;
  MPI_Comm_rank(mpi, &rank);
  MPI_Comm_size(mpi, &nranks);
  braid_unique_id_t id;
  std::memset(&id, 0, sizeof id);
  const braid_result_t made = rank == 0 ? braid_get_unique_id(&id) : BRAID_SUCCESS;
  int ok = made == BRAID_SUCCESS;
  MPI_Bcast(&ok, 1, MPI_INT, 0, mpi);
  if (!ok) return rank == 0 ? made : BRAID_ERR_REMOTE;
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, mpi);
  return braid_comm_init_rank(comm, nranks, id, rank);
}

}  // namespace braid_bench
