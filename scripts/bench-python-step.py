#!/usr/bin/env python3
"""A training step through the strata Python front end against the plain PyTorch loop
(torch.optim.AdamW(foreach=True)) on the same model, alternating rounds in one process;
prints each round and the medians, and the front end's own hook cost per unit use.

    PYTHONPATH=build/python build/ref-venv/bin/python scripts/bench-python-step.py \\
        [--layers 8 --hidden 512 --vocab 8192 --seq 256 --batch 4 --steps 4 --rounds 5] [--json]

Everything lives in the device budget (parameters on the device, optimizer state in pinned
memory with CPU Adam), so this measures the front end and the optimizer stage, not offload.
"""
import argparse
import json
import os
import statistics
import time

import torch
import transformers

import strata


def make_model(args):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=args.seq)
    config._attn_implementation = "sdpa" if hasattr(torch.nn.functional, "scaled_dot_product_attention") else "eager"
    return transformers.AutoModelForCausalLM.from_config(config).float()


def batch(args, step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def plain_steps(model, opt, args):
    times = []
    for step in range(args.steps):
        ids = batch(args, step)
        began = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    return times


def strata_steps(engine, args):
    times = []
    for step in range(args.steps):
        ids = batch(args, step)
        began = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - began)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("layers", 8), ("hidden", 512), ("vocab", 8192), ("seq", 256), ("batch", 4), ("steps", 4), ("rounds", 5)):
        parser.add_argument("--" + name, type=int, default=default)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--strata", default="{}", help="more keys of the config's strata section, as JSON")
    args = parser.parse_args()
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "cpu"}},
              "strata": {"device": "cpu", "device_budget_mib": 16384, **json.loads(args.strata)}}
    plain = make_model(args)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    engine = strata.initialize(model=make_model(args), config=config)
    params = sum(p.numel() for p in plain.parameters())
    load_before = os.getloadavg()[0]  # the machine's 1-minute load: how shared it was
    rounds = []
    for r in range(args.rounds):
        # The first step of each side in a round warms it; the rest are timed.
        p = statistics.median(plain_steps(plain, opt, args)[1:])
        before = engine.hook_stats()
        s = statistics.median(strata_steps(engine, args)[1:])
        after = engine.hook_stats()
        per_use = (after["seconds"] - before["seconds"]) / max(1, after["calls"] - before["calls"])
        rounds.append({"plain_s": p, "strata_s": s, "ratio": p / s, "hook_us_per_call": per_use * 1e6})
        if not args.json:
            print(f"round {r}: plain {p:.3f} s, strata {s:.3f} s, plain/strata {p / s:.2f}x, hooks {per_use * 1e6:.0f} us per call",
                  flush=True)
    engine.close()
    summary = {key: statistics.median(x[key] for x in rounds) for key in rounds[0]}
    summary.update(params=params, torch=torch.__version__, threads=torch.get_num_threads(), load_before=load_before,
                   load_after=os.getloadavg()[0], **vars(args))
    print(json.dumps(summary) if args.json else
          f"median: plain {summary['plain_s']:.3f} s, strata {summary['strata_s']:.3f} s, plain/strata {summary['ratio']:.2f}x; "
          f"{params / 1e6:.1f} M parameters; hooks {summary['hook_us_per_call']:.0f} us per call; "
          f"load average {load_before:.1f} before, {summary['load_after']:.1f} after")


if __name__ == "__main__":
    main()
