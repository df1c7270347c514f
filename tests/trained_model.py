"""The trained byte-level Llama in tests/data/stdlib_llama/ and a harness that measures
what a compile option costs in accuracy (issue 14): held-out perplexity, next-token
(top-1) agreement with fp32, and greedy-decoding agreement.

Random-init weights give near-uniform logits, where quantization error hides; this
model has learned Python source, so its argmaxes are confident and its perplexity means
something. Tokens are bytes (id = byte value, vocab 256): no tokenizer is needed to make
data, and any text is in vocabulary. How it was made: docs/trained-model.md and
bench/train_stdlib_llama.py (which imports the corpus helpers below).

The held-out text ships with the model (`heldout.bin`, bytes of stdlib files the model
never trained on), so figures do not depend on the Python version the tests run under.
"""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).resolve().parent / "data" / "stdlib_llama"
HELDOUT_FILE = "heldout.bin"
META_FILE = "training.json"
# Tests, data files and third-party packages are not "the standard library's sources": test
# files hold long generated literals and odd encodings that teach little.
SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test"})
HELDOUT_EVERY = 20  # every 20th file (by sorted path) is held out, whole: its text is unseen
HELDOUT_CHUNK = 4096  # the shipped sample: chunks this long, evenly spaced over the held-out text
HELDOUT_CHUNKS = 16
# The check the tests repeat (training.json records its value): HF perplexity over these windows.
CHECK_SEQ, CHECK_WINDOWS = 128, 16
FP32: dict[str, Any] = {"precision_mode": "must_keep_origin_dtype"}


def stdlib_llama_dir() -> Path:
    return DATA


def training_meta() -> dict[str, Any]:
    return dict(json.loads((DATA / META_FILE).read_text()))


# -- the corpus (used by bench/train_stdlib_llama.py to train, and to cut heldout.bin) --

