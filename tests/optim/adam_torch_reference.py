#!/usr/bin/python3
"""PyTorch's Adam/AdamW on the data adam_torch_reference_test.cpp wrote, for comparison.

Usage: adam_torch_reference.py DIR [DIR ...]   (one case per directory; torch loads once)

Each DIR holds config.json, master.f32 (the initial fp32 parameters, n values) and grads.f32
(steps x n raw gradient values, still multiplied by the loss scale, little-endian fp32).
Per step this script divides the raw gradients by the loss scale (a power of two, so
exactly), clips the global norm when max_grad_norm > 0, sets the step's learning rate,
and calls optimizer.step(). It writes the final master.out.f32, exp_avg.out.f32 and
exp_avg_sq.out.f32 into DIR.

Clipping follows torch.nn.utils.clip_grad_norm_ (coefficient max_norm / (norm + 1e-6),
applied when below 1) but takes the norm in float64: clip_grad_norm_ reduces in fp32,
whose rounding (around 1e-6 relative for ten thousand values) would blur a comparison
of the optimizers themselves; Strata reduces the sum of squares in double.

Runs with Debian's /usr/bin/python3 (python3-torch, python3-numpy).
"""
import json
import os
import sys

import numpy as np
import torch


def clip_grad_norm_float64(param: torch.nn.Parameter, max_norm: float) -> None:
    total_norm = float(param.grad.double().norm())
    coefficient = max_norm / (total_norm + 1e-6)
    if coefficient < 1.0:
        param.grad.mul_(coefficient)


def run_case(directory: str) -> int:
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    n = int(config["n"])
    steps = int(config["steps"])

    master = np.fromfile(os.path.join(directory, "master.f32"), dtype="<f4")
    grads = np.fromfile(os.path.join(directory, "grads.f32"), dtype="<f4").reshape(steps, n)
    if master.size != n:
        print(f"master.f32 holds {master.size} values, config says {n}", file=sys.stderr)
        return 1

    param = torch.nn.Parameter(torch.from_numpy(master.copy()))
    kind = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[config["optimizer"]]
    optimizer = kind([param], lr=config["lr"][0], betas=(config["beta1"], config["beta2"]), eps=config["eps"],
                     weight_decay=config["weight_decay"], foreach=bool(config.get("foreach", False)))
    loss_scale = float(config["loss_scale"])
    max_norm = float(config["max_grad_norm"])
    for step in range(steps):
        param.grad = torch.from_numpy(grads[step].copy()) / loss_scale
        if max_norm > 0:
            clip_grad_norm_float64(param, max_norm)
        for group in optimizer.param_groups:
            group["lr"] = config["lr"][step]
        optimizer.step()

    state = optimizer.state[param]
    param.detach().numpy().astype("<f4").tofile(os.path.join(directory, "master.out.f32"))
    state["exp_avg"].numpy().astype("<f4").tofile(os.path.join(directory, "exp_avg.out.f32"))
    state["exp_avg_sq"].numpy().astype("<f4").tofile(os.path.join(directory, "exp_avg_sq.out.f32"))
    return 0


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    for directory in sys.argv[1:]:
        rc = run_case(directory)
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
