"""Train a DeepSeek-V3-style multi-token-prediction (MTP) layer on top of the frozen byte-level
Llama in tests/data/stdlib_llama/: a draft head that predicts the token after next, for
MTP speculative decoding.

    python bench/train_stdlib_mtp.py --threads 2                    # the default run (4.5 min on 1 thread)
    python bench/train_stdlib_mtp.py --steps 5 --out /tmp/mtp_smoke  # a smoke check

The layer, L = the base's num_hidden_layers, is vLLM's DeepSeekMultiTokenPredictorLayer
over the base model's own LlamaDecoderLayer (mtp_forward below has the formula). Row p of
a window t_0..t_{S-1} takes ids t_{p+1} at position p and h_p, the base's last hidden state
(after its final norm) at p, and learns t_{p+2}: rows p = 0..S-3. The base is frozen and
shares its embedding; only the MTP layer trains, from a start that copies the base's last
decoder layer, final norm and LM head, with eh_proj = [0 | I] so that its input starts as
hnorm(h). Corpus and schedule are bench/train_stdlib_llama.py's: the training half of the
standard library's sources (tests/trained_model.py has the split), seeded random windows,
AdamW with warmup then cosine. Held-out figures use the base folder's heldout.bin.

Writes `--out`: the base folder's files, with config.json gaining
"num_nextn_predict_layers": 1, model.safetensors rewritten with the MTP tensors (fp32)
added under model.layers.{L}. (enorm, hnorm, eh_proj, shared_head.norm, shared_head.head,
and the decoder layer's own self_attn.*, mlp.*, input_layernorm, post_attention_layernorm),
and training.json: settings, loss curve, held-out MTP and base accuracy, time (the base's
own record nested under "base_training"). The run ends by re-reading the written tensors
and recomputing held-out MTP accuracy from them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
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
from train_stdlib_llama import batch, lr_at  # noqa: E402

WEIGHTS = "model.safetensors"


class SharedHead(torch.nn.Module):
    def __init__(self, config: Any) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__()
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MtpLayer(torch.nn.Module):
    """The MTP layer's parameters; its state_dict names are the checkpoint's under
    model.layers.{L}., with the decoder layer's own ("layer." dropped: mtp_key)."""

    def __init__(self, config: Any) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

        super().__init__()
        hidden = config.hidden_size
        self.enorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head = SharedHead(config)

    def start_from(self, base: Any) -> None:
        """The base's last decoder layer, final norm and LM head; eh_proj = [0 | I], so the
        decoder layer first sees hnorm(h) and the embedding's block learns from zero."""
        hidden = base.config.hidden_size
        with torch.no_grad():
            self.layer.load_state_dict(base.model.layers[-1].state_dict())
            self.shared_head.norm.weight.copy_(base.model.norm.weight)
            self.shared_head.head.weight.copy_(base.lm_head.weight)
            self.eh_proj.weight.copy_(torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1))


def mtp_key(name: str, n_layers: int) -> str:
    """MtpLayer's parameter name -> the checkpoint's: 'layer.mlp.up_proj.weight' ->
    'model.layers.4.mlp.up_proj.weight', 'enorm.weight' -> 'model.layers.4.enorm.weight'."""
    return f"model.layers.{n_layers}.{name.removeprefix('layer.')}"


def mtp_forward(base: Any, mtp: MtpLayer, ids: torch.Tensor, positions: torch.Tensor,
                h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, hidden) of vLLM's DeepSeekMultiTokenPredictorLayer: ids, positions [b, s],
    h [b, s, H]. Position 0's embedding is zeroed, as vLLM does; the decoder layer is causal
    over s (sdpa with no mask)."""
    e = base.model.embed_tokens(ids)
    e = e * (positions != 0).unsqueeze(-1).to(e.dtype)
    x = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h)], dim=-1))
    cos, sin = base.model.rotary_emb(x, positions)
    x = mtp.layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
    if isinstance(x, tuple):
        x = x[0]
    return mtp.shared_head.head(mtp.shared_head.norm(x)), x


def rows(base: Any, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The base's final hidden states and logits over `windows` [b, S] (no grad), and the
    MTP rows' ids and positions: row p takes t_{p+1} at position p and h_p."""
    with torch.no_grad():
        h = base.model(input_ids=windows, use_cache=False).last_hidden_state
        logits = base.lm_head(h)
    n = windows.shape[1] - 2
    positions = torch.arange(n).expand(len(windows), n)
    return h, logits, windows[:, 1:n + 1], positions


def mtp_loss(base: Any, mtp: MtpLayer, windows: torch.Tensor) -> torch.Tensor:
    h, _, ids, positions = rows(base, windows)
    logits, _ = mtp_forward(base, mtp, ids, positions, h[:, :-2])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 2:].reshape(-1))


