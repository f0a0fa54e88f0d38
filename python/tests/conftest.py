"""Launches rank processes for the braid_torch tests."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankResult:
    def __init__(self, rank, returncode, output):
        self.rank, self.returncode, self.output = rank, returncode, output

    def __repr__(self):
        return f"rank {self.rank} exited {self.returncode}:\n{self.output[-3000:]}"


def launch(scenario, world, backend="braid", env=None, timeout=180):
    """Runs `workers.py scenario` as `world` ranks on loopback; returns one
    RankResult per rank. A rank still running at the timeout is killed and
    reported with returncode None (a hang)."""
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ)
        e.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TEST_BACKEND=backend,
            BRAID_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
        )
        e.update(env or {})
        procs.append(subprocess.Popen([sys.executable, str(WORKERS), scenario], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout)
            results.append(RankResult(rank, p.returncode, out))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            results.append(RankResult(rank, None, out))
    return results


def assert_all_ok(results, what=""):
    """Every rank exited 0; `what` names the run in the failure (e.g. which backend)."""
    bad = [r for r in results if r.returncode != 0]
    assert not bad, (what + ":\n" if what else "") + "\n".join(repr(r) for r in bad)


@pytest.fixture
def ranks():
    return launch


def assert_state_dicts_close(out, rtol, atol):
    """braid's trained state (out["braid"]) matches gloo's (out["gloo"])."""
    import torch

    for name, gloo_value in out["gloo"].items():
        braid_value = out["braid"][name]
        if gloo_value.is_floating_point():
            torch.testing.assert_close(braid_value, gloo_value, rtol=rtol, atol=atol, msg=f"parameter {name}")
        else:
            assert torch.equal(braid_value, gloo_value), name
