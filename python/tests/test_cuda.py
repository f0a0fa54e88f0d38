"""braid_torch on CUDA tensors: every operation exact across processes
(several ranks may share one GPU: braid allows it), and DDP on a CUDA model
that matches gloo's. Skipped where torch sees no GPU; tools/gpu-check.sh
runs it on a GPU machine."""

import pytest
import torch

from conftest import assert_all_ok, assert_state_dicts_close, launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (tools/gpu-check.sh)")


@pytest.mark.parametrize("world", [2, 4])
def test_cuda_collectives_exact(world):
    assert_all_ok(launch("cuda_collectives", world, timeout=300))


def test_cuda_ddp_matches_across_ranks_and_matches_gloo(tmp_path):
    out = {}
    for backend in ("braid", "gloo"):
        path = tmp_path / f"{backend}.pt"
        results = launch("cuda_ddp_train", 2, backend=backend, env={"DDP_OUT": str(path), "DDP_STEPS": "6"},
                         timeout=300)
        assert_all_ok(results, f"CUDA DDP training through {backend}")
        out[backend] = torch.load(path)
    assert_state_dicts_close(out, rtol=1e-4, atol=1e-5)


def test_cuda_wait_after_abort_raises():
    # A stream-ordered work's wait() after the group was aborted raised
    # nothing: it asked the aborted handle for an error, which failed.
    results = launch("wait_after_abort", 2, env={"WAIT_DEVICE": "cuda"}, timeout=60)
    assert_all_ok(results)
    assert "wait after abort raised" in results[0].output, results[0]
