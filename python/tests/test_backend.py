"""braid as a torch.distributed backend: exact results of every operation
across real processes, clear errors for bad input, errors (not hangs) for
dead and hung peers, DDP training that matches gloo's, and the launchers:
torchrun, mpirun and Spark's TorchDistributor."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import WORKERS, assert_all_ok, assert_state_dicts_close, free_port, launch


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_exact(world):
    assert_all_ok(launch("collectives", world))


def test_bad_input_is_rejected_with_a_message():
    results = launch("bad_input", 2)
    assert_all_ok(results)


@pytest.mark.parametrize("world", [2, 3])
def test_dead_peer_is_an_error_not_a_hang(world):
    results = launch("dead_peer", world, timeout=120)
    assert all(r.returncode is not None for r in results), results
    assert_all_ok(results)
    for r in results[:-1]:
        assert "dead peer reported" in r.output, r


def test_hung_peer_times_out_with_the_group_timeout():
    results = launch("hung_peer", 2, timeout=60)
    assert_all_ok(results)
    assert "hung peer reported" in results[0].output, results[0]


def test_monitored_barrier_names_the_absent_rank():
    results = launch("absent_from_barrier", 2, timeout=60)
    assert_all_ok(results)
    assert "monitored_barrier failed after" in results[0].output, results[0]


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_matches_across_ranks_and_matches_gloo(world, tmp_path):
    out = {}
    for backend in ("braid", "gloo"):
        path = tmp_path / f"{backend}.pt"
        results = launch("ddp_train", world, backend=backend, env={"DDP_OUT": str(path), "DDP_STEPS": "6"})
        assert_all_ok(results, f"DDP training through {backend}")
        out[backend] = torch.load(path)
    assert_state_dicts_close(out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_init_methods(scheme, tmp_path):
    method = f"tcp://127.0.0.1:{free_port()}" if scheme == "tcp" else f"file://{tmp_path / 'rendezvous'}"
    assert_all_ok(launch("init_methods", 2, env={"INIT_METHOD": method}))


def test_pending_recv_does_not_block_collectives():
    assert_all_ok(launch("pending_recv", 3))


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_mpirun_two_processes():
    """mpirun sets OMPI_COMM_WORLD_*; braid_torch maps them to RANK and WORLD_SIZE."""
    env = dict(os.environ, BRAID_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    proc = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
         "-x", "BRAID_SOCKET_IFNAME", sys.executable, str(WORKERS), "torchrun_env"],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count('"ok": true') == 2, proc.stdout


def test_torchrun_two_processes():
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    port = free_port()
    env = dict(os.environ, BRAID_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        cmd + ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(WORKERS), "torchrun_env"],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count('"ok": true') == 2, proc.stdout


SPARK_DRIVER = os.path.join(os.path.dirname(__file__), "spark_distributor.py")


@pytest.mark.parametrize("mode", ["local", "barrier"])
def test_spark_torch_distributor(mode):
    """Spark's TorchDistributor runs an unchanged training function with
    backend "braid": through torchrun on the driver (local) and as one
    barrier task per rank (barrier). DDP's parameters agree exactly across
    ranks and match one process training on the whole batch."""
    pytest.importorskip("pyspark", reason="pyspark is not installed (tools/install-torch.sh installs it)")
    if shutil.which("java") is None:
        pytest.skip("Spark needs java (tools/install-deps.sh installs openjdk-17-jre-headless)")
    env = dict(os.environ, BRAID_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SPARK_DRIVER, mode], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == "braid"
    assert result["world"] == 2
    assert result["sum"] == [3.0] * 5
    params = [torch.tensor(p) for p in result["params"]]
    assert torch.equal(params[0], params[1]), "DDP left the ranks' parameters different"
    torch.testing.assert_close(params[0], torch.tensor(result["reference"]), rtol=1e-5, atol=1e-6)
