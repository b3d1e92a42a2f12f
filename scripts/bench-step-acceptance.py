#!/usr/bin/env python3
"""The disk-bound and host-bound steps against their bounds, with the store and CPU Adam
measured in the same rounds (docs/benchmarks.md, issue 9).

Each round: `strata-bench nvme` (1 GiB, 1 MiB blocks, queue depth 32) on the NVMe path;
the disk-bound step (16 x 2048, parameters and optimizer state on NVMe) with the store's
figures as --store-gbps; the host-bound step (both pinned); `strata-bench adam` at the
host-bound step's parameter count. The directory is emptied before every run, so every run
writes new files.

  scripts/bench-step-acceptance.py --nvme-path /work/nvme-bench [--rounds 3]
      [--bench build/bin/strata-bench]

Prints one line per round and the medians of the per-round ratios.
"""
import argparse
import glob
import json
import os
import statistics
import subprocess

HOST_STEP_PARAMS = 71335936  # the 16 x 2048 stack's parameters (the step's shard_elements)


def run_json(command):
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def empty(path):
    # Only the store's own files: a run that finds one reuses it, and a rewrite of written
    # blocks is faster than a first write (ext4 converts fallocated extents on first write).
    for name in glob.glob(os.path.join(path, "strata-rank*.swap")) + glob.glob(os.path.join(path, "strata-rank*.lock")):
        os.remove(name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bench", default="build/bin/strata-bench")
    args = parser.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    step = [args.bench, "step", "--layers", "16", "--width", "2048", "--batch", "1", "--micro-batches", "1", "--steps", "6",
            "--world-size", "1", "--device", "cpu", "--device-budget-mib", "512", "--param-dtype", "bf16",
            "--nvme-path", args.nvme_path, "--json"]
    ratios = {"disk": [], "host": [], "landing": [], "optimizer": []}
    for r in range(args.rounds):
        empty(args.nvme_path)
        store = run_json([args.bench, "nvme", "--nvme-path", args.nvme_path, "--size-mib", "1024", "--block-kib", "1024",
                          "--queue-depth", "32", "--json"])
        read_gbps, write_gbps = store["read_gbps"], store["write_gbps"]
        empty(args.nvme_path)
        disk = run_json(step + ["--offload-param", "nvme", "--offload-optimizer", "nvme", "--store-gbps", f"{read_gbps},{write_gbps}"])
        empty(args.nvme_path)
        host = run_json(step + ["--offload-param", "cpu", "--offload-optimizer", "cpu"])
        adam = run_json([args.bench, "adam", "--params", str(HOST_STEP_PARAMS), "--threads", "0", "--grad-dtype", "bf16",
                         "--param-dtype", "bf16", "--json"])
        bound = disk["nvme_bytes_read"] / 1e9 / read_gbps + disk["nvme_bytes_written"] / 1e9 / write_gbps
        busy = host["busy_s"]
        slowest = max(busy.values())
        ratios["disk"].append(disk["step_s"] / bound)
        ratios["host"].append(host["step_s"] / slowest)
        ratios["landing"].append(busy["landing"] / busy["optimizer"])
        ratios["optimizer"].append(host["optimizer_params_per_s"] / adam["params_per_s"])
        print(f"round {r + 1}: store read {read_gbps:.2f} / write {write_gbps:.2f} GB/s; "
              f"disk-bound step {disk['step_s']:.3f} s / bound {bound:.3f} s = {ratios['disk'][-1]:.2f}; "
              f"host-bound step {host['step_s']:.3f} s / {host['slowest_stage']} {slowest:.3f} s = {ratios['host'][-1]:.2f}; "
              f"landing / optimizer {ratios['landing'][-1]:.2f}; "
              f"engine optimizer {host['optimizer_params_per_s'] / 1e9:.2f} / bench {adam['params_per_s'] / 1e9:.2f} G params/s "
              f"= {ratios['optimizer'][-1]:.2f}", flush=True)
    empty(args.nvme_path)
    print("medians: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
