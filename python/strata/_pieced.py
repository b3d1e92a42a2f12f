"""Vocabulary-sized weights used piece by piece.

A parameter larger than ``max_group_elements`` is cut by rows into groups of its own
(_groups.py). A unit that is a plain ``nn.Linear`` (a language-model head, tied or not) or
``nn.Embedding`` whose weight is such a parameter does not join the pieces: its forward is
replaced by one autograd node that gathers the pieces one at a time and computes each
piece's rows of the output (Linear) or looks up the tokens that fall in each piece
(Embedding); its backward gathers them again, one at a time, and hands each piece's
gradient to that piece's gradient buffer (rows scattered into it, for an embedding). So
neither the joined weight nor its dense gradient — each as large as the vocabulary — is
ever made, and no piece's slot is held longer than its own rows take.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import nn
from torch.nn import functional as F

from . import _autograd


class PiecedWeight:
    """A unit's weight in pieces: where the pieces are and how the unit uses them."""
    __slots__ = ("engine", "module", "param", "entries", "kind")

    def __init__(self, engine: Any, module: nn.Module, param: nn.Parameter, entries: List[tuple], kind: str):
        self.engine = engine
        self.module = module
        self.param = param
        self.entries = entries  # [(group, tensor index, piece)] in row order
        self.kind = kind        # "linear" | "embedding"

    @property
    def trainable(self) -> bool:
        """Whether this use's gradient goes to the engine (asked outside the autograd node,
        whose forward runs with gradients off)."""
        return self.engine._groups[self.entries[0][0]].trainable and torch.is_grad_enabled()

    def piece(self, gid: int, index: int) -> torch.Tensor:
        """The piece's rows in gathered memory, in the parameter's dtype (the group gathered)."""
        g = self.engine._groups[gid]
        view = g.tensor(g.flat, index)
        return view if view.dtype == self.param.dtype else view.to(self.param.dtype)

    def pieces(self):
        """(group, tensor index, piece, rows view) for each piece in turn: gathered for the
        loop body and released after it unless something else holds it."""
        engine = self.engine
        for gid, index, piece in self.entries:
            g = engine._groups[gid]
            held = g.flat is not None
            engine._flush_releases()
            engine._gather(g)
            try:
                yield gid, index, piece, self.piece(gid, index)
            finally:
                if not held:
                    engine._release(g)


def install(engine: Any, unit: Any) -> Optional[PiecedWeight]:
    """Replaces the forward of a unit that computes piece by piece (see the top of this file);
    None for any other unit."""
    module = unit.module
    weight = module._parameters.get("weight")
    if weight is None or len(engine._where.get(id(weight), ())) < 2:
        return None
    if type(module) is nn.Linear:
        kind = "linear"
    elif type(module) is nn.Embedding and module.max_norm is None and not module.sparse and not module.scale_grad_by_freq:
        kind = "embedding"
    else:
        return None
    pieced = PiecedWeight(engine, module, weight, sorted(engine._where[id(weight)], key=lambda e: e[2].row_begin), kind)
    if kind == "linear":
        def forward(x: torch.Tensor) -> torch.Tensor:
            out = PiecedLinearFn.apply(x, _autograd.make_anchor(x.device), pieced, pieced.trainable)
            return out if module.bias is None else out + module.bias
    else:
        def forward(ids: torch.Tensor) -> torch.Tensor:
            return PiecedEmbeddingFn.apply(ids, _autograd.make_anchor(ids.device), pieced, pieced.trainable)
    module.forward = forward
    return pieced


class PiecedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, pieced: PiecedWeight, trainable: bool):  # type: ignore[override]
        rows = pieced.entries[0][2].full_shape[0]
        out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
        for _, _, piece, w in pieced.pieces():
            out[..., piece.row_begin:piece.row_end].copy_(F.linear(x, w))
        ctx.pieced = pieced
        ctx.trainable = trainable
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        pieced = ctx.pieced
        engine = pieced.engine
        engine._check_in_backward()
        x, = ctx.saved_tensors
        # The pieces' shares of x's gradient are summed in fp32 whatever x's dtype, so a bf16
        # model rounds the sum once, as the one matmul over the whole vocabulary would.
        grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[0] else None
        flat_x = x.reshape(-1, x.shape[-1])
        for gid, index, piece, w in pieced.pieces():
            part = grad_out[..., piece.row_begin:piece.row_end]
            if grad_x is not None:
                grad_x.add_(part @ w)
            if ctx.trainable:
                engine._deliver_gradient(engine._groups[gid], index, part.reshape(-1, part.shape[-1]).t() @ flat_x)
        return (None if grad_x is None else grad_x.to(x.dtype)), None, None, None


class PiecedEmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, anchor: torch.Tensor, pieced: PiecedWeight, trainable: bool):  # type: ignore[override]
        rows, width = pieced.entries[0][2].full_shape[0], pieced.entries[0][2].full_shape[1]
        if ids.numel() > 0 and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise IndexError(f"index out of range in self: token ids must lie in [0, {rows})")
        out = torch.empty(*ids.shape, width, dtype=pieced.param.dtype, device=ids.device)
        for _, _, piece, w in pieced.pieces():
            chosen = (ids >= piece.row_begin) & (ids < piece.row_end)
            if bool(chosen.any()):
                out[chosen] = w[ids[chosen] - piece.row_begin]
        ctx.pieced = pieced
        ctx.trainable = trainable
        ctx.save_for_backward(ids)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        pieced = ctx.pieced
        engine = pieced.engine
        engine._check_in_backward()
        if not ctx.trainable:
            return None, None, None, None
        ids, = ctx.saved_tensors
        padding = pieced.module.padding_idx
        for gid, index, piece in pieced.entries:
            chosen = (ids >= piece.row_begin) & (ids < piece.row_end)
            if padding is not None:
                chosen &= ids != padding
            engine._deliver_rows(engine._groups[gid], index, ids[chosen] - piece.row_begin, grad_out[chosen])
        return None, None, None, None
