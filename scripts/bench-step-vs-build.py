#!/usr/bin/env python3
"""The step benchmarks of docs/benchmarks.md against another build of strata-bench, in
alternating rounds (the order reversed every other round): the disk-bound step (16 x 2048,
parameters and optimizer state on NVMe) and the host-bound step (both in pinned memory),
each with the CPU device's kernels. Prints each run and, per step, the medians and the
median of the per-round ratios (this build's step over the other's: below 1 is faster).

  scripts/bench-step-vs-build.py --nvme-path /work/nvme-bench --before OTHER/strata-bench
      [--bench build/bin/strata-bench] [--rounds 5]
"""
import argparse
import glob
import json
import os
import statistics
import subprocess

STEPS = {
    "disk-bound": ["--offload-param", "nvme", "--offload-optimizer", "nvme"],
    "host-bound": ["--offload-param", "cpu", "--offload-optimizer", "cpu"],
}


def run(bench, nvme_path, placement):
    for name in glob.glob(os.path.join(nvme_path, "strata-rank*.swap")) + glob.glob(os.path.join(nvme_path, "strata-rank*.lock")):
        os.remove(name)
    command = [bench, "step", "--layers", "16", "--width", "2048", "--batch", "1", "--micro-batches", "1", "--steps", "6",
               "--world-size", "1", "--device", "cpu", "--device-budget-mib", "512", "--param-dtype", "bf16",
               "--nvme-path", nvme_path, "--json", *placement]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["step_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--before", required=True, help="the other build's strata-bench")
    parser.add_argument("--bench", default="build/bin/strata-bench")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    builds = [("this", args.bench), ("before", args.before)]
    times = {(step, build): [] for step in STEPS for build, _ in builds}
    for r in range(args.rounds):
        for step, placement in STEPS.items():
            for build, bench in builds if r % 2 == 0 else reversed(builds):
                times[(step, build)].append(run(bench, args.nvme_path, placement))
                print(f"round {r}: {step} {build}: {times[(step, build)][-1]:.3f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    for step in STEPS:
        this, before = times[(step, "this")], times[(step, "before")]
        ratios = [a / b for a, b in zip(this, before)]
        print(f"{step}: this build {statistics.median(this):.3f} s, before {statistics.median(before):.3f} s, "
              f"median ratio {statistics.median(ratios):.3f} (rounds {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
