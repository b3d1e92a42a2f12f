"""strata.init_empty(): build a module tree without allocating its weights.

Inside the context every parameter a module registers goes to the meta device (shape and
dtype, no memory), so ``AutoModelForCausalLM.from_config(cfg)`` of a model larger than
host memory builds in moments; buffers stay real (rotary tables are small and computed).
initialize() then plans the engine from the shapes, and engine.load_hf(dir) streams the
weights into the tiers.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def init_empty():
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            requires_grad = param.requires_grad
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=requires_grad)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original
