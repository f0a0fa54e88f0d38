#!/usr/bin/env python3
"""braid against Open MPI and the in-process ceiling on one host: the tables
of issue 3, from the *_perf binaries and bench/ceiling, in one run.

    python3 bench/shm_vs_mpi.py --build build --nps 2,4 > tables.md

For every collective and rank count it launches
    mpirun -np NP build/bench/<collective>_perf -b B -e E -f F -n N -c 1 --compare mpi --rounds R
and prints, per size, braid's time over MPI's as a speed-up (MPI time / braid
time): out of place for every collective (MPI runs out of place), and in
place for broadcast, where MPI_Bcast's root copies nothing, as braid's root
does only in place. At up to 4 ranks it also prints braid's and MPI's busbw
as a share of bench/ceiling's for the same collective, size and thread count
(all_reduce in fp32 and bf16, the others in fp32; broadcast's ceiling and
braid's figure are in place), the ceiling's also the best of R runs.
Every run checks results (-c 1); a wrong value stops the script.
Each time is the best of R turns (default 3) taken in turns with MPI's in
one launch; these machines are noisy, so run it twice.
"""

import argparse
import os
import re
import subprocess
import sys

COLLECTIVES = ["all_reduce", "broadcast", "all_gather", "reduce_scatter"]
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]


def fmt_size(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def run(cmd):
    env = dict(os.environ)
    env.setdefault("BRAID_SOCKET_IFNAME", "lo")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"shm_vs_mpi: {' '.join(cmd)} exited with {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p.stdout


def rows(text):
    """The data rows of an nccl-tests table: size followed by its columns."""
    out = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        f = line.split()
        if re.fullmatch(r"\d+", f[0]):
            out.append(f)
    return out


def perf(build, coll, np_, lo, hi, factor, iters, rounds, dtype, compare, register=False):
    cmd = MPIRUN + ["-np", str(np_), "-x", "BRAID_SOCKET_IFNAME", f"{build}/bench/{coll}_perf",
                    "-b", lo, "-e", hi, "-f", str(factor), "-n", str(iters), "-w", str(max(5, iters // 10)),
                    "-c", "1", "-d", dtype, "--rounds", str(rounds), "-R", "1" if register else "0"]
    if compare:
        cmd += ["--compare", "mpi"]
    table = {}
    for f in rows(run(cmd)):
        size = int(f[0])
        if int(f[1]) == 0:
            continue  # fewer bytes than ranks x element: nothing moves
        # size count type redop root | time algbw busbw #wrong | [mpi time busbw ratio] | time algbw busbw #wrong
        oop_time, oop_bus, oop_wrong = float(f[5]), float(f[7]), f[8]
        rest = f[9:]
        mpi_time = None
        if compare:
            mpi_time = None if rest[0] == "N/A" else float(rest[0])
            rest = rest[3:]
        ip_time, ip_bus, ip_wrong = float(rest[0]), float(rest[2]), rest[3]
        for w in (oop_wrong, ip_wrong):
            if w not in ("0", "N/A"):
                sys.exit(f"shm_vs_mpi: {coll} -np {np_} at {size} B: {w} wrong values")
        table[size] = dict(oop=oop_time, ip=ip_time, mpi=mpi_time, oop_bus=oop_bus, ip_bus=ip_bus)
    return table


def ceiling(build, coll, threads, lo, hi, factor, iters, dtype, rounds):
    """busbw per size, best of `rounds` runs: braid's figures are best of as
    many turns, and one run of the ceiling read 5.4 GB/s where the next
    read 10 (2 threads, 8 MiB) on this shared machine."""
    cmd = [f"{build}/bench/ceiling", "-C", coll, "-t", str(threads), "-b", lo, "-e", hi, "-f", str(factor), "-n",
           str(iters), "-d", dtype]
    best = {}
    for _ in range(rounds):
        for f in rows(run(cmd)):
            best[int(f[0])] = max(best.get(int(f[0]), 0.0), float(f[7]))
    return best


def markdown(title, header, body):
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in body:
        print("| " + " | ".join(r) + " |")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--nps", default="2,4,8", help="rank counts (comma-separated)")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("--small-iters", type=int, default=2000, help="iterations per size, 8 B to 32 KiB")
    ap.add_argument("--large-iters", type=int, default=40, help="iterations per size, 64 KiB to 32 MiB")
    ap.add_argument("--rounds", type=int, default=3,
                    help="turns of braid and MPI per size, best kept (the perf binaries' --rounds)")
    ap.add_argument("--register", action="store_true",
                    help="buffers from braid_mem_alloc, registered (the perf binaries' -R 1); MPI uses them too")
    args = ap.parse_args()
    reg = args.register
    what = ", registered buffers (`-R 1`)" if reg else ""
    nps = [int(x) for x in args.nps.split(",")]
    colls = args.collectives.split(",")

    for coll in colls:
        for np_ in nps:
            small = perf(args.build, coll, np_, "8", "32K", 4, args.small_iters, args.rounds, "float", True, reg)
            large = perf(args.build, coll, np_, "64K", "32M", 2, args.large_iters, args.rounds, "float", True, reg)
            body = []
            for size, t in sorted({**small, **large}.items()):
                cells = [fmt_size(size), f"{t['oop']:.2f}", f"{t['mpi']:.2f}", f"{t['mpi'] / t['oop']:.2f}x"]
                if coll == "broadcast":
                    cells += [f"{t['ip']:.2f}", f"{t['mpi'] / t['ip']:.2f}x"]
                body.append(cells)
            header = ["size", "braid us", "MPI us", "MPI/braid"]
            if coll == "broadcast":
                header += ["braid in place us", "MPI/braid in place"]
            markdown(f"### {coll}, {np_} ranks, float sum (`--compare mpi -c 1`{what})", header, body)

    for coll in colls:
        for dtype in ("float", "bfloat16") if coll == "all_reduce" else ("float",):
            for np_ in nps:
                if np_ > 4:
                    continue
                ours = perf(args.build, coll, np_, "64K", "32M", 2, args.large_iters, args.rounds, dtype, True,
                            reg)
                ceil = ceiling(args.build, coll, np_, "64K", "32M", 2, args.large_iters, dtype, args.rounds)
                # broadcast: the ceiling's root copies nothing, as braid's in place and MPI_Bcast's.
                key, title = ("ip", "braid in place") if coll == "broadcast" else ("oop", "braid out of place")
                body = []
                for size in sorted(ours):
                    c, t = ceil[size], ours[size]
                    bus = t[key + "_bus"]
                    cells = [fmt_size(size), f"{c:.2f}", f"{bus:.2f}", f"{bus / c:.0%}"]
                    if t["mpi"] is None:  # a type MPI lacks (bfloat16)
                        cells += ["-", "-"]
                    else:
                        mpi_bus = bus * t[key] / t["mpi"]  # same size and busbw factor
                        cells += [f"{mpi_bus:.2f}", f"{mpi_bus / c:.0%}"]
                    if coll in ("all_reduce", "reduce_scatter"):  # in place, they move the same bytes
                        cells += [f"{t['ip_bus']:.2f}", f"{t['ip_bus'] / c:.0%}"]
                    body.append(cells)
                header = ["size", "ceiling", title, "share", "MPI", "share"]
                if coll in ("all_reduce", "reduce_scatter"):
                    header += ["braid in place", "share"]
                sum_ = " sum" if coll in ("all_reduce", "reduce_scatter") else ""
                markdown(f"### {coll} against the in-process ceiling, {np_} ranks, {dtype}{sum_} (busbw GB/s{what})",
                         header, body)

if __name__ == "__main__":
    main()
