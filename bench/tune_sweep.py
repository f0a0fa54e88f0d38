#!/usr/bin/env python3
"""Checks the tuner against every forced algorithm, side by side in one run.

For each job shape (ranks x simulated hosts) it runs a *_perf binary once,
with one communicator per algorithm (BRAID_ALGO forcing it) and one with the
tuner choosing, taking turns at every size (perf --algos), and
prints per size each algorithm's time, the best one, the tuner's pick, and
pick/best: the picked algorithm's forced time against the best forced time
(1.00 is a perfect pick; the issue's bar is 1.10). The tuner's communicator
is timed too ('tuner'): the same algorithm as the pick, measured once more.
On one host every communicator times peer reads against the ring at init and
picks by what it measured, so there the ratio is the 'tuner' column's.

  bench/tune_sweep.py --build build --shapes 4x1,8x1,4x2,8x2 -b 8 -e 16M

With --sweeps N each shape runs N times and every time printed is the median
of the N (a near-tie changes sides from one run to the next on a shared
machine; the median says which side it usually falls on).

Simulated hosts: rank r of N gets BRAID_HOST_ID=sim-host-(r*H/N), so each
host's ranks talk over shm and hosts over loopback TCP.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

ALGOS = {
    "all_reduce": ["direct", "rd", "rabenseifner", "ring", "tree", "dbtree", "peer_read", "hier"],
    "broadcast": ["ring", "tree", "peer_read", "hier"],
    "reduce": ["ring", "tree", "hier"],
    "all_gather": ["direct", "ring", "peer_read", "hier"],
    "reduce_scatter": ["direct", "ring", "peer_read", "hier"],
}
PIECE = 256 * 1024  # the default channel piece (BRAID_SHM_SLOT_BYTES)


def runs(algo, nranks, hosts, size):
    """Whether a forced algorithm really runs at this size (else braid falls back)."""
    if algo == "direct":
        return size <= PIECE
    if algo == "peer_read":
        return hosts == 1
    if algo == "hier":
        return 1 < hosts < nranks  # several hosts, and several ranks on each
    return True


def parse_size(text):
    m = re.fullmatch(r"(\d+)([KMG]?)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size '{text}'")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def run_perf(args, coll, nranks, hosts, algos=None):
    """With `algos`: every algorithm's time per size, from one run in which
    they take turns (perf --algos). Without: the tuner's INFO line."""
    wrapper = (
        'H={h}; export BRAID_HOST_ID=sim-host-$(( OMPI_COMM_WORLD_RANK * H / OMPI_COMM_WORLD_SIZE )); exec "$@"'
    ).format(h=hosts)
    env = dict(os.environ, BRAID_SOCKET_IFNAME="lo")
    env.pop("BRAID_ALGO", None)
    cmd = [args.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(nranks),
           "-x", "BRAID_SOCKET_IFNAME"]
    if algos is None:
        # The tuner's own account of its choice, from rank 0's INFO log, in a
        # separate short run (logging stays out of the timed one).
        env.update(BRAID_DEBUG="INFO", BRAID_DEBUG_SUBSYS="TUNE")
        cmd += ["-x", "BRAID_DEBUG", "-x", "BRAID_DEBUG_SUBSYS"]
        sizes = ["-b", "8", "-e", "8", "-n", "1", "-w", "0"]
    else:
        sizes = ["-b", str(args.b), "-e", str(args.e), "-f", str(args.f), "-n", str(args.n), "-w", str(args.w),
                 "--algos", ",".join(algos), "--rounds", str(args.repeat)]
    cmd += ["bash", "-c", wrapper, "wrap", os.path.join(args.build, "bench", f"{coll}_perf")] + sizes + ["-c", "0"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    if algos is None:
        for line in out.stderr.splitlines():
            m = re.search(r"\[0\] INFO TUNE (" + coll + r": .*)", line)
            if m:
                return m.group(1)
        return "?"
    results = {a: {} for a in algos}
    for line in out.stdout.splitlines():
        f = line.split()
        if len(f) >= 5 + len(algos) and f[0].isdigit():
            for a, t in zip(algos, f[5:5 + len(algos)]):
                results[a][int(f[0])] = float(t)
    return results


def parse_picks(line, coll):
    """The tuner's INFO line ("all_reduce: rd < 32 KiB <= hier") as a list of
    (algorithm, first size it is not picked at, or None for the last)."""
    text = line.split(":", 1)[1] if line.startswith(coll + ":") else ""
    picks = []
    for part in text.split("<="):
        m = re.fullmatch(r"\s*(\w+)(?:\s*<\s*(\d+)\s*(B|KiB|MiB|GiB))?\s*", part)
        if not m:
            return []
        limit = None
        if m.group(2):
            limit = int(m.group(2)) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(3)]
        picks.append((m.group(1), limit))
    return picks


