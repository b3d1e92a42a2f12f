"""Ranks as processes (Gloo on the CPU device): 2 processes, each with its own micro-batch,
train as 1 process accumulating both; a Mixtral rank whose tokens leave experts idle
neither hangs nor changes the result."""

import os

import pytest

from launch import one_process, two_processes

DATASHEET = os.path.join(os.environ.get("STRATA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")),
                         "examples", "profiles", "h200-datasheet.json")


def assert_same_training(single: dict, ranks: list) -> None:
    for step, micro_losses in enumerate(single["losses"]):
        for rank, want in enumerate(micro_losses):
            got = ranks[rank]["losses"][step][0]
            assert abs(got - want) <= 1e-5 * abs(want), f"step {step} rank {rank}: {got!r} against one process's {want!r}"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_two_processes_train_as_one_process_accumulating_their_batches(family):
    assert_same_training(one_process("--family", family), two_processes("--family", family))


def test_mixtral_with_idle_experts_on_one_rank_neither_hangs_nor_differs():
    ranks = two_processes("--family", "mixtral")
    assert ranks[1]["idle_experts"] > 0, "the test's batch left no expert idle on rank 1"
    assert_same_training(one_process("--family", "mixtral"), ranks)


def test_with_placement_auto_every_rank_takes_rank_0s_choice_and_trains_as_one_process():
    ranks = two_processes("--placement-auto", DATASHEET)
    assert ranks[0]["placement"] and "chosen: params " in ranks[0]["placement"]
    assert ranks[1]["placement"] == ranks[0]["placement"]
    # A placement moves state between tiers, never changes the arithmetic.
    assert_same_training(one_process(), ranks)
