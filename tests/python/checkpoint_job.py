"""One run of the checkpoint round-trip test, in a process of its own: trains the tiny
Llama for --steps steps (resuming from --load first, saving to --save at the end) and
prints {"first_step", "losses", "client_state"} as JSON on its last line."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reference as ref  # noqa: E402
import strata  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--nvme")
    args = parser.parse_args()
    engine = strata.initialize(model=ref.make_model("llama"), config=ref.strata_config(nvme_path=args.nvme))
    first, client = 0, None
    if args.load:
        _, client = engine.load_checkpoint(args.load)
        first = engine.global_steps
    data = ref.batches(args.steps)[first:]
    losses = ref.train_strata(engine, data)
    if args.save:
        engine.save_checkpoint(args.save, client_state={"epoch": 3})
    engine.close()
    print(json.dumps({"first_step": first, "losses": losses, "client_state": client}))


if __name__ == "__main__":
    main()
