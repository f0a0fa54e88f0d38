"""Rank programs for the braid_torch tests: `python workers.py SCENARIO` runs
one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment,
as torchrun sets them). A failed check raises, so the rank exits non-zero
with the reason on stderr."""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import braid_torch  # noqa: F401  registers "braid"

BACKEND = os.environ.get("TEST_BACKEND", "braid")


def init(timeout_s=60):
    dist.init_process_group(BACKEND, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def expect_equal(got, want, what):
    if not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got}, want {want}")


def expect_raises(fn, *fragments):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        text = str(e)
        for frag in fragments:
            if frag not in text:
                raise AssertionError(f"error message lacks {frag!r}: {text}") from e
        return text
    raise AssertionError(f"no error raised; expected one mentioning {fragments}")


def batch_ring(n, rank, nxt, prv, what):
    """batch_isend_irecv of n floats around the ring: each rank sends its
    rank to the next and checks what the previous sent."""
    got = torch.empty(n)
    ops = [dist.P2POp(dist.isend, torch.full((n,), float(rank)), nxt), dist.P2POp(dist.irecv, got, prv)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    expect_equal(got, torch.full((n,), float(prv)), what)


def expect_same_parameters_everywhere(params, what, rank, world):
    """Every rank holds the same `params` (tensors); `what` names them in the failure."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    for r, other in enumerate(everyone):
        if not torch.equal(other, flat):
            raise AssertionError(f"{what}: rank {r}'s parameters differ from rank {rank}'s")


def exit_reference_run():
    """Ends a gloo reference run at once. gloo (torch 2.11) now and then
    aborts at interpreter exit after training, its work done and written
    ("terminate called without an active exception", seen in CI and in the
    FSDP2 test): skip the teardown there. braid's runs exit normally, so
    their teardown stays tested."""
    if BACKEND == "gloo":
        sys.stdout.flush()
        os._exit(0)


# ---- scenarios ----


def collectives():
    rank, world = init()
    r1 = rank + 1
    # all_reduce: every op, several dtypes, sync and async.
    base = torch.arange(1, 7, dtype=torch.float64)
    for op, want in [
        (dist.ReduceOp.SUM, base * sum(range(1, world + 1))),
        (dist.ReduceOp.AVG, base * sum(range(1, world + 1)) / world),
        (dist.ReduceOp.PRODUCT, base ** world * float(torch.prod(torch.arange(1, world + 1)))),
        (dist.ReduceOp.MIN, base),
        (dist.ReduceOp.MAX, base * world),
    ]:
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            if dtype == torch.bfloat16 and op == dist.ReduceOp.PRODUCT:
                continue  # partial products round differently by reduction order
            t = (base * r1).to(dtype)
            dist.all_reduce(t, op=op)
            expect_equal(t, want.to(dtype), f"all_reduce {op} {dtype}")
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64):
        t = torch.tensor([r1, 2 * r1, 1], dtype=dtype)
        dist.all_reduce(t)
        s = sum(range(1, world + 1))
        expect_equal(t, torch.tensor([s, 2 * s, world], dtype=dtype), f"all_reduce sum {dtype}")
    for op, combine in [(dist.ReduceOp.BAND, lambda a, b: a & b), (dist.ReduceOp.BOR, lambda a, b: a | b),
                        (dist.ReduceOp.BXOR, lambda a, b: a ^ b)]:
        vals = [torch.tensor([0b1011 << r, 0x7F ^ r, -1 - r], dtype=torch.int64) for r in range(world)]
        want = vals[0]
        for v in vals[1:]:
            want = combine(want, v)
        t = vals[rank].clone()
        dist.all_reduce(t, op=op)
        expect_equal(t, want, f"all_reduce {op}")
    # A strided view of a parameter (a leaf that requires grad): gloo writes
    # the raw data; the copy back from braid's staging buffer must too, on
    # the caller's thread (blocking) and on the completion thread (async).
    for async_op in (False, True):
        w = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * r1).requires_grad_()
        work = dist.all_reduce(w.t(), async_op=async_op)
        if async_op:
            work.wait()
        expect_equal(w.detach(), torch.arange(12, dtype=torch.float32).reshape(3, 4) * sum(range(1, world + 1)),
                     f"all_reduce of a parameter's strided view (async_op={async_op})")
    t = torch.tensor([rank == 0, True, False])
    dist.all_reduce(t, op=dist.ReduceOp.BXOR)
    expect_equal(t, torch.tensor([True, world % 2 == 1, False]), "all_reduce bool bxor")
    t = torch.tensor([rank == 0, True, False])
    dist.all_reduce(t)
    expect_equal(t, torch.tensor([True, True, False]), "all_reduce bool sum (logical or)")
    c = torch.tensor([1 + 2j, -3j], dtype=torch.complex64) * r1
    dist.all_reduce(c)
    expect_equal(c, torch.tensor([1 + 2j, -3j], dtype=torch.complex64) * sum(range(1, world + 1)), "complex sum")
    # complex32 (torch hands complex all_reduces over as real views, not
    # reduce_scatters), built and checked through float16 views.
    halves = torch.tensor([1.0, 2.0] * world, dtype=torch.float16) * r1
    out = torch.zeros(2, dtype=torch.float16)
    dist.reduce_scatter_tensor(out.view(torch.complex32), halves.view(torch.complex32))
    expect_equal(out, torch.tensor([1.0, 2.0], dtype=torch.float16) * sum(range(1, world + 1)),
                 "complex32 reduce_scatter_tensor")
    t = torch.full((5,), float(r1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    expect_equal(t, torch.full((5,), 0.5 * sum(range(1, world + 1))), "premul_sum")
    # Sparse COO sum: rank r contributes r + 1 at (r, r) and 1 at (0, 1).
    i = torch.tensor([[rank, 0], [rank, 1]])
    sp = torch.sparse_coo_tensor(i, torch.tensor([float(r1), 1.0]), (world, world))
    dist.all_reduce(sp)
    want = torch.zeros(world, world)
    for r in range(world):
        want[r, r] += r + 1
    want[0, 1] += world
    expect_equal(sp.to_dense(), want, "sparse all_reduce")
    # Non-contiguous input: the strided view is reduced and written back.
    m = torch.zeros(4, 6)
    m[:, 1] = r1
    view = m[:, 1]
    dist.all_reduce(view)
    expect_equal(m[:, 1], torch.full((4,), float(sum(range(1, world + 1)))), "strided all_reduce")
    expect_equal(m[:, 0], torch.zeros(4), "strided all_reduce leaves neighbours alone")
    # Async: Work and Future.
    t = torch.ones(1000) * r1
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    work.wait()
    assert work.is_completed() and work.is_success()
    got = fut.wait()[0]
    expect_equal(got, torch.ones(1000) * sum(range(1, world + 1)), "future value")
    chained = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    expect_equal(chained.wait(), torch.full((3,), 2.0 * world), "future then")
    # Coalesced all_reduce.
    ts = [torch.ones(3) * r1, torch.ones(2, 2) * r1]
    dist.all_reduce_coalesced(ts)
    expect_equal(ts[1], torch.ones(2, 2) * sum(range(1, world + 1)), "all_reduce_coalesced")
    # broadcast and reduce from every root.
    for root in range(world):
        t = torch.tensor([rank, 7], dtype=torch.int64)
        dist.broadcast(t, root)
        expect_equal(t, torch.tensor([root, 7]), f"broadcast root {root}")
        t = torch.tensor([float(r1)])
        dist.reduce(t, root, op=dist.ReduceOp.MAX)
        if rank == root:
            expect_equal(t, torch.tensor([float(world)]), f"reduce root {root}")
    # Gathers and scatters.
    outs = [torch.empty(2, 3) for _ in range(world)]
    dist.all_gather(outs, torch.full((2, 3), float(rank)))
    for i, o in enumerate(outs):
        expect_equal(o, torch.full((2, 3), float(i)), "all_gather")
    big = torch.empty(world * 4, dtype=torch.int32)
    dist.all_gather_into_tensor(big, torch.full((4,), rank, dtype=torch.int32))
    expect_equal(big, torch.arange(world, dtype=torch.int32).repeat_interleave(4), "all_gather_into_tensor")
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": i} for i in range(world)], objs
    out = torch.empty(3)
    dist.reduce_scatter(out, [torch.full((3,), float(r1 * (i + 1))) for i in range(world)])
    expect_equal(out, torch.full((3,), float(sum(range(1, world + 1)) * r1)), "reduce_scatter")
    out = torch.empty(2, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, torch.arange(2 * world, dtype=torch.float64), op=dist.ReduceOp.AVG)
    expect_equal(out, torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float64), "reduce_scatter_tensor avg")
    root = world - 1
    gl = [torch.empty(2) for _ in range(world)] if rank == root else None
    dist.gather(torch.full((2,), float(rank)), gl, dst=root)
    if rank == root:
        for i, g in enumerate(gl):
            expect_equal(g, torch.full((2,), float(i)), "gather")
    out = torch.empty(3, dtype=torch.int64)
    sl = [torch.full((3,), 10 * i, dtype=torch.int64) for i in range(world)] if rank == 0 else None
    dist.scatter(out, sl, src=0)
    expect_equal(out, torch.full((3,), 10 * rank, dtype=torch.int64), "scatter")
    # all_to_all: even, uneven (split sizes), and lists of different sizes.
    inp = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
    out = torch.empty(world * 2)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.tensor([100.0 * s + 2 * rank, 100.0 * s + 2 * rank + 1]) for s in range(world)])
    expect_equal(out, want, "all_to_all_single")
    in_splits = [rank + d + 1 for d in range(world)]  # rows to rank d
    out_splits = [s + rank + 1 for s in range(world)]  # rows from rank s
    inp = torch.cat([torch.full((n, 2), float(10 * rank + d)) for d, n in enumerate(in_splits)])
    out = torch.empty(sum(out_splits), 2)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    want = torch.cat([torch.full((n, 2), float(10 * s + rank)) for s, n in enumerate(out_splits)])
    expect_equal(out, want, "all_to_all_single with splits")
    ins = [torch.full((d + 1,), float(rank)) for d in range(world)]
    outs = [torch.empty(rank + 1) for _ in range(world)]
    dist.all_to_all(outs, ins)
    for s, o in enumerate(outs):
        expect_equal(o, torch.full((rank + 1,), float(s)), "all_to_all lists")
    # all_gather with outputs of different sizes (rank r gives r + 1
    # elements), one of them not contiguous.
    outs = [torch.empty(r + 1) for r in range(world)]
    outs[-1] = torch.empty(2 * world).view(world, 2)[:, 0]
    dist.all_gather(outs, torch.full((rank + 1,), float(rank)))
    for r, o in enumerate(outs):
        expect_equal(o, torch.full((r + 1,), float(r)), "all_gather of uneven sizes")
    expect_raises(lambda: dist.all_gather([torch.empty(5) for _ in range(world)], torch.ones(rank + 1)),
                  "braid", "this rank's")
    # reduce_scatter with shares of different sizes (rank r's is r + 1
    # elements), as gloo allows: before, braid refused it.
    for op, want in ((dist.ReduceOp.SUM, lambda r: float(sum(q + r for q in range(world)))),
                     (dist.ReduceOp.MAX, lambda r: float(world - 1 + r))):
        out = torch.zeros(rank + 1)
        dist.reduce_scatter(out, [torch.full((r + 1,), float(r + rank)) for r in range(world)], op=op)
        expect_equal(out, torch.full((rank + 1,), want(rank)), f"reduce_scatter of uneven shares ({op})")
    expect_raises(lambda: dist.reduce_scatter(torch.zeros(rank + 1), [torch.ones(5) for _ in range(world)]),
                  "braid", "this rank's share")
    # Point-to-point: a ring, blocking and not, and batch_isend_irecv.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    recv = torch.empty(5, dtype=torch.int64)
    reqs = [dist.isend(torch.full((5,), rank, dtype=torch.int64), nxt), dist.irecv(recv, prv)]
    for q in reqs:
        q.wait()
    expect_equal(recv, torch.full((5,), prv, dtype=torch.int64), "isend/irecv ring")
    if rank == 0:
        dist.send(torch.tensor([3.5]), 1)
    elif rank == 1:
        t = torch.empty(1)
        dist.recv(t, 0)
        expect_equal(t, torch.tensor([3.5]), "send/recv")
    # Receive from any source: rank 0 takes one message from every other rank.
    if rank == 0:
        senders = set()
        for _ in range(world - 1):
            t = torch.empty(2)
            src = dist.recv(t)
            expect_equal(t, torch.full((2,), float(src)), "recv from any source")
            senders.add(src)
        assert senders == set(range(1, world)), senders
    else:
        dist.send(torch.full((2,), float(rank)), 0)
    # Without it a sender's next message (below) could meet rank 0's second
    # any-source receive, as it would in MPI.
    dist.barrier()
    batch_ring(3, rank, nxt, prv, "batch_isend_irecv")
    dist.barrier()
    braid_torch.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    # Subgroups: each is its own braid communicator.
    evens = [r for r in range(world) if r % 2 == 0]
    g_even = dist.new_group(evens)
    g_all = dist.new_group(list(range(world)))
    if rank in evens:
        t = torch.tensor([1.0])
        dist.all_reduce(t, group=g_even)
        expect_equal(t, torch.tensor([float(len(evens))]), "subgroup all_reduce")
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g_all)
    expect_equal(t, torch.tensor([float(world - 1)]), "second group")
    if world >= 4:
        sub, _ = dist.new_subgroups(group_size=2)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=sub)
        base_rank = rank - rank % 2
        expect_equal(t, torch.tensor([float(2 * base_rank + 1)]), "new_subgroups")
    assert dist.get_backend() == "braid", dist.get_backend()
    dist.destroy_process_group()
    print(f"rank {rank}: collectives ok", flush=True)


def bad_input():
    rank, world = init()
    t = torch.ones(4, dtype=torch.int32)
    expect_raises(lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND), "braid", "need an integer")
    expect_raises(lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG), "braid", "AVG needs a floating dtype")
    expect_raises(lambda: dist.all_reduce(torch.ones(2, dtype=torch.int16)), "braid", "cannot reduce dtype")
    # A device braid does not take: a meta tensor handed to the backend
    # directly (torch's dispatcher would route it away).
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    meta = torch.empty(3, device="meta")
    expect_raises(lambda: backend.allreduce([meta]), "braid", "meta", "CPU and CUDA tensors")
    expect_raises(
        lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2)), "braid", "all_gather_into_tensor"
    )
    expect_raises(lambda: dist.broadcast(torch.ones(1), world + 3), "")  # torch or braid: a clear error
    # The group still works after rejected calls.
    t = torch.ones(2)
    dist.all_reduce(t)
    expect_equal(t, torch.full((2,), float(world)), "all_reduce after errors")
    dist.destroy_process_group()
    print(f"rank {rank}: bad input ok", flush=True)


def dead_peer():
    rank, world = init(timeout_s=120)
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    if rank == world - 1:
        os._exit(0)  # dies without a word to anyone
    start = time.time()
    msg = expect_raises(lambda: [dist.all_reduce(t) for _ in range(3)], "braid", "all_reduce")
    took = time.time() - start
    assert f"rank {world - 1}" in msg, msg
    assert took < 60, f"took {took:.1f} s to notice a dead peer (timeout is 120 s)"
    print(f"rank {rank}: dead peer reported in {took:.2f} s: {msg}", flush=True)
    os._exit(0)  # the group is broken; skip teardown


def hung_peer():
    rank, world = init(timeout_s=3)
    if rank == world - 1:
        time.sleep(8)  # alive, never joins
        os._exit(0)
    start = time.time()
    msg = expect_raises(lambda: dist.all_reduce(torch.ones(4)), "braid", "all_reduce", "timed out",
                        f"rank {world - 1}")
    took = time.time() - start
    assert 2 < took < 30, f"timed out after {took:.1f} s for a 3 s timeout"
    print(f"rank {rank}: hung peer reported in {took:.2f} s: {msg}", flush=True)
    os._exit(0)


def absent_from_barrier():
    """Rank 0 names the rank that never arrives; then its group ends at once
    (abort), not after the group's 30 s timeout waiting for the receive still
    posted for the absent rank, which stays alive meanwhile."""
    rank, world = init(timeout_s=30)
    if rank == world - 1:
        time.sleep(10)  # alive, never arrives
        os._exit(0)
    if rank == 0:
        start = time.time()
        # torch's own function, as an unchanged script calls it (torch
        # accepts only gloo groups by name; braid_torch routes braid's).
        msg = expect_raises(
            lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=1), wait_all_ranks=True),
            "monitored_barrier", f"Ranks {world - 1} failed to pass monitoredBarrier in 1000 ms",
        )
        print(f"rank {rank}: monitored_barrier failed after {time.time() - start:.2f} s: {msg}", flush=True)
        start = time.time()
        dist.destroy_process_group()
        took = time.time() - start
        assert took < 5, f"destroy_process_group after a failed monitored_barrier took {took:.1f} s"
        print(f"rank {rank}: destroyed in {took:.2f} s", flush=True)
    else:
        # Arrives, and is not released: fails at its own timeout, as gloo's
        # ranks do, not at the group's 30 s.
        start = time.time()
        expect_raises(
            lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=1)),
            f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting for "
            "send/recv from rank 0",
        )
        took = time.time() - start
        assert took < 10, f"rank {rank} waited {took:.1f} s for a release"
        print(f"rank {rank}: not released, failed after {took:.2f} s", flush=True)
        dist.destroy_process_group()
    os._exit(0)


def exit_with_work_pending():
    """Rank 0 exits with an async all_reduce pending and a Python callback on
    its Future: the interpreter's exit aborts the group and completes the
    work (the callback sees the error) instead of dying in braid's threads
    (`terminate called without an active exception`, status 134). Rank 1,
    late, either finds what rank 0 sent before it left (its call completes)
    or learns of the abort; it does not wait for its timeout."""
    rank, _ = init(timeout_s=60)
    t = torch.ones(4)
    if rank == 0:
        seen = []
        if os.environ.get("PENDING") == "batch_recv":
            # A work of torch's coalescing: before, it was not known as
            # pending, completed during the interpreter's teardown, and the
            # process died (SIGSEGV).
            fut = dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(4), 1)])[0].get_future()
        else:
            fut = dist.all_reduce(t, async_op=True).get_future()

        def callback(f):
            try:
                f.value()
                seen.append("value")
            except Exception as e:  # noqa: BLE001
                seen.append(f"error: {e}")
                print(f"rank 0: the callback saw {e}", flush=True)

        fut.then(callback)
        sys.exit(0)
    time.sleep(3)
    if os.environ.get("PENDING") == "batch_recv":
        os._exit(0)  # rank 0's receive is left for the abort to end
    start = time.time()
    try:
        dist.all_reduce(t)
        expect_equal(t, torch.full((4,), 2.0), "all_reduce with rank 0's contribution sent before it left")
        print("rank 1: all_reduce completed with what rank 0 sent", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"rank 1: all_reduce failed: {e}", flush=True)
        assert "abort" in str(e), e
    assert time.time() - start < 30, f"rank 1 took {time.time() - start:.1f} s"
    os._exit(0)


def debug_checks_calls():
    """Under TORCH_DISTRIBUTED_DEBUG=INFO a broadcast whose ranks name
    different roots fails at that broadcast, naming both, not at a later
    collective (or never, where it was the last)."""
    rank, _ = init(timeout_s=60)
    # monitored_barrier goes to braid's own under DETAIL too, where torch
    # wraps the backend (before: "only implemented for GLOO backend").
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    t = torch.full((8,), float(rank))
    expect_raises(lambda: dist.broadcast(t, src=rank), "broadcast", "root")
    print(f"rank {rank}: mismatched roots found at the broadcast", flush=True)
    os._exit(0)


def mpi_env_set_in_code():
    """Under mpirun, a script that sets MASTER_ADDR and MASTER_PORT in code,
    after `import torch`, still gets RANK and WORLD_SIZE from Open MPI's
    variables when it joins."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = os.environ["TEST_MASTER_PORT"]
    rank, world = init(timeout_s=60)
    assert rank == int(os.environ["OMPI_COMM_WORLD_RANK"]) and world == int(os.environ["OMPI_COMM_WORLD_SIZE"])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expect_equal(t, torch.tensor([float(world * (world + 1) // 2)]), "all_reduce")
    print(json.dumps({"rank": rank, "ok": True}), flush=True)
    dist.destroy_process_group()


def wait_after_abort():
    """An op that cannot finish (the last rank never joins), then the group
    aborted: wait() on its work raises, naming the abort, on the device the
    WAIT_DEVICE variable names (cpu, or cuda: a stream-ordered work)."""
    rank, world = init(timeout_s=60)
    if rank == world - 1:
        time.sleep(5)  # alive, never joins
        os._exit(0)
    dev = torch.device(os.environ.get("WAIT_DEVICE", "cpu"))
    if dev.type == "cuda":
        dev = cuda_device()
        torch.cuda.set_device(dev)
    work = dist.all_reduce(torch.ones(1024, device=dev), async_op=True)
    time.sleep(0.2)
    backend = dist.distributed_c10d._get_default_group()._get_backend(dev)
    # ErrorType and Backend::getError() came with torch 2.7.
    error_type = getattr(torch._C._distributed_c10d, "ErrorType", None)
    assert error_type is None or backend.get_error() == error_type.SUCCESS, backend.get_error()
    dist.distributed_c10d._abort_process_group()
    assert error_type is None or backend.get_error() == error_type.COMM_ERROR, backend.get_error()
    msg = expect_raises(work.wait, "braid", "abort")
    print(f"rank {rank}: wait after abort raised: {msg}", flush=True)
    os._exit(0)


def mismatched_roots():
    """Each rank believes it is broadcast's root, and nothing follows: the
    broadcast returns each rank's own data, and destroy_process_group on the
    rank that destroys second (once the first is gone, so the first's
    message has arrived) warns on stderr, naming the message no call took,
    and leaves torch torn down (a new group can be made). The first may
    find the other's message too."""
    rank, world = init()
    t = torch.full((4,), float(rank))
    dist.broadcast(t, src=rank)
    done = os.path.join(os.environ["MISMATCH_DIR"], "rank0-destroyed")
    if rank == 1:
        while not os.path.exists(done):
            time.sleep(0.01)
    dist.destroy_process_group()
    if dist.is_initialized():
        raise AssertionError("torch still holds the group after destroy_process_group")
    print(f"rank {rank}: destroyed", flush=True)
    if rank == 0:
        open(done, "w").close()


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def ddp_train():
    """Trains a small CNN with DDP on synthetic data; checks after every step
    that every rank holds the same parameters, and writes them out so the
    test can compare braid's run with gloo's."""
    rank, world = init()
    torch.manual_seed(1234)  # same initial weights everywhere, checked by DDP anyway
    model = nn.parallel.DistributedDataParallel(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(99)
    data = torch.randn(64, 1, 28, 28, generator=gen)
    labels = torch.randint(0, 10, (64,), generator=gen)
    sampler = torch.utils.data.distributed.DistributedSampler(
        torch.utils.data.TensorDataset(data, labels), shuffle=False
    )
    idx = list(iter(sampler))
    steps = int(os.environ.get("DDP_STEPS", "5"))
    for step in range(steps):
        batch = idx[(step * 4) % len(idx):][:4] or idx[:4]
        opt.zero_grad()
        loss = F.cross_entropy(model(data[batch]), labels[batch])
        loss.backward()
        opt.step()
        expect_same_parameters_everywhere(model.parameters(), f"step {step}", rank, world)
    out = os.environ.get("DDP_OUT")
    if out and rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, out)
    dist.destroy_process_group()
    print(f"rank {rank}: ddp ok after {steps} steps, loss {loss.item():.4f}", flush=True)
    exit_reference_run()


def sharded_train():
    """FSDP2 (fully_shard: parameters sharded, all_gather_into_tensor before
    use, reduce_scatter_tensor of gradients) and tensor parallelism
    (parallelize_module over DTensor: the functional collectives) on a CPU
    device mesh of every rank. FSDP2's layer widths do not divide by 3, which
    makes uneven shards (tensor parallelism needs even ones). Checks that
    every rank ends with the same full parameters and writes them out for the
    test to compare with gloo's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank, world = init()
    mesh = init_device_mesh("cpu", (world,))

    def mlp(hidden):
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(20, hidden), nn.ReLU(), nn.Linear(hidden, 6))

    fsdp = mlp(50)
    for layer in (fsdp[0], fsdp[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    tp = parallelize_module(mlp(48), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    out = {}
    for name, model, per_rank_data in (("fsdp", fsdp, True), ("tp", tp, False)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(rank if per_rank_data else 0)
        for _ in range(4):
            opt.zero_grad()
            x, y = torch.randn(8, 20, generator=gen), torch.randn(8, 6, generator=gen)
            F.mse_loss(model(x), y).backward()
            opt.step()
        full = {f"{name}.{pname}": p.full_tensor().detach().clone() for pname, p in model.named_parameters()}
        expect_same_parameters_everywhere(full.values(), name, rank, world)
        out.update(full)
    path = os.environ.get("SHARDED_OUT")
    if path and rank == 0:
        torch.save(out, path)
    dist.destroy_process_group()
    print(f"rank {rank}: fsdp and tp ok", flush=True)
    exit_reference_run()


def avg_reduce_scatter():
    """Prints what reduce_scatter_tensor with AVG gives for ranks holding
    1, 2, ...: their mean, (world + 1) / 2, where the backend is right (gloo
    in torch 2.8 returns the sum)."""
    rank, world = init()
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, torch.full((2 * world,), float(rank + 1)), op=dist.ReduceOp.AVG)
    print(f"rank {rank}: avg {out[0].item()} of {world}", flush=True)
    dist.destroy_process_group()


def init_methods():
    """INIT_METHOD picks tcp:// or file:// (env:// is every other scenario)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("braid", init_method=os.environ["INIT_METHOD"], rank=rank, world_size=world)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expect_equal(t, torch.tensor([world * (world + 1) / 2.0]), "all_reduce after " + os.environ["INIT_METHOD"])
    dist.destroy_process_group()
    print(f"rank {rank}: {os.environ['INIT_METHOD'].split(':')[0]} ok", flush=True)


def pending_recv():
    """A receive that waits for a message sent only later does not hold up the
    group's collectives, which also keep their order across async calls."""
    rank, world = init()
    if rank == 0:
        early = torch.zeros(4)
        work = dist.irecv(early, src=1)
    outs = [dist.all_reduce(torch.full((3,), float(k + rank)), async_op=True) for k in range(5)]
    for k, w in enumerate(outs):
        w.wait()
        got = w.result()[0]
        expect_equal(got, torch.full((3,), float(k * world + sum(range(world)))), f"async all_reduce #{k}")
    dist.barrier()
    if rank == 1:
        dist.send(torch.full((4,), 9.0), 0)
    if rank == 0:
        work.wait()
        expect_equal(early, torch.full((4,), 9.0), "late message")
    dist.destroy_process_group()
    print(f"rank {rank}: pending recv ok", flush=True)


def threads_futures_tags():
    """What a review found against gloo's behaviour, on 2 ranks:
    - a blocking collective on one thread does not keep another thread's
      send from starting (the peer receives it before it joins the collective);
    - a Future callback may wait on another work's Future (torch's PowerSGD
      hook does);
    - a barrier completes the async collectives before it (result copied out,
      work completed);
    - send/recv tags travel and are checked: in order they deliver, and a
      receive for another tag fails naming both, where it took the other
      message's bytes;
    - polling an async barrier's is_completed() while a Python callback of
      the collective before it still runs returns (it blocked on the work's
      lock, holding the GIL the callback waited for: both ranks hung);
    - a sparse all_reduce does not keep another thread's send from starting
      either (it waited under the lock that orders the posts)."""
    import threading

    rank, world = init(timeout_s=20)
    assert world == 2
    peer = 1 - rank
    big = torch.full((1 << 18,), 1.0)

    def beside_a_send(collective, what):
        """collective() on rank 0 while its second thread sends to rank 1,
        which receives that before it joins the collective."""
        if rank == 0:
            sender = threading.Thread(target=lambda: (time.sleep(0.3), dist.send(big, 1)))
            sender.start()
            collective()
            sender.join()
        else:
            got = torch.zeros(1 << 18)
            dist.recv(got, 0)
            expect_equal(got, big, f"send from a second thread beside {what}")
            collective()

    # Another thread's send while this one blocks in a collective.
    t = torch.ones(2)
    beside_a_send(lambda: dist.all_reduce(t), "an all_reduce")
    expect_equal(t, torch.full((2,), 2.0), "all_reduce beside a second thread's send")
    # A Future callback that waits on another work's Future.
    for n in (4, 1 << 18):
        a, b = torch.full((n,), rank + 1.0), torch.full((n,), rank + 1.0)
        if rank == 1:
            time.sleep(0.2)  # rank 0's inner op cannot finish at once
        fut = dist.all_reduce(a, async_op=True).get_future().then(
            lambda _: dist.all_reduce(b, async_op=True).get_future().wait()[0])
        expect_equal(fut.wait(), torch.full((n,), 3.0), f"Future waited on inside a callback, {n} elements")
    # A barrier completes the collectives before it.
    for k in range(20):
        base = torch.zeros(6, 4)
        col = base[:, 1]  # non-contiguous: the result is copied back
        col.fill_(rank + 1.0 + k)
        work = dist.all_reduce(col, async_op=True)
        dist.barrier()
        if not work.is_completed():
            raise AssertionError(f"round {k}: the all_reduce before the barrier is not completed after it")
        expect_equal(base[:, 1], torch.full((6,), 3.0 + 2 * k), f"round {k}: result after the barrier")
    # An async barrier polled while a callback of the work before it runs.
    t = torch.ones(1 << 20)
    if rank == 1:
        time.sleep(0.3)
    work = dist.all_reduce(t, async_op=True)
    work.get_future().then(lambda f: (time.sleep(0.5), f.value())[1])
    barrier = dist.barrier(async_op=True)
    start = time.time()
    while not barrier.is_completed():
        if time.time() - start > 20:
            raise AssertionError("the async barrier did not complete within 20 s")
    expect_equal(t[:4], torch.full((4,), 2.0), "all_reduce before the polled barrier")
    # A sparse all_reduce beside another thread's send its peer waits for.
    sparse = torch.sparse_coo_tensor(torch.tensor([[rank]]), torch.tensor([rank + 1.0]), (4,))
    beside_a_send(lambda: dist.all_reduce(sparse), "a sparse all_reduce")
    expect_equal(sparse.to_dense(), torch.tensor([1.0, 2.0, 0.0, 0.0]), "sparse all_reduce")
    # Tags: in order they deliver; a receive for another tag fails.
    x, y = torch.full((4,), 1.0), torch.full((4,), 2.0)
    if rank == 0:
        dist.send(x, 1, tag=1)
        dist.send(y, 1, tag=2)
    else:
        gx, gy = torch.zeros(4), torch.zeros(4)
        dist.recv(gx, 0, tag=1)
        dist.recv(gy, 0, tag=2)
        expect_equal(torch.stack([gx, gy]), torch.stack([x, y]), "tagged messages in order")
    tags = dist.new_group([0, 1])  # a mismatch breaks its communicator only
    if rank == 0:
        try:
            dist.send(x, 1, group=tags, tag=3)
        except Exception:  # noqa: BLE001 - the receiver's failure may reach the sender
            pass
    else:
        gx = torch.zeros(4)
        expect_raises(lambda: dist.recv(gx, 0, group=tags, tag=4), "with tag 4", "with tag 3")
        expect_equal(gx, torch.zeros(4), "a receive for another tag left its buffer alone")
    dist.barrier()
    print(f"rank {rank}: threads, futures, barrier and tags ok", flush=True)
    os._exit(0)  # the broken group is not torn down


def coalescing():
    """torch's coalescing (batch_isend_irecv, _coalescing_manager with a
    device) makes one braid group of the ops inside: a ring in both
    directions with messages far larger than the transport buffers, ops that
    complete only at the end, and an error inside that leaves the group
    usable."""
    from torch.distributed.distributed_c10d import _coalescing_manager, _get_default_group

    rank, world = init()
    group = _get_default_group()
    assert group._get_backend(torch.device("cpu")).supports_coalescing
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    n = 4 << 20  # 16 MiB a message
    from_prv, from_nxt = torch.empty(n), torch.empty(n)
    ops = [dist.P2POp(dist.isend, torch.full((n,), float(rank)), nxt),
           dist.P2POp(dist.isend, torch.full((n,), float(-rank)), prv),
           dist.P2POp(dist.irecv, from_prv, prv), dist.P2POp(dist.irecv, from_nxt, nxt)]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == 1, works  # one work for the whole batch, as with NCCL
    works[0].wait()
    assert works[0].is_success()
    expect_equal(from_prv, torch.full((n,), float(prv)), "batch ring, from the previous rank")
    expect_equal(from_nxt, torch.full((n,), float(-nxt)), "batch ring, from the next rank")
    # A blocking broadcast inside returns at once; its result is there
    # once the coalescing ended.
    b = torch.full((3,), float(rank))
    got = torch.empty(2)
    with _coalescing_manager(group, torch.device("cpu"), async_ops=True) as cm:
        dist.broadcast(b, src=world - 1)
        dist.isend(torch.full((2,), float(rank)), nxt)
        dist.irecv(got, prv)
    cm.wait()
    expect_equal(b, torch.full((3,), float(world - 1)), "broadcast in a coalescing")
    expect_equal(got, torch.full((2,), float(prv)), "send and recv in a coalescing")
    # An op that cannot join the group raises, and ends the coalescing:
    # later calls of this thread run as usual.
    expect_raises(lambda: _failing_coalescing(group), "braid", "monitored_barrier inside a coalescing")
    # torch keeps its own record of the unfinished coalescing (it would
    # capture the next all_reduce): drop it, as braid dropped its group.
    from torch.distributed.distributed_c10d import _world

    _world.pg_coalesce_state.pop(group, None)
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    expect_equal(t, torch.full((2,), float(sum(range(world)))), "all_reduce after a failed coalescing")
    batch_ring(4, rank, nxt, prv, "a batch after a failed coalescing")
    dist.destroy_process_group()
    print(f"rank {rank}: coalescing ok", flush=True)


def coalescing_edges():
    """A coalesced work's wait() with a timeout that passes while a part is
    still pending raises (a part left with under 1 ms must not wait without
    limit); an op on another group inside a coalescing is refused, and ends
    that coalescing; a work seen completed has its Future completed."""
    from torch.distributed.distributed_c10d import _coalescing_manager, _world

    rank, world = init()
    assert world == 2
    first, second = torch.zeros(4), torch.zeros(4)
    if rank == 0:
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, first, 1), dist.P2POp(dist.irecv, second, 1)])
        time.sleep(0.5)
        start = time.time()
        expect_raises(lambda: works[0].wait(datetime.timedelta(milliseconds=1)), "did not complete within")
        took = time.time() - start
        assert took < 5, f"a coalesced wait with a 1 ms timeout took {took:.1f} s"
    else:
        dist.send(torch.full((4,), 1.0), 0)
    dist.barrier()
    if rank == 1:
        dist.send(torch.full((4,), 2.0), 0)
    else:
        works[0].wait()
        expect_equal(first, torch.full((4,), 1.0), "first coalesced receive")
        expect_equal(second, torch.full((4,), 2.0), "second coalesced receive")

    sub = dist.new_group(list(range(world)))
    t = torch.full((3,), float(rank))
    got = torch.zeros(2)

    def all_reduce_inside_sub_coalescing():
        with _coalescing_manager(sub, torch.device("cpu")):
            dist.isend(torch.full((2,), float(rank)), 1 - rank, group=sub)
            dist.irecv(got, 1 - rank, group=sub)
            dist.all_reduce(t)  # the default group: not sub

    expect_raises(all_reduce_inside_sub_coalescing, "braid", "all_reduce",
                  "while another process group coalesces on this thread")
    _world.pg_coalesce_state.pop(sub, None)  # torch's record of the block the exception left
    expect_equal(t, torch.full((3,), float(rank)), "the refused all_reduce left its tensor alone")
    dist.all_reduce(t)
    expect_equal(t, torch.full((3,), 1.0), "all_reduce after the refused one")
    dist.barrier(group=sub)  # sub's coalesced send and receive started when its coalescing ended
    deadline = time.time() + 30
    while not torch.equal(got, torch.full((2,), float(1 - rank))):
        assert time.time() < deadline, f"sub's coalesced receive never landed: {got}"
        time.sleep(0.01)

    for k in range(300):
        w = dist.all_reduce(torch.full((2,), float(k)), async_op=True)
        while not w.is_completed():
            pass
        expect_equal(w.get_future().value()[0], torch.full((2,), float(k * world)), f"future of all_reduce #{k}")
    dist.destroy_process_group()
    print(f"rank {rank}: coalescing edges ok", flush=True)


def _failing_coalescing(group):
    from torch.distributed.distributed_c10d import _coalescing_manager

    with _coalescing_manager(group, torch.device("cpu")):
        braid_torch.monitored_barrier(group, timeout=datetime.timedelta(seconds=10))


def torchrun_env():
    """Under torchrun: init from the environment it sets, nothing else."""
    dist.init_process_group("braid")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expect_equal(t, torch.tensor([world * (world + 1) / 2.0]), "all_reduce under torchrun")
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "ok": True}), flush=True)


