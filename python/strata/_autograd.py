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


class Holding:
    """Groups kept gathered (and, for a unit bound without its own hooks, its parameters kept
    bound) until the GatherFn of a use runs: a recompute's memory is read by the backward of
    the ops it recomputed, which all come before that node."""
    __slots__ = ("unit", "groups", "bound", "done")

    def __init__(self, unit: Any, groups: List[int], bound: bool):
        self.unit = unit
        self.groups = groups
        self.bound = bound    # the unit's parameters stay bound until then (a forward run without hooks)
        self.done = False


class UseHandle:
    """One use of one unit: its trainable parameters' views, and what its backward ends."""
    __slots__ = ("engine", "views", "slots", "holdings")

    def __init__(self, engine: Any, views: List[torch.Tensor], slots: List[tuple]):
        self.engine = engine
        self.views = views                     # per trainable parameter: its view (a joined copy when it is in pieces)
        self.slots = slots                     # per trainable parameter: [(group, tensor index, piece)]
        self.holdings: List[Holding] = []      # released when this use's GatherFn runs


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


def make_anchor(device: torch.device) -> torch.Tensor:
    """A leaf that requires grad, so GatherFn is in the graph even when nothing else is; on
    the engine's device, so autograd runs the node with that device's streams."""
    return torch.zeros((), requires_grad=True, device=device)
