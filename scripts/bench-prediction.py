#!/usr/bin/env python3
"""The plan's predicted step against the measured one (docs/profile.md, docs/benchmarks.md):
the machine profile measured first, in the same session (--profiles times, each figure the
median of those measurements: one profile on a shared machine can be 20-50% off in a figure),
then a grid of configurations run
in alternating rounds (each round runs every configuration once, in reversed order every
other round), and per configuration the median measured step and per-stage busy time
against the prediction.

  scripts/bench-prediction.py --nvme-path /work/nvme-pred [--rounds 3] [--profiles 3 | --interleave] [--profile FILE]
      [--bin build/bin] [--only 'NAME;...'] [--json] [--save-samples FILE]
  scripts/bench-prediction.py --nvme-path /work/nvme-pred --replan FILE [--bin build/bin] [--json]

--interleave measures a profile before each round instead of all of them first, and each
run is predicted from the profile measured just before its round: on a shared machine whose
speed drifts by tens of percent within minutes (docs/benchmarks.md), a profile from the
start of the session describes a different machine by the last round. Ratios are then the
median of each run's measured / predicted.

--save-samples keeps every run's summary and its profile's path; --replan compares those
measurements against the predictions of the build at hand (each configuration's
--plan-only with the same profiles, nothing run): a change to the cost model checked
against a grid already measured.

The grid: GPT-2 small and medium through strata-train (--compute kernels: the CPU device's
own kernels), and the GPT-2 medium, GPT-2 XL and Llama-3.2-1B shapes as strata-bench step's
layer stack with --compute none (the host stages alone), over parameters device / cpu /
nvme, optimizer state cpu / nvme and exact / delayed overlap. Stages whose predicted and
measured busy times are both under 2% of the step are not compared.
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

TRAIN = ["--seq-len", "128", "--micro-batch", "1", "--steps", "5", "--eval-sequences", "0", "--device", "cpu",
         "--device-budget-mib", "2048"]


def gpt(preset, params, optimizer, overlap):
    return ["strata-train", "--preset", preset, *TRAIN, "--offload-param", params, "--offload-optimizer", optimizer,
            "--set", f"strata.optimizer_overlap={overlap}"]


def stack(layers, width, params, optimizer, overlap, steps=4):
    return ["strata-bench", "step", "--layers", str(layers), "--width", str(width), "--batch", "1", "--micro-batches", "1",
            "--steps", str(steps), "--world-size", "1", "--device", "cpu", "--device-budget-mib", "1024", "--param-dtype", "bf16",
            "--offload-param", params, "--offload-optimizer", optimizer, "--overlap", overlap, "--compute", "none", "--json"]


GRID = {
    "gpt2 small, params device, opt cpu, exact, kernels": gpt("gpt2", "none", "cpu", "exact"),
    "gpt2 small, params cpu, opt cpu, delayed, kernels": gpt("gpt2", "cpu", "cpu", "delayed"),
    "gpt2 small, params nvme, opt nvme, exact, kernels": gpt("gpt2", "nvme", "nvme", "exact"),
    "gpt2 medium, params cpu, opt cpu, exact, kernels": gpt("gpt2-medium", "cpu", "cpu", "exact"),
    "gpt2-medium shape, params device, opt cpu, exact, none": stack(24, 1024, "device", "cpu", "exact"),
    "gpt2-xl shape, params cpu, opt nvme, exact, none": stack(48, 1600, "cpu", "nvme", "exact", steps=3),
    "gpt2-xl shape, params nvme, opt nvme, delayed, none": stack(48, 1600, "nvme", "nvme", "delayed", steps=3),
    "llama-1b shape, params nvme, opt nvme, exact, none": stack(16, 2048, "nvme", "nvme", "exact"),
}


def empty(path):
    for name in glob.glob(os.path.join(path, "strata-rank*.swap")) + glob.glob(os.path.join(path, "strata-rank*.lock")):
        os.remove(name)


def run(command, bin_dir, nvme_path, profile):
    command = [os.path.join(bin_dir, command[0]), *command[1:], "--nvme-path", nvme_path, "--profile", profile]
    empty(nvme_path)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plan_only(command, bin_dir, nvme_path, profile):
    """The build's prediction for a configuration: its --plan-only line (nothing runs)."""
    command = [os.path.join(bin_dir, command[0]), *[a for a in command[1:] if a != "--json"], "--nvme-path", nvme_path,
               "--profile", profile, "--plan-only"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        sys.exit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(samples, predictions=None):
    """Each run's measured step and busy times against its prediction: the run's own, or
    predictions[i] (a --plan-only line) for run i when given. The row holds the medians of
    the measured and predicted figures and the median of the runs' ratios (with one profile
    for every run, that is the median measured over the prediction)."""
    if predictions is not None:
        samples = [{**s, "predicted_step_s": p["predicted_step_s"], "predicted_busy_s": p["predicted_busy_s"]}
                   for s, p in zip(samples, predictions)]
    step = statistics.median(s["step_s"] for s in samples)
    predicted = statistics.median(s["predicted_step_s"] for s in samples)
    row = {"predicted_step_s": predicted, "step_s": step, "step_ratio": statistics.median(s["step_s"] / s["predicted_step_s"] for s in samples),
           "steps_s": [s["step_s"] for s in samples], "stages": {}}
    for stage in samples[0]["predicted_busy_s"]:
        want = statistics.median(s["predicted_busy_s"].get(stage, 0.0) for s in samples)
        got = statistics.median(s["busy_s"].get(stage, 0.0) for s in samples)
        if max(got, want) >= 0.02 * max(step, predicted):
            ratios = [s["busy_s"].get(stage, 0.0) / s["predicted_busy_s"][stage] for s in samples if s["predicted_busy_s"].get(stage, 0.0) > 0]
            row["stages"][stage] = {"predicted": want, "measured": got, "ratio": statistics.median(ratios) if ratios else None}
    return row


def median_profile(profiles):
    """Each number the median of the profiles' (same shape: the same machine, flags and
    build); everything else as the first has it."""
    first = profiles[0]
    if isinstance(first, bool) or not isinstance(first, (int, float, dict, list)):
        return first
    if isinstance(first, (int, float)):
        return statistics.median(profiles) if all(isinstance(p, (int, float)) for p in profiles) else first
    if isinstance(first, list):
        if any(not isinstance(p, list) or len(p) != len(first) for p in profiles):
            return first
        return [median_profile([p[i] for p in profiles]) for i in range(len(first))]
    return {k: median_profile([p[k] for p in profiles if k in p]) for k in first}


def profile_once(args, path):
    subprocess.run([os.path.join(args.bin, "strata-bench"), "profile", "--nvme-path", os.path.join(args.nvme_path, "profile"),
                    "--out", path, "--no-keep"], check=True, capture_output=True)
    p = json.load(open(path))
    read = p["nvme"][0]["read_bytes_per_s"] if p.get("nvme") else 0.0
    adam = max((a["elements_per_s"] for a in p.get("cpu_adam", [])), default=0.0)
    print(f"profile {path}: gemm {p['compute']['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s, nvme read {read / 1e9:.2f} GB/s, "
          f"cpu adam {adam / 1e9:.2f} G elements/s", file=sys.stderr, flush=True)


def measure_profile(args, out):
    paths = []
    for i in range(args.profiles):
        path = out if args.profiles == 1 else f"{out}.{i}"
        profile_once(args, path)
        paths.append(path)
    if args.profiles > 1:
        profiles = [json.load(open(path)) for path in paths]
        merged = median_profile(profiles)
        merged["notes"] = f"{merged.get('notes', '')} Each figure the median of {args.profiles} profiles measured one after another.".strip()
        with open(out, "w") as f:
            json.dump(merged, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bin", default="build/bin")
    parser.add_argument("--profile", help="a profile measured in this session already (default: measure one first)")
    parser.add_argument("--profiles", type=int, default=3, help="profiles to measure first, each figure their median")
    parser.add_argument("--interleave", action="store_true", help="a profile before each round, predicting that round's runs")
    parser.add_argument("--only", help="semicolon-separated substrings of the grid's configuration names")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--save-samples", help="write every run's summary and the profile's path here (JSON)")
    parser.add_argument("--replan", help="samples saved with --save-samples: compare them against this build's --plan-only")
    args = parser.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    if args.replan:
        saved = json.load(open(args.replan))
        rows = {}
        for name, runs in saved["samples"].items():
            # Each run's profile (saved by --interleave), else the one profile of the grid.
            profiles = [r.get("profile", saved["profile"]) for r in runs]
            plans = {p: plan_only(GRID[name], args.bin, args.nvme_path, p) for p in set(profiles)}
            rows[name] = compare(runs, [plans[p] for p in profiles])
        print_rows(rows, args.json)
        return
    profile = args.profile or os.path.join(args.nvme_path, "profile.json")
    if not args.profile and not args.interleave:
        measure_profile(args, profile)
    names = [n for n in GRID if not args.only or any(o in n for o in args.only.split(";"))]
    samples = {n: [] for n in names}
    for r in range(args.rounds):
        if args.interleave and not args.profile:
            profile = os.path.join(args.nvme_path, f"profile.round{r}.json")
            profile_once(args, profile)
        for name in names if r % 2 == 0 else reversed(names):
            result = run(GRID[name], args.bin, args.nvme_path, profile)
            result["profile"] = os.path.abspath(profile)
            samples[name].append(result)
            print(f"round {r}: {name}: step {result['step_s']:.3f} s, predicted {result['predicted_step_s']:.3f} s, "
                  f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    if args.save_samples:
        with open(args.save_samples, "w") as f:
            json.dump({"profile": os.path.abspath(profile), "samples": samples}, f)
    print_rows({name: compare(samples[name]) for name in names}, args.json)


def print_rows(rows, as_json):
    if as_json:
        print(json.dumps(rows))
        return
    print("| configuration | predicted step | measured (median) | measured / predicted | stages: measured / predicted |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, row in rows.items():
        stages = ", ".join(f"{s} {v['ratio']:.2f}" if v["ratio"] is not None else f"{s} {v['measured']:.3f} s (predicted 0)"
                           for s, v in row["stages"].items())
        print(f"| {name} | {row['predicted_step_s']:.3f} s | {row['step_s']:.3f} s | {row['step_ratio']:.2f} | {stages} |")


if __name__ == "__main__":
    main()
