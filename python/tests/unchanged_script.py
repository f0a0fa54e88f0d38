"""A training script as a gloo user writes it, with only the backend's name
changed: no `import braid_torch`. torch loads braid through the entry point
braid_torch installs (group "torch.backends"), under any launcher.

    torchrun --nproc-per-node 2 unchanged_script.py
    mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT python unchanged_script.py

Each rank trains a small model with DDP for a few steps, checks an exact
all_reduce and that every rank ends with the same parameters, and prints
one JSON line.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

# Loaded by `import torch` alone; recorded before anything below could load it.
loaded_with_torch = "braid_torch" in sys.modules

dist.init_process_group("braid")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(rank)
for _ in range(3):
    opt.zero_grad()
    nn.functional.mse_loss(model(torch.randn(4, 8, generator=gen)), torch.randn(4, 2, generator=gen)).backward()
    opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
every = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(every, flat)
print(json.dumps({
    "rank": rank,
    "world": world,
    "loaded_with_torch": loaded_with_torch,
    "backend": dist.get_backend(),
    "sum": t.item(),
    "same_parameters": all(torch.equal(e, flat) for e in every),
}), flush=True)
dist.destroy_process_group()
