"""State in and out with ranks as processes (Gloo on the CPU device): 2 processes save a
checkpoint that fresh processes resume bit for bit (and 1 process resumes too), export a
directory from_pretrained loads, and give the same full state_dict on every rank; a save
that fails on one rank fails on both, leaving no checkpoint."""

import os

import pytest
import torch

import reference as ref
from launch import one_process, two_processes

STEPS = 10
SAVED_AT = 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-process run that saves at step 5 and goes on to step 10, exports and tries
    refused saves; 2 fresh processes and 1 resuming from its checkpoint."""
    work = tmp_path_factory.mktemp("ranks_state")
    ckpt, out, single_out = str(work / "ckpt"), str(work / "out"), str(work / "single-out")
    straight = two_processes("--steps", str(STEPS), "--save", ckpt, "--save-at", str(SAVED_AT), "--export", out,
                             "--refused-saves", str(work / "refused"))
    return {"straight": straight, "ckpt": ckpt, "out": out, "single_out": single_out,
            "resumed": two_processes("--steps", str(STEPS), "--load", ckpt),
            "one_process": one_process("--steps", str(STEPS), "--load", ckpt, "--export", single_out)}


def test_two_processes_resume_a_two_process_checkpoint_bit_for_bit(runs):
    assert os.path.exists(os.path.join(runs["ckpt"], f"step-{SAVED_AT}", "rank-1-of-2.bin"))
    for rank, (straight, resumed) in enumerate(zip(runs["straight"], runs["resumed"])):
        assert resumed["first_step"] == SAVED_AT
        assert resumed["losses"] == straight["losses"][SAVED_AT:], f"rank {rank}: steps 6-10 after the resume differ"
        assert resumed["client_state"] == {"saved_by_rank": 0}, "the client state is rank 0's"


def test_one_process_resumes_a_two_process_checkpoint(runs):
    single = runs["one_process"]
    assert single["first_step"] == SAVED_AT
    for step, micro_losses in enumerate(single["losses"]):
        for rank, got in enumerate(micro_losses):
            want = runs["straight"][rank]["losses"][SAVED_AT + step][0]
            assert abs(got - want) <= 1e-5 * abs(want), f"step {SAVED_AT + step + 1} rank {rank}: {got!r} against {want!r}"


def test_state_dict_gives_the_same_full_weights_on_every_rank(runs):
    states = [torch.load(f"{runs['out']}.state-{rank}.pt") for rank in range(2)]
    model = ref.make_model("llama")
    assert set(states[0]) == {name for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert states[0][name].shape == p.shape, name
        assert torch.equal(states[0][name], states[1][name]), f"{name} differs between the ranks"


def test_two_processes_export_a_directory_from_pretrained_loads_with_the_trained_weights(runs):
    import transformers
    exported = transformers.AutoModelForCausalLM.from_pretrained(runs["out"])
    state = torch.load(f"{runs['out']}.state-0.pt")
    for name, p in exported.named_parameters():
        assert torch.equal(p.detach(), state[name]), f"{name} in the export differs from the state_dict"
    # The same training in one process (resumed from the checkpoint of step 5) exports the same weights.
    ref.assert_weights_close(state, transformers.AutoModelForCausalLM.from_pretrained(runs["single_out"]))


def test_a_save_that_fails_on_one_rank_fails_on_both_and_leaves_no_checkpoint(runs):
    for rank, run in enumerate(runs["straight"]):
        refused = run["refused"]
        assert "every rank must save the same step to the same directory" in refused["different_dirs"], refused
        assert "rank-1-of-2.bin" in refused["unwritable_rank_file"], f"rank {rank}: {refused['unwritable_rank_file']}"
        assert "was not saved" in refused["unwritable_rank_file"], refused
        assert not refused["complete_after_failure"], f"rank {rank} saw a checkpoint after the failed save"
        assert refused["saved_again"], f"rank {rank}: the save after the failure did not complete"
