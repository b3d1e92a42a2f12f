"""Which parameters the engine gathers together: groups from the model's structure.

A *unit* is a module whose forward the engine wraps: before it runs, the groups its
parameters belong to are gathered and its parameters point into the gathered memory;
after it, they are released. By default the units are the blocks of the model's repeated
``nn.ModuleList`` (Hugging Face's ``model.layers``, ``transformer.h``, ...) and, outside
them, every module that holds parameters of its own (embeddings, final norm, head). A
parameter belongs to the first unit (in module order) that binds it; another unit that
uses the same parameter (a head tied to the embedding) gathers the owner's group.

Each unit's parameters form one engine group, split in two when it holds both trainable
and frozen parameters (the frozen part keeps no gradient or optimizer state, and is stored
in its parameters' dtype: one frozen group per dtype). A parameter
larger than ``max_group_elements`` (a vocabulary-sized embedding or head) is cut by rows
into groups of its own, so no group — and no buffer the engine sizes by the largest group —
is vocabulary-sized; the unit that uses it joins the pieces at each gather.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

GroupsArg = Union[None, Sequence[type], type, Callable[[nn.Module], Iterable[nn.Module]]]


@dataclasses.dataclass
class Binding:
    """One parameter slot of a module inside a unit: ``module._parameters[attr]``."""
    module: nn.Module
    attr: str
    param: nn.Parameter


@dataclasses.dataclass
class Unit:
    name: str
    module: nn.Module
    bindings: List[Binding]


@dataclasses.dataclass
class Piece:
    """Rows [row_begin, row_end) of a parameter: one tensor of an engine group."""
    name: str            # the parameter's qualified name
    param: nn.Parameter
    row_begin: int = 0
    row_end: int = 0     # == rows: to the end
    row_elements: int = 1  # elements per row (kept: the parameter itself is emptied by initialize)

    full_shape: Tuple[int, ...] = ()

    @property
    def whole(self) -> bool:
        return self.row_begin == 0 and self.row_end == (self.full_shape[0] if self.full_shape else 1)

    @property
    def shape(self) -> List[int]:
        if not self.full_shape:
            return []
        return [self.row_end - self.row_begin, *self.full_shape[1:]]

    @property
    def label(self) -> str:
        """The engine tensor's name: the parameter's, with its rows when it is a piece."""
        return self.name if self.whole else f"{self.name}[{self.row_begin}:{self.row_end}]"

    def values(self, full: "torch.Tensor") -> "torch.Tensor":
        """This piece of a tensor of the parameter's full shape."""
        return full if self.whole else full[self.row_begin:self.row_end]

    def element_offset(self) -> int:
        return self.row_begin * self.row_elements


@dataclasses.dataclass
class GroupPlan:
    name: str
    trainable: bool
    pieces: List[Piece]  # registration order
    dtype: Optional[torch.dtype] = None  # a frozen group's: its parameters' (all alike)


def _rows(param: nn.Parameter) -> int:
    return param.shape[0] if param.dim() > 0 else 1


def _split(name: str, param: nn.Parameter, max_elements: int) -> List[Piece]:
    rows, shape = _rows(param), tuple(param.shape)
    per_row = param.numel() // max(1, rows)
    if param.numel() <= max_elements or param.dim() == 0 or rows < 2:
        return [Piece(name, param, 0, rows, per_row, shape)]
    step = max(1, max_elements // max(1, per_row))
    return [Piece(name, param, r, min(rows, r + step), per_row, shape) for r in range(0, rows, step)]


def _block_list(model: nn.Module) -> Optional[nn.ModuleList]:
    """The ModuleList of same-class children holding the most parameters."""
    best, best_count = None, 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(c) for c in module}) == 1:
            count = sum(p.numel() for p in module.parameters())
            if count > best_count:
                best, best_count = module, count
    return best


def _unit_roots(model: nn.Module, groups: GroupsArg) -> List[nn.Module]:
    if groups is None:
        blocks = _block_list(model)
        roots = list(blocks) if blocks is not None else []
    elif callable(groups) and not isinstance(groups, type):
        roots = list(groups(model))
    else:
        classes = tuple(groups) if isinstance(groups, (list, tuple)) else (groups,)
        roots = []
        for module in model.modules():
            if isinstance(module, classes) and not any(_contains(r, module) for r in roots):
                roots.append(module)
    for root in roots:
        if not isinstance(root, nn.Module):
            raise TypeError(f"groups= gave {type(root).__name__}, not an nn.Module")
    return roots


def _contains(root: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in root.modules())


def _bindings(root: nn.Module, stop: Sequence[nn.Module]) -> List[Binding]:
    """The direct parameters of root's subtree, not descending into other units."""
    out: List[Binding] = []
    stack = [root]
    while stack:
        module = stack.pop(0)
        for attr, param in module._parameters.items():
            if param is not None:
                out.append(Binding(module, attr, param))
        for child in module.children():
            if not any(child is s for s in stop):
                stack.append(child)
    return out


def plan_units(model: nn.Module, groups: GroupsArg = None) -> List[Unit]:
    """The units of ``model`` in module order (see the top of this file)."""
    roots = _unit_roots(model, groups)
    names = {id(m): n for n, m in model.named_modules()}
    units = [Unit(names.get(id(r), "?"), r, _bindings(r, [])) for r in roots]
    # Modules outside every root that hold parameters of their own.
    inside = {id(m) for r in roots for m in r.modules()}
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        own = [Binding(module, a, p) for a, p in module._parameters.items() if p is not None]
        if own:
            units.append(Unit(name or type(module).__name__, module, own))
    order = {id(m): i for i, m in enumerate(model.modules())}
    units.sort(key=lambda u: order[id(u.module)])
    return units


def plan_groups(model: nn.Module, units: List[Unit], max_group_elements: int) -> Tuple[List[GroupPlan], dict]:
    """Engine groups from the units, and {id(param): [(group index, tensor index, piece)]}."""
    qualified = {id(param): name for name, param in model.named_parameters()}  # a shared parameter: its first name
    plans: List[GroupPlan] = []
    where: dict = {}

    def add(plan: GroupPlan) -> None:
        for index, piece in enumerate(plan.pieces):
            where.setdefault(id(piece.param), []).append((len(plans), index, piece))
        plans.append(plan)

    for unit in units:
        trainable = GroupPlan(unit.name, True, [])
        frozen: dict = {}  # dtype -> GroupPlan
        large: List[GroupPlan] = []
        taken = set()
        for b in unit.bindings:
            if id(b.param) in where or id(b.param) in taken:
                continue
            taken.add(id(b.param))
            name = qualified.get(id(b.param), unit.name + "." + b.attr)
            pieces = _split(name, b.param, max_group_elements)
            grad, dtype = b.param.requires_grad, None if b.param.requires_grad else b.param.dtype
            if len(pieces) > 1:
                suffix = "" if grad else ":frozen"
                large += [GroupPlan(f"{name}[{p.row_begin}:{p.row_end}]{suffix}", grad, [p], dtype) for p in pieces]
            elif grad:
                trainable.pieces.append(pieces[0])
            else:
                suffix = ":frozen" if not frozen else f":frozen:{str(dtype).replace('torch.', '')}"
                frozen.setdefault(dtype, GroupPlan(unit.name + suffix, False, [], dtype)).pieces.append(pieces[0])
        for plan in [trainable, *frozen.values(), *large]:
            if plan.pieces:
                add(plan)
    return plans, where
