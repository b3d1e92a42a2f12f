"""The front end on a GPU ("strata": {"device": "cuda"}): PyTorch computes on the caller's
current stream, the engine gathers into and reduces out of GPU memory, and the two are
joined by events, never by a device-wide synchronisation. With a GPU the tiny families
train as plain PyTorch on the same GPU does (within 1e-4: the GPU's reductions are not
bitwise stable between two runs); without one, asking for it is a clear error.

scripts/gpu-check runs this file with STRATA_REQUIRE_GPU=1, where a skipped GPU case fails."""

import os

import pytest
import torch

import reference as ref
import strata

HAVE_GPU = torch.cuda.is_available()
REQUIRE_GPU = os.environ.get("STRATA_REQUIRE_GPU") == "1"
GPU_RTOL = 1e-4


def needs_gpu(test):
    if REQUIRE_GPU and not HAVE_GPU:
        def fail(*args, **kwargs):
            pytest.fail("STRATA_REQUIRE_GPU=1 but torch.cuda.is_available() is False")
        fail.__name__ = test.__name__
        return fail
    return pytest.mark.skipif(not HAVE_GPU, reason="no GPU: torch.cuda.is_available() is False")(test)


def cuda_config(nvme_path=None, **keys):
    config = ref.strata_config(nvme_path, **keys)
    config["strata"]["device"] = "cuda"
    return config


def on_gpu(data):
    return [[ids.cuda() for ids in micro_batches] for micro_batches in data]


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """fp32 products in fp32 on both sides (not TF32), as the comparison needs."""
    if not HAVE_GPU:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is here: the GPU cases run instead")
def test_asking_for_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(strata.StrataError, match="(?i)no gpu|cuda"):
        strata.initialize(model=ref.make_model("llama"), config=cuda_config())


def test_without_a_device_key_a_model_on_the_cpu_trains_on_the_cpu_device():
    config = ref.strata_config()
    del config["strata"]["device"]
    engine = strata.initialize(model=ref.make_model("llama"), config=config)
    assert engine.device == torch.device("cpu")
    engine.close()


def train_on_gpu(family, tmp_path, stream=None):
    model = ref.make_model(family)
    plain = ref.copy_model(model).cuda()
    data = on_gpu(ref.batches())
    want = ref.train_reference(plain, data)
    engine = strata.initialize(model=model, config=cuda_config(str(tmp_path / "nvme")))
    assert engine.device.type == "cuda"
    if stream is None:
        got = ref.train_strata(engine, data)
    else:
        with torch.cuda.stream(stream):
            got = ref.train_strata(engine, data)
    return engine, model, plain, got, want


@needs_gpu
@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_a_family_trains_on_the_gpu_as_plain_pytorch_does(family, tmp_path):
    engine, model, plain, got, want = train_on_gpu(family, tmp_path)
    ref.assert_losses_close(got, want, rtol=GPU_RTOL)
    ref.assert_weights_close(engine.state_dict(), plain, rtol=GPU_RTOL)
    # Between passes the model holds empty placeholders, on the GPU (model.device says cuda).
    assert all(p.numel() == 0 and p.device.type == "cuda" for p in model.parameters())
    engine.close()


@needs_gpu
def test_training_on_a_side_stream_is_ordered_against_that_stream(tmp_path):
    engine, _, plain, got, want = train_on_gpu("llama", tmp_path, stream=torch.cuda.Stream())
    ref.assert_losses_close(got, want, rtol=GPU_RTOL)
    ref.assert_weights_close(engine.state_dict(), plain, rtol=GPU_RTOL)
    engine.close()


@needs_gpu
def test_a_model_built_empty_loads_and_trains_on_the_gpu(tmp_path):
    source = ref.make_model("llama")
    source.save_pretrained(str(tmp_path / "hf"))
    plain = ref.copy_model(source).cuda()
    data = on_gpu(ref.batches())
    want = ref.train_reference(plain, data)
    import transformers
    with strata.init_empty():
        model = transformers.AutoModelForCausalLM.from_config(source.config)
    engine = strata.initialize(model=model, config=cuda_config(str(tmp_path / "nvme")))
    engine.load_hf(str(tmp_path / "hf"))
    got = ref.train_strata(engine, data)
    ref.assert_losses_close(got, want, rtol=GPU_RTOL)
    engine.close()


@needs_gpu
def test_parameters_on_another_device_than_the_engine_are_refused():
    model = ref.make_model("llama").cuda()
    config = ref.strata_config()  # device cpu
    with pytest.raises(strata.StrataError, match="is on cuda"):
        strata.initialize(model=model, config=config)
