"""The front end's API: bad input gets a clear error before step 1, checkpoints resume bit
for bit in a fresh process, Hugging Face directories load by name, init_empty builds
without weights."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import reference as ref
import strata
from strata import StrataError

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_engine(tmp_path=None, **keys):
    model = ref.make_model("llama")
    return model, strata.initialize(model=model, config=ref.strata_config(**keys))


def one_micro_batch(engine, backward=True, step=True):
    ids = ref.batches(1, 1)[0][0]
    loss = engine(input_ids=ids, labels=ids).loss
    if backward:
        engine.backward(loss)
    if step:
        engine.step()
    return loss


def test_a_model_without_parameters_is_refused():
    with pytest.raises(StrataError, match="no parameters"):
        strata.initialize(model=nn.ReLU(), config=ref.strata_config())


def test_an_unknown_config_key_is_named():
    config = ref.strata_config()
    config["zero_optimization"] = {"offload_parameters": {"device": "cpu"}}
    with pytest.raises(StrataError, match="offload_parameters"):
        strata.initialize(model=ref.make_model("llama"), config=config)


def test_a_trainer_only_key_is_refused_naming_it():
    config = ref.strata_config()
    config["strata"]["model"] = {"n_layer": 4}
    with pytest.raises(StrataError, match="strata.model.n_layer"):
        strata.initialize(model=ref.make_model("llama"), config=config)


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(StrataError, match="no-such.json"):
        strata.initialize(model=ref.make_model("llama"), config=str(tmp_path / "no-such.json"))


def test_an_integer_parameter_is_refused_naming_it():
    model = nn.Linear(4, 4)
    model.count = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(StrataError, match="count"):
        strata.initialize(model=model, config=ref.strata_config())


def test_an_nvme_path_that_cannot_be_made_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StrataError, match=str(blocker)):
        strata.initialize(model=ref.make_model("llama"), config=ref.strata_config(nvme_path=str(blocker / "nvme")))


def test_a_device_budget_too_small_is_refused_before_step_one():
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])  # 16 MiB of training state on the device
    with pytest.raises(StrataError, match="budget"):
        strata.initialize(model=model, config=ref.strata_config(device_budget_mib=1))


def test_step_without_backward_is_an_error():
    _, engine = tiny_engine()
    one_micro_batch(engine, backward=False, step=False)
    with pytest.raises(StrataError, match="step\\(\\) without backward"):
        engine.step()
    engine.close()


def test_backward_without_forward_is_an_error():
    _, engine = tiny_engine()
    with pytest.raises(StrataError, match="backward\\(\\) without a training forward"):
        engine.backward(torch.zeros((), requires_grad=True))
    engine.close()


def test_calling_the_model_instead_of_the_engine_is_an_error():
    model, engine = tiny_engine()
    ids = ref.batches(1, 1)[0][0]
    with pytest.raises(StrataError, match="outside the engine"):
        model(input_ids=ids, labels=ids)
    engine.close()


def test_loss_backward_instead_of_engine_backward_is_an_error():
    _, engine = tiny_engine(accumulation=1)
    ids = ref.batches(1, 1)[0][0]
    loss = engine(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="engine.backward"):
        loss.backward()


def test_an_exception_inside_the_forward_leaves_the_engine_usable():
    model, engine = tiny_engine(accumulation=1)
    ids = ref.batches(1, 1)[0][0]
    with pytest.raises(IndexError):
        engine(input_ids=ids + 1000, labels=ids)  # token ids past the vocabulary: the embedding raises
    for name, p in model.named_parameters():
        assert p.numel() == 0, f"{name} is still bound"
    one_micro_batch(engine)
    engine.close()


def test_use_after_close_is_an_error():
    _, engine = tiny_engine()
    engine.close()
    with pytest.raises(StrataError, match="closed"):
        one_micro_batch(engine)


def test_parameters_are_empty_placeholders_after_initialize():
    model, engine = tiny_engine()
    for name, p in model.named_parameters():
        assert p.numel() == 0, name
        assert len(p.strata_shape) > 0, name
    engine.close()


def test_evaluation_under_no_grad_between_steps_sees_the_trained_weights():
    model = ref.make_model("llama")
    plain = ref.copy_model(model)
    engine = strata.initialize(model=model, config=ref.strata_config(accumulation=1))
    data = ref.batches(3, 1)
    ref.train_strata(engine, data)
    ref.train_reference(plain, data)
    ids = data[0][0]
    with torch.no_grad():
        got = engine(input_ids=ids, labels=ids).loss.item()
        want = plain(input_ids=ids, labels=ids).loss.item()
    assert abs(got - want) <= 1e-5 * abs(want)
    engine.close()


def test_a_checkpoint_resumes_in_a_fresh_process_bit_for_bit(tmp_path):
    job = os.path.join(HERE, "checkpoint_job.py")
    env = dict(os.environ)

    def run(*args):
        out = subprocess.run([sys.executable, job, *args], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    nvme = str(tmp_path / "nvme")
    straight = run("--steps", "10", "--nvme", nvme)
    saved = run("--steps", "5", "--save", str(tmp_path / "ckpt"), "--nvme", nvme)
    resumed = run("--steps", "10", "--load", str(tmp_path / "ckpt"), "--nvme", nvme)
    assert saved["losses"] == straight["losses"][:5]
    assert resumed["first_step"] == 5
    assert resumed["losses"] == straight["losses"][5:], "steps 6-10 after a resume differ from the straight run"
    assert resumed["client_state"] == {"epoch": 3}


def test_load_hf_streams_a_directory_by_parameter_name(tmp_path):
    import transformers
    source = ref.make_model("llama", seed=5)
    source.save_pretrained(str(tmp_path / "hf"), safe_serialization=True, max_shard_size="40KB")
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    model = ref.make_model("llama", seed=9)
    engine = strata.initialize(model=model, config=ref.strata_config(nvme_path=str(tmp_path / "nvme")))
    engine.load_hf(str(tmp_path / "hf"))
    ref.assert_weights_close(engine.state_dict(), source, rtol=0.0)
    engine.close()


def test_a_model_built_under_init_empty_trains_after_load_hf(tmp_path):
    import transformers
    source = ref.make_model("llama", seed=5)
    plain = ref.copy_model(source)
    source.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    with strata.init_empty():
        model = transformers.AutoModelForCausalLM.from_config(source.config)
    assert all(p.is_meta for p in model.parameters())
    engine = strata.initialize(model=model, config=ref.strata_config(nvme_path=str(tmp_path / "nvme")))
    with pytest.raises(StrataError, match="load_hf"):
        one_micro_batch(engine)
    engine.load_hf(str(tmp_path / "hf"))
    data = ref.batches()
    ref.assert_losses_close(ref.train_strata(engine, data), ref.train_reference(plain, data))
    engine.close()


def test_load_hf_names_a_tensor_whose_shape_differs(tmp_path):
    import transformers
    other = ref.make_model("llama")
    other.config.intermediate_size = 40
    transformers.AutoModelForCausalLM.from_config(other.config).save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    _, engine = tiny_engine()
    with pytest.raises(StrataError, match="mlp.gate_proj.weight"):
        engine.load_hf(str(tmp_path / "hf"))
    engine.close()
