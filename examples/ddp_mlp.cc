// Data-parallel training of a small MLP on synthetic data with braid's DDP
// layer, in plain C++.
//
//   mpirun -np 4 build/examples/ddp_mlp               (Open MPI carries braid's id)
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=0 build/examples/ddp_mlp &
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=1 build/examples/ddp_mlp
//                                                      (the torchrun environment)
// Options: --steps N (default 200), --batch N global rows per step (default 256).
#include <braid/braid.h>
#include <braid/ddp.hpp>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "examples/launch.h"
#include "examples/mlp_model.h"

int main(int argc, char** argv) {
  braid::examples::Launch job;
  if (!job.start(&argc, &argv, "ddp_mlp")) return 2;
  const int rank = job.rank, nranks = job.nranks, rows = job.batch / nranks;
  braid_comm_t comm = job.comm;

  const int in = 32, hidden = 64, out = 8;
  braid::examples::Dataset data(job.batch, in, out, 2026);
  braid::examples::Mlp model(in, hidden, out, 1 + static_cast<uint64_t>(rank));  // rank 0's values win
  std::vector<braid::ddp::Parameter> params;
  for (int k = 0; k < braid::examples::Mlp::kParams; ++k) {
    params.push_back({model.names[k], model.p[k].data(), model.grad[k], model.count(k), BRAID_FLOAT32});
  }
  std::unique_ptr<braid::ddp::Reducer> ddp;
  if (auto r = braid::ddp::Reducer::create(comm, params, {}, {}, &ddp); !r) {
    std::fprintf(stderr, "ddp_mlp: Reducer::create: %s\n", r.message.c_str());
    return 1;
  }
  if (rank == 0) {
    std::printf("ddp_mlp: %d ranks (%s), %d rows per step, %d per rank, %zu bucket(s)\n", nranks,
                job.launcher(), job.batch, rows, ddp->buckets().size());
  }
  braid::ddp::Result failure;
  for (int s = 0; s < job.steps && failure.ok(); ++s) {
    model.zero_grad();
    float loss = model.backward(data.x_row(rank * rows), data.t_row(rank * rows), rows, [&](int k) {
      if (auto r = ddp->mark_ready(k); !r && failure.ok()) failure = r;
    });
    if (auto r = ddp->finish(); !r && failure.ok()) failure = r;
    model.sgd(0.05f);
    if (s % 50 == 0 || s == job.steps - 1) {
      braid_all_reduce(&loss, &loss, 1, BRAID_FLOAT32, BRAID_AVG, comm, nullptr);
      if (rank == 0) std::printf("step %4d  loss %.6f\n", s, loss);
    }
  }
  if (!failure) {
    std::fprintf(stderr, "ddp_mlp: rank %d: %s\n", rank, failure.message.c_str());
    return 1;
  }
  ddp.reset();
  job.finish();
  return 0;
}
