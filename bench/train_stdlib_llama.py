"""Train the byte-level Llama shipped in tests/data/stdlib_llama/ (issue 14): trained weights
to measure what quantization costs, which random-init weights hide (docs/trained-model.md).

    python bench/train_stdlib_llama.py                          # the shipped run (2 CPU threads)
    python bench/train_stdlib_llama.py --steps 20 --out /tmp/x  # a smoke check

Corpus: the running interpreter's standard-library .py sources, tests and site-packages
left out, sorted by path; every 20th file is held out whole (tests/trained_model.py has
the split). Tokens are bytes. The model is a transformers LlamaForCausalLM built from a
config (GQA, untied LM head), seeded, trained with AdamW and a warmup-then-cosine
schedule on seeded random windows of the training text. Writes the fp32 safetensors
checkpoint, a byte-level tokenizer (ids = bytes, so `npuc generate --prompt` works), the
held-out sample the tests measure on (heldout.bin) and training.json: the settings, the
loss curve, the final losses and the hashes of the corpus files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import trained_model as tm  # noqa: E402

# ~2.4M parameters: hidden 256 keeps two groups of 128 per row for w4a16 g128, and
# 512 = 4 x 128 for the MLP's down projection.
CONFIG: dict[str, Any] = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def byte_tokenizer() -> Any:
    """A fast tokenizer whose ids are the UTF-8 bytes: GPT-2's byte-to-character map and a
    BPE with no merges, so each byte is one token whose id is the byte's value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=CONFIG["max_position_embeddings"])


def batch(text: torch.Tensor, size: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(text) - seq, (size,), generator=gen)
    return torch.stack([text[s:s + seq] for s in starts.tolist()]).long()


def mean_loss(model: Any, windows: torch.Tensor, chunk: int = 16) -> float:
    with torch.no_grad():
        losses = [math.log(tm.perplexity(model(w, use_cache=False).logits.float(), w)) * len(w)
                  for w in windows.split(chunk)]
    return sum(losses) / len(windows)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    done = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * done))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=tm.DATA)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min_lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight_decay", type=float, default=0.1)
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shape", default=None, metavar="HIDDEN,LAYERS,INTER,HEADS,KV_HEADS",
                    help="another model size on the same data, e.g. 128,1,256,4,2 for a draft model "
                         "(bench/speculative.py --draft); default: the shipped model's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    root = Path(sysconfig.get_paths()["stdlib"])
    train_files, held_files = tm.split_files(tm.stdlib_files(root))
    train_text = tm.read_corpus(root, train_files)
    held_sample = tm.heldout_sample(tm.read_corpus(root, held_files))
    train = torch.frombuffer(bytearray(train_text), dtype=torch.uint8)
    # Same shape of sample from the training text: the train/held-out gap is then like for like.
    train_windows = torch.frombuffer(bytearray(tm.heldout_sample(train_text)), dtype=torch.uint8).long()
    train_windows = train_windows.reshape(-1, args.seq)
    held_windows = torch.frombuffer(bytearray(held_sample), dtype=torch.uint8).long().reshape(-1, args.seq)
    curve_windows = held_windows[:: len(held_windows) // 32]  # cheap enough to watch every eval_every steps
    print(f"corpus: {len(train_files)} train files ({len(train_text):,} bytes), {len(held_files)} held out; "
          f"held-out sample {len(held_sample):,} bytes", flush=True)

    torch.manual_seed(args.seed)
    config = dict(CONFIG)
    if args.shape:
        keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads")
        config.update(zip(keys, (int(v) for v in args.shape.split(",")), strict=True))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters; uniform loss ln 256 = {math.log(256):.3f}", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]  # not the norms' gains
    keep = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": keep, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    curve: list[dict[str, float]] = []
    start, recent = time.perf_counter(), []
    for step in range(args.steps):
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        x = batch(train, args.batch, args.seq, gen)
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            point = {"step": step + 1, "train": sum(recent) / len(recent), "heldout": mean_loss(model, curve_windows),
                     "seconds": time.perf_counter() - start}
            curve.append(point)
            recent = []
            print(f"step {step + 1:5d}  train {point['train']:.3f}  held-out {point['heldout']:.3f}  "
                  f"lr {lr_at(step, args):.2e}  {point['seconds']:.0f} s", flush=True)
    train_seconds = time.perf_counter() - start

    model.eval()
    final = {"train_loss": mean_loss(model, train_windows), "heldout_loss": mean_loss(model, held_windows)}
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out))
    byte_tokenizer().save_pretrained(str(args.out))
    (args.out / tm.HELDOUT_FILE).write_bytes(held_sample)
    # What tests/test_trained_model.py recomputes, from the saved files, with the same helper.
    check_windows = tm.windows_of(held_windows.reshape(-1), tm.CHECK_SEQ, tm.CHECK_WINDOWS)
    meta = {
        "config": config, "parameters": n_params,
        "training": {k: v for k, v in vars(args).items() if k not in ("out", "shape")},
        "tokens_seen": args.steps * args.batch * args.seq, "train_seconds": round(train_seconds, 1),
        **{k: round(v, 4) for k, v in final.items()},
        "heldout_sample_windows": f"{len(held_windows)} x {args.seq}",
        "check": {"seq": tm.CHECK_SEQ, "windows": tm.CHECK_WINDOWS,
                  "perplexity": tm.perplexity_hf(args.out, check_windows)},
        "corpus": {"python": platform.python_version(), "stdlib": "sysconfig.get_paths()['stdlib']",
                   "skipped_dirs": sorted(tm.SKIP_DIRS), "heldout_every": tm.HELDOUT_EVERY,
                   "train_files": len(train_files), "train_bytes": len(train_text),
                   "train_sha256": tm.files_hash(root, train_files),
                   "heldout_files": len(held_files), "heldout_sha256": tm.files_hash(root, held_files)},
        "torch": torch.__version__, "transformers": transformers.__version__,
        "curve": [{k: round(v, 4) for k, v in p.items()} for p in curve],
    }
    (args.out / tm.META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    print(f"trained {args.steps} steps in {train_seconds:.0f} s: train loss {final['train_loss']:.4f}, "
          f"held-out {final['heldout_loss']:.4f} nats/byte; wrote {args.out}")


if __name__ == "__main__":
    main()
