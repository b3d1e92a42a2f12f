"""Memory stays within its budgets: a model whose parameters are several times the device
budget trains with the engine's device peak under the budget."""

import torch

import reference as ref
import strata

MiB = 1 << 20


def test_a_model_four_times_the_device_budget_trains_under_it(tmp_path):
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=24,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    budget_mib = 1
    assert param_bytes >= 4 * budget_mib * MiB, param_bytes
    settings = ref.strata_config(nvme_path=str(tmp_path / "nvme"), device_budget_mib=budget_mib)
    settings["zero_optimization"]["offload_param"]["device"] = "cpu"
    settings["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every group streams
    engine = strata.initialize(model=model, config=settings)
    losses = ref.train_strata(engine, ref.batches(steps=2))
    report = engine.last_report
    assert all(loss == loss for loss in losses)
    assert report["device_budget_bytes"] == budget_mib * MiB
    assert 0 < report["device_high_water_bytes"] <= report["device_budget_bytes"], report
    engine.close()