def stdlib_files(root: Path | None = None) -> list[Path]:
    """The running interpreter's standard-library .py files, relative to `root`, sorted."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    return sorted(p.relative_to(root) for p in root.rglob("*.py")
                  if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(root).parts))


def split_files(files: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """(train, held-out): by file, so no held-out line was seen in training."""
    held = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_EVERY // 2]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


def files_hash(root: Path, files: Sequence[Path]) -> str:
    """SHA-256 over each file's relative path and bytes: names the exact corpus."""
    h = hashlib.sha256()
    for f in files:
        data = (root / f).read_bytes()
        h.update(f.as_posix().encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def read_corpus(root: Path, files: Sequence[Path]) -> bytes:
    return b"".join((root / f).read_bytes() for f in files)


def heldout_sample(text: bytes) -> bytes:
    """HELDOUT_CHUNKS chunks of HELDOUT_CHUNK bytes, evenly spaced over the held-out text
    (the start of one file would be a narrow sample of it)."""
    step = (len(text) - HELDOUT_CHUNK) // (HELDOUT_CHUNKS - 1)
    return b"".join(text[i * step:i * step + HELDOUT_CHUNK] for i in range(HELDOUT_CHUNKS))


# -- held-out data --

def heldout_tokens(n_tokens: int | None = None) -> torch.Tensor:
    """The first `n_tokens` bytes of the shipped held-out sample as int64 ids (all by default)."""
    data = (DATA / HELDOUT_FILE).read_bytes()
    if n_tokens is not None and n_tokens > len(data):
        raise ValueError(f"the held-out sample has {len(data)} tokens, {n_tokens} asked for")
    return torch.frombuffer(bytearray(data[:n_tokens]), dtype=torch.uint8).long()


def heldout_windows(seq: int, count: int | None = None) -> torch.Tensor:
    """[count, seq] windows of the held-out sample, evenly spaced over it (all by default).
    A `seq` dividing HELDOUT_CHUNK keeps every window inside one chunk."""
    return windows_of(heldout_tokens(), seq, count)


def windows_of(tokens: torch.Tensor, seq: int, count: int | None = None) -> torch.Tensor:
    all_windows = tokens[:len(tokens) // seq * seq].reshape(-1, seq)
    if count is None or count >= len(all_windows):
        return all_windows
    return all_windows[torch.arange(count) * (len(all_windows) // count)]


def heldout_prompts(count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` bytes, each the start of an evenly spaced held-out window."""
    return [w[:length].tolist() for w in heldout_windows(length * 2, count)]


# -- logits and the measures on them --

def logits_hf(model_dir: str | Path, windows: torch.Tensor) -> torch.Tensor:
    """[W, S, vocab] fp32 logits of HF's eager model on each window (one at a time, as the .om runs)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    with torch.no_grad():
        return torch.cat([model(w[None], use_cache=False).logits.float() for w in windows])


def logits_om(om_path: str | Path, windows: torch.Tensor) -> torch.Tensor:
    """The same through an npuc .om compiled at --input_shape input_ids:1,S (no --max_seq_len:
    one program, logits of every row)."""
    from npuc.runtime import Session

    sess = Session.load(str(om_path))
    return torch.cat([sess.run({"input_ids": w[None]})["logits"].float() for w in windows])


def perplexity(logits: torch.Tensor, windows: torch.Tensor) -> float:
    """exp(mean cross-entropy) of each row predicting the next byte of its window."""
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             windows[:, 1:].reshape(-1))
    return math.exp(float(loss))


def perplexity_hf(model_dir: str | Path, windows: torch.Tensor) -> float:
    return perplexity(logits_hf(model_dir, windows), windows)


def perplexity_om(om_path: str | Path, windows: torch.Tensor) -> float:
    return perplexity(logits_om(om_path, windows), windows)


def top1_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of positions where both logits pick the same next token."""
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


@dataclass(frozen=True)
class Greedy:
    leading: list[int]  # per prompt: how many leading generated tokens agree
    n_tokens: int

    @property
    def all_rate(self) -> float:
        """The share of prompts whose n_tokens all agree."""
        return sum(n == self.n_tokens for n in self.leading) / len(self.leading)


def greedy_tokens(model: str | Path, prompts: Sequence[Sequence[int]], n_tokens: int) -> list[list[int]]:
    """Greedy continuations by an .om compiled with --max_seq_len, or by an HF folder."""
    if str(model).endswith(".om"):
        from npuc.apps.generate import generate
        from npuc.runtime import Session

        sess = Session.load(str(model))
        return [generate(sess, list(p), n_tokens, ignore_eos=True) for p in prompts]
    import transformers
    from hf_models import hf_greedy

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), attn_implementation="eager").eval()
    return [hf_greedy(hf, list(p), n_tokens) for p in prompts]


def leading_agreement(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def greedy_agreement(a: str | Path, b: str | Path, prompts: Sequence[Sequence[int]], n_tokens: int = 32) -> Greedy:
    """Greedy decoding of `a` against `b` (each an .om with --max_seq_len, or an HF folder)."""
    ta, tb = greedy_tokens(a, prompts, n_tokens), greedy_tokens(b, prompts, n_tokens)
    return Greedy([leading_agreement(x, y) for x, y in zip(ta, tb, strict=True)], n_tokens)


# -- the table --

@dataclass(frozen=True)
class Row:
    config: str
    perplexity: float
    ratio: float  # to the fp32 .om's
    top1: float  # next-token argmax agreement with the fp32 .om over the held-out windows
    greedy: Greedy  # against the fp32 .om's greedy continuations


def label(options: Mapping[str, Any]) -> str:
    shown = {k: v for k, v in options.items() if (k, v) not in FP32.items()}
    return ", ".join(f"{k}={v}" for k, v in shown.items()) or "fp32"


@dataclass(frozen=True)
class Harness:
    """Compiles the shipped model under compile options and measures each against fp32.
    `seq`: the prefill length for perplexity and top-1 (over `windows` held-out windows);
    greedy runs `prompts` held-out prompts of `prompt_len` bytes for `n_tokens` tokens."""
    work: Path
    seq: int = 128
    windows: int = 16
    prompts: int = 8
    prompt_len: int = 32
    n_tokens: int = 32
    soc_version: str = "cpu"

    def compile(self, options: Mapping[str, Any], generate: bool = False) -> Path:
        """The .om for `options`: one prefill program at `seq` rows, or (`generate`)
        prefill + decode over a cache of prompt_len + n_tokens positions. Options pass
        through to compile_model, so ones it learns later (quant_type) need nothing here."""
        from npuc.compiler.driver import compile_model

        name = hashlib.sha256(json.dumps([sorted(options.items()), generate], default=str).encode()).hexdigest()[:12]
        out = self.work / f"{'gen' if generate else 'ppl'}_{name}"
        if not out.with_suffix(".om").exists():
            shape = f"input_ids:1,{self.prompt_len if generate else self.seq}"
            extra = {"max_seq_len": self.prompt_len + self.n_tokens} if generate else {}
            compile_model(str(DATA), input_shape=shape, output=str(out), soc_version=self.soc_version,
                          **{**extra, **options})
        return out.with_suffix(".om")

    def data(self) -> tuple[torch.Tensor, list[list[int]]]:
        return heldout_windows(self.seq, self.windows), heldout_prompts(self.prompts, self.prompt_len)

    def table(self, configs: Sequence[Mapping[str, Any]]) -> list[Row]:
        windows, prompts = self.data()
        ref_logits = logits_om(self.compile(FP32), windows)
        ref_ppl = perplexity(ref_logits, windows)
        ref_tokens = greedy_tokens(self.compile(FP32, generate=True), prompts, self.n_tokens)
        rows = []
        for options in configs:
            got = logits_om(self.compile(options), windows)
            tokens = greedy_tokens(self.compile(options, generate=True), prompts, self.n_tokens)
            ppl = perplexity(got, windows)
            rows.append(Row(label(options), ppl, ppl / ref_ppl, top1_agreement(got, ref_logits),
                            Greedy([leading_agreement(t, r) for t, r in zip(tokens, ref_tokens, strict=True)],
                                   self.n_tokens)))
        return rows


def accuracy_table(configs: Sequence[Mapping[str, Any]], work: str | Path, **harness: Any) -> list[Row]:
    """Rows of perplexity, its ratio to fp32, top-1 and greedy agreement with fp32, one per
    set of compile options (e.g. {"precision_mode": "allow_mix_precision_bf16"},
    {"quant_type": "w4a16", "group_size": 32}); `harness` sets Harness's fields."""
    return Harness(Path(work), **harness).table(configs)


def format_table(rows: Sequence[Row]) -> str:
    """A Markdown table of `rows`."""
    lines = ["| config | held-out perplexity | ratio to fp32 | top-1 agreement | greedy: all tokens agree "
             "| greedy: mean leading agreement |", "|---|---|---|---|---|---|"]
    for r in rows:
        g = r.greedy
        lines.append(f"| {r.config} | {r.perplexity:.4f} | {r.ratio:.5f} | {r.top1:.2%} | {g.all_rate:.0%} "
                     f"({sum(n == g.n_tokens for n in g.leading)}/{len(g.leading)}) "
                     f"| {sum(g.leading) / len(g.leading):.1f}/{g.n_tokens} |")
    return "\n".join(lines)


# The rows docs/trained-model.md reports; the quantized ones wait for compile_model's quant_type (issue 14).
TABLE_CONFIGS: list[dict[str, Any]] = [
    FP32, {"precision_mode": "allow_mix_precision_bf16"}, {"quant_type": "w8a16"},
    {"quant_type": "w4a16", "group_size": 128}, {"quant_type": "w4a16", "group_size": 32},
    {"quant_type": "w8a8"}, {"quant_type": "w4a8", "group_size": 32}]


def main() -> None:
    """python tests/trained_model.py [--seq 256 --windows 256 --prompts 16]: the docs' table."""
    import argparse
    import inspect
    import tempfile

    from npuc.compiler.driver import compile_model

    ap = argparse.ArgumentParser(description=main.__doc__)
    for name, default in (("seq", 256), ("windows", 256), ("prompts", 16), ("prompt_len", 32), ("n_tokens", 32)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--soc_version", default="cpu")
    args = ap.parse_args()
    known = inspect.signature(compile_model).parameters
    ready = [c for c in TABLE_CONFIGS if set(c) <= set(known)]
    with tempfile.TemporaryDirectory() as work:
        print(format_table(Harness(Path(work), **vars(args)).table(ready)))
    for c in TABLE_CONFIGS:
        if c not in ready:
            print(f"| {label(c)} | pending: issue 14 quantization | | | | |")


if __name__ == "__main__":
    main()
