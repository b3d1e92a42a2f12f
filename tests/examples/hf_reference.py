#!/usr/bin/env python3
"""Hugging Face transformers as the reference for Strata's Llama-family models.

Runs under the venv of scripts/reference-venv ($STRATA_REFERENCE_PYTHON). Subcommands:

  make-tiny --family llama|mistral|qwen2 [--tied|--untied] [--rope-scaling none|llama3|linear]
            [--llama-biases none|attention|attention-mlp] [--attention causal|document]
            [--save-dtype fp32|bf16|fp16] [--steps K --lr --beta1 --beta2 --eps --weight-decay
            --decay-on matrices|all --clip-grad-norm] --seed S --out DIR
      A tiny random model made by transformers, its batch and the reference numbers (below).
  logits --model DIR --tokens 1,2,3 [--compare-with DIR2] [--tolerance X] [--report FILE]
      Loads with AutoModelForCausalLM (no missing or unexpected keys allowed), prints a logits
      summary, or the max abs / rel difference against a second model.
  loss --model DIR --batch batch.json
      A checkpoint's loss (fp32 as transformers computes it, and fp64) on a make-tiny batch.
  compare-weights --model DIR --reference DIR2 [--tolerance X]
      Every parameter by name: max abs difference and ||a - b|| / ||b|| (e.g. Strata's weights
      after K steps, exported, against reference/after_adamw).
  check-load DIR [DIR...]
      Loads each DIR, reports missing / unexpected / mismatched keys and whether the tokenizer
      fits the vocabulary; non-zero on any.
  make-random (used by scripts/make-random-llama)
      A random-weight checkpoint of a real model's shape, sharded, written tensor by tensor.

Exit status 77 when torch or transformers cannot be imported (C++ tests skip with the reason),
1 when a check fails or an argument is refused, 2 on arguments argparse rejects.

make-tiny writes DIR as a Hugging Face model directory (config.json, model.safetensors in
fp32 or --save-dtype, generation_config.json, a tiny tokenizer) plus:
  batch.json     input_ids, labels, targets, position_ids ([batch][seq] integer lists).
  expected.json  the reference numbers, with the conventions spelled out in it.
  reference/gradients_fp64.safetensors  d loss / d parameter at the initial weights, float64,
                 transformers' parameter names (tied: model.embed_tokens.weight carries the
                 head's gradient too; there is no lm_head.weight).
  reference/after_adamw/  the fp32 weights after the AdamW steps (save_pretrained).

Conventions the Strata side has to match (also written into expected.json):
  * Labels shift inside the model, as transformers does: the logits at position t are scored
    against labels[t+1]; the last position scores nothing. batch.json's `targets` is that
    shift done already (targets[t] = labels[t+1], targets[T-1] = -100), llm.c style.
  * -100 means "no loss here". The loss is the mean of the per-token cross entropy over all
    unmasked targets of the whole batch (not a mean of per-row means).
  * position_ids only move the rotary embedding. With --attention causal (the default, what
    transformers does with position_ids and no mask) attention is causal over the whole row,
    across the restart; with --attention document it is also cut at the restart (a
    block-diagonal causal mask), and the script checks that equals running each document alone.
  * AdamW is torch.optim.AdamW (decoupled decay p *= 1 - lr*wd; eps added to
    sqrt(v)/sqrt(1-beta2^t)), constant lr, no clipping unless --clip-grad-norm; with
    --decay-on matrices (default) only tensors with 2 or more dimensions decay (not norms,
    not biases), as Strata's TensorSpec::weight_decay does; --decay-on all decays every tensor.
  * losses[k] is the loss of the batch at the weights after k updates (losses[0] is the
    initial loss), so `steps` updates give steps + 1 losses.
  * Rotary angles are fp32 in transformers even in a float64 model: inv_freq = 1 / theta^(2i/d)
    (and its llama3 / linear rescaling) in fp32, angle = position * inv_freq in fp32, cos and
    sin in fp32, then cast. loss_fp64 and the fp64 gradients carry that (~1e-7 relative).
"""
import argparse
import copy
import json
import os
import sys

# The reference never reaches a hub: everything is made here.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

