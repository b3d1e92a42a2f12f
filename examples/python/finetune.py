#!/usr/bin/env python3
"""Fine-tunes any Hugging Face causal LM on Strata's tiers (docs/python.md).

    PYTHONPATH=build/python python3 examples/python/finetune.py --model MODEL_DIR \\
        --data FILE.bin --config CONFIG.json --steps 100 [--seq-len 512] \\
        [--gradient-checkpointing] [--empty-init] [--save DIR] [--export DIR]

--data is a token file as scripts/prepare-data writes it (Strata's fine-tuning rows, with a
loss flag per token) or an llm.c token file (a stream, cut into windows of seq_len + 1).
--config is a Strata/DeepSpeed config (micro-batch size, accumulation, tiers, optimizer,
schedule). --empty-init builds the model under strata.init_empty() and streams the
weights from MODEL_DIR into the tiers, so the model is never whole in host memory. Each
process of a torchrun/strata-launch world takes its own share of the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

import strata

HEADER_INTS = 256
MAGICS = {20240520: np.uint16, 20240801: np.uint32}
FLAG_TARGET = 1


class TokenFile:
    """A token file's rows of seq_len + 1 tokens and, for fine-tuning files, the loss flags."""

    def __init__(self, path: str, seq_len: int):
        header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
        if header.size < HEADER_INTS or int(header[0]) not in MAGICS:
            raise SystemExit(f"{path}: not a token file (scripts/prepare-data writes them)")
        dtype, count, row = MAGICS[int(header[0])], int(header[2]), int(header[3])
        version = int(header[1])
        self.tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_INTS * 4, shape=(count,))
        flagged = version in (2, 8)
        self.flags = (np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER_INTS * 4 + count * np.dtype(dtype).itemsize,
                                shape=(count,)) if flagged else None)
        self.row = row if row > 0 else seq_len + 1
        if row > 0 and row != seq_len + 1:
            raise SystemExit(f"{path}: rows of {row} tokens; pass --seq-len {row - 1}")
        self.rows = count // self.row

    def sample(self, index: int):
        begin = (index % self.rows) * self.row
        ids = torch.from_numpy(self.tokens[begin:begin + self.row].astype(np.int64))
        labels = ids.clone()
        if self.flags is not None:
            labels[torch.from_numpy(self.flags[begin:begin + self.row] & FLAG_TARGET) == 0] = -100
        labels[0] = -100  # the first token predicts nothing (HF shifts labels by one)
        return ids, labels


def build_model(args):
    import transformers
    config = transformers.AutoConfig.from_pretrained(args.model)
    if args.empty_init:
        with strata.init_empty():
            model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--data", required=True, help="a token file (scripts/prepare-data)")
    parser.add_argument("--config", required=True, help="a Strata / DeepSpeed config file")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--empty-init", action="store_true", help="build without weights and stream them in (load_hf)")
    parser.add_argument("--save", help="save a checkpoint here at the end")
    parser.add_argument("--resume", help="resume from the newest checkpoint here")
    parser.add_argument("--export", help="export a Hugging Face directory here at the end")
    args = parser.parse_args()

    with open(args.config, encoding="utf-8") as f:
        config = json.load(f)
    micro = int(config.get("train_micro_batch_size_per_gpu", 1))
    accumulation = int(config.get("gradient_accumulation_steps", 1))
    data = TokenFile(args.data, args.seq_len)
    engine = strata.initialize(model=build_model(args), config=config)
    if args.empty_init:
        engine.load_hf(args.model)
    if args.resume:
        engine.load_checkpoint(args.resume)
    rank, world = strata.rank(), strata.world_size()
    start = engine.global_steps
    for step in range(start, args.steps):
        began = time.perf_counter()
        for m in range(accumulation):
            first = ((step * accumulation + m) * world + rank) * micro
            ids, labels = zip(*(data.sample(first + i) for i in range(micro)))
            loss = engine(input_ids=torch.stack(ids), labels=torch.stack(labels)).loss
            engine.backward(loss)
            engine.step()
        report = engine.last_report
        if rank == 0:
            print(f"step {step + 1}: loss {report['loss']:.4f}, grad norm {report['grad_norm']:.3f}, "
                  f"lr {engine.get_lr()[0]:.3g}, {time.perf_counter() - began:.2f} s", flush=True)
    if args.save:
        engine.save_checkpoint(args.save)
    if args.export:
        engine.export_hf(args.export, tokenizer_dir=args.model)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
