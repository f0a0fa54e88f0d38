// The DDP example with libtorch: an MLP on synthetic data, wrapped by
// braid::ddp::wrap, trained with an ordinary libtorch loop.
//
//   mpirun -np 4 build/examples/ddp_torch_mlp
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=0 build/examples/ddp_torch_mlp &
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=1 build/examples/ddp_torch_mlp
// Options: --steps N (default 200), --batch N global rows per step (default 256).
#include <braid/braid.h>
#include <braid/ddp_torch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "examples/launch.h"

int main(int argc, char** argv) {
  braid::examples::Launch job;
  if (!job.start(&argc, &argv, "ddp_torch_mlp")) return 2;
  const int rank = job.rank, nranks = job.nranks, batch = job.batch, steps = job.steps;
  braid_comm_t comm = job.comm;
  torch::set_num_threads(1);

  // Every rank builds the same data; each trains on its own rows.
  torch::manual_seed(2026);
  const auto x = torch::rand({batch, 32}) * 2 - 1;
  const auto teacher = torch::rand({32, 8}) * 2 - 1;
  const auto y = torch::relu(x.matmul(teacher));
  const int rows = batch / nranks;
  const auto my_x = x.narrow(0, rank * rows, rows), my_y = y.narrow(0, rank * rows, rows);

  torch::manual_seed(rank);  // different on each rank: wrap() starts every replica from rank 0's
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 8));
  try {
    auto ddp = braid::ddp::wrap(*model, comm);
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    if (rank == 0) {
      std::printf("ddp_torch_mlp: %d ranks (%s), %d rows per step, %d per rank, %zu bucket(s)\n", nranks,
                  job.launcher(), batch, rows, ddp->reducer().buckets().size());
    }
    for (int s = 0; s < steps; ++s) {
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model->forward(my_x), my_y);
      loss.backward();  // gradients are averaged over the ranks when this returns
      optimizer.step();
      if (s % 50 == 0 || s == steps - 1) {
        float l = loss.item<float>();
        braid_all_reduce(&l, &l, 1, BRAID_FLOAT32, BRAID_AVG, comm, nullptr);
        if (rank == 0) std::printf("step %4d  loss %.6f\n", s, l);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_torch_mlp: rank %d: %s\n", rank, e.what());
    return 1;
  }
  job.finish();
  return 0;
}
