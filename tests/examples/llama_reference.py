#!/usr/bin/python3
"""The Llama-family forward and backward in plain PyTorch, for tests/examples/llama_model_test.cpp.

For each case directory (one process for all: importing torch is the slow part), reads a model (Hugging Face names: model.embed_tokens.weight, model.layers.{i}.self_attn.
{q,k,v,o}_proj.{weight,bias}, mlp.{gate,up,down}_proj.*, input_layernorm / post_attention_
layernorm / model.norm weights, lm_head.weight when untied), its Hugging Face config.json, a
batch (inputs, targets with -1 = no loss, positions) and Strata's loss and gradients, all
from safetensors files parsed here with struct and json (no safetensors or transformers
package). Runs the model in float64 as transformers' LlamaForCausalLM / Qwen2ForCausalLM
compute it (RMSNorm, rotate_half rotary embeddings with the position ids, rope_scaling
linear / llama3, grouped-query causal attention, SwiGLU, tied or untied head, mean
cross-entropy over the targets that are not -1) and writes a JSON report: the relative
error ||strata - torch|| / ||torch|| of the loss and of every gradient.

Exit status 77 when torch cannot be imported (the C++ test skips with the reason).
"""
import argparse
import json
import math
import sys

try:
    import torch
    import torch.nn.functional as F
except Exception as error:  # noqa: BLE001 - any import failure means "skip"
    print(f"cannot import torch: {error}", file=sys.stderr)
    sys.exit(77)

# The safetensors reader and the error measure are gpt2_reference.py's (same folder).
from gpt2_reference import read_safetensors, relative_error  # noqa: E402


def inverse_frequencies(config, head_dim):
    """transformers' rope init (default, linear, llama3), in float64."""
    theta = config.get("rope_theta", 10000.0)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        low_freq_wavelen = original / low
        high_freq_wavelen = original / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"rope_scaling type {kind} is not implemented here")
    return inv


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def linear(params, name, x):
    y = x @ params[name + ".weight"].t()
    if name + ".bias" in params:
        y = y + params[name + ".bias"]
    return y


def llama_loss(params, config, inputs, targets, positions):
    batch, seq_len = inputs.shape
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    eps = config.get("rms_norm_eps", 1e-6)
    layers = config["num_hidden_layers"]

    inv = inverse_frequencies(config, head_dim)
    freqs = positions.to(torch.float64)[..., None] * inv  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]     # [B, 1, T, D]
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()

    x = params["model.embed_tokens.weight"][inputs]
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        h = rms_norm(x, params[prefix + "input_layernorm.weight"], eps)
        q = linear(params, prefix + "self_attn.q_proj", h).view(batch, seq_len, heads, head_dim).transpose(1, 2)
        k = linear(params, prefix + "self_attn.k_proj", h).view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)
        v = linear(params, prefix + "self_attn.v_proj", h).view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        attention = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, seq_len, heads * head_dim)
        x = x + linear(params, prefix + "self_attn.o_proj", attention)
        h = rms_norm(x, params[prefix + "post_attention_layernorm.weight"], eps)
        h = F.silu(linear(params, prefix + "mlp.gate_proj", h)) * linear(params, prefix + "mlp.up_proj", h)
        x = x + linear(params, prefix + "mlp.down_proj", h)
    x = rms_norm(x, params["model.norm.weight"], eps)
    head = params["lm_head.weight"] if "lm_head.weight" in params else params["model.embed_tokens.weight"]
    logits = x @ head.t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(), ignore_index=-1)


def check_case(directory):
    """One case directory: model.safetensors, config.json, batch.safetensors, grads.safetensors -> report.json."""
    with open(f"{directory}/config.json") as f:
        config = json.load(f)
    model, _ = read_safetensors(f"{directory}/model.safetensors")
    batch, _ = read_safetensors(f"{directory}/batch.safetensors")
    grads, grads_meta = read_safetensors(f"{directory}/grads.safetensors")

    params = {name: tensor.to(torch.float64).requires_grad_(True) for name, tensor in model.items()}
    loss = llama_loss(params, config, batch["inputs"].long(), batch["targets"], batch["positions"].long())
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
    with open(f"{directory}/report.json", "w") as f:
        json.dump(report, f, indent=1)
    worst = max(report["gradients"].items(), key=lambda item: item[1]) if report["gradients"] else ("-", float("nan"))
    print(f"{directory}: loss torch {loss.item():.8f} strata {strata_loss:.8f}; "
          f"worst gradient relative error {worst[1]:.3e} ({worst[0]})")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("cases", nargs="+",
                        help="directories, each with model.safetensors (Hugging Face Llama names), config.json, "
                             "batch.safetensors (I32 'inputs', 'targets', 'positions' [batch, seq_len]) and "
                             "grads.safetensors (Strata's gradients, the model's names, metadata 'loss'); "
                             "the report goes to report.json there")
    args = parser.parse_args()
    for directory in args.cases:
        check_case(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
