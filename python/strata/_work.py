"""What a step of a PyTorch model computes, for strata.placement "auto" (the plan's cost
model, which predicts each placement's step from it and the machine profile).

Counted as the engine's own models count it (FLOPs per token: 6 per matrix-product weight,
12 x layers x seq_len x attention width): every module with a 2-D weight other than an
embedding (nn.Linear, Hugging Face's Conv1D, ...) is a matrix product each token meets, so
every expert of an MoE block counts (an upper bound for top-k routing); the attention
layers, heads and head width come from the model's config; the output head is the model's
get_output_embeddings()."""
from typing import Optional, Tuple

from torch import nn

from ._strata import StrataError


def _config_int(config, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _head_weights(model: nn.Module) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None) if isinstance(head, nn.Module) else None
    return weight.numel() if weight is not None and weight.dim() == 2 else 0


def model_work(model: nn.Module, seq_len: Optional[int]) -> Tuple[int, int, int, int, int, bool]:
    """(matmul weights, attention layers, attention width, seq_len, head weights, recompute)."""
    weights = 0
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and weight.dim() == 2 and not isinstance(module, nn.Embedding):
            weights += weight.numel()
    config = getattr(model, "config", None)
    heads = _config_int(config, "num_attention_heads", "n_head")
    hidden = _config_int(config, "hidden_size", "n_embd", "d_model")
    width = heads * (_config_int(config, "head_dim") or (hidden // heads if heads else 0))
    layers = _config_int(config, "num_hidden_layers", "n_layer", "num_layers") if width else 0
    seq_len = seq_len or _config_int(config, "max_position_embeddings", "n_positions", "n_ctx")
    if not seq_len:
        raise StrataError('strata.placement "auto" predicts a step of seq_len tokens per sequence: pass '
                          "strata.initialize(..., seq_len=N) (the model's config names no max_position_embeddings)")
    recompute = bool(getattr(model, "is_gradient_checkpointing", False))
    return weights, layers, width, int(seq_len), min(_head_weights(model), weights), recompute