def pick_at(picks, size):
    for algo, limit in picks:
        if limit is None or size < limit:
            return algo
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--collective", default="all_reduce", choices=sorted(ALGOS))
    p.add_argument("--shapes", default="4x1,8x1,4x2,8x2", help="RANKSxHOSTS, comma separated")
    p.add_argument("-b", type=parse_size, default=8)
    p.add_argument("-e", type=parse_size, default=16 << 20)
    p.add_argument("-f", type=int, default=4)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("-w", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--repeat", type=int, default=3,
                   help="turns per algorithm and size, interleaved (perf --rounds); each keeps its best time")
    p.add_argument("--sweeps", type=int, default=1,
                   help="whole runs per shape; each time printed is the median over them (the machine's "
                        "state drifts between runs more than within one)")
    args = p.parse_args()
    coll = args.collective
    worst = 0.0
    for shape in args.shapes.split(","):
        nranks, hosts = (int(x) for x in shape.split("x"))
        algos = [a for a in ALGOS[coll] if any(runs(a, nranks, hosts, s) for s in (args.b, args.e))]
        sweeps = [run_perf(args, coll, nranks, hosts, algos + ["auto"]) for _ in range(max(1, args.sweeps))]
        results = {a: {size: statistics.median(r[a][size] for r in sweeps if size in r[a])
                       for size in sweeps[0][a]} for a in sweeps[0]}
        print(f"\n{coll}, {nranks} ranks on {hosts} simulated host(s): time in us (forced algorithm"
              f"{f', median of {len(sweeps)} runs' if len(sweeps) > 1 else ''}), tuner/best")
        tune = run_perf(args, coll, nranks, hosts)
        picks = parse_picks(tune, coll)
        print(f"tuner: {tune}")
        # On one host each communicator times peer reads against the ring at
        # init (Communicator::probe_peer_reads), so the logged line comes from
        # another communicator than the timed one, and may differ from its picks.
        measured = hosts == 1
        if measured:
            print("ratio: the tuner's communicator ('tuner') against the best column; on one host each")
            print("communicator times peer reads at init, so 'pick' (another run's log) may differ from it")
        else:
            print("ratio: the picked algorithm's own column against the best column; 'tuner' times the")
            print("tuner's communicator, which runs the same code as the pick's")
        print(f"{'size':>10} " + " ".join(f"{a:>10}" for a in algos) +
              f" {'tuner':>10} {'pick':>10} {'best':>10} {'ratio':>6}")
        for size in sorted(results["auto"]):
            if size == 0:
                continue  # a gather's smallest sizes round down to no elements: nothing runs
            row, best, best_t = [], None, float("inf")
            for a in algos:
                t = results[a].get(size)
                if t is None or not runs(a, nranks, hosts, size):
                    row.append(f"{'-':>10}")
                    continue
                row.append(f"{t:>10.1f}")
                if t < best_t:
                    best, best_t = a, t
            auto_t = results["auto"][size]
            pick = pick_at(picks, size)
            pick_t = results.get(pick, {}).get(size) if pick in algos and runs(pick, nranks, hosts, size) else None
            ratio = (pick_t if pick_t is not None and not measured else auto_t) / best_t
            worst = max(worst, ratio)
            print(f"{size:>10} " + " ".join(row) +
                  f" {auto_t:>10.1f} {pick or '?':>10} {best:>10} {ratio:>6.2f}")
    print(f"\nworst tuner/best: {worst:.2f}")


if __name__ == "__main__":
    main()
