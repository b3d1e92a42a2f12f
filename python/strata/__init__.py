"""Strata: train any PyTorch model with its state in device, pinned and NVMe memory.

    engine = strata.initialize(model=model, config="ds_config.json")
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

See docs/python.md for the API, how groups are chosen and what runs where.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ._empty import init_empty
from ._engine import Engine
from ._strata import StrataError

__all__ = ["Engine", "StrataError", "init_empty", "initialize", "rank", "world_size"]

_live: Optional[Engine] = None


def initialize(model=None, config: Any = None, groups=None, weight_decay=None, max_group_elements: int = 1 << 26,
               seq_len: Optional[int] = None, **unsupported) -> Engine:
    """The engine for ``model`` under ``config`` (a DeepSpeed-vocabulary dict or JSON file).

    ``groups``: module classes, or a function of the model giving the modules, whose
    instances are gathered whole (default: the blocks of the model's repeated ModuleList).
    ``weight_decay``: a function (name, parameter) -> bool choosing the parameters AdamW
    decays (default: all, as torch.optim.AdamW(model.parameters()) does).
    ``max_group_elements``: a parameter larger than this is cut by rows into groups of its
    own (a vocabulary-sized embedding), so no engine buffer is sized by it.
    ``seq_len``: tokens per sequence of the training batches, for ``"strata": {"placement":
    "auto"}``, which picks the tiers, prefetch depth and overlap by the step it predicts
    (default: the model config's max_position_embeddings).
    """
    global _live
    if unsupported:
        names = ", ".join(sorted(unsupported))
        raise StrataError(f"strata.initialize() does not take {names}: the optimizer and schedule come from the config's "
                          "'optimizer' and 'scheduler' sections, the data from the calling script")
    if model is None or config is None:
        raise TypeError("strata.initialize() needs model= and config=")
    _live = Engine(model, config, groups=groups, weight_decay=weight_decay, max_group_elements=max_group_elements,
                   seq_len=seq_len)
    return _live


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value:
            return int(value)
    return default


def rank() -> int:
    """This process's rank: the live engine's, else the launcher's (RANK, SLURM_PROCID)."""
    if _live is not None and not _live._session.closed:
        return _live.rank
    return _env_int("RANK", "SLURM_PROCID", default=0)


def world_size() -> int:
    """The number of ranks: the live engine's, else the launcher's (WORLD_SIZE, SLURM_NTASKS)."""
    if _live is not None and not _live._session.closed:
        return _live.world_size
    return _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
