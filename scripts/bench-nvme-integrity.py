#!/usr/bin/env python3
"""The NVMe store with checksums on, through fio's buffer footprint, against fio, and
against an older build of strata-bench, alternating in one run.

Each round and shape runs fio (write, then read), `strata-bench nvme --buffer-ring` with
checksums on from --bench and from --before, and --bench's ring without checksums; the
order reverses every other round. Everything else is as in bench-nvme-vs-fio.py (whose
runners this uses): O_DIRECT, io_uring, huge-page buffers, registered buffers and files,
a new file for every write. The report gives the median GB/s of each column and the
median of the per-round ratios to fio (a noisy machine moves whole rounds together).

  sudo scripts/bench-nvme-integrity.py --nvme-path /work/nvme-bench --bench build/bin/strata-bench
      [--before OLD/bin/strata-bench] [--rounds 5] [--shapes 1024:32,128:8,4096:8]
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

_spec = importlib.util.spec_from_file_location(
    "bench_nvme_vs_fio", os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench-nvme-vs-fio.py"))
vs_fio = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs_fio)


def run_round(args, shape, round_index, results):
    block, depth = shape

    def add(column, write, read):
        results.setdefault((shape, column), []).append((write, read))

    def fio():
        write, _ = vs_fio.run_fio(args.nvme_path, args.size_mib, block, depth, "write")
        read, _ = vs_fio.run_fio(args.nvme_path, args.size_mib, block, depth, "read")
        add("fio", write, read)

    def strata(column, bench, checksums):
        write, read, _ = vs_fio.run_strata(bench, args.nvme_path, args.size_mib, block, depth, checksums, ring=True)
        add(column, write, read)

    steps = [fio, lambda: strata("sums", args.bench, True), lambda: strata("plain", args.bench, False)]
    if args.before:
        steps.insert(2, lambda: strata("sums_before", args.before, True))
    if round_index % 2 == 1:
        steps.reverse()
    for step in steps:
        step()


def report(args, shapes, results):
    columns = [("sums", "ring, checksums on")]
    if args.before:
        columns.append(("sums_before", "ring, checksums on, --before"))
    columns.append(("plain", "ring, checksums off"))
    print(f"date {time.strftime('%Y-%m-%d')}, CPU {vs_fio.cpu_name()} ({os.cpu_count()} cores), {args.rounds} rounds, "
          f"{args.size_mib} MiB on {args.nvme_path}; GB/s are medians, ratios the median of the per-round ratios to fio")
    header = "| shape | op | fio |" + "".join(f" {title} | / fio |" for _, title in columns)
    print(header)
    print("|---|---|---:|" + "---:|---:|" * len(columns))
    for shape in shapes:
        block, depth = shape
        label = f"{block // 1024} MiB QD{depth}" if block >= 1024 else f"{block} KiB QD{depth}"
        for op_index, op in enumerate(("write", "read")):
            fio = [pair[op_index] for pair in results[(shape, "fio")]]
            row = f"| {label} | {op} | {statistics.median(fio):.2f} |"
            for column, _ in columns:
                values = [pair[op_index] for pair in results[(shape, column)]]
                ratio = statistics.median(v / f for v, f in zip(values, fio))
                row += f" {statistics.median(values):.2f} | {ratio:.2f} |"
            print(row)
    raw = {f"{s[0]}k_qd{s[1]}_{c}": [[round(w, 3), round(r, 3)] for w, r in v] for (s, c), v in results.items()}
    print("\nraw (write, read) per round:", json.dumps(raw))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--bench", default="build/bin/strata-bench")
    parser.add_argument("--before", default="", help="an older strata-bench measured in the same rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--shapes", default="1024:32,128:8,4096:8", help="block_kib:queue_depth,...")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in shape.split(":")) for shape in args.shapes.split(",")]
    os.makedirs(args.nvme_path, exist_ok=True)
    results = {}  # (shape, column) -> [(write GB/s, read GB/s)]
    try:
        with vs_fio.reserved_huge_pages(vs_fio.huge_pages_needed(args.size_mib, shapes)):
            for round_index in range(args.rounds):
                for shape in shapes:
                    run_round(args, shape, round_index, results)
                print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        vs_fio.remove_bench_files(args.nvme_path)
    report(args, shapes, results)


if __name__ == "__main__":
    main()
