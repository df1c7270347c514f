"""What each `--kv_cache_dtype` costs in accuracy against an f32 cache (docs/precision.md).

    python bench/kv_cache_accuracy.py [--work DIR] [--contexts 512,1024] [--depths 4096,8192]
        [--greedy-depth 4096] [--parts ppl,depth,greedy]

Three measurements, each against the same model compiled with an f32 cache:

ppl     The trained byte-level Llama (tests/data/stdlib_llama/, trained on 256-token windows,
        max_position_embeddings 512): held-out perplexity at context C (every C-token window
        of the shipped held-out sample). Every token goes through the decode program in steps
        of 64 (`--decode_tokens 64`), from position 0, so every query reads its keys and values
        from the cache, its own included: the cache's rounding reaches every logit. A prefill
        would not do: prefill's attention reads the fresh keys, not the cache.
depth   A random-init Llama (head_dim 64, max_position_embeddings 16384; initializer_range
        0.1, as tests/test_half_kv_cache.py) fed d + 64 random tokens the same way: the
        logits of the last step's 64 rows (depths d..d+63) against the f32 cache's, as the
        largest |difference| over the largest |logit|, and the share of rows whose argmax
        agrees. The trained model has not seen such depths.
greedy  The trained model again: a 4096-byte held-out prompt prefilled (the prefill program),
        then 32 greedy tokens decoded one at a time over the cache at depth 4096..4127, against
        the f32 cache's tokens (leading agreement per prompt). Depth 4096 is 16x the trained
        window: the text it writes is poor, but the question is only whether the cache's dtype
        changes it.

All runs use the torch interpreter (runtime/session.py, with libnpucrt's kernels where they
apply), on the cpu target.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

DTYPES = ("f32", "bf16", "f16", "int8")
CHUNK = 64


def _compile(model: Path, out: Path, **options: Any) -> Path:
    from npuc.compiler.driver import compile_model

    if not out.with_suffix(".om").exists():
        compile_model(str(model), output=str(out), soc_version="cpu", **options)
    return out.with_suffix(".om")


def chunked_logits(sess: Any, tokens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """[n, vocab] f32 logits of one sequence fed from position 0 through the decode program,
    `chunk` tokens a step (the program's --decode_tokens): every row read from the cache."""
    sess.reset_state()
    rows = []
    for i in range(0, tokens.numel(), chunk):
        ids = tokens[i:i + chunk]
        out = sess.run({"input_ids": ids[None], "position": torch.arange(i, i + chunk)[None]}, "decode")
        rows.append(out["logits"].reshape(chunk, -1).float())
    return torch.cat(rows)


def perplexity_rows(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[float, int]:
    """Summed cross-entropy of each row predicting the next token, and the rows counted."""
    loss = torch.nn.functional.cross_entropy(logits[:-1], tokens[1:], reduction="sum")
    return float(loss), tokens.numel() - 1


def part_ppl(work: Path, contexts: list[int]) -> list[dict[str, Any]]:
    from trained_model import heldout_windows, stdlib_llama_dir

    from npuc.runtime import Session

    rows = []
    for ctx in contexts:
        windows = heldout_windows(ctx)
        ref: torch.Tensor | None = None
        ref_ppl = 0.0
        for dt in DTYPES:
            t0 = time.time()
            om = _compile(stdlib_llama_dir(), work / f"ppl_{ctx}_{dt}", input_shape=f"input_ids:1,{CHUNK}",
                          max_seq_len=ctx, decode_tokens=CHUNK, kv_cache_dtype=dt)
            sess = Session.load(str(om))
            loss, n, agree = 0.0, 0, 0
            logits = [chunked_logits(sess, w) for w in windows]
            for w, lg in zip(windows, logits, strict=True):
                s, c = perplexity_rows(lg, w)
                loss, n = loss + s, n + c
            stacked = torch.stack(logits)
            if ref is None:
                ref, ref_ppl = stacked, math.exp(loss / n)
            ppl = math.exp(loss / n)
            agree = float((stacked.argmax(-1) == ref.argmax(-1)).float().mean())
            row = {"context": ctx, "kv_cache_dtype": dt, "windows": len(windows), "tokens": n,
                   "perplexity": ppl, "ratio": ppl / ref_ppl, "top1_vs_f32": agree,
                   "max_logit_err": float((stacked - ref).abs().max()), "seconds": round(time.time() - t0, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _random_llama(work: Path, positions: int) -> Path:
    import transformers as tf

    path = work / f"random_llama_{positions}"
    if not (path / "config.json").exists():
        cfg = tf.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             max_position_embeddings=positions, initializer_range=0.1)
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return path


def part_depth(work: Path, depths: list[int]) -> list[dict[str, Any]]:
    from npuc.runtime import Session

    top = max(depths) + CHUNK
    model = _random_llama(work, top)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (top,), generator=gen)
    rows = []
    ref: dict[int, torch.Tensor] = {}
    for dt in DTYPES:
        t0 = time.time()
        om = _compile(model, work / f"depth_{top}_{dt}", input_shape=f"input_ids:1,{CHUNK}", max_seq_len=top,
                      decode_tokens=CHUNK, kv_cache_dtype=dt)
        sess = Session.load(str(om))
        for d in depths:
            last = chunked_logits(sess, tokens[:d + CHUNK])[d:]  # depths d..d+63
            if dt == "f32":
                ref[d] = last
            err = float((last - ref[d]).abs().max()) / float(ref[d].abs().max())
            row = {"depth": d, "kv_cache_dtype": dt, "rel_max_logit_err": err,
                   "argmax_agree": float((last.argmax(-1) == ref[d].argmax(-1)).float().mean()),
                   "seconds": round(time.time() - t0, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def part_greedy(work: Path, depth: int, prompts: int = 4, new: int = 32) -> list[dict[str, Any]]:
    from trained_model import heldout_tokens, leading_agreement, stdlib_llama_dir

    from npuc.apps.generate import generate
    from npuc.runtime import Session

    data = heldout_tokens()
    step = (data.numel() - depth) // max(prompts - 1, 1)
    texts = [data[i * step:i * step + depth].tolist() for i in range(prompts)]
    ref: list[list[int]] = []
    rows = []
    for dt in DTYPES:
        t0 = time.time()
        om = _compile(stdlib_llama_dir(), work / f"greedy_{depth}_{dt}", input_shape=f"input_ids:1,{depth}",
                      max_seq_len=depth + new + 16, kv_cache_dtype=dt)
        sess = Session.load(str(om))
        out = [generate(sess, p, new, ignore_eos=True) for p in texts]
        if dt == "f32":
            ref = out
        lead = [leading_agreement(a, b) for a, b in zip(out, ref, strict=True)]
        row = {"depth": depth, "kv_cache_dtype": dt, "new_tokens": new, "leading_agreement": lead,
               "all_agree": sum(n == new for n in lead), "prompts": prompts,
               "text": bytes(out[0]).decode("utf-8", "replace"), "seconds": round(time.time() - t0, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=None)
    ap.add_argument("--contexts", default="512,1024")
    ap.add_argument("--depths", default="4096,8192")
    ap.add_argument("--greedy-depth", type=int, default=4096)
    ap.add_argument("--parts", default="ppl,depth,greedy")
    ap.add_argument("--json", default=None, help="write every row here too")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="kv_acc_"))
    work.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    out: dict[str, Any] = {}
    if "ppl" in parts:
        out["ppl"] = part_ppl(work, [int(c) for c in args.contexts.split(",")])
    if "depth" in parts:
        out["depth"] = part_depth(work, [int(d) for d in args.depths.split(",")])
    if "greedy" in parts:
        out["greedy"] = part_greedy(work, args.greedy_depth)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
