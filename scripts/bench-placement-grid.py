#!/usr/bin/env python3
"""--placement auto against a grid of hand-made placements (docs/profile.md, issue 26):
GPT-2 XL through strata-train under a 1 GiB device budget, each placement of the grid and
the automatic one run in alternating rounds; prints the median step of each, the one auto
picked, and auto's step over the best hand-made one's.

  scripts/bench-placement-grid.py --nvme-path /work/nvme-grid --profile FILE [--rounds 2]
      [--bin build/bin] [--preset gpt2-xl]
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

GRID = {  # hand-made placements that fit the host's memory (fp32 GPT-2 XL: 18 GiB of optimizer state)
    "params cpu, optimizer nvme, exact": ["--offload-param", "cpu", "--offload-optimizer", "nvme"],
    "params cpu, optimizer nvme, delayed": ["--offload-param", "cpu", "--offload-optimizer", "nvme", "--set", "strata.optimizer_overlap=delayed"],
    "params nvme, optimizer nvme, exact": ["--offload-param", "nvme", "--offload-optimizer", "nvme"],
    "params nvme, optimizer nvme, delayed": ["--offload-param", "nvme", "--offload-optimizer", "nvme", "--set", "strata.optimizer_overlap=delayed"],
    "params cpu, optimizer nvme, exact, checkpoints pinned": ["--offload-param", "cpu", "--offload-optimizer", "nvme",
                                                              "--activation-checkpointing", "pinned"],
    "params nvme, optimizer nvme, exact, checkpoints pinned": ["--offload-param", "nvme", "--offload-optimizer", "nvme",
                                                               "--activation-checkpointing", "pinned"],
}


def run(args, extra):
    for name in glob.glob(os.path.join(args.nvme_path, "strata-rank*")):
        os.remove(name)
    command = [os.path.join(args.bin, "strata-train"), "--preset", args.preset, "--seq-len", "128", "--micro-batch", "1", "--steps", "3",
               "--eval-sequences", "0", "--device", "cpu", "--device-budget-mib", "1024", "--nvme-path", args.nvme_path,
               "--profile", args.profile, *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    chosen = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("chosen:")]
    return json.loads(done.stdout.strip().splitlines()[-1]), (chosen[0] if chosen else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bin", default="build/bin")
    parser.add_argument("--preset", default="gpt2-xl")
    args = parser.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    runs = dict(GRID)
    runs["auto"] = ["--placement", "auto"]
    steps = {name: [] for name in runs}
    chosen = ""
    for r in range(args.rounds):
        for name in runs if r % 2 == 0 else reversed(list(runs)):
            summary, line = run(args, runs[name])
            chosen = line or chosen
            steps[name].append(summary["step_s"])
            print(f"round {r}: {name}: step {summary['step_s']:.3f} s, predicted {summary.get('predicted_step_s') or 0:.3f} s",
                  file=sys.stderr, flush=True)
    medians = {name: statistics.median(v) for name, v in steps.items()}
    for name, value in medians.items():
        print(f"| {name} | {value:.3f} s |")
    best = min(v for name, v in medians.items() if name != "auto")
    print(f"auto {chosen}: {medians['auto']:.3f} s, {medians['auto'] / best:.3f}x the best hand-made placement ({best:.3f} s)")


if __name__ == "__main__":
    main()
