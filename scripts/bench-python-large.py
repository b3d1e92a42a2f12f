#!/usr/bin/env python3
"""A model larger than host memory through the strata Python front end: built under
strata.init_empty(), its weights streamed from a Hugging Face directory with load_hf, then
trained a few steps with parameters and optimizer state on NVMe; prints each phase's time,
each step's report, and the process's peak RSS after each phase (so the phase that set it
can be told).

    scripts/make-random-llama --out /tmp/llama1b --preset llama-1b --dtype bf16
    PYTHONPATH=build/python /usr/bin/time -v build/ref-venv/bin/python scripts/bench-python-large.py \\
        --model /tmp/llama1b --nvme-path /tmp/nvme1b [--pinned-budget-mib 2048 --device-budget-mib 2048 --steps 2 --tokens 16]
"""
import argparse
import json
import resource
import time

import torch
import transformers

import strata


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def phase(name: str, began: float) -> None:
    print(f"{name}: {time.time() - began:.1f} s, RSS {rss_gib():.2f} GiB, peak {peak_rss_gib():.2f} GiB", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--pinned-budget-mib", type=int, default=2048)
    parser.add_argument("--device-budget-mib", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    began = time.time()
    model_config = transformers.AutoConfig.from_pretrained(args.model)
    with strata.init_empty():
        model = transformers.AutoModelForCausalLM.from_config(model_config, torch_dtype=torch.bfloat16)
    phase("built under init_empty", began)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": args.nvme_path},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
              "strata": {"device": "cpu", "pinned_budget_mib": args.pinned_budget_mib,
                         "device_budget_mib": args.device_budget_mib}}
    engine = strata.initialize(model=model, config=config)
    phase("initialized", began)
    engine.load_hf(args.model)
    phase("loaded", began)
    g = torch.Generator().manual_seed(0)
    keys = ("loss", "grad_norm", "device_high_water_bytes", "device_budget_bytes", "pinned_bytes", "nvme_bytes_read",
            "nvme_bytes_written")
    for step in range(args.steps):
        ids = torch.randint(0, model_config.vocab_size, (1, args.tokens), generator=g)
        t = time.time()
        loss = engine(input_ids=ids, labels=ids).loss
        phase(f"step {step + 1} forward", t)
        engine.backward(loss)
        phase(f"step {step + 1} backward", t)
        engine.step()
        report = {k: engine.last_report[k] for k in keys}
        print(f"step {step + 1}: {time.time() - t:.1f} s {json.dumps(report)}", flush=True)
    engine.close()
    print(f"peak RSS {peak_rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
