"""strata.placement "auto" in the Python front end: the plan's search picks the tiers, the
prefetch depth and the overlap by the step it predicts from a machine profile, and the
engine it makes trains exactly as the same placement written into the config by hand."""
import os
import re

import pytest

import reference as ref
import strata
from strata import StrataError

DATASHEET = os.path.join(os.environ.get("STRATA_SOURCE_DIR", "."), "examples", "profiles", "h200-datasheet.json")
TIER_WORDS = {"device": "none", "cpu": "cpu", "nvme": "nvme"}  # the choice's words -> offload_*.device


@pytest.fixture(autouse=True)
def no_kept_profile(tmp_path, monkeypatch):
    """No profile kept on the machine running the tests leaks in."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def chosen(text):
    match = re.search(r"chosen: params (\w+), optimizer (\w+), prefetch depth (\d+), .*, overlap (\w+)", text)
    assert match, text
    return match.groups()


def train(engine, steps=3):
    losses = []
    for micro_batches in ref.batches(steps):
        for ids in micro_batches:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def test_auto_picks_a_placement_that_fits_and_trains_as_that_placement_written_by_hand(tmp_path):
    keys = dict(device_budget_mib=1, nvme_path=str(tmp_path / "nvme"))
    engine = strata.initialize(model=ref.make_model("llama"),
                               config=ref.strata_config(placement="auto", profile=DATASHEET, **keys), seq_len=ref.SEQ)
    assert "placement auto: " in engine.placement and "runner-up: " in engine.placement
    params, optimizer, depth, overlap = chosen(engine.placement)
    assert f"parameters: fp32 on {params if params != 'cpu' else 'pinned'}" in engine.plan()["text"]
    automatic = train(engine)
    engine.close()

    config = ref.strata_config(prefetch_depth=int(depth), optimizer_overlap=overlap, **keys)
    config["zero_optimization"] = {"stage": 3, "offload_param": {"device": TIER_WORDS[params]},
                                   "offload_optimizer": {"device": TIER_WORDS[optimizer]}}
    config["strata"]["nvme_path"] = keys["nvme_path"]  # for whichever tier the choice put on NVMe
    by_hand = strata.initialize(model=ref.make_model("llama"), config=config)
    assert by_hand.placement is None
    assert train(by_hand) == automatic
    by_hand.close()


def test_auto_without_a_machine_profile_says_what_it_needs():
    with pytest.raises(StrataError, match="needs a machine profile"):
        strata.initialize(model=ref.make_model("llama"), config=ref.strata_config(placement="auto"), seq_len=ref.SEQ)


def test_an_unknown_placement_is_named():
    with pytest.raises(StrataError, match="strata.placement"):
        strata.initialize(model=ref.make_model("llama"), config=ref.strata_config(placement="fastest"))
