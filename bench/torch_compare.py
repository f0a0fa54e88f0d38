"""braid against gloo through torch.distributed, in one run on this host.

    python bench/torch_compare.py --nprocs 2

Every rank holds a gloo group and a braid group over the same processes, and
each measurement alternates between them, so both see the same machine
state. For all_reduce it also times braid's C API directly on the same
communicator (ctypes on the extension's exported braid_all_reduce): the
"torch/C" column is what the binding adds. The last section times a DDP
training step (about 10 M parameters) through each backend, and through DDP
with a communication hook that keeps every bucket local: DDP's own cost,
the floor any backend can reach. Point-to-point: a dist.send/dist.recv
ping-pong between pairs of ranks, and a ring exchange through
batch_isend_irecv. Last, what making a group costs
(dist.new_group and its first all_reduce), as torch makes one per mesh
dimension or pipeline stage.

Times are medians over iterations of the slowest rank; ratios are
braid / gloo (below 1 means braid is faster).
"""

import argparse
import ctypes
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import braid_torch

SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20]
BRAID_FLOAT32, BRAID_SUM = 8, 0


def fmt_size(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def iters_for(nbytes, base):
    return max(5, min(base, int(base * (1 << 20) / max(nbytes, 1 << 20))))


def timed(fn, iters, group_for_max):
    """Median per-call seconds over up to 5 samples of back-to-back calls
    (iters calls in all), taking the slowest rank for each sample. Calls run
    back to back, as in nccl-tests: a barrier before every single call would
    time how far apart the ranks leave that barrier, not the call."""
    nsamples = min(5, iters)
    per_sample = max(1, iters // nsamples)
    samples = []
    for _ in range(nsamples):
        dist.barrier(group=group_for_max)
        t0 = time.perf_counter()
        for _ in range(per_sample):
            fn()
        samples.append((time.perf_counter() - t0) / per_sample)
    return statistics.median(max_over_ranks(samples, group_for_max))


def max_over_ranks(seconds, group):
    """Each of a list of per-rank times, as the slowest rank took it (one all_reduce)."""
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def group_creation(backend, gloo, rounds=5):
    """Median over rounds of the slowest rank's dist.new_group over every
    rank plus the group's first all_reduce (where lazy setup would show)."""
    t = torch.ones(1)
    samples = []
    for _ in range(rounds):
        dist.barrier(group=gloo)
        t0 = time.perf_counter()
        g = dist.new_group(backend=backend)
        dist.all_reduce(t, group=g)
        samples.append(time.perf_counter() - t0)
        dist.destroy_process_group(g)
    return statistics.median(max_over_ranks(samples, gloo))


def c_all_reduce(lib, comm, buf):
    rc = lib.braid_all_reduce(ctypes.c_void_p(buf.data_ptr()), ctypes.c_void_p(buf.data_ptr()),
                              ctypes.c_size_t(buf.numel()), BRAID_FLOAT32, BRAID_SUM, ctypes.c_void_p(comm), None)
    if rc != 0:
        raise RuntimeError(lib.braid_get_last_error().decode())


class Mlp(nn.Module):
    def __init__(self, width=1024, depth=4):
        super().__init__()
        layers = [nn.Linear(width, 2 * width), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Linear(2 * width, 2 * width), nn.ReLU()]
        layers += [nn.Linear(2 * width, width)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def worker(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("BRAID_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if args.separate_hosts:
        # Every rank on its own simulated host: braid talks TCP, as gloo always does.
        os.environ["BRAID_HOST_ID"] = f"sim-host-{rank}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    gloo = dist.group.WORLD
    dist.barrier(group=gloo)
    t0 = time.perf_counter()
    braid = dist.new_group(backend="braid")
    first_group = max_over_ranks([time.perf_counter() - t0], gloo)[0]
    lib = ctypes.CDLL(braid_torch._C.__file__)
    lib.braid_get_last_error.restype = ctypes.c_char_p
    comm = braid._get_backend(torch.device("cpu")).comm_handle
    rows = []
    # torch.distributed's own cost per call: a group of one rank, where the
    # collective itself does nothing, through torch and through the C API.
    solo = dist.new_group(ranks=[0], backend="braid")
    solo_cost = None
    if rank == 0:
        solo_comm = solo._get_backend(torch.device("cpu")).comm_handle
        t2 = torch.ones(2)
        costs = {"torch": [], "c": []}
        for _ in range(3):
            for label, fn in (("torch", lambda: dist.all_reduce(t2, group=solo)),
                              ("c", lambda: c_all_reduce(lib, solo_comm, t2))):
                for _ in range(100):
                    fn()
                t0 = time.perf_counter()
                for _ in range(20000):
                    fn()
                costs[label].append((time.perf_counter() - t0) / 20000)
        solo_cost = {k: min(v) for k, v in costs.items()}

    def both(name, size, make_fn, with_c=False):
        iters = iters_for(size, args.iters)
        fns = {"gloo": make_fn(gloo), "braid": make_fn(braid)}
        if with_c:
            # Right after the torch call in every round, so both find the
            # caches in the state gloo's turn left them.
            buf = torch.ones(max(1, size // 4))
            fns["c"] = lambda: c_all_reduce(lib, comm, buf)
            # The binding alone: braid's c10d Backend called as
            # dist.all_reduce calls it, without torch.distributed's Python
            # and dispatcher layers above it.
            opts = dist.AllreduceOptions()
            opts.asyncOp = False
            bk = braid._get_backend(torch.device("cpu"))
            fns["backend"] = lambda: bk.allreduce([buf], opts).wait()
        for fn in fns.values():  # warm up
            fn()
            fn()
        res = {}
        for _ in range(args.rounds):  # alternate to share the machine's moods
            for label, fn in fns.items():
                res.setdefault(label, []).append(timed(fn, iters, gloo))
        rows.append((name, size, {k: min(v) for k, v in res.items()}))

    for size in SIZES if not args.ddp_only else ():
        n = max(1, size // 4)

        def ar(g, n=n):
            t = torch.ones(n)
            return lambda: dist.all_reduce(t, group=g)

        both("all_reduce", size, ar, with_c=True)
    for size in (64 << 10, 8 << 20) if not args.ddp_only else ():
        n = max(1, size // 4)

        def bc(g, n=n):
            t = torch.ones(n)
            return lambda: dist.broadcast(t, 0, group=g)

        def ag(g, n=n):
            t, o = torch.ones(n // world or 1), torch.empty((n // world or 1) * world)
            return lambda: dist.all_gather_into_tensor(o, t, group=g)

        def rs(g, n=n):
            t, o = torch.ones((n // world or 1) * world), torch.empty(n // world or 1)
            return lambda: dist.reduce_scatter_tensor(o, t, group=g)

        both("broadcast", size, bc)
        both("all_gather", size, ag)
        both("reduce_scatter", size, rs)
    # Point-to-point: a ping-pong between ranks 2k and 2k + 1 (dist.send and
    # dist.recv, one way at a time), and a ring exchange through
    # batch_isend_irecv (every rank sends to the next, receives from the
    # previous), as pipeline stages move activations.
    for size in (64 << 10, 8 << 20) if not args.ddp_only else ():
        n = max(1, size // 4)

        def ping_pong(g, n=n):
            t, peer = torch.ones(n), rank ^ 1
            if peer >= world:
                return lambda: None
            if rank % 2 == 0:
                return lambda: (dist.send(t, peer, group=g), dist.recv(t, peer, group=g))
            return lambda: (dist.recv(t, peer, group=g), dist.send(t, peer, group=g))

        def ring(g, n=n):
            out, into = torch.ones(n), torch.empty(n)
            ops = [dist.P2POp(dist.isend, out, (rank + 1) % world, group=g),
                   dist.P2POp(dist.irecv, into, (rank - 1) % world, group=g)]

            def exchange():
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            return exchange

        both("ping-pong", size, ping_pong)
        both("p2p ring", size, ring)

    # DDP: one optimizer step per sample, same model and data for both.
    torch.manual_seed(0)
    base = Mlp()
    params = sum(p.numel() for p in base.parameters())
    x, y = torch.randn(args.batch, 1024), torch.randn(args.batch, 1024)
    models = {}
    for label, g in (("gloo", gloo), ("braid", braid), ("no comm", braid)):
        m = Mlp()
        m.load_state_dict(base.state_dict())
        ddp = nn.parallel.DistributedDataParallel(m, process_group=g)
        if label == "no comm":
            # DDP's own work (bucket copies, hooks, the averaging) without any
            # communication: the floor any backend's step can reach.
            def keep_local(state, bucket):
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut

            ddp.register_comm_hook(None, keep_local)
        models[label] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4))

    def step(label):
        ddp, opt = models[label]
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    step_times = {"gloo": [], "braid": [], "no comm": []}
    for label in step_times:
        step(label)
    for _ in range(args.ddp_steps):
        for label in step_times:
            step_times[label].append(timed(lambda label=label: step(label), 1, gloo))
    # The compute alone (no communication) bounds what any backend can reach.
    local = Mlp()
    local.load_state_dict(base.state_dict())
    lopt = torch.optim.SGD(local.parameters(), lr=1e-4)

    def local_step():
        lopt.zero_grad()
        nn.functional.mse_loss(local(x), y).backward()
        lopt.step()

    compute = [timed(local_step, 1, gloo) for _ in range(args.ddp_steps)]
    groups = {"first braid": first_group}
    for label in ("gloo", "braid"):
        groups[label] = group_creation(label, gloo)
    if rank == 0:
        out.put((rows, params, {k: statistics.median(v) for k, v in step_times.items()}, statistics.median(compute),
                 solo_cost, groups))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    # 50 calls (5 samples of 10) timed how far apart gloo's barrier let the
    # ranks go rather than the call: braid's 64 KiB broadcast read 48 us
    # there and 14.7 us with 500.
    parser.add_argument("--iters", type=int, default=300, help="calls per measurement at 1 MiB and below")
    parser.add_argument("--rounds", type=int, default=3, help="alternating samples per backend (best kept)")
    parser.add_argument("--ddp-steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ddp-only", action="store_true", help="skip the collectives table, time the DDP step only")
    parser.add_argument("--separate-hosts", action="store_true",
                        help="give every rank its own BRAID_HOST_ID, so braid uses TCP between all ranks")
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.nprocs, port, args, out)) for r in range(args.nprocs)]
    for p in procs:
        p.start()
    rows, params, ddp, compute, solo_cost, groups = out.get(timeout=1800)
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        sys.exit("a rank failed")

    where = "each on its own simulated host (braid over TCP)" if args.separate_hosts else "on this host"
    print(f"# torch {torch.__version__}, braid {braid_torch.version()}, {args.nprocs} ranks {where}, "
          f"float32 sum; times per call (us), back to back, median of samples, slowest rank")
    print(f"{'op':<15}{'size':>9}{'gloo us':>12}{'braid us':>12}{'braid/gloo':>12}{'C us':>10}{'torch/C':>9}"
          f"{'backend/C':>11}")
    for name, size, t in rows:
        c = f"{t['c'] * 1e6:>10.1f}{t['braid'] / t['c']:>9.2f}{t['backend'] / t['c']:>11.2f}" if "c" in t else ""
        print(f"{name:<15}{fmt_size(size):>9}{t['gloo'] * 1e6:>12.1f}{t['braid'] * 1e6:>12.1f}"
              f"{t['braid'] / t['gloo']:>12.2f}{c}")
    print(f"\ntorch's own cost per call (all_reduce of 8 B in a group of one rank): "
          f"{solo_cost['torch'] * 1e6:.1f} us through torch.distributed, {solo_cost['c'] * 1e6:.1f} us "
          f"through braid's C API (ctypes); the difference is in every torch row above")
    print("backend/C: braid's c10d Backend.allreduce(...).wait() called directly, against the C API: what the "
          "binding itself adds; torch/C adds torch.distributed's Python and dispatcher layers on top")
    print(f"\nDDP step, MLP with {params / 1e6:.1f} M parameters, batch {args.batch} per rank:")
    print(f"  gloo {ddp['gloo'] * 1e3:.1f} ms, braid {ddp['braid'] * 1e3:.1f} ms, "
          f"DDP without communication {ddp['no comm'] * 1e3:.1f} ms, compute alone {compute * 1e3:.1f} ms")
    print(f"ddp braid/gloo = {ddp['braid'] / ddp['gloo']:.2f}")
    over_gloo, over_braid = ddp["gloo"] - ddp["no comm"], ddp["braid"] - ddp["no comm"]
    if over_gloo > 0:
        print(f"what communication adds to the step, braid/gloo = {over_braid / over_gloo:.2f} "
              f"({over_braid * 1e3:.1f} ms against {over_gloo * 1e3:.1f} ms)")
    print(f"\nnew_group over every rank and its first all_reduce (slowest rank, median of 5): "
          f"gloo {groups['gloo'] * 1e3:.1f} ms, braid {groups['braid'] * 1e3:.1f} ms; braid's first group of "
          f"this shape, which times peer reads at init, {groups['first braid'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
