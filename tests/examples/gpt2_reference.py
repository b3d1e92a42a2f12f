#!/usr/bin/python3
"""The GPT-2 forward and backward in PyTorch, for tests/examples/gpt_model_test.cpp.

Reads a model (Hugging Face GPT-2 names, Conv1D (in, out) layouts), a batch and
Strata's loss and gradients, all from safetensors files parsed here with struct and
json (no safetensors package), runs the same GPT-2 in float64, and writes a JSON report:
the relative error ||strata - torch|| / ||torch|| of the loss and of every gradient.

Exit status 77 when torch cannot be imported (the C++ test skips with the reason).
"""
import argparse
import json
import math
import struct
import sys

try:
    import torch
    import torch.nn.functional as F
except Exception as error:  # noqa: BLE001 - any import failure means "skip"
    print(f"cannot import torch: {error}", file=sys.stderr)
    sys.exit(77)

DTYPES = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
}


def read_safetensors(path):
    """Returns ({name: tensor}, metadata) for a safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if 8 + header_len > len(blob):
        raise ValueError(f"{path}: header length {header_len} runs past the end of the file ({len(blob)} bytes)")
    header = json.loads(blob[8:8 + header_len].decode("utf-8"))
    data = blob[8 + header_len:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        dtype, size = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = info["shape"]
        count = math.prod(shape) if shape else 1
        if end - begin != count * size:
            raise ValueError(f"{path}: {name} has {end - begin} bytes, expected {count * size}")
        raw = bytearray(data[begin:end])
        tensors[name] = torch.frombuffer(raw, dtype=dtype).reshape(shape) if count > 0 else torch.zeros(shape, dtype=dtype)
    return tensors, metadata


def layer_norm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def gpt2_loss(params, inputs, targets, n_layer, n_head):
    batch, seq_len = inputs.shape
    channels = params["wte.weight"].shape[1]
    head_dim = channels // n_head
    positions = torch.arange(seq_len)
    x = params["wte.weight"][inputs] + params["wpe.weight"][positions][None, :, :]
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    for layer in range(n_layer):
        p = lambda name: params[f"h.{layer}.{name}"]  # noqa: E731
        h = layer_norm(x, p("ln_1.weight"), p("ln_1.bias"))
        qkv = h @ p("attn.c_attn.weight") + p("attn.c_attn.bias")
        q, k, v = qkv.split(channels, dim=-1)
        q = q.view(batch, seq_len, n_head, head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, n_head, head_dim).transpose(1, 2)
        v = v.view(batch, seq_len, n_head, head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        attention = torch.softmax(scores, dim=-1) @ v
        attention = attention.transpose(1, 2).reshape(batch, seq_len, channels)
        x = x + attention @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        h = layer_norm(x, p("ln_2.weight"), p("ln_2.bias"))
        h = gelu_tanh(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"))
        x = x + h @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    x = layer_norm(x, params["ln_f.weight"], params["ln_f.bias"])
    logits = x @ params["wte.weight"].t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(), ignore_index=-1)


def relative_error(got, want):
    norm = want.norm().item()
    diff = (got - want).norm().item()
    return diff / norm if norm > 0 else diff


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="model.safetensors (Hugging Face GPT-2 names)")
    parser.add_argument("--batch", required=True, help="safetensors with I32 'inputs' and 'targets' [batch, seq_len]")
    parser.add_argument("--grads", required=True, help="Strata's gradients, same names as the model; metadata 'loss'")
    parser.add_argument("--n-head", type=int, required=True)
    parser.add_argument("--out", required=True, help="the JSON report")
    args = parser.parse_args()

    model, _ = read_safetensors(args.model)
    batch, _ = read_safetensors(args.batch)
    grads, grads_meta = read_safetensors(args.grads)
    n_layer = len({name.split(".")[1] for name in model if name.startswith("h.")})

    params = {name: tensor.to(torch.float64).requires_grad_(True) for name, tensor in model.items()}
    loss = gpt2_loss(params, batch["inputs"].long(), batch["targets"], n_layer, args.n_head)
    loss.backward()

    strata_loss = float(grads_meta["loss"])
    report = {
        "torch_loss": loss.item(),
        "strata_loss": strata_loss,
        "loss_relative_error": abs(strata_loss - loss.item()) / abs(loss.item()),
        "gradients": {},
        "missing": [],
    }
    for name, param in params.items():
        if name not in grads:
            report["missing"].append(name)
            continue
        report["gradients"][name] = relative_error(grads[name].to(torch.float64), param.grad)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    worst = max(report["gradients"].values()) if report["gradients"] else float("nan")
    print(f"loss torch {loss.item():.8f} strata {strata_loss:.8f}; worst gradient relative error {worst:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
