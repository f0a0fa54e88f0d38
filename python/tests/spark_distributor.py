"""An unchanged training function run by Spark's TorchDistributor with
backend "braid": the way Spark users launch torch.distributed.

    python spark_distributor.py local     # torchrun on the driver (local_mode=True)
    python spark_distributor.py barrier   # one barrier task per rank (local_mode=False)

Spark runs as master local[2], bound to 127.0.0.1. The training function is
the one a user would write for gloo with the backend's name changed (and
no braid import: installing braid_torch registers it with torch); it
returns, from rank 0, what the test checks: the backend's name, an exact
all_reduce, every rank's parameters after DDP training, and the parameters a
single process reaches on the whole batch (what DDP must reproduce).
Prints that result as one JSON line.
"""

import json
import os
import sys


def train(steps):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    # No `import braid_torch`: `import torch` registered "braid" (its entry point).

    dist.init_process_group("braid")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reference.load_state_dict(net.state_dict())
    x, y = torch.randn(8 * world, 16), torch.randn(8 * world, 4)
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    mine = slice(8 * rank, 8 * (rank + 1))
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        # The whole batch in one process: DDP averages the ranks' gradients
        # of equal shards, which is the gradient of this mean loss.
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    ones = torch.full((5,), float(rank + 1))
    dist.all_reduce(ones)
    result = {
        "backend": dist.get_backend(),
        "world": world,
        "sum": ones.tolist(),
        "params": [t.tolist() for t in every],
        "reference": torch.cat([p.detach().reshape(-1) for p in reference.parameters()]).tolist(),
    }
    dist.destroy_process_group()
    return result


def main():
    mode = sys.argv[1]
    if mode not in ("local", "barrier"):
        sys.exit(f"usage: {sys.argv[0]} local|barrier")
    # Everything on loopback; inherited by torchrun (local) and by Spark's
    # Python workers (barrier), hence set before Spark starts.
    os.environ.setdefault("BRAID_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("braid-torch-distributor")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    try:
        result = TorchDistributor(num_processes=2, local_mode=mode == "local", use_gpu=False).run(train, 3)
    finally:
        spark.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
