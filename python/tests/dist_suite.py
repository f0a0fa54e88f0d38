"""Runs torch's own distributed test suite (DistributedTest._DistTestBase, the
cases torch runs for gloo) against a backend, braid or gloo, and records the
outcome of every case.

    python python/tests/dist_suite.py --backend braid --world-size 2 \
        --json out.json [-k substring ...]

torch's own driver accepts only built-in backend names, so this one declares
braid a plugin with DDP and subgroup support before the suite is imported.
Spawned rank processes re-import this file as their main module: the
environment set here reaches them, and the import registers braid again.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import unittest

if __name__ == "__main__" and "BACKEND" not in os.environ:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="braid", choices=["braid", "gloo", "braid-as-gloo"],
                        help="braid-as-gloo: the suite believes it tests gloo (so cases torch gates "
                        "to gloo by name run) while every process group is braid")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", help="write {test: outcome} here")
    parser.add_argument("-k", action="append", default=[], help="run cases whose name contains this")
    parser.add_argument("--names", default="", help="comma-separated case names to run (exact)")
    ARGS = parser.parse_args()
    os.environ["BACKEND"] = "gloo" if ARGS.backend == "braid-as-gloo" else ARGS.backend
    os.environ["DIST_SUITE_BRAID_AS_GLOO"] = "1" if ARGS.backend == "braid-as-gloo" else "0"
    os.environ["WORLD_SIZE"] = str(ARGS.world_size)
    os.environ.setdefault("INIT_METHOD", "env://")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("BRAID_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tmp = tempfile.mkdtemp(prefix="braid-dist-suite-")
    for sub in ("barrier", "test_dir"):
        os.makedirs(os.path.join(tmp, sub), exist_ok=True)
    os.environ["TEMP_DIR"] = tmp
else:
    ARGS = None

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import braid_torch  # noqa: E402,F401  registers "braid"
from torch.testing._internal import common_distributed  # noqa: E402

if os.environ.get("DIST_SUITE_BRAID_AS_GLOO") == "1":
    # Every group the suite asks gloo for is made by braid instead.
    import torch.distributed.distributed_c10d as c10d

    _make_group = c10d._new_process_group_helper

    def _braid_instead_of_gloo(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        if str(backend).lower() == "gloo":
            backend = c10d.Backend("braid")
        return _make_group(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs)

    c10d._new_process_group_helper = _braid_instead_of_gloo

features = common_distributed.DistTestCases.backend_feature
for feature in ("plugin", "ddp", "subgroup"):
    features[feature].add("braid")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


class RecordingResult(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}
        self.started = {}

    def _name(self, test):
        return test.id().rsplit(".", 1)[-1]

    def startTest(self, test):
        self.started[self._name(test)] = time.time()
        super().startTest(test)

    def addSuccess(self, test):
        self.outcomes[self._name(test)] = "pass"
        super().addSuccess(test)

    def addFailure(self, test, err):
        self.outcomes[self._name(test)] = "fail"
        super().addFailure(test, err)

    def addError(self, test, err):
        self.outcomes[self._name(test)] = "fail"
        super().addError(test, err)

    def addSkip(self, test, reason):
        self.outcomes[self._name(test)] = "skip"
        super().addSkip(test, reason)

    def addExpectedFailure(self, test, err):
        self.outcomes[self._name(test)] = "pass"
        super().addExpectedFailure(test, err)

    def addUnexpectedSuccess(self, test):
        self.outcomes[self._name(test)] = "fail"
        super().addUnexpectedSuccess(test)


def main():
    loader = unittest.TestLoader()
    suite = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
    if ARGS.k:
        suite = unittest.TestSuite(t for t in suite if any(k in t.id() for k in ARGS.k))
    if ARGS.names:
        wanted = set(ARGS.names.split(","))
        suite = unittest.TestSuite(t for t in suite if t.id().rsplit(".", 1)[-1] in wanted)
    runner = unittest.TextTestRunner(resultclass=RecordingResult, verbosity=2, stream=sys.stdout)
    start = time.time()
    result = runner.run(suite)
    counts = {o: sum(1 for v in result.outcomes.values() if v == o) for o in ("pass", "skip", "fail")}
    print(
        f"dist_suite backend={ARGS.backend} world_size={ARGS.world_size}: "
        f"{counts['pass']} passed, {counts['skip']} skipped, {counts['fail']} failed "
        f"in {time.time() - start:.0f} s",
        flush=True,
    )
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump({"backend": ARGS.backend, "world_size": ARGS.world_size, "outcomes": result.outcomes}, f,
                      indent=1, sort_keys=True)
    return 0 if counts["fail"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
