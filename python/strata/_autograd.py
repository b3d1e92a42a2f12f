"""The autograd side of a gathered group: how parameters point into engine memory during a
unit's forward, how gradients reach the engine's buffers, and how tensors autograd saves
for backward survive the gathered memory being released.

- ``GatherFn`` hands a unit's trainable parameters to its forward as outputs of one
  autograd node. Its backward runs once every gradient of those parameters for this use
  is complete (autograd waits for all of a node's outputs), so that is where they are
  added into the engine's gradient buffer: no ``param.grad``, no hook per parameter.
- ``SavedRef`` replaces, in autograd's saved tensors, any tensor that lies in a gathered
  group's memory (a weight, its transpose, a slice). It records the group and the
  tensor's place, and unpacking re-creates the view in the group's memory as gathered at
  that time — gathering it again if it was released since.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import torch


class SavedRef:
    __slots__ = ("group", "offset", "size", "stride")

    def __init__(self, group: int, offset: int, size: torch.Size, stride: Sequence[int]):
        self.group = group
        self.offset = offset
        self.size = size
        self.stride = tuple(stride)


class UseHandle:
    """One use of one unit in a training forward: its trainable groups and tensors."""
    __slots__ = ("engine", "groups", "views", "slots", "in_backward")

    def __init__(self, engine: Any, groups: List[int], views: List[torch.Tensor], slots: List[tuple], in_backward: bool):
        self.engine = engine
        self.groups = groups            # the engine groups this use gathered (trainable and frozen)
        self.views = views              # trainable parameters' views, in the order GatherFn returns them
        self.slots = slots              # per view: (group, tensor index)
        self.in_backward = in_backward  # a recompute (checkpointing): its groups are held until GatherFn runs


class GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, handle: UseHandle):  # type: ignore[override]
        ctx.handle = handle
        if hasattr(ctx, "set_materialize_grads"):
            ctx.set_materialize_grads(False)
        return tuple(v.view_as(v) for v in handle.views)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        handle = ctx.handle
        handle.engine._use_backward(handle, grads)
        return None, None


def make_anchor() -> torch.Tensor:
    """A leaf that requires grad, so GatherFn is in the graph even when nothing else is."""
    return torch.zeros((), requires_grad=True)