def evaluate(base: Any, mtp: MtpLayer, windows: torch.Tensor, chunk: int = 16) -> dict[str, float]:
    """Held-out measures: the MTP rows' loss and top-1 accuracy on t_{p+2}; `agree_base`, how
    often MTP's pick equals the base's own pick for t_{p+2} (made at p+1, seeing t_{p+1}: a
    greedy draft's acceptance rate); the base's next-token loss and top-1 accuracy."""
    sums = dict.fromkeys(("mtp_loss", "mtp_correct", "agree_base", "base_loss", "base_correct"), 0.0)
    n_mtp = n_base = 0
    with torch.no_grad():
        for w in windows.split(chunk):
            h, base_logits, ids, positions = rows(base, w)
            logits, _ = mtp_forward(base, mtp, ids, positions, h[:, :-2])
            want, base_want = w[:, 2:], w[:, 1:]
            sums["mtp_loss"] += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), want.reshape(-1), reduction="sum"))
            sums["mtp_correct"] += float((logits.argmax(-1) == want).sum())
            sums["agree_base"] += float((logits.argmax(-1) == base_logits[:, 1:-1].argmax(-1)).sum())
            sums["base_loss"] += float(torch.nn.functional.cross_entropy(
                base_logits[:, :-1].reshape(-1, base_logits.shape[-1]), base_want.reshape(-1), reduction="sum"))
            sums["base_correct"] += float((base_logits[:, :-1].argmax(-1) == base_want).sum())
            n_mtp, n_base = n_mtp + want.numel(), n_base + base_want.numel()
    return {"mtp_loss": sums["mtp_loss"] / n_mtp, "mtp_top1": sums["mtp_correct"] / n_mtp,
            "mtp_agree_base_top1": sums["agree_base"] / n_mtp,
            "base_loss": sums["base_loss"] / n_base, "base_top1": sums["base_correct"] / n_base,
            "mtp_rows": n_mtp, "base_rows": n_base}


def load_base(folder: Path) -> Any:
    import transformers

    # sdpa: the MTP layer's attention is causal only through sdpa's is_causal (no mask given).
    transformers.utils.logging.disable_progress_bar()
    base = transformers.LlamaForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa",
                                                         dtype=torch.float32).eval()
    base.requires_grad_(False)
    return base


