"""PEFT LoRA: the frozen base weights get storage and gathers only (no gradient path, master
copy or optimizer state) and may live on NVMe; training matches plain PyTorch + PEFT."""

import pytest
import torch

import reference as ref
import strata

peft = pytest.importorskip("peft", reason="peft is not installed in this environment")


def lora_model(seed=0, base_dtype=torch.float32):
    base = ref.make_model("llama", seed=seed).to(base_dtype)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(base, config)
    torch.manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # B starts at zero in PEFT; give the first steps a gradient for A
        if p.requires_grad:
            p.data = p.data.float()  # fp32 adapters over any base
    return model


def train_reference(model, data):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=ref.LR, betas=ref.BETAS, eps=ref.EPS, weight_decay=ref.WEIGHT_DECAY)
    losses = []
    for step, micro_batches in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = ref.warmup_lr(step)
        total = 0.0
        for ids in micro_batches:
            loss = model(input_ids=ids, labels=ids).loss
            (loss / len(micro_batches)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, ref.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / len(micro_batches))
    return losses


# 1000 elements: the frozen embedding and head are cut into pieces and computed by pieces.
@pytest.mark.parametrize("max_group_elements", [1 << 26, 1000])
def test_lora_with_the_frozen_base_on_nvme_trains_as_plain_pytorch_and_peft(tmp_path, max_group_elements):
    model = lora_model()
    plain = ref.copy_model(model)
    data = ref.batches()
    want = train_reference(plain, data)
    engine = strata.initialize(model=model, config=ref.strata_config(nvme_path=str(tmp_path / "nvme")),
                               max_group_elements=max_group_elements)
    got = ref.train_strata(engine, data)
    ref.assert_losses_close(got, want)
    weights = engine.state_dict()
    for name, p in plain.named_parameters():
        if p.requires_grad:
            scale = p.detach().abs().max().item()
            assert (weights[name] - p.detach()).abs().max().item() <= 1e-5 * scale, name
        else:
            assert torch.equal(weights[name], p.detach()), f"frozen {name} changed"
    engine.close()


def test_lora_with_a_bf16_base_on_nvme_trains_as_plain_pytorch_and_peft_and_stores_the_base_in_bf16(tmp_path):
    model = lora_model(base_dtype=torch.bfloat16)
    plain = ref.copy_model(model)
    data = ref.batches()
    want = train_reference(plain, data)
    engine = strata.initialize(model=model, config=ref.strata_config(nvme_path=str(tmp_path / "nvme")))
    got = ref.train_strata(engine, data)
    ref.assert_losses_close(got, want)
    weights = engine.state_dict()
    for name, p in plain.named_parameters():
        if p.requires_grad:
            scale = p.detach().abs().max().item()
            assert (weights[name] - p.detach()).abs().max().item() <= 1e-5 * scale, name
        else:
            assert p.dtype == torch.bfloat16 and torch.equal(weights[name], p.detach().float()), f"frozen {name} changed"
    engine.close()


def parameter_bytes(engine):
    return sum(b for what, tier, b in engine.plan()["lines"] if what.startswith("parameter shards"))


def test_a_bf16_base_takes_bf16_bytes_on_nvme_under_fp32_adapters(tmp_path):
    engines = [strata.initialize(model=lora_model(base_dtype=dtype), config=ref.strata_config(nvme_path=str(tmp_path / str(dtype))))
               for dtype in (torch.float32, torch.bfloat16)]
    fp32_base, bf16_base = (parameter_bytes(e) for e in engines)
    # The base is ~88% of the parameters; every group's shard is rounded up to 4 KiB.
    assert bf16_base < 0.65 * fp32_base
    frozen = [g for g in engines[1]._groups if not g.trainable]
    assert frozen and all(g.flat is None for g in frozen)
    for e in engines:
        e.close()


def test_the_optimizer_state_is_the_adapters_alone(tmp_path):
    model = lora_model()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = strata.initialize(model=model, config=ref.strata_config(nvme_path=str(tmp_path / "nvme")))
    plan = engine.plan()
    state = sum(b for what, tier, b in plan["lines"] if what.startswith("master weights"))
    groups = [engine._session.layout(g.id) for g in engine._groups if g.trainable]
    assert state == 12 * sum(layout["shard_numel"] for layout in groups)
    assert trainable <= sum(layout["numel"] for layout in groups) < 2 * trainable + 64 * len(groups)
    engine.close()


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_load_hf_fills_the_base_and_keeps_the_adapters(tmp_path, base_dtype):
    source = ref.make_model("llama", seed=3).to(base_dtype)
    source.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    model = lora_model(base_dtype=base_dtype)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    engine = strata.initialize(model=model, config=ref.strata_config(nvme_path=str(tmp_path / "nvme")))
    engine.load_hf(str(tmp_path / "hf"))
    weights = engine.state_dict()
    for name, value in adapters.items():
        assert torch.equal(weights[name], value), f"adapter {name} changed"
    base = dict(source.named_parameters())
    for name, value in weights.items():
        if name not in adapters:
            plain = name[len("base_model.model."):].replace(".base_layer.", ".")
            assert torch.equal(value, base[plain].detach().float()), name
    engine.close()
