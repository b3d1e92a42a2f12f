#!/usr/bin/python3
"""Times PyTorch's CPU Adam the way `strata-bench adam` times Strata's, for comparison.

    /usr/bin/python3 scripts/bench-adam-vs-torch.py --params 67108864 --threads 2 [--foreach|--no-foreach]
        [--optimizer adamw|adam] [--steps 9] [--warmup 2] [--with-cast] [--json]

One fp32 parameter tensor of --params elements with an fp32 gradient (torch's CPU Adam
steps fp32 state; it has no bf16-gradient path), torch.set_num_threads(--threads), and
the median of --steps optimizer.step() calls after --warmup. --with-cast adds what Strata's
fused step also does: writing a bf16 copy of the parameters (param.to(torch.bfloat16)
into a preallocated buffer). With --json the last line of stdout is
{"bench":"torch_adam","params":N,"threads":T,"foreach":…,"with_cast":…,"seconds_per_step":…,"params_per_s":…}.

Runs with Debian's /usr/bin/python3 (python3-torch).
"""
import argparse
import json
import statistics
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=64 << 20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizer", choices=["adamw", "adam"], default="adamw")
    parser.add_argument("--foreach", dest="foreach", action="store_true", default=True)
    parser.add_argument("--no-foreach", dest="foreach", action="store_false")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--with-cast", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(args.params, generator=generator))
    param.grad = torch.randn(args.params, generator=generator) * 1e-2
    kind = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
    optimizer = kind([param], lr=1e-3, weight_decay=0.01, foreach=args.foreach)
    bf16_copy = torch.empty(args.params, dtype=torch.bfloat16)

    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        optimizer.step()
        if args.with_cast:
            bf16_copy.copy_(param.detach())
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
    seconds = statistics.median(times)
    result = {
        "bench": "torch_adam",
        "params": args.params,
        "threads": args.threads,
        "foreach": args.foreach,
        "with_cast": args.with_cast,
        "torch": torch.__version__,
        "seconds_per_step": seconds,
        "params_per_s": args.params / seconds,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"torch {torch.__version__} {args.optimizer} foreach={args.foreach} threads={args.threads} "
              f"cast={'bf16' if args.with_cast else 'none'}: {seconds * 1e3:.3f} ms/step, "
              f"{args.params / seconds / 1e9:.3f} G params/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