def write_folder(base_dir: Path, out: Path, mtp: MtpLayer, n_layers: int) -> dict[str, torch.Tensor]:
    """Copies `base_dir` to `out`, then config.json gains num_nextn_predict_layers and
    model.safetensors the MTP tensors (one file: no index to keep in step). Returns them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if out.resolve() == base_dir.resolve():
        raise SystemExit(f"--out must not be the base folder {base_dir}")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(base_dir.iterdir()):
        if f.is_file() and f.name not in (tm.META_FILE, WEIGHTS):
            shutil.copy2(f, out / f.name)
    config = json.loads((base_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    with safe_open(str(base_dir / WEIGHTS), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata() or {"format": "pt"}
    added = {mtp_key(k, n_layers): v.detach().float().contiguous().clone() for k, v in mtp.state_dict().items()}
    if clash := set(added) & set(tensors):
        raise SystemExit(f"{base_dir / WEIGHTS} already holds MTP tensors: {sorted(clash)[:3]}")
    save_file({**tensors, **added}, str(out / WEIGHTS), metadata=metadata)
    shutil.copymode(base_dir / WEIGHTS, out / WEIGHTS)  # save_file makes it owner-only
    return added


def check_written(base_dir: Path, out: Path, n_layers: int, windows: torch.Tensor,
                  expected: dict[str, float]) -> dict[str, Any]:
    """Rebuilds the base and MTP layer from `out`'s files alone and recomputes the held-out
    measures on `windows`: they must equal `expected` (the trained model's on the same windows)."""
    from safetensors.torch import load_file

    written = load_file(str(out / WEIGHTS))
    original = load_file(str(base_dir / WEIGHTS))
    prefix = f"model.layers.{n_layers}."
    assert set(written) - set(original) == {k for k in written if k.startswith(prefix)}, "stray keys"
    assert all(torch.equal(written[k], v) for k, v in original.items()), "a base tensor changed"
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == n_layers
    base = load_base(out)
    mtp = MtpLayer(base.config).eval()
    names = {mtp_key(k, n_layers): k for k in mtp.state_dict()}
    assert set(names) == {k for k in written if k.startswith(prefix)}, "MTP keys differ from the layer's"
    mtp.load_state_dict({names[k]: written[k] for k in names}, strict=True)
    got = evaluate(base, mtp, windows)
    for k, v in expected.items():
        assert math.isclose(got[k], v, rel_tol=1e-5, abs_tol=1e-6), f"{k}: written {got[k]} != trained {v}"
    return {"windows": f"{len(windows)} x {windows.shape[1]}", **{k: round(v, 4) for k, v in got.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, default=tm.DATA, help="the trained base model's folder")
    ap.add_argument("--out", type=Path, default=Path("/tmp/stdlib_mtp"))
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=6e-3)
    ap.add_argument("--min_lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight_decay", type=float, default=0.1)
    ap.add_argument("--eval_every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.out.resolve() == args.base.resolve():
        ap.error("--out must not be the base folder: the MTP run writes a copy of it")
    torch.set_num_threads(args.threads)
    import transformers

    began = time.perf_counter()
    root = Path(sysconfig.get_paths()["stdlib"])
    train_files, held_files = tm.split_files(tm.stdlib_files(root))
    train = torch.frombuffer(bytearray(tm.read_corpus(root, train_files)), dtype=torch.uint8)
    held_tokens = torch.frombuffer(bytearray((args.base / tm.HELDOUT_FILE).read_bytes()), dtype=torch.uint8).long()
    held_windows = tm.windows_of(held_tokens, args.seq)
    curve_windows = tm.windows_of(held_tokens, args.seq, 32)
    base_meta = json.loads((args.base / tm.META_FILE).read_text())
    same_corpus = tm.files_hash(root, train_files) == base_meta["corpus"]["train_sha256"]
    print(f"corpus: {len(train_files)} train files ({len(train):,} bytes; "
          f"{'the' if same_corpus else 'NOT the'} base's training corpus), "
          f"held-out {len(held_windows)} x {args.seq} from {args.base / tm.HELDOUT_FILE}", flush=True)

    torch.manual_seed(args.seed)
    base = load_base(args.base)
    n_layers = base.config.num_hidden_layers
    mtp = MtpLayer(base.config)
    mtp.start_from(base)
    n_params = sum(p.numel() for p in mtp.parameters())
    print(f"MTP layer {n_layers}: {n_params:,} trainable parameters over a frozen "
          f"{sum(p.numel() for p in base.parameters()):,}", flush=True)
    decay = [p for p in mtp.parameters() if p.dim() >= 2]  # not the norms' gains
    keep = [p for p in mtp.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": keep, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)

    def point(step: int, train_loss: float | None) -> dict[str, float]:
        mtp.eval()
        m = evaluate(base, mtp, curve_windows)
        p = {"step": step, **({"train": train_loss} if train_loss is not None else {}),
             "heldout": m["mtp_loss"], "heldout_top1": m["mtp_top1"], "seconds": time.perf_counter() - start}
        print(f"step {step:5d}  train {'-' if train_loss is None else f'{train_loss:.3f}':>5}  "
              f"held-out {p['heldout']:.3f}  top-1 {p['heldout_top1']:.2%}  {p['seconds']:.0f} s", flush=True)
        return p

    start = time.perf_counter()
    curve = [point(0, None)]  # the copied start: the base's last layer and head, one token further
    recent: list[float] = []
    for step in range(args.steps):
        mtp.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        loss = mtp_loss(base, mtp, batch(train, args.batch, args.seq, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        recent.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append(point(step + 1, sum(recent) / len(recent)))
            recent = []
    train_seconds = time.perf_counter() - start

    mtp.eval()
    final = evaluate(base, mtp, held_windows)
    write_folder(args.base, args.out, mtp, n_layers)
    check_windows = held_windows[:: max(1, len(held_windows) // 8)]
    check = check_written(args.base, args.out, n_layers, check_windows, evaluate(base, mtp, check_windows))
    meta = {
        "mtp": {"layer": n_layers, "parameters": n_params, "num_nextn_predict_layers": 1,
                "keys": sorted(mtp_key(k, n_layers) for k in mtp.state_dict()),
                "start": "layer = base layer L-1, shared_head = base final norm and lm_head, "
                         "enorm = hnorm = ones, eh_proj = [0 | I]"},
        "training": {k: v for k, v in vars(args).items() if k not in ("out", "base")},
        "rows_per_window": args.seq - 2, "tokens_seen": args.steps * args.batch * args.seq,
        "train_seconds": round(train_seconds, 1),
        "heldout": {"windows": f"{len(held_windows)} x {args.seq}", "file": tm.HELDOUT_FILE,
                    **{k: round(v, 4) for k, v in final.items()}},
        "check_from_written_tensors": check,
        "corpus": {"python": platform.python_version(), "train_files": len(train_files), "train_bytes": len(train),
                   "train_sha256": tm.files_hash(root, train_files), "same_as_base": same_corpus,
                   "heldout_files": len(held_files)},
        "torch": torch.__version__, "transformers": transformers.__version__,
        "curve": [{k: round(v, 4) for k, v in p.items()} for p in curve],
        "total_seconds": round(time.perf_counter() - began, 1),
        "base_training": base_meta,
    }
    (args.out / tm.META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    print(f"trained {args.steps} steps in {train_seconds:.0f} s; held-out ({len(held_windows)} x {args.seq}): "
          f"MTP (t+2) top-1 {final['mtp_top1']:.2%}, loss {final['mtp_loss']:.4f}, agrees with the base's "
          f"pick {final['mtp_agree_base_top1']:.2%}; base (t+1) top-1 {final['base_top1']:.2%}, loss "
          f"{final['base_loss']:.4f}; checked from the written tensors; wrote {args.out}")


if __name__ == "__main__":
    main()
