"""The config strata.initialize takes: a dict or a JSON file in Strata's DeepSpeed vocabulary,
as the text and source name the engine parses (and names in its errors)."""

from __future__ import annotations

import json
import os
from typing import Any

from torch import nn

from ._device import model_device
from ._strata import StrataError


def config_text(config: Any, model: nn.Module):
    """The config as JSON text and its source. Without strata.device, the device is the
    model's: cuda for a model whose parameters are on a GPU, else cpu (a model on the
    CPU or built under init_empty; such a model trains on a GPU when the config says so)."""
    if isinstance(config, dict):
        text, source = json.dumps(config), "<config dict>"
    elif isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise StrataError(f"cannot read the config file {source}: {e.strerror}") from None
    else:
        raise TypeError(f"config must be a dict or a path to a JSON file, not {type(config).__name__}")
    try:
        parsed = json.loads(text)
    except ValueError:
        return text, source  # the engine's parser names the fault
    strata = parsed.setdefault("strata", {}) if isinstance(parsed, dict) else None
    if not isinstance(strata, dict) or "device" in strata:
        return text, source  # as written (a wrong "strata" is the engine's to name)
    strata["device"] = model_device(model)
    return json.dumps(parsed), source
