#!/usr/bin/env python3
"""strata-bench nvme against fio given the same advantages, side by side.

Both sides: O_DIRECT, io_uring, registered (fixed) buffers and files, buffers on
reserved huge pages (fio: --iomem=mmaphuge), the same file system, 1 GiB, the same
block size and queue depth, a new file for every write. Strata runs with checksums off (what fio does) and on
(what training does), and with checksums off through a ring of queue-depth blocks
(--buffer-ring: fio's buffer footprint) as well as through 1 GiB of distinct memory. Rounds alternate which side goes first; the report is the
median of each column and the ratio Strata / fio.

  sudo scripts/bench-nvme-vs-fio.py --nvme-path /work/nvme-bench [--rounds 5]
      [--bench build-dev/bin/strata-bench] [--shapes 1024:32,128:8,4096:8]

Reserves huge pages in /proc/sys/vm/nr_hugepages for the run and restores the old
value afterwards (root needed).
"""
import argparse
import contextlib
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HUGE_PAGES_PATH = "/proc/sys/vm/nr_hugepages"


def remove_store_files(path):
    # The store reuses a data file a finished run left in the directory, so without this
    # every run after the first would rewrite written blocks, while fio writes a new file
    # (see run_fio): ext4 converts fallocated extents on a file's first write, and a
    # rewrite skips that. Both sides write a new file every time.
    for name in glob.glob(os.path.join(path, "strata-rank*.swap")) + glob.glob(os.path.join(path, "strata-rank*.lock")):
        os.remove(name)


def remove_bench_files(path):
    """What a run leaves in the directory: fio's file and the store's."""
    try:
        os.remove(os.path.join(path, "fio-compare.dat"))
    except FileNotFoundError:
        pass
    remove_store_files(path)


def run_strata(bench, path, size_mib, block_kib, depth, checksums, ring=False):
    remove_store_files(path)
    command = [bench, "nvme", "--nvme-path", path, "--size-mib", str(size_mib), "--block-kib", str(block_kib),
               "--queue-depth", str(depth), "--json"]
    if not checksums:
        command.append("--no-checksums")
    if ring:
        command.append("--buffer-ring")
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["write_gbps"], result["read_gbps"], command


def run_fio(path, size_mib, block_kib, depth, rw):
    # Each write goes to a new file, as each strata-bench run does (remove_store_files): ext4
    # converts fallocated (unwritten) extents on a file's first write, which costs ~40% of
    # the bandwidth here, so a rewrite of the file a previous round left would not compare.
    if rw == "write":
        try:
            os.remove(os.path.join(path, "fio-compare.dat"))
        except FileNotFoundError:
            pass
    command = ["fio", "--name=strata-compare", f"--filename={path}/fio-compare.dat", "--direct=1",
               "--ioengine=io_uring", "--fixedbufs", "--registerfiles", "--iomem=mmaphuge",
               f"--bs={block_kib}k", f"--iodepth={depth}", f"--size={size_mib}m", f"--rw={rw}",
               "--output-format=json"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return side["bw_bytes"] / 1e9, command


@contextlib.contextmanager
def reserved_huge_pages(pages):
    """Reserves `pages` more 2 MiB huge pages for the block, then restores the old count."""
    with open(HUGE_PAGES_PATH) as f:
        old_pages = int(f.read())
    try:
        with open(HUGE_PAGES_PATH, "w") as f:
            f.write(str(old_pages + pages))
        with open(HUGE_PAGES_PATH) as f:
            granted = int(f.read()) - old_pages
        print(f"huge pages: {granted} of {pages} reserved (was {old_pages})", file=sys.stderr)
        yield
    finally:
        with open(HUGE_PAGES_PATH, "w") as f:
            f.write(str(old_pages))


def huge_pages_needed(size_mib, shapes):
    """Strata's data buffer (size) + fio's (block x depth) + slack, in 2 MiB pages."""
    largest_fio = max(block * depth for block, depth in shapes) // 1024
    return (size_mib + largest_fio) // 2 + 64


def cpu_name():
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--bench", default="build-dev/bin/strata-bench")
    parser.add_argument("--shapes", default="1024:32,128:8,4096:8", help="block_kib:queue_depth,...")
    parser.add_argument("--huge-pages", type=int, default=0,
                        help="pages to reserve (0: enough for Strata's buffer plus fio's)")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in shape.split(":")) for shape in args.shapes.split(",")]
    os.makedirs(args.nvme_path, exist_ok=True)

    pages = args.huge_pages or huge_pages_needed(args.size_mib, shapes)
    results = {}  # (shape, column) -> [GB/s]
    commands = {}
    try:
        with reserved_huge_pages(pages):
            for round_index in range(args.rounds):
                for block, depth in shapes:
                    def strata(checksums, ring=False):
                        w, r, cmd = run_strata(args.bench, args.nvme_path, args.size_mib, block, depth, checksums, ring)
                        tag = "strata_ring" if ring else ("strata_sums" if checksums else "strata")
                        results.setdefault(((block, depth), tag + "_write"), []).append(w)
                        results.setdefault(((block, depth), tag + "_read"), []).append(r)
                        commands[tag] = " ".join(cmd)

                    def fio():
                        for rw in ("write", "read"):
                            bw, cmd = run_fio(args.nvme_path, args.size_mib, block, depth, rw)
                            results.setdefault(((block, depth), "fio_" + rw), []).append(bw)
                            commands["fio_" + rw] = " ".join(cmd)

                    order = [lambda: strata(False), lambda: strata(False, ring=True), fio, lambda: strata(True)]
                    if round_index % 2 == 1:
                        order.reverse()
                    for step in order:
                        step()
                print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        remove_bench_files(args.nvme_path)

    median = lambda key: statistics.median(results[key])
    print(f"date {time.strftime('%Y-%m-%d')}, CPU {cpu_name()} ({os.cpu_count()} cores), {args.rounds} rounds, medians, "
          f"{args.size_mib} MiB on {args.nvme_path}")
    print("| shape | op | fio (huge pages, fixedbufs, registerfiles) | Strata, checksums off | ratio | "
          "Strata, ring, checksums off | ratio | Strata, checksums on | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for block, depth in shapes:
        shape = (block, depth)
        label = f"{block // 1024} MiB QD{depth}" if block >= 1024 else f"{block} KiB QD{depth}"
        for op in ("write", "read"):
            f = median((shape, "fio_" + op))
            s = median((shape, "strata_" + op))
            g = median((shape, "strata_ring_" + op))
            c = median((shape, "strata_sums_" + op))
            print(f"| {label} | {op} | {f:.2f} GB/s | {s:.2f} GB/s | {s / f:.2f}x | {g:.2f} GB/s | {g / f:.2f}x | "
                  f"{c:.2f} GB/s | {c / f:.2f}x |")
    print("\nraw:", json.dumps({f"{k[0][0]}k_qd{k[0][1]}_{k[1]}": [round(v, 3) for v in vs] for k, vs in results.items()}))
    for name, command in sorted(commands.items()):
        print(f"{name}: {command}")


if __name__ == "__main__":
    main()