def elastic_restart():
    """Under torchrun --max-restarts 1: in the first attempt the last rank
    dies after a collective; the others' next all_reduce must fail at once
    (not hang until a timeout), so that torchrun restarts the workers, and
    the second attempt, a new group on the same store, runs to the end."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, world = init(timeout_s=120)
    t = torch.ones(4)
    dist.all_reduce(t)
    if attempt == 0:
        if rank == world - 1:
            os._exit(3)
        start = time.time()
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            print(json.dumps({"rank": rank, "attempt": 0, "failed_after_s": time.time() - start,
                              "error": str(e)}), flush=True)
            sys.exit(1)
        raise AssertionError("an all_reduce with a dead peer succeeded")
    dist.all_reduce(t)
    expect_equal(t, torch.full((4,), float(world * world)), "all_reduce after the restart")
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "attempt": attempt, "ok": True}), flush=True)


# ---- CUDA tensors (python/tests/test_cuda.py; need a GPU) ----


def cuda_device():
    """Ranks share the GPUs there are, several to a GPU if need be."""
    return torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())


def cuda_collectives():
    """Every operation on CUDA tensors, stream-ordered: results read back
    after a stream synchronisation (or work.wait() and the future), exact."""
    rank, world = init()
    dev = cuda_device()
    torch.cuda.set_device(dev)
    r1 = rank + 1
    total = world * (world + 1) // 2
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        # Several IPC chunks (32 MiB windows) at 20 M elements of float32.
        for n in (1, 1000, 20_000_000 if dtype == torch.float32 else 5000):
            t = torch.full((n,), r1, dtype=dtype, device=dev)
            dist.all_reduce(t)
            expect_equal(t, torch.full((n,), total, dtype=dtype, device=dev), f"all_reduce {dtype} x {n}")
    t = torch.arange(12, dtype=torch.float32, device=dev) * r1
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()  # the current stream waits; the CPU does not
    got = work.get_future().wait()[0]
    expect_equal(got, torch.arange(12, dtype=torch.float32, device=dev) * total / world, "async AVG")
    # With a timeout, wait() blocks the CPU until the device ran the op.
    t = torch.full((1 << 20,), float(r1), device=dev)
    work = dist.all_reduce(t, async_op=True)
    assert work.wait(timeout=datetime.timedelta(seconds=60))
    assert work.is_completed(), "wait(timeout) returned before the device finished"
    # A non-contiguous tensor (staged, then copied back on the stream).
    m = (torch.arange(12, dtype=torch.float32, device=dev).reshape(3, 4) * r1).t()
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    expect_equal(m, (torch.arange(12, dtype=torch.float32, device=dev).reshape(3, 4) * world).t(), "strided")
    b = torch.full((5,), float(r1), device=dev)
    dist.broadcast(b, src=world - 1)
    expect_equal(b, torch.full((5,), float(world), device=dev), "broadcast")
    red = torch.full((7,), float(r1), device=dev)
    dist.reduce(red, dst=0, op=dist.ReduceOp.PRODUCT)
    if rank == 0:
        expect_equal(red, torch.full((7,), float(torch.prod(torch.arange(1, world + 1))), device=dev), "reduce")
    outs = [torch.empty(3, device=dev) for _ in range(world)]
    dist.all_gather(outs, torch.full((3,), float(r1), device=dev))
    for p, o in enumerate(outs):
        expect_equal(o, torch.full((3,), float(p + 1), device=dev), f"all_gather from {p}")
    big = torch.empty(world * 4, device=dev)
    dist.all_gather_into_tensor(big, torch.full((4,), float(r1), device=dev))
    expect_equal(big, torch.arange(1, world + 1, device=dev, dtype=torch.float32).repeat_interleave(4), "agit")
    rs = torch.empty(4, device=dev)
    dist.reduce_scatter_tensor(rs, torch.arange(world * 4, dtype=torch.float32, device=dev) * r1)
    expect_equal(rs, torch.arange(rank * 4, rank * 4 + 4, dtype=torch.float32, device=dev) * total, "rs_tensor")
    a2a = torch.empty(world * 2, device=dev)
    dist.all_to_all_single(a2a, torch.full((world * 2,), float(r1), device=dev))
    expect_equal(a2a, torch.arange(1, world + 1, device=dev, dtype=torch.float32).repeat_interleave(2), "a2a")
    # Uneven splits: rank p sends i + 1 elements of value 10 (p + 1) + i to rank i.
    a2av = torch.empty(world * (rank + 1), device=dev)
    src = torch.cat([torch.full((i + 1,), float(10 * r1 + i), device=dev) for i in range(world)])
    dist.all_to_all_single(a2av, src, output_split_sizes=[rank + 1] * world,
                           input_split_sizes=[i + 1 for i in range(world)])
    want = torch.cat([torch.full((rank + 1,), float(10 * (p + 1) + rank), device=dev) for p in range(world)])
    expect_equal(a2av, want, "a2a with split sizes")
    gathered = [torch.empty(3, device=dev) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((3,), float(r1), device=dev), gathered, dst=0)
    for i, g in enumerate(gathered or []):
        expect_equal(g, torch.full((3,), float(i + 1), device=dev), "gather")
    sc = torch.empty(3, device=dev)
    parts = [torch.full((3,), float(i), device=dev) for i in range(world)] if rank == world - 1 else None
    dist.scatter(sc, parts, src=world - 1)
    expect_equal(sc, torch.full((3,), float(rank), device=dev), "scatter")
    # Point-to-point (host staging): a ring.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(6, device=dev)
    ops = [dist.P2POp(dist.isend, torch.full((6,), float(r1), device=dev), nxt),
           dist.P2POp(dist.irecv, got, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    expect_equal(got, torch.full((6,), float(prv + 1), device=dev), "ring")
    # Messages larger than any staging buffer: each rank's receive is
    # behind its send on the stream unless the batch is one group.
    n = 16 << 20
    got = torch.empty(n, device=dev)
    ops = [dist.P2POp(dist.isend, torch.full((n,), float(r1), device=dev), nxt),
           dist.P2POp(dist.irecv, got, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    expect_equal(got, torch.full((n,), float(prv + 1), device=dev), "large ring")
    # CPU and CUDA tensors on one group, interleaved.
    c = torch.full((3,), float(r1))
    dist.all_reduce(c)
    expect_equal(c, torch.full((3,), float(total)), "CPU all_reduce between CUDA ones")
    expect_raises(lambda: dist.recv(torch.empty(1, device=dev)), "braid", "CPU tensors")
    dist.barrier()
    torch.cuda.synchronize()
    dist.destroy_process_group()
    print(f"rank {rank}: cuda collectives ok", flush=True)


def cuda_ddp_train():
    """DDP on a CUDA model: parameters equal across ranks after every step,
    written out for the comparison with gloo."""
    rank, world = init()
    dev = cuda_device()
    torch.cuda.set_device(dev)
    torch.manual_seed(1234)
    model = nn.parallel.DistributedDataParallel(SmallCNN().to(dev), device_ids=[dev])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(99)
    data = torch.randn(64, 1, 28, 28, generator=gen).to(dev)
    labels = torch.randint(0, 10, (64,), generator=gen).to(dev)
    steps = int(os.environ.get("DDP_STEPS", "5"))
    for step in range(steps):
        batch = torch.arange(rank * 4, rank * 4 + 4, device=dev) + (step * 4 * world) % 32
        opt.zero_grad()
        loss = F.cross_entropy(model(data[batch]), labels[batch])
        loss.backward()
        opt.step()
        expect_same_parameters_everywhere(model.parameters(), f"step {step}", rank, world)
    out = os.environ.get("DDP_OUT")
    if out and rank == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}, out)
    dist.destroy_process_group()
    print(f"rank {rank}: cuda ddp ok after {steps} steps, loss {loss.item():.4f}", flush=True)
    exit_reference_run()


SCENARIOS = {
    f.__name__: f
    for f in (
        collectives, bad_input, dead_peer, hung_peer, absent_from_barrier, wait_after_abort, ddp_train, sharded_train, torchrun_env,
        exit_with_work_pending, debug_checks_calls, mpi_env_set_in_code,
        elastic_restart, init_methods, avg_reduce_scatter, mismatched_roots,
        pending_recv, threads_futures_tags, coalescing, coalescing_edges, cuda_collectives, cuda_ddp_train,
    )
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
