"""One process of the multi-process tests: a rank when WORLD_SIZE is set (launched like
torchrun), else a world of one taking every rank's micro-batch in turn (gradient
accumulation over the ranks' batches). Prints {"losses": [[per micro-batch]...],
"idle_experts": n} as JSON on its last line: losses[step][r] is rank r's micro-batch."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import reference as ref  # noqa: E402
import strata  # noqa: E402

RANKS = 2
STEPS = 4


def rank_batches(family: str):
    """Per step, each rank's micro-batch; the MoE case gives rank 1 three tokens, so some
    of its experts get none."""
    g = torch.Generator().manual_seed(7)
    shapes = [(2, ref.SEQ), (1, 3)] if family == "mixtral" else [(2, ref.SEQ)] * RANKS
    return [[torch.randint(0, ref.VOCAB, shape, generator=g) for shape in shapes] for _ in range(STEPS)]


def count_idle_experts(model) -> list:
    """Hooks every router: appends, per call, how many experts no token chose."""
    idle = []
    for name, module in model.named_modules():
        if name.endswith(("block_sparse_moe.gate", "mlp.gate")):  # transformers 4 | 5
            k = model.config.num_experts_per_tok
            experts = model.config.num_local_experts

            def hook(mod, args, out, k=k, experts=experts):
                logits = out[0] if isinstance(out, tuple) else out  # 5 returns (logits, scores, indices)
                chosen = torch.topk(logits, k, dim=-1).indices.flatten().tolist()
                idle.append(experts - len(set(chosen)))
            module.register_forward_hook(hook)
    return idle


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="llama")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = ref.make_model(args.family)
    idle = count_idle_experts(model)
    engine = strata.initialize(model=model, config=ref.strata_config(accumulation=RANKS // world))
    assert strata.world_size() == world and strata.rank() == int(os.environ.get("RANK", "0"))
    losses = []
    for micro_batches in rank_batches(args.family):
        mine = micro_batches if world == 1 else [micro_batches[strata.rank()]]
        step_losses = []
        for ids in mine:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
    engine.close()
    print(json.dumps({"losses": losses, "idle_experts": max(idle) if idle else 0}))


if __name__ == "__main__":
    main()
