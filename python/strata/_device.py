"""Where the front end's tensors live: the device a model's parameters are on, and its
buffers moved to the engine's device."""

from __future__ import annotations

import torch
from torch import nn


def model_device(model: nn.Module) -> str:
    for p in model.parameters():
        if p.device.type == "cuda":
            return "cuda"
    return "cpu"


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """The model's buffers (rotary frequencies, position ids, masks) onto the device its
    parameters are gathered to; meta ones are left (init_empty keeps buffers real)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device and buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)
