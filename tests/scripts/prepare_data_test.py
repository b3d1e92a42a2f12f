#!/usr/bin/env python3
"""scripts/prepare-data on tiny JSONL with a tiny word-level tokenizer trained here, offline.

Reads each written file back byte by byte (docs/data.md) and checks the tokens, the loss
and document-start flags and the position ids they imply, for prompt/completion,
messages through a chat template, and text; packed and padded; uint16 and uint32; and
the errors for malformed input. Runs with the reference venv's interpreter
(build/ref-venv, made by scripts/reference-venv; STRATA_REF_PYTHON overrides it) and
exits 77 (skipped) naming what is missing when there is none, or when it lacks jinja2
(transformers' chat templates need it; transformers does not install it).
"""
import contextlib
import importlib.machinery
import importlib.util
import io
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SOURCE_DIR = Path(os.environ.get("STRATA_SOURCE_DIR", Path(__file__).resolve().parents[2]))
PREPARE_DATA = SOURCE_DIR / "scripts" / "prepare-data"
SKIP = 77


def ensure_interpreter():
    """Runs on with an interpreter that has tokenizers, transformers and jinja2 (found
    without importing them: transformers takes seconds to import)."""
    have = {name: importlib.util.find_spec(name) is not None for name in ("tokenizers", "transformers", "jinja2")}
    if have["tokenizers"] and have["transformers"]:
        if not have["jinja2"]:
            # transformers renders chat templates with jinja2 but does not install it.
            print(f"SKIP: {sys.executable} has transformers but not jinja2, which its chat templates need "
                  "(pip install jinja2 into the reference venv, or apt-get install python3-jinja2)")
            sys.exit(SKIP)
        return
    venv_python = Path(os.environ.get("STRATA_REF_PYTHON", SOURCE_DIR / "build" / "ref-venv" / "bin" / "python"))
    if venv_python.exists() and os.environ.get("STRATA_PREPARE_DATA_TEST_REEXEC") != "1":
        os.environ["STRATA_PREPARE_DATA_TEST_REEXEC"] = "1"
        os.execv(str(venv_python), [str(venv_python), str(Path(__file__).resolve()), *sys.argv[1:]])
    print(f"SKIP: {sys.executable} lacks tokenizers/transformers and there is no reference venv at {venv_python} "
          "(run scripts/reference-venv)")
    sys.exit(SKIP)


ensure_interpreter()

from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers  # noqa: E402


def load_prepare_data():
    """scripts/prepare-data as a module, to run in this process (importing transformers once
    for all cases rather than once per run)."""
    loader = importlib.machinery.SourceFileLoader("prepare_data", str(PREPARE_DATA))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("prepare_data", loader))
    loader.exec_module(module)
    return module


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SENTENCES = ["the cat sat on the mat", "what is two plus two ? four", "hello there , how are you ? fine thanks",
             "be brief", "say hi hi"]
# The tiny model's chat format: BOS, then per message "<|role|> content <|end|> ".
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")
T, D = 1, 2  # flags: loss target, document start


def make_tokenizer(directory: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=SPECIAL))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
              "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer


def read_token_file(path: Path):
    data = path.read_bytes()
    header = struct.unpack_from("<256i", data, 0)
    width = {(20240520, 2): 2, (20240801, 8): 4}[(header[0], header[1])]
    count = header[2]
    assert len(data) == 1024 + count * width + count, (len(data), count, width)
    tokens = list(struct.unpack_from(f"<{count}{'H' if width == 2 else 'I'}", data, 1024))
    flags = list(data[1024 + count * width:])
    assert all(h == 0 for h in header[7:]), "reserved header ints"
    assert header[5] == sum(f & T for f in flags) and header[6] == sum(1 for f in flags if f & D)
    return {"magic": header[0], "version": header[1], "row_length": header[3], "pad": header[4], "tokens": tokens, "flags": flags}


def rows_of(values, row_length):
    return [values[i:i + row_length] for i in range(0, len(values), row_length)]


def positions(flags):
    """The loader's rule (docs/data.md): 0 at a row's first token and at each document start, else + 1."""
    out, position = [], 0
    for index, f in enumerate(flags):
        position = 0 if index == 0 or f & D else position + 1
        out.append(position)
    return out


class PrepareDataTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        base = os.environ.get("STRATA_TEST_TMPDIR")
        if base:
            Path(base).mkdir(parents=True, exist_ok=True)
        cls.tmp = tempfile.TemporaryDirectory(dir=base)
        cls.dir = Path(cls.tmp.name)
        cls.tokenizer = make_tokenizer(cls.dir / "model")
        cls.prepare_data = load_prepare_data()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def ids(self, text):
        return [self.tokenizer.token_to_id(word) for word in text.split()]

    def run_prepare(self, lines, *options, name="input.jsonl", model="model"):
        source = self.dir / name
        source.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
        out = self.dir / (name + ".bin")
        argv = ["--tokenizer", str(self.dir / model), "--out", str(out), *options, str(source)]
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = self.prepare_data.main(argv)
            except SystemExit as exit_:  # argparse
                code = exit_.code
        return Result(code, stdout.getvalue(), stderr.getvalue()), out

    def prepare(self, lines, *options, model="model"):
        result, out = self.run_prepare(lines, *options, model=model)
        self.assertEqual(result.returncode, 0, result.stderr)
        summary = json.loads(result.stdout.strip().splitlines()[-1])["prepare_data"]
        return read_token_file(out), summary

    def test_prompt_completion_padded_rows_target_only_the_completion(self):
        data, summary = self.prepare([{"prompt": "what is two plus two ?", "completion": "four"},
                                      {"prompt": "say hi", "completion": "hi hi"}], "--seq-len", "9", "--pad", "--eos")
        self.assertEqual((data["magic"], data["version"], data["row_length"]), (20240520, 2, 10))
        pad, eos = self.ids("<pad> </s>")
        self.assertEqual(data["pad"], pad)
        rows = rows_of(data["tokens"], 10)
        self.assertEqual(rows, [self.ids("<s> what is two plus two ? four </s>") + [pad],
                                self.ids("<s> say hi hi hi </s>") + [pad] * 4])
        flags = rows_of(data["flags"], 10)
        self.assertEqual(flags, [[D, 0, 0, 0, 0, 0, 0, T, T, 0], [D, 0, 0, T, T, T, 0, 0, 0, 0]])
        # Padding continues the example's positions (right padding, as transformers counts it).
        self.assertEqual([positions(f) for f in flags], [list(range(10)), list(range(10))])
        self.assertEqual((summary["rows"], summary["targets"], summary["padding"], summary["prompt/completion"]), (2, 5, 5, 2))

    def test_messages_target_the_assistant_turns_through_the_chat_template(self):
        conversation = {"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "what is two plus two ?"},
                                     {"role": "assistant", "content": "four"},
                                     {"role": "user", "content": "say hi"},
                                     {"role": "assistant", "content": "hi hi"}]}
        data, summary = self.prepare([conversation], "--seq-len", "31", "--pad")
        expected = ("<s> <|system|> be brief <|end|> <|user|> what is two plus two ? <|end|> <|assistant|> four <|end|> "
                    "<|user|> say hi <|end|> <|assistant|> hi hi <|end|>")
        tokens = self.ids(expected)
        self.assertEqual(data["tokens"][:len(tokens)], tokens)
        targets = [i for i, f in enumerate(data["flags"]) if f & T]
        words = expected.split()
        self.assertEqual([words[i] for i in targets], ["four", "<|end|>", "hi", "hi", "<|end|>"])
        self.assertEqual(data["flags"][0], D)
        self.assertEqual(summary["messages"], 1)

    def test_a_byte_level_token_that_begins_with_the_prompts_space_is_a_target(self):
        # Byte-level BPE puts the space the generation prompt ends with ("<|assistant|> ")
        # into the assistant's first token ("Ġfour").
        model = self.dir / "byte_level"
        model.mkdir()
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.train_from_iterator(SENTENCES * 20, trainers.BpeTrainer(special_tokens=SPECIAL,
                                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        bpe.save(str(model / "tokenizer.json"))
        (model / "tokenizer_config.json").write_text((self.dir / "model" / "tokenizer_config.json").read_text())
        self.assertIsNotNone(bpe.token_to_id("Ġfour"))
        conversation = {"messages": [{"role": "user", "content": "what is two plus two ?"}, {"role": "assistant", "content": "four"}]}
        data, _ = self.prepare([conversation], "--seq-len", "40", "--pad", model="byte_level")
        targets = [bpe.id_to_token(token) for token, f in zip(data["tokens"], data["flags"]) if f & T]
        self.assertEqual(targets, ["Ġfour", "Ġ", "<|end|>", "Ġ"])

    def test_packed_rows_hold_whole_examples_and_positions_restart_at_each(self):
        lines = [{"text": "the cat sat"}, {"prompt": "say", "completion": "hi"}, {"text": "hello there , how are you ?"},
                 {"text": "be brief"}]
        data, summary = self.prepare(lines, "--seq-len", "7", "--pack")
        pad = self.ids("<pad>")[0]
        self.assertEqual(rows_of(data["tokens"], 8), [self.ids("<s> the cat sat <s> say hi") + [pad],
                                                      self.ids("<s> hello there , how are you ?"),
                                                      self.ids("<s> be brief") + [pad] * 5])
        flags = rows_of(data["flags"], 8)
        self.assertEqual(flags, [[D, T, T, T, D, 0, T, 0], [D, T, T, T, T, T, T, T], [D, T, T, 0, 0, 0, 0, 0]])
        self.assertEqual([positions(f) for f in flags], [[0, 1, 2, 3, 0, 1, 2, 3], list(range(8)), list(range(8))])
        self.assertEqual((summary["rows"], summary["text"], summary["prompt/completion"]), (3, 3, 1))

    def test_long_examples_are_cut_and_ones_without_loss_dropped(self):
        lines = [{"text": "the cat sat on the mat the cat sat"}, {"prompt": "what is two plus two ?", "completion": "four"},
                 {"prompt": "be", "completion": "brief"}]
        data, summary = self.prepare(lines, "--seq-len", "4", "--pad")
        # The second example's completion falls past its row: cut, no target left, dropped.
        self.assertEqual(rows_of(data["tokens"], 5), [self.ids("<s> the cat sat on"), self.ids("<s> be brief") + [0, 0]])
        self.assertEqual((summary["truncated"], summary["dropped_no_loss"], summary["rows"]), (2, 1, 2))

    def test_a_vocabulary_past_uint16_writes_uint32_tokens(self):
        data, _ = self.prepare([{"text": "hello there"}], "--seq-len", "3", "--pad", "--vocab-size", "70000")
        self.assertEqual((data["magic"], data["version"]), (20240801, 8))
        self.assertEqual(data["tokens"], self.ids("<s> hello there <pad>"))

    def test_malformed_lines_are_refused_naming_the_line(self):
        cases = [
            (['{"text": "the cat"}', '{"text": "the cat"', ''], "input.jsonl:2: not valid JSON"),
            (['[1, 2]'], "input.jsonl:1: expected a JSON object, got list"),
            ([{"text": "hi"}, {"title": "x"}], "input.jsonl:2: expected {\"prompt\", \"completion\"}"),
            ([{"prompt": "say"}], "input.jsonl:1: \"completion\" must be a string, got NoneType"),
            ([{"messages": [{"role": "user", "content": "hi"}]}], "input.jsonl:1: the conversation has no assistant message"),
            ([{"messages": [{"role": "user"}]}], "input.jsonl:1: messages[0] must be an object with string \"role\" and \"content\""),
            ([{"text": "the cat"}, {"text": "hello there"}], "input.jsonl:2: token 1 is id"),
        ]
        for lines, expected in cases:
            with self.subTest(expected=expected):
                options = ["--seq-len", "8", "--pad"]
                if "token 1 is id" in expected:
                    # A model vocabulary that holds "the cat" but not "hello".
                    bound = max(self.ids("<s> the cat")) + 1
                    self.assertGreater(self.ids("hello")[0], bound - 1)
                    options += ["--vocab-size", str(bound)]
                result, out = self.run_prepare(lines, *options, name="input.jsonl")
                self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
                self.assertIn(expected, result.stderr)
                out.unlink(missing_ok=True)


def write_fixture(directory: Path) -> int:
    """For tests/examples/prepare_data_reader_test.cpp: scripts/prepare-data run as a command
    writes a packed file of every kind of example to DIR/data.bin and, in DIR/expected.json, each row's inputs, targets and
    position ids by the rules of docs/data.md, which the C++ loader must reproduce."""
    make_tokenizer(directory / "model")
    lines = [{"text": "the cat sat on the mat"}, {"prompt": "what is two plus two ?", "completion": "four"},
             {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi hi"}]},
             {"text": "hello there , how are you ? fine thanks"}, {"prompt": "be", "completion": "brief"}]
    (directory / "input.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    seq_len = 11
    # The command line, end to end (the unit tests above run it in their process).
    result = subprocess.run([sys.executable, str(PREPARE_DATA), "--tokenizer", str(directory / "model"), "--seq-len", str(seq_len),
                             "--pack", "--eos", "--out", str(directory / "data.bin"), str(directory / "input.jsonl")])
    if result.returncode != 0:
        return result.returncode
    data = read_token_file(directory / "data.bin")
    rows = []
    for tokens, flags in zip(rows_of(data["tokens"], seq_len + 1), rows_of(data["flags"], seq_len + 1)):
        rows.append({"inputs": tokens[:-1], "targets": [tokens[t + 1] if flags[t + 1] & T else -1 for t in range(seq_len)],
                     "positions": positions(flags)[:-1]})
    vocab = Tokenizer.from_file(str(directory / "model" / "tokenizer.json")).get_vocab_size()
    (directory / "expected.json").write_text(json.dumps({"seq_len": seq_len, "vocab_size": vocab, "rows": rows}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--fixture":
        sys.exit(write_fixture(Path(sys.argv[2])))
    unittest.main(verbosity=2)
