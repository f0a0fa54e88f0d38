"""braid as a torch.distributed backend: exact results of every operation
across real processes, clear errors for bad input, errors (not hangs) for
dead and hung peers, DDP training that matches gloo's, and the launchers:
torchrun, mpirun and Spark's TorchDistributor."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import WORKERS, assert_all_ok, assert_state_dicts_close, free_port, launch

# What older torch releases lack (braid_torch builds against 2.4 and later;
# tools/torch-compat.sh runs this file with them).
needs_cpu_coalescing = pytest.mark.skipif(
    not hasattr(torch._C._distributed_c10d.Backend, "supports_coalescing"),
    reason=f"torch {torch.__version__} coalesces no CPU ops (batch_isend_irecv runs them one by one)")
needs_autoload = pytest.mark.skipif(
    not hasattr(torch, "_import_device_backends"),
    reason=f"torch {torch.__version__} loads no backend entry points at import (2.5 and later do); "
    "scripts there import braid_torch")
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    HAVE_FSDP2 = True
except ImportError:
    HAVE_FSDP2 = False


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


# _abort_process_group reaches a backend's abort() from torch 2.7 (with
# ErrorType); before, it is missing (2.5) or aborts NCCL only (2.6).
@pytest.mark.skipif(not hasattr(torch._C._distributed_c10d, "ErrorType"),
                    reason=f"torch {torch.__version__}'s _abort_process_group does not abort other backends")
def test_wait_after_abort_raises():
    results = launch("wait_after_abort", 2, timeout=60)
    assert_all_ok(results)
    assert "wait after abort raised" in results[0].output, results[0]


# A destroy that finds a mismatch warns from Backend::shutdown(), which
# destroy_process_group calls from torch 2.7; before, the backend warns as it
# is freed, outside Python's warnings.
@pytest.mark.skipif(not hasattr(torch._C._distributed_c10d, "ErrorType"),
                    reason=f"torch {torch.__version__} calls no Backend::shutdown() (braid warns as it frees it)")
def test_mismatched_roots_are_reported_at_destroy(tmp_path):
    results = launch("mismatched_roots", 2, env={"MISMATCH_DIR": str(tmp_path)}, timeout=60)
    assert_all_ok(results)
    for frag in ("rank 1: comm_destroy: rank 0 sent a message of broadcast #0 (count 16, uint8, root 0) that no "
                 "call on this rank took", "counts are in bytes", "rank 1: destroyed"):
        assert frag in results[1].output, results[1]


@pytest.mark.parametrize("world", [2, 3])
def test_monitored_barrier_names_the_absent_rank(world):
    results = launch("absent_from_barrier", world, timeout=60)
    assert_all_ok(results)
    assert "monitored_barrier failed after" in results[0].output, results[0]
    for r in results[1:-1]:
        assert "not released, failed after" in r.output, r


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_matches_across_ranks_and_matches_gloo(world, tmp_path):
    out = {}
    for backend in ("braid", "gloo"):
        path = tmp_path / f"{backend}.pt"
        results = launch("ddp_train", world, backend=backend, env={"DDP_OUT": str(path), "DDP_STEPS": "6"})
        assert_all_ok(results, f"DDP training through {backend}")
        out[backend] = torch.load(path)
    assert_state_dicts_close(out, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAVE_FSDP2, reason=f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard")
def test_fsdp2_and_tensor_parallel_match_gloo(tmp_path):
    """fully_shard (FSDP2) and parallelize_module (DTensor tensor parallelism)
    train on a CPU mesh of 3 ranks (uneven shards) to gloo's parameters."""
    # FSDP2 averages gradients with reduce_scatter_tensor(AVG), which gloo
    # gets wrong in some torch releases (2.8: the sum): no reference there.
    probe = launch("avg_reduce_scatter", 3, backend="gloo")
    gloo_avg = re.search(r"avg (\S+) of 3", probe[0].output)
    if gloo_avg is None:  # refused ("Cannot use ReduceOp.AVG with Gloo")
        pytest.skip(f"gloo in torch {torch.__version__} has no reduce_scatter_tensor(AVG): "
                    f"{probe[0].output.strip().splitlines()[-1:]}")
    if gloo_avg.group(1) != "2.0":
        braid_probe = launch("avg_reduce_scatter", 3)
        assert_all_ok(braid_probe)
        assert "avg 2.0 of 3" in braid_probe[0].output, braid_probe[0].output
        pytest.skip(f"gloo in torch {torch.__version__} gets reduce_scatter_tensor(AVG) wrong: "
                    f"{gloo_avg.group(1)} for the mean of 1, 2 and 3 (braid: 2.0)")
    out = {}
    for backend in ("braid", "gloo"):
        path = tmp_path / f"{backend}.pt"
        results = launch("sharded_train", 3, backend=backend, env={"SHARDED_OUT": str(path)})
        assert_all_ok(results, f"FSDP2 and tensor parallel training through {backend}")
        out[backend] = torch.load(path)
    assert sorted(out["braid"]) == sorted(out["gloo"])
    assert_state_dicts_close(out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_init_methods(scheme, tmp_path):
    method = f"tcp://127.0.0.1:{free_port()}" if scheme == "tcp" else f"file://{tmp_path / 'rendezvous'}"
    assert_all_ok(launch("init_methods", 2, env={"INIT_METHOD": method}))


@needs_cpu_coalescing
@pytest.mark.parametrize("world", [2, 3])
def test_coalescing_makes_one_group(world):
    assert_all_ok(launch("coalescing", world, timeout=120))


@needs_cpu_coalescing
def test_coalescing_edges():
    assert_all_ok(launch("coalescing_edges", 2, timeout=120))


@needs_autoload
def test_mpi_environment_is_filled_only_for_env_rendezvous():
    """Under mpirun, `import torch` (braid_torch's autoload) fills RANK and
    WORLD_SIZE from Open MPI's variables only where MASTER_ADDR says the job
    uses env://; otherwise other libraries would think torch.distributed was
    launched."""
    code = "import os, torch; print(os.environ.get('RANK'), os.environ.get('WORLD_SIZE'))"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    env.update(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None"], out.stdout
    env["MASTER_ADDR"] = "127.0.0.1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "2"], out.stdout
    # A process that inherited Open MPI's variables but joins with its own
    # rank and world size (a worker spawned by an mpirun rank) keeps them
    # out of its environment: before, gloo's group of 1 set RANK=1 and
    # WORLD_SIZE=2 there, contradicting it.
    env.pop("MASTER_ADDR")
    env.update(GLOO_SOCKET_IFNAME="lo")
    code = ("import os, torch, torch.distributed as dist; "
            f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{free_port()}'); "
            "dist.init_process_group('gloo', init_method='env://', rank=0, world_size=1); "
            "print(os.environ.get('RANK'), os.environ.get('WORLD_SIZE')); dist.destroy_process_group()")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # (the last line: gloo in torch 2.8 prints its own "[Gloo] Rank 0 is connected ..." first)
    assert out.stdout.strip().splitlines()[-1].split() == ["None", "None"], out.stdout


@pytest.mark.parametrize("pending", ["all_reduce", "batch_recv"])
def test_exit_with_work_pending_aborts_the_group_cleanly(pending):
    """Before, rank 0 died with status 134 (terminate called in braid's
    completion thread during the interpreter's teardown), and with a
    batch_isend_irecv receive pending, of SIGSEGV."""
    results = launch("exit_with_work_pending", 2, env={"PENDING": pending}, timeout=60)
    assert_all_ok(results)
    assert "the callback saw" in results[0].output, results[0]
    if pending == "all_reduce":
        assert "rank 1: all_reduce" in results[1].output, results[1]


@pytest.mark.parametrize("level", ["INFO", "DETAIL"])
def test_torch_debug_level_turns_on_call_checks(level):
    results = launch("debug_checks_calls", 2, env={"TORCH_DISTRIBUTED_DEBUG": level}, timeout=60)
    assert_all_ok(results)


def test_mpirun_script_that_sets_master_addr_in_code():
    """RANK / WORLD_SIZE were filled only at import, where MASTER_ADDR was
    already exported: such a script failed with "environment variable RANK
    expected, but not set"."""
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI's mpirun is not installed")
    env = dict(os.environ, BRAID_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TEST_MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "TEST_MASTER_PORT", "-x",
         "BRAID_SOCKET_IFNAME", sys.executable, str(WORKERS), "mpi_env_set_in_code"],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count('"ok": true') == 2, proc.stdout


def test_pending_recv_does_not_block_collectives():
    assert_all_ok(launch("pending_recv", 3))


def test_threads_futures_barrier_and_tags_behave_as_with_gloo():
    results = launch("threads_futures_tags", 2, timeout=90)
    assert_all_ok(results)
    for r in results:
        assert "threads, futures, barrier and tags ok" in r.output, r


def run_mpirun(nprocs, args):
    """`mpirun -np nprocs python args...` on loopback, with only Open MPI's
    OMPI_COMM_WORLD_* to say who is who (MASTER_ADDR / MASTER_PORT exported);
    checks the exit status and returns the CompletedProcess."""
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI's mpirun is not installed")
    env = dict(os.environ, BRAID_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    proc = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nprocs), "-x", "MASTER_ADDR", "-x",
         "MASTER_PORT", "-x", "BRAID_SOCKET_IFNAME", sys.executable, *args],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_torchrun(nprocs, args, options=(), timeout=180):
    """`torchrun --nproc-per-node nprocs [options] args...` on loopback;
    checks the exit status and returns the CompletedProcess."""
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    env = dict(os.environ, BRAID_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        cmd + ["--nproc-per-node", str(nprocs), *options, "--master-addr", "127.0.0.1", "--master-port",
               str(free_port()), *args],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def json_records(stdout):
    """The JSON records the ranks printed; they share one stdout, so one line
    may hold several."""
    return [json.loads(x) for x in re.findall(r"\{[^{}]*\}", stdout)]


def test_mpirun_two_processes():
    """mpirun sets OMPI_COMM_WORLD_*; braid_torch maps them to RANK and WORLD_SIZE."""
    proc = run_mpirun(2, [str(WORKERS), "torchrun_env"])
    assert proc.stdout.count('"ok": true') == 2, proc.stdout


def test_torchrun_two_processes():
    proc = run_torchrun(2, [str(WORKERS), "torchrun_env"])
    assert proc.stdout.count('"ok": true') == 2, proc.stdout


def test_torchrun_restarts_the_job_after_a_rank_dies():
    """torchrun --max-restarts 1: after a rank dies, torchrun restarts every
    worker, and the new group (same store and keys under the static
    rendezvous) completes; a survivor that reports its failure before torchrun
    stops it names the dead rank and failed at once. Without rank 0 deleting
    the unique id from the store, the new group hung in its init."""
    proc = run_torchrun(3, [str(WORKERS), "elastic_restart"], options=["--max-restarts", "1"], timeout=240)
    records = json_records(proc.stdout)
    # torchrun stops the survivors as soon as it sees rank 2 exit, so on a
    # loaded machine they may not get to report their error; what they do
    # report must be the dead peer, found at once.
    failed = [r for r in records if r["attempt"] == 0]
    assert {r["rank"] for r in failed} <= {0, 1}, proc.stdout
    for r in failed:
        assert "rank 2" in r["error"] and "died" in r["error"], r
        assert r["failed_after_s"] < 30, r  # the peer's death, not the 120 s group timeout
    assert sorted(r["rank"] for r in records if r["attempt"] == 1 and r.get("ok")) == [0, 1, 2], proc.stdout


UNCHANGED_SCRIPT = os.path.join(os.path.dirname(__file__), "unchanged_script.py")


@needs_autoload
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_unchanged_script_needs_no_import(launcher, monkeypatch):
    """A gloo script with only the backend's name changed, without `import
    braid_torch`: `import torch` loads braid through its entry point, under
    torchrun and under mpirun (whose OMPI_COMM_WORLD_* braid maps to RANK and
    WORLD_SIZE)."""
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    proc = (run_torchrun if launcher == "torchrun" else run_mpirun)(2, [UNCHANGED_SCRIPT])
    lines = sorted(json_records(proc.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in lines] == [0, 1], proc.stdout
    for r in lines:
        assert r == {"rank": r["rank"], "world": 2, "loaded_with_torch": True, "backend": "braid", "sum": 3.0,
                     "same_parameters": True}, r


@needs_autoload
def test_autoload_can_be_turned_off_and_never_breaks_torch():
    """TORCH_DEVICE_BACKEND_AUTOLOAD=0 leaves braid unloaded until imported;
    a braid_torch that cannot load is a warning, and torch still imports."""
    probe = ("import sys, torch, torch.distributed as d; "
             "print(sys.modules.get('braid_torch') is not None, hasattr(d.Backend, 'BRAID'))")
    off = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert off.returncode == 0 and off.stdout.split() == ["False", "False"], off.stdout + off.stderr
    broken = subprocess.run([sys.executable, "-c", "import sys; sys.modules['braid_torch'] = None; " + probe],
                            capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"})
    assert broken.returncode == 0 and broken.stdout.split() == ["False", "False"], broken.stdout + broken.stderr
    assert "braid_torch did not load, so the backend 'braid' is not registered" in broken.stderr, broken.stderr
    # Where warnings are errors (-W error, pytest's filterwarnings=error) too:
    # the warning raised inside torch's entry-point loop, and `import torch` failed.
    strict = subprocess.run([sys.executable, "-W", "error", "-c",
                             "import sys; sys.modules['braid_torch'] = None; " + probe],
                            capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"})
    assert strict.returncode == 0 and strict.stdout.split() == ["False", "False"], strict.stdout + strict.stderr
    assert "braid_torch did not load" in strict.stderr, strict.stderr


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
