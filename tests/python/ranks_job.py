"""One process of the multi-process tests: a rank when WORLD_SIZE is set (launched like
torchrun), else a world of one taking every rank's micro-batch in turn (gradient
accumulation over the ranks' batches). Prints {"losses": [[per micro-batch]...],
"idle_experts": n, "first_step": s, "client_state": c, "refused": {...}} as JSON on its last
line: losses[step][r] is rank r's micro-batch of step first_step + step.

State in and out (every rank makes the same calls, as a training script would):
  --load DIR          load_checkpoint(DIR) first, and train from the step it holds
  --save DIR          save_checkpoint(DIR) after step --save-at (default: the last)
  --export DIR        after the last step: export_hf(DIR), and the state_dict() to
                      DIR.state-<rank>.pt
  --placement-auto P  strata.placement "auto" with machine profile P (rank 0 chooses)
  --refused-saves DIR after the last step: a save whose directory differs between ranks,
                      and one whose rank-1 file cannot be written; their errors are printed
                      (refused), then the save is made again, whole."""

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


def rank_batches(family: str, steps: int):
    """Per step, each rank's micro-batch; the MoE case gives rank 1 three tokens, so some
    of its experts get none."""
    g = torch.Generator().manual_seed(7)
    shapes = [(2, ref.SEQ), (1, 3)] if family == "mixtral" else [(2, ref.SEQ)] * RANKS
    return [[torch.randint(0, ref.VOCAB, shape, generator=g) for shape in shapes] for _ in range(steps)]


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


def refused(call) -> str:
    """The StrataError `call` raises (an empty string when it raises none)."""
    try:
        call()
    except strata.StrataError as e:
        return str(e)
    return ""


def refused_saves(engine, save_dir: str) -> dict:
    out = {"different_dirs": refused(lambda: engine.save_checkpoint(f"{save_dir}-rank{strata.rank()}"))}
    step_dir = os.path.join(save_dir, f"step-{engine.global_steps}")
    if strata.rank() == 1:  # rank 1's file cannot be created: a directory holds its name
        os.makedirs(os.path.join(save_dir, f".tmp-step-{engine.global_steps}", "rank-1-of-2.bin"))
    out["unwritable_rank_file"] = refused(lambda: engine.save_checkpoint(save_dir))
    out["complete_after_failure"] = os.path.exists(step_dir)
    out["saved_again"] = refused(lambda: engine.save_checkpoint(save_dir)) == "" and os.path.exists(step_dir)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="llama")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--export")
    parser.add_argument("--refused-saves")
    parser.add_argument("--placement-auto", metavar="PROFILE", help="strata.placement auto with this machine profile")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = ref.make_model(args.family)
    idle = count_idle_experts(model)
    # Exact overlap only: a delayed update would change the arithmetic the test compares.
    keys = ({"placement": "auto", "profile": args.placement_auto, "device_budget_mib": 1, "optimizer_overlap": "exact"}
            if args.placement_auto else {})
    engine = strata.initialize(model=model, config=ref.strata_config(accumulation=RANKS // world, **keys), seq_len=ref.SEQ)
    assert strata.world_size() == world and strata.rank() == int(os.environ.get("RANK", "0"))
    first, client = 0, None
    if args.load:
        _, client = engine.load_checkpoint(args.load)
        first = engine.global_steps
    losses = []
    for step, micro_batches in enumerate(rank_batches(args.family, args.steps)[first:], start=first + 1):
        mine = micro_batches if world == 1 else [micro_batches[strata.rank()]]
        step_losses = []
        for ids in mine:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
        if args.save and step == (args.save_at or args.steps):
            engine.save_checkpoint(args.save, client_state={"saved_by_rank": strata.rank()})
    if args.export:
        engine.export_hf(args.export)
        torch.save(engine.state_dict(), f"{args.export}.state-{strata.rank()}.pt")
    saves = refused_saves(engine, args.refused_saves) if args.refused_saves else {}
    engine.close()
    print(json.dumps({"losses": losses, "idle_experts": max(idle) if idle else 0, "first_step": first,
                      "client_state": client, "refused": saves, "placement": engine.placement}))


if __name__ == "__main__":
    main()
