"""What the Python front end's tests compare against: tiny random Hugging Face models and a
plain PyTorch training loop (torch.optim.AdamW, clip_grad_norm_, DeepSpeed's WarmupLR by
its formula), plus the config that asks Strata for the same training."""

from __future__ import annotations

import copy
import math
from typing import Callable, Dict, List, Optional

import torch

VOCAB = 96
SEQ = 12
MICRO_BATCH = 2
STEPS = 10
ACCUMULATION = 2
LR = 2e-3
WARMUP_STEPS = 4
WARMUP_MIN_LR = 1e-4
CLIP = 0.5
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1


def _shape(**extra):
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    shape.update(extra)
    return shape


def make_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of `family`, in fp32, with eager attention."""
    import transformers as t
    torch.manual_seed(seed)
    if family == "llama":
        config = t.LlamaConfig(**_shape())
    elif family == "qwen2":
        config = t.Qwen2Config(**_shape())
    elif family == "gemma2":
        config = t.Gemma2Config(**_shape(head_dim=8, sliding_window=8, query_pre_attn_scalar=8))
    elif family == "mixtral":
        config = t.MixtralConfig(**_shape(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0))
    elif family == "gpt2":
        config = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif family == "qwen3":
        config = t.Qwen3Config(**_shape(head_dim=8))
    elif family == "qwen3_moe":
        config = t.Qwen3MoeConfig(**_shape(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                           decoder_sparse_step=1, router_aux_loss_coef=0.0))
    elif family == "gemma3":
        config = t.Gemma3TextConfig(**_shape(head_dim=8, sliding_window=8, query_pre_attn_scalar=8))
    else:
        raise ValueError(family)
    config._attn_implementation = "eager"
    model = t.AutoModelForCausalLM.from_config(config)
    return model.float()


def batches(steps: int = STEPS, accumulation: int = ACCUMULATION, seed: int = 1) -> List[List[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g) for _ in range(accumulation)] for _ in range(steps)]


def warmup_lr(updates_applied: int) -> float:
    """DeepSpeed's WarmupLR (linear warmup) for the update after `updates_applied` updates."""
    i = updates_applied - 1
    w = max(2, WARMUP_STEPS)
    if i < 0:
        return WARMUP_MIN_LR
    if i < w:
        return WARMUP_MIN_LR + (LR - WARMUP_MIN_LR) * (i / w)
    return LR


def strata_config(nvme_path: Optional[str] = None, accumulation: int = ACCUMULATION, **strata_keys) -> Dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": WARMUP_MIN_LR, "warmup_max_lr": LR,
                                                     "warmup_num_steps": WARMUP_STEPS, "warmup_type": "linear"}},
        "strata": {"device": "cpu", "grad_wire_dtype": "fp32", **strata_keys},
    }
    if nvme_path is not None:
        config["zero_optimization"] = {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
        }
    return config


def train_reference(model: torch.nn.Module, data: List[List[torch.Tensor]]) -> List[float]:
    """The plain PyTorch loop; returns each step's mean micro-batch loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    losses = []
    for step, micro_batches in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step)
        total = 0.0
        for ids in micro_batches:
            loss = model(input_ids=ids, labels=ids).loss
            (loss / len(micro_batches)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / len(micro_batches))
    return losses


def train_strata(engine, data: List[List[torch.Tensor]], on_step: Optional[Callable[[int], None]] = None) -> List[float]:
    losses = []
    for step, micro_batches in enumerate(data):
        total = 0.0
        for ids in micro_batches:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / len(micro_batches))
        if on_step is not None:
            on_step(step)
    return losses


def assert_losses_close(got: List[float], want: List[float], rtol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert math.isfinite(a), f"step {step}: loss {a}"
        assert abs(a - b) <= rtol * abs(b), f"step {step}: strata {a!r}, PyTorch {b!r} (relative {abs(a - b) / abs(b):.2e})"


# The key projection's bias adds q.b to every score of a row, which softmax ignores: its
# gradient is zero but for rounding, and Adam turns rounding of that size into steps of lr.
# Its values are the two loops' rounding, not their training, so they are not compared:
# name suffix -> the part of the tensor that is the key bias (GPT-2 fuses q, k, v).
GRADIENT_IS_ROUNDING = {"k_proj.bias": lambda t: t[:0], "attn.c_attn.bias": lambda t: torch.cat([t[:t.numel() // 3],
                                                                                                  t[2 * t.numel() // 3:]])}


def _compared(name: str, t: torch.Tensor) -> torch.Tensor:
    for suffix, part in GRADIENT_IS_ROUNDING.items():
        if name.endswith(suffix):
            return part(t)
    return t


def assert_weights_close(got: Dict[str, torch.Tensor], model: torch.nn.Module, rtol: float = 1e-5) -> None:
    """Each tensor within rtol of its own scale (its largest magnitude)."""
    for name, param in model.named_parameters():
        assert name in got, f"no exported tensor {name}"
        want = _compared(name, param.detach().float())
        if want.numel() == 0:
            continue
        scale = want.abs().max().item() or 1.0
        err = (_compared(name, got[name].float()) - want).abs().max().item()
        assert err <= rtol * scale, f"{name}: max error {err:.3e} against scale {scale:.3e}"


def copy_model(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)
