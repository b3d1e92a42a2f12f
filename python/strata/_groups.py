"""Which parameters the engine gathers together: groups from the model's structure.

A *unit* is a module whose forward the engine wraps: before it runs, the groups its
parameters belong to are gathered and its parameters point into the gathered memory;
after it, they are released. By default the units are the blocks of the model's repeated
``nn.ModuleList`` (Hugging Face's ``model.layers``, ``transformer.h``, ...) and, outside
them, every module that holds parameters of its own (embeddings, final norm, head). A
parameter belongs to the first unit (in module order) that binds it; another unit that
uses the same parameter (a head tied to the embedding) gathers the owner's group.

Each unit's parameters form one engine group, split in two when it holds both trainable
and frozen parameters (the frozen part keeps no gradient or optimizer state).
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
class GroupPlan:
    name: str
    trainable: bool
    params: List[Tuple[str, nn.Parameter]]  # (qualified name, parameter), registration order


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


def plan_groups(model: nn.Module, units: List[Unit]) -> Tuple[List[GroupPlan], dict]:
    """Engine groups from the units, and {id(param): (group index, tensor index)}."""
    qualified = {id(param): name for name, param in model.named_parameters()}  # a shared parameter: its first name
    plans: List[GroupPlan] = []
    where: dict = {}
    for unit in units:
        trainable = GroupPlan(unit.name, True, [])
        frozen = GroupPlan(unit.name + ":frozen", False, [])
        for b in unit.bindings:
            if id(b.param) in where or any(b.param is p for _, p in trainable.params + frozen.params):
                continue
            target = trainable if b.param.requires_grad else frozen
            target.params.append((qualified.get(id(b.param), unit.name + "." + b.attr), b.param))
        for plan in (trainable, frozen):
            if plan.params:
                for index, (_, param) in enumerate(plan.params):
                    where[id(param)] = (len(plans), index)
                plans.append(plan)
    return plans, where