try:
    import torch
    import torch.nn.functional as F
    import transformers
    from safetensors.torch import save_file
    from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)
except Exception as error:  # noqa: BLE001 - any import failure means "skip"
    print(f"cannot import torch / transformers / safetensors with {sys.executable}: {error}"
          " (scripts/reference-venv makes an interpreter that can)", file=sys.stderr)
    sys.exit(77)

transformers.utils.logging.disable_progress_bar()

IGNORE_INDEX = -100

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}

# Tiny shapes: GQA (4 query heads share 2 KV heads), an MLP width that is not a multiple of
# 64, a vocabulary that is not a power of two.
TINY_SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)

# head_dim 16 gives rotary wavelengths 2*pi*theta^(i/8) = 6.3, 20.9, 62.8, ... tokens; with
# an original context of 32, llama3 scaling leaves the first alone (< 32/4), blends the second
# (between 32/4 and 32/1) and divides the rest by the factor: all three branches at any length.
ROPE_SCALINGS = {
    "none": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "linear": {"type": "linear", "factor": 2.0},
}

# Real shapes for scripts/make-random-llama (Llama 3.2 1B / 3B, Llama 3.1 8B), and a small one
# with the same structure for tests of sharding.
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
PRESETS = {
    "llama-1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                     rope_scaling=dict(LLAMA3_ROPE, factor=32.0), max_position_embeddings=131072, rms_norm_eps=1e-5,
                     bos_token_id=128000, eos_token_id=128001),
    "llama-3b": dict(num_hidden_layers=28, hidden_size=3072, num_attention_heads=24, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                     rope_scaling=dict(LLAMA3_ROPE, factor=32.0), max_position_embeddings=131072, rms_norm_eps=1e-5,
                     bos_token_id=128000, eos_token_id=128001),
    "llama-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                     rope_scaling=dict(LLAMA3_ROPE, factor=8.0), max_position_embeddings=131072, rms_norm_eps=1e-5,
                     bos_token_id=128000, eos_token_id=128001),
    "llama-tiny": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=704, vocab_size=2048, tie_word_embeddings=True, rope_theta=500000.0,
                       rope_scaling=dict(LLAMA3_ROPE, factor=32.0, original_max_position_embeddings=64),
                       max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's chat layout, so data preparation can be tested with a tiny model's own template.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
                 "{{ message['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# What the tiny tokenizer learns its merges from (made here; nothing is downloaded).
TOKENIZER_CORPUS = [
    "Strata trains models whose parameters, gradients and optimizer states do not fit in device memory.",
    "The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun.",
    "Fine-tune a model on one node: prepare the data, train, and export the weights.",
    "user: what is the capital of France? assistant: the capital of France is Paris.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 the of and to in is that for it as with",
]


