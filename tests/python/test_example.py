"""examples/python/finetune.py runs as a user would run it: a model directory, a token
file, a config; it trains, checkpoints, resumes and exports a directory from_pretrained loads."""

import json
import os
import subprocess
import sys

import numpy as np

import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "python", "finetune.py")


def write_llmc_tokens(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def run(args, timeout=300):
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_finetune_trains_resumes_and_exports(tmp_path):
    import transformers
    model_dir, data, config = tmp_path / "model", tmp_path / "tokens.bin", tmp_path / "config.json"
    ref.make_model("qwen2").save_pretrained(str(model_dir), safe_serialization=True)
    write_llmc_tokens(str(data), np.random.default_rng(0).integers(0, ref.VOCAB, 4096))
    config.write_text(json.dumps(ref.strata_config(nvme_path=str(tmp_path / "nvme"))))
    common = ["--model", str(model_dir), "--data", str(data), "--config", str(config), "--seq-len", "16"]
    first = run(common + ["--steps", "2", "--save", str(tmp_path / "ckpt"), "--empty-init", "--gradient-checkpointing"])
    assert "step 2: loss" in first
    second = run(common + ["--steps", "4", "--resume", str(tmp_path / "ckpt"), "--export", str(tmp_path / "out")])
    assert "step 3: loss" in second and "step 4: loss" in second and "step 1:" not in second
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert sum(p.numel() for p in exported.parameters()) > 0
