#!/usr/bin/env python3
"""Charts of the benchmark outputs: bus bandwidth and latency against size.

    bench/plot.py --perf all_reduce.txt [--ceiling ceiling.txt] [--torch torch.txt] -o all_reduce.png

--perf   output of a *_perf binary (braid; with --compare mpi also Open MPI's
         columns, drawn as a second line against braid's columns of the same
         kind: out of place, or in place for broadcast, whose MPI call has
         one buffer)
--ceiling output of bench/ceiling for the same sizes (all_reduce only)
--torch  output of bench/torch_compare.py: its rows for the same operation
         give Gloo's (and braid-through-torch's) times
One PNG with two log-log panels, busbw (GB/s) and time (us) against message
size, one line per library. Needs matplotlib (pip install matplotlib).
"""
import argparse
import re
import sys

# busbw = algbw * factor(n), as in nccl-tests.
FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


def numbers(line):
    return line.split()


def parse_perf(path):
    """{'op', 'nranks', 'braid': [(size, us, busbw)], 'mpi': [...]} from a *_perf table.

    busbw is recomputed from size and time: the tables round it to 0.01 GB/s."""
    op, nranks, compare, braid_col = None, None, False, 5
    braid, mpi = [], []
    with open(path) as f:
        for line in f:
            m = re.match(r"# braid-tests: (\w+)_perf nranks (\d+)", line)
            if m:
                op, nranks = m.group(1), int(m.group(2))
            if line.startswith("#") and "mpi out-of-place" in line:
                compare = True
            if line.startswith("#") and "mpi in-place" in line:
                # MPI's call has one buffer (MPI_Bcast): braid in place is its match.
                compare, braid_col = True, 12
            if line.startswith("#") or not line.strip():
                continue
            cols = numbers(line)
            if not cols[0].isdigit() or len(cols) < 9:
                continue
            size = int(cols[0])
            braid.append((size, float(cols[braid_col])))
            if compare and cols[9] != "N/A":
                mpi.append((size, float(cols[9])))
    if op is None:
        raise ValueError(f"{path}: not the output of a *_perf binary (no '# braid-tests:' line)")
    factor = FACTORS.get(op, lambda n: 1.0)(nranks)
    with_bw = lambda rows: [(size, us, size / (us * 1e3) * factor) for size, us in rows]
    return {"op": op, "nranks": nranks, "braid": with_bw(braid), "mpi": with_bw(mpi)}


def parse_ceiling(path):
    rows, threads = [], 2
    with open(path) as f:
        for line in f:
            m = re.search(r"between (\d+) threads", line)
            if m:
                threads = int(m.group(1))
            cols = numbers(line)
            if line.startswith("#") or len(cols) < 8 or not cols[0].isdigit():
                continue
            size, us = int(cols[0]), float(cols[5])
            rows.append((size, us, size / (us * 1e3) * FACTORS["all_reduce"](threads)))
    return rows


def parse_torch(path, op, factor):
    """Gloo's and braid's rows for `op` from torch_compare.py, busbw computed from time."""
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
    nranks, gloo, braid = None, [], []
    with open(path) as f:
        for line in f:
            m = re.search(r"(\d+) ranks on this host", line)
            if m:
                nranks = int(m.group(1))
            m = re.match(r"(\w+)\s+(\d+) (B|KiB|MiB)\s+([\d.]+)\s+([\d.]+)", line)
            if m and m.group(1) == op and nranks:
                size = int(m.group(2)) * units[m.group(3)]
                for rows, us in ((gloo, float(m.group(4))), (braid, float(m.group(5)))):
                    rows.append((size, us, size / (us * 1e3) * factor(nranks)))
    return gloo, braid


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--perf", required=True)
    ap.add_argument("--ceiling")
    ap.add_argument("--torch")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("bench/plot.py needs matplotlib: pip install matplotlib")
    try:
        perf = parse_perf(args.perf)
    except (OSError, ValueError) as err:
        sys.exit(f"bench/plot.py: {err}")
    op, n = perf["op"], perf["nranks"]
    lines = [("braid", perf["braid"], "-o")]
    if perf["mpi"]:
        lines.append(("Open MPI", perf["mpi"], "-s"))
    if args.torch:
        gloo, braid_torch = parse_torch(args.torch, op, FACTORS.get(op, lambda n: 1.0))
        if gloo:
            lines.append(("Gloo (torch)", gloo, "-^"))
            lines.append(("braid (torch)", braid_torch, "--^"))
    if args.ceiling:
        lines.append(("in-process ceiling", parse_ceiling(args.ceiling), ":"))

    fig, (bw_ax, t_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rows, style in lines:
        if not rows:
            continue
        sizes = [r[0] for r in rows]
        t_ax.plot(sizes, [r[1] for r in rows], style, label=label, markersize=4)
        bw_ax.plot(sizes, [r[2] for r in rows], style, label=label, markersize=4)
    for ax, ylabel in ((bw_ax, "busbw (GB/s)"), (t_ax, "time (us)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{op}, {n} ranks, float32" + (" sum" if op in ("all_reduce", "reduce", "reduce_scatter") else ""))
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"bench/plot.py: {args.output} ({', '.join(label for label, rows, _ in lines if rows)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