def fail(message):
    print(f"hf_reference.py: {message}", file=sys.stderr)
    sys.exit(1)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def build_tiny_tokenizer(vocab_size):
    """A byte-level BPE tokenizer trained here on TOKENIZER_CORPUS, at most vocab_size ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TOKENIZER_CORPUS * 4, trainer=trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids, more than the model's {vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>", chat_template=CHAT_TEMPLATE,
                                   clean_up_tokenization_spaces=False)


def tiny_tokenizer_for(vocab_size):
    """The tiny tokenizer for a model of vocab_size (at most 512 ids of it used)."""
    return build_tiny_tokenizer(min(vocab_size, 512))


# ---------------------------------------------------------------------------------------------
# make-tiny


def tiny_config(args, tokenizer):
    config_class, _ = FAMILIES[args.family]
    fields = dict(TINY_SHAPE, tie_word_embeddings=args.tied, initializer_range=args.init_std,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if args.family == "llama":
        fields.update(rope_theta=10000.0, rope_scaling=copy.deepcopy(ROPE_SCALINGS[args.rope_scaling]),
                      attention_bias=args.llama_biases != "none", mlp_bias=args.llama_biases == "attention-mlp")
    elif args.rope_scaling != "none":
        raise SystemExit(f"--rope-scaling {args.rope_scaling}: transformers {transformers.__version__} has rope scaling "
                         "for llama only")
    elif args.family == "mistral":
        fields.update(rope_theta=1000000.0, sliding_window=None)  # no window: every position sees all before it
    else:
        fields.update(rope_theta=1000000.0, use_sliding_window=False)  # qwen2: q/k/v biases are built in
    return config_class(**fields)


def make_tiny_model(args, tokenizer):
    """transformers' own initialization (normal, std --init-std), then norm gains 1 + N(0, 0.1^2) and
    biases N(0, 0.02^2) so that a wrong gain or bias cannot hide behind ones and zeros."""
    torch.manual_seed(args.seed)
    _, model_class = FAMILIES[args.family]
    model = model_class(tiny_config(args, tokenizer)).to(torch.float32)
    generator = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith(".bias"):
                parameter.copy_(0.02 * torch.randn(parameter.shape, generator=generator))
    return model


def make_batch(seed, vocab_size, batch_size, seq_len):
    """Three kinds of row, repeated: a prompt whose first tokens are masked; two packed documents
    (positions restart, the first token of the second is not predicted from the first); a row
    whose last tokens are masked like padding. Ids 0 and vocab-1 occur."""
    if seq_len < 12:
        raise SystemExit("--seq-len must be at least 12")
    generator = torch.Generator().manual_seed(seed + 2)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    input_ids[0, 1] = 0
    input_ids[0, 2] = vocab_size - 1
    labels = input_ids.clone()
    position_ids = torch.arange(seq_len).repeat(batch_size, 1)
    restart = seq_len // 2 - 2
    for row in range(batch_size):
        kind = row % 3
        if kind == 0:
            labels[row, :6] = IGNORE_INDEX
        elif kind == 1:
            position_ids[row, restart:] = torch.arange(seq_len - restart)
            labels[row, restart] = IGNORE_INDEX
        else:
            labels[row, -3:] = IGNORE_INDEX
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return {"input_ids": input_ids, "labels": labels, "targets": targets, "position_ids": position_ids}


def document_mask(position_ids, dtype):
    """[B, 1, T, T] additive mask, 0 where query i may see key j (j <= i, same document), the
    dtype's minimum elsewhere; a document starts wherever position_ids is 0. transformers 4.44
    takes a 4-D mask as given."""
    documents = torch.cumsum((position_ids == 0).to(torch.int64), dim=1)
    same = documents[:, :, None] == documents[:, None, :]
    seq_len = position_ids.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    allowed = same & causal
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None, :, :]


def model_inputs(batch, attention, dtype):
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if attention == "document":
        inputs["attention_mask"] = document_mask(batch["position_ids"], dtype)
    return inputs


def batch_loss(model, batch, attention):
    """The mean next-token cross entropy over unmasked targets, computed in the model's dtype.
    transformers casts logits to fp32 before its loss; this keeps float64 models in float64."""
    dtype = next(model.parameters()).dtype
    hidden = model.model(**model_inputs(batch, attention, dtype)).last_hidden_state
    logits = model.lm_head(hidden)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1), ignore_index=IGNORE_INDEX)


def transformers_loss(model, batch, attention):
    """transformers' own loss (labels shifted inside the model)."""
    dtype = next(model.parameters()).dtype
    return model(**model_inputs(batch, attention, dtype), labels=batch["labels"]).loss


def check_document_attention(model, batch):
    """The document mask must equal running each document alone: sum the per-document losses."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for row in range(batch["input_ids"].shape[0]):
        starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
        for begin, end in zip(starts[:-1], starts[1:]):
            piece = {key: batch[key][row:row + 1, begin:end] for key in ("input_ids", "targets")}
            piece["targets"] = piece["targets"].clone()
            piece["targets"][0, -1] = IGNORE_INDEX  # the piece's last target belongs to the next document
            hidden = model.model(input_ids=piece["input_ids"]).last_hidden_state
            logits = model.lm_head(hidden)
            total = total + F.cross_entropy(logits[0], piece["targets"][0], ignore_index=IGNORE_INDEX, reduction="sum")
            count += int((piece["targets"] != IGNORE_INDEX).sum())
    whole = batch_loss(model, batch, "document")
    alone = total / count
    if not torch.isclose(whole, alone, rtol=1e-10, atol=0.0):
        fail(f"the document mask gives loss {whole.item()!r}, documents run alone give {alone.item()!r}")


def adamw_losses(model, batch, args):
    """args.steps updates of torch.optim.AdamW on the one batch; returns the steps + 1 losses."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    vector_decay = args.weight_decay if args.decay_on == "all" else 0.0
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},
                                   {"params": vectors, "weight_decay": vector_decay}],
                                  lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = batch_loss(model, batch, args.attention)
        losses.append(loss.item())
        loss.backward()
        if args.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
    with torch.no_grad():
        losses.append(batch_loss(model, batch, args.attention).item())
    return losses


def conventions():
    return {
        "label_shift": "logits at position t are scored against labels[t+1] (transformers shifts inside the model); "
                       "batch.json targets[t] = labels[t+1], targets[T-1] = -100",
        "ignore_index": IGNORE_INDEX,
        "loss_average": "mean of per-token cross entropy over all unmasked targets of the whole batch",
        "position_ids": "only rotate q and k (RoPE); attention follows the 'attention' field",
        "attention_modes": {"causal": "causal over the whole row, across position restarts (transformers with "
                                      "position_ids and no mask)",
                            "document": "causal and cut at each position restart (block-diagonal)"},
        "adamw": "torch.optim.AdamW: p -= lr*wd*p; m, v; p -= lr * m_hat / (sqrt(v_hat) + eps); constant lr",
        "losses": "losses[k] is the batch loss after k updates; losses[0] is the initial loss",
        "rotary": "inv_freq = 1/theta^(2i/d) (rescaled for llama3/linear), angle = position*inv_freq, cos, sin: "
                  "all in fp32, even in the float64 runs",
    }


def command_make_tiny(args):
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "reference"), exist_ok=True)
    tokenizer = tiny_tokenizer_for(TINY_SHAPE["vocab_size"])
    model = make_tiny_model(args, tokenizer)
    save_dtype = DTYPES[args.save_dtype]
    if save_dtype != torch.float32:
        # The reference runs from exactly the saved values: round them, keep computing in fp32.
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.to(save_dtype).to(torch.float32))
    copy.deepcopy(model).to(save_dtype).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    batch = make_batch(args.seed, model.config.vocab_size, args.batch_size, args.seq_len)
    with open(os.path.join(out, "batch.json"), "w") as f:
        json.dump({key: value.tolist() for key, value in batch.items()} | {"attention": args.attention}, f)

    model64 = copy.deepcopy(model).to(torch.float64)
    if args.attention == "document":
        with torch.no_grad():
            check_document_attention(model64, batch)
    with torch.no_grad():
        loss_fp32 = transformers_loss(model, batch, args.attention).item()
        own_fp32 = batch_loss(model, batch, args.attention).item()
    if own_fp32 != loss_fp32 and abs(own_fp32 - loss_fp32) > 1e-6 * abs(loss_fp32):
        fail(f"this script's loss {own_fp32!r} differs from transformers' {loss_fp32!r}: the conventions above are wrong")
    loss64 = batch_loss(model64, batch, args.attention)
    loss64.backward()
    gradients = {name: p.grad.detach().clone().contiguous() for name, p in model64.named_parameters()}
    save_file(gradients, os.path.join(out, "reference", "gradients_fp64.safetensors"),
              metadata={"loss": repr(loss64.item()), "dtype": "float64"})

    trained = copy.deepcopy(model)
    losses_fp32 = adamw_losses(trained, batch, args)
    trained.save_pretrained(os.path.join(out, "reference", "after_adamw"), safe_serialization=True)
    losses_fp64 = adamw_losses(copy.deepcopy(model).to(torch.float64), batch, args)

    expected = {
        "family": args.family,
        "seed": args.seed,
        "tied": args.tied,
        "rope_scaling": args.rope_scaling,
        "attention": args.attention,
        "save_dtype": args.save_dtype,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "loss_tokens": int((batch["targets"] != IGNORE_INDEX).sum()),
        "loss_fp32": loss_fp32,
        "loss_fp64": loss64.item(),
        "gradients": "reference/gradients_fp64.safetensors",
        "adamw": {"lr": args.lr, "betas": [args.beta1, args.beta2], "eps": args.eps, "weight_decay": args.weight_decay,
                  "decay_on": args.decay_on, "clip_grad_norm": args.clip_grad_norm, "steps": args.steps,
                  "losses_fp32": losses_fp32, "losses_fp64": losses_fp64, "weights_fp32": "reference/after_adamw"},
        "conventions": conventions(),
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(f"{args.family} ({'tied' if args.tied else 'untied'}, rope scaling {args.rope_scaling}, {args.attention} "
          f"attention) in {out}: loss fp32 {loss_fp32:.9g} fp64 {loss64.item():.12g}; "
          f"AdamW losses fp32 {[f'{x:.7g}' for x in losses_fp32]}")


# ---------------------------------------------------------------------------------------------
# Loading: check-load and logits


def load_strict(directory, dtype):
    """AutoModelForCausalLM.from_pretrained with every load problem an error. dtype is a torch
    dtype or "auto" (the checkpoint's, so checking an 8B bf16 export needs 16 GB, not 32)."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        fail(f"{directory}: no config.json")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True, torch_dtype=dtype,
                                                           local_files_only=True)
    except Exception as error:  # noqa: BLE001 - report any load failure with the directory
        fail(f"{directory}: AutoModelForCausalLM.from_pretrained failed: {type(error).__name__}: {error}")
    problems = {key: info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    problems = {key: list(value) for key, value in problems.items() if value}
    return model.eval(), problems


def check_load(directory):
    """Loads directory strictly and checks its tokenizer fits the model; returns the problems."""
    model, problems = load_strict(directory, "auto")
    count = sum(p.numel() for p in model.parameters())
    print(f"{directory}: {type(model).__name__}, {count} parameters, tied {model.config.tie_word_embeddings}")
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
        if len(tokenizer) > model.config.vocab_size:
            problems["tokenizer"] = [f"{len(tokenizer)} ids for a model vocabulary of {model.config.vocab_size}"]
        print(f"{directory}: tokenizer with {len(tokenizer)} ids")
    for key, values in problems.items():
        print(f"{directory}: {key}: {values}", file=sys.stderr)
    return problems


def command_check_load(args):
    failed = [directory for directory in args.directories if check_load(directory)]
    if failed:
        fail(f"{', '.join(failed)} did not load cleanly (above)")


def parse_tokens(text):
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--tokens {text!r}: expected comma-separated integers")
    if not tokens:
        raise SystemExit("--tokens: no tokens")
    return torch.tensor([tokens])


def logits_of(directory, tokens):
    model, problems = load_strict(directory, torch.float32)
    if problems:
        fail(f"{directory} does not load cleanly: {problems}")
    if int(tokens.max()) >= model.config.vocab_size or int(tokens.min()) < 0:
        fail(f"--tokens: ids must be in [0, {model.config.vocab_size}) for {directory}")
    with torch.no_grad():
        return model(input_ids=tokens).logits[0].to(torch.float64)


def command_logits(args):
    tokens = parse_tokens(args.tokens)
    logits = logits_of(args.model, tokens)
    report = {"model": args.model, "tokens": tokens[0].tolist(), "shape": list(logits.shape),
              "mean": logits.mean().item(), "std": logits.std().item(), "max_abs": logits.abs().max().item(),
              "argmax": logits.argmax(dim=-1).tolist(), "first": logits[0, :5].tolist()}
    if args.compare_with:
        other = logits_of(args.compare_with, tokens)
        if other.shape != logits.shape:
            fail(f"logits of {args.model} are {list(logits.shape)}, of {args.compare_with} {list(other.shape)}")
        difference = (logits - other).abs().max().item()
        report |= {"compare_with": args.compare_with, "max_abs_diff": difference,
                   "max_rel_diff": difference / max(other.abs().max().item(), 1e-30),
                   "same_argmax": bool((logits.argmax(-1) == other.argmax(-1)).all())}
    print(json.dumps(report))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    if args.tolerance is not None:
        if not args.compare_with:
            raise SystemExit("--tolerance needs --compare-with")
        if report["max_rel_diff"] > args.tolerance:
            fail(f"logits differ: max rel diff {report['max_rel_diff']:.3g} > {args.tolerance:g}")


def read_batch(path):
    with open(path) as f:
        batch = json.load(f)
    return {key: torch.tensor(batch[key]) for key in ("input_ids", "labels", "targets", "position_ids")}, batch["attention"]


def command_loss(args):
    """The batch loss of a checkpoint (a Strata export, say), by this script's conventions."""
    batch, attention = read_batch(args.batch)
    model, problems = load_strict(args.model, torch.float32)
    if problems:
        fail(f"{args.model} does not load cleanly: {problems}")
    with torch.no_grad():
        report = {"model": args.model, "batch": args.batch, "attention": attention,
                  "loss_fp32": transformers_loss(model, batch, attention).item(),
                  "loss_fp64": batch_loss(model.to(torch.float64), batch, attention).item()}
    print(json.dumps(report))


def command_compare_weights(args):
    """Every parameter of two checkpoints, by name: max abs difference and ||a - b|| / ||b||."""
    a, problems_a = load_strict(args.model, torch.float32)
    b, problems_b = load_strict(args.reference, torch.float32)
    if problems_a or problems_b:
        fail(f"does not load cleanly: {args.model}: {problems_a}, {args.reference}: {problems_b}")
    params_a, params_b = dict(a.named_parameters()), dict(b.named_parameters())
    if params_a.keys() != params_b.keys():
        fail(f"different parameters: only in {args.model}: {sorted(params_a.keys() - params_b.keys())}, "
             f"only in {args.reference}: {sorted(params_b.keys() - params_a.keys())}")
    tensors = {}
    for name, reference in params_b.items():
        difference = (params_a[name].detach().double() - reference.detach().double())
        if difference.shape != reference.shape:
            fail(f"{name}: shape {list(params_a[name].shape)} against {list(reference.shape)}")
        tensors[name] = {"max_abs_diff": difference.abs().max().item(),
                         "rel_l2": (difference.norm() / max(reference.detach().double().norm().item(), 1e-30)).item()}
    worst = max(tensors, key=lambda name: tensors[name]["rel_l2"])
    report = {"model": args.model, "reference": args.reference, "worst": worst, "worst_rel_l2": tensors[worst]["rel_l2"],
              "max_abs_diff": max(t["max_abs_diff"] for t in tensors.values()), "tensors": tensors}
    print(json.dumps(report))
    if args.tolerance is not None and report["worst_rel_l2"] > args.tolerance:
        fail(f"weights differ: {worst} has ||a - b|| / ||b|| = {report['worst_rel_l2']:.3g} > {args.tolerance:g}")


# ---------------------------------------------------------------------------------------------
# make-random (scripts/make-random-llama)


def fill_random(model, seed, init_std):
    """Fills every parameter in place, in its own dtype, tensor by tensor: N(0, init_std^2) for
    matrices, ones for norm gains, zeros for biases. No fp32 copy of the model exists."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, init_std, generator=generator)
            elif name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.zero_()


def command_make_random(args):
    fields = dict(PRESETS[args.preset], initializer_range=args.init_std, torch_dtype=args.dtype_name)
    tokenizer = tiny_tokenizer_for(fields["vocab_size"]) if args.tokenizer == "tiny" else None
    if tokenizer is not None:  # the config names the tokens the shipped tokenizer has
        fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = LlamaConfig(**fields)
    dtype = DTYPES[args.dtype]
    # Parameters are created in the target dtype (the default dtype during construction) and
    # transformers' and torch's initializers are skipped: fill_random writes each tensor once.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with transformers.modeling_utils.no_init_weights():
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    fill_random(model, args.seed, args.init_std)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True, max_shard_size=args.shard_mib * 2**20)
    if tokenizer is not None:
        tokenizer.save_pretrained(args.out)
    count = sum(p.numel() for p in model.parameters())
    shards = sorted(f for f in os.listdir(args.out) if f.endswith(".safetensors"))
    print(f"{args.preset}: {count} parameters in {args.dtype}, {len(shards)} shard(s) in {args.out}")


# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser("make-tiny", help="a tiny random model, its batch and the reference numbers")
    tiny.add_argument("--family", choices=sorted(FAMILIES), required=True)
    tying = tiny.add_mutually_exclusive_group()
    tying.add_argument("--tied", dest="tied", action="store_true", help="lm_head shares embed_tokens (the default)")
    tying.add_argument("--untied", dest="tied", action="store_false")
    tiny.set_defaults(tied=True)
    tiny.add_argument("--rope-scaling", choices=list(ROPE_SCALINGS), default="none", help="llama only")
    tiny.add_argument("--llama-biases", choices=["none", "attention", "attention-mlp"], default="none",
                      help="llama's attention_bias / mlp_bias (qwen2 always has q/k/v biases)")
    tiny.add_argument("--attention", choices=["causal", "document"], default="causal")
    tiny.add_argument("--seed", type=int, required=True)
    tiny.add_argument("--save-dtype", choices=sorted(DTYPES), default="fp32",
                      help="the checkpoint's dtype; the reference computes in fp32 from the saved (rounded) values")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--init-std", type=float, default=0.1,
                      help="weights' std; 0.1 (not transformers' 0.02) so attention is far from uniform")
    tiny.add_argument("--batch-size", type=int, default=3)
    tiny.add_argument("--seq-len", type=int, default=24)
    tiny.add_argument("--steps", type=int, default=3)
    tiny.add_argument("--lr", type=float, default=3e-3)
    tiny.add_argument("--beta1", type=float, default=0.9)
    tiny.add_argument("--beta2", type=float, default=0.95)
    tiny.add_argument("--eps", type=float, default=1e-8)
    tiny.add_argument("--weight-decay", type=float, default=0.1)
    tiny.add_argument("--decay-on", choices=["matrices", "all"], default="matrices")
    tiny.add_argument("--clip-grad-norm", type=float, default=None)

    logits = commands.add_parser("logits", help="logits of a model, or the difference between two")
    logits.add_argument("--model", required=True)
    logits.add_argument("--tokens", required=True, help="comma-separated token ids")
    logits.add_argument("--compare-with")
    logits.add_argument("--tolerance", type=float, help="fail when max_rel_diff exceeds this")
    logits.add_argument("--report", help="also write the JSON report here")

    loss = commands.add_parser("loss", help="a checkpoint's loss on a make-tiny batch.json")
    loss.add_argument("--model", required=True)
    loss.add_argument("--batch", required=True, help="batch.json written by make-tiny")

    weights = commands.add_parser("compare-weights", help="two checkpoints' parameters, tensor by tensor")
    weights.add_argument("--model", required=True)
    weights.add_argument("--reference", required=True)
    weights.add_argument("--tolerance", type=float, help="fail when some tensor's ||a - b|| / ||b|| exceeds this")

    check = commands.add_parser("check-load", help="load strictly; non-zero on missing/unexpected keys")
    check.add_argument("directories", nargs="+", metavar="DIR")

    random = commands.add_parser("make-random", help="a random checkpoint of a real shape (scripts/make-random-llama)")
    random.add_argument("--out", required=True)
    random.add_argument("--preset", choices=sorted(PRESETS), default="llama-1b")
    random.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    random.add_argument("--shard-mib", type=int, default=1024, help="max_shard_size of save_pretrained, MiB")
    random.add_argument("--seed", type=int, default=0)
    random.add_argument("--init-std", type=float, default=0.02)
    random.add_argument("--tokenizer", choices=["tiny", "none"], default="tiny",
                        help="write a tiny byte-level BPE tokenizer made here (ids < 512)")
    args = parser.parse_args(argv)
    if args.command == "make-tiny" and (args.steps < 0 or args.batch_size < 1):
        parser.error("--steps must be >= 0 and --batch-size >= 1")
    if args.command == "make-random":
        if args.shard_mib < 1:
            parser.error("--shard-mib must be >= 1")
        args.dtype_name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    return args


def main(argv):
    args = parse_args(argv)
    if args.command != "make-random":
        # The tests' commands compute tiny models in fp64 with one thread: CTest runs two
        # tests at once on two cores, where PyTorch's OpenMP pool waits a scheduler slice at
        # every parallel op. make-random (scripts/make-random-llama) keeps every core.
        torch.set_num_threads(1)
    {"make-tiny": command_make_tiny, "logits": command_logits, "check-load": command_check_load,
     "loss": command_loss, "compare-weights": command_compare_weights, "make-random": command_make_random}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
