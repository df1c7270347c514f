"""Recurrent-state models: npuc against HF transformers, and what the recurrence costs the compiler.

    python bench/recurrent_ab.py --quick                  # tiny models, a smoke check (~1 minute)
    python bench/recurrent_ab.py --part speed             # the two ~130M models against HF (~5 min)
    python bench/recurrent_ab.py --part compile           # the ~1.2B hybrid and the ~1.1B dense compile (~8 min)
    python bench/recurrent_ab.py --doc docs/benchmarks.md # both, and the section written into the report

Models are built from configs (random weights, seeded, nothing downloaded), saved with
save_pretrained under ``--work`` (default ~/.cache/npuc-bench/recurrent), each by a child
process, and reused by later runs (``build.json`` is written last; 1.1B: ~1 minute, 4.8 GB).

Speed (``--part speed``): a Mamba2 (mamba2-130m's layout, 22 layers to land near the 125M
of bench/run.py's Llama: hidden 768, expand 2, 24 heads of 64, 1 group, state 128, vocab
32000, untied; initializer_range 0.02, see ``mamba2``) and a Qwen3.5-style hybrid
("qwen3_5_text": hidden 768, 12 layers, three Gated DeltaNet layers to one full-attention
layer, 12 heads of 64 and 4 KV heads, linear attention 6 key heads and 12 value heads of
64, intermediate 2048, vocab 32000), fp32. Each is compiled by ``compile_model(folder,
input_shape="input_ids:1,128", max_seq_len=256)`` (cpu target), then run by two workers,
each in its own process with the same thread count (``--threads``, 2): npuc through
``npuc.load``'s executor choice (runtime/executor.py: the C executor where it runs the
model, else the torch interpreter with a one-line notice, which the report quotes;
``--executor`` forces one) and apps/generate.py's ``steps``; HF through ``model.generate``
(greedy, ``use_cache=True``, transformers' default attention and its torch fallbacks for
the recurrences, a streamer stamping each token; torch.set_num_threads). Each round, per
system: one prefill alone (npuc: the prefill program; HF: one forward with
``use_cache=True, logits_to_keep=1``, as generate's first step), then one whole
generation (prompt 128, 64 new tokens; the decode steps are the gaps between tokens after
the first, whose own time from the call is the TTFT). The two take turns, the order
reversed on odd rounds, each waiting 50 ms first (bench/decode_ab.py's ``ask``). Reported:
medians, and the median and quartiles of the per-round ratios. npuc's first tokens are
checked against HF's greedy ones (a warning, not an error: random weights make near-ties,
and benchmarks print, tests assert).

Compile (``--part compile``): a ~1.2B Qwen3.5-style hybrid (hidden 2048, 16 layers 3:1,
32 heads of 64 and 8 KV heads, linear attention 8 key heads and 16 value heads of 128,
intermediate 8192, vocab 32000) against the dense ~1.1B Qwen3 of the same width, depth
and MLP, each ``npuc compile --input_shape input_ids:1,2048 --max_seq_len 4096`` in a
fresh child process (wall time; peak RSS from ``os.wait4``, bench/compile_scale.py's
``measure``), in turn ``--compile-repeat`` times (3); ratio hybrid / dense. That size fits
this 2-core, 24 GiB machine with room: weights stream, and one compile of each took
72 s and 50 s at 1.1 GiB and 0.7 GiB peak RSS.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import compile_scale  # noqa: E402
import decode_ab  # noqa: E402

BEGIN, END = "<!-- bench/recurrent_ab.py -->", "<!-- /bench/recurrent_ab.py -->"
DEFAULT_WORK = Path.home() / ".cache" / "npuc-bench" / "recurrent"


@dataclass(frozen=True)
class Model:
    """A checkpoint to build: its transformers config class and arguments."""

    name: str  # the report's
    config: str  # a transformers config class
    args: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        """The cache folder's name: the family, width and depth, and a digest of the whole config."""
        digest = hashlib.sha1(json.dumps([self.config, self.args], sort_keys=True).encode()).hexdigest()[:10]
        a = self.args
        return f"{self.config.removesuffix('Config').lower()}_h{a['hidden_size']}_L{a['num_hidden_layers']}_{digest}"


def _hybrid_layers(n: int) -> list[str]:
    """Three Gated DeltaNet layers to one full-attention layer, as Qwen3.5's."""
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]


def mamba2(hidden: int, layers: int, heads: int, head_dim: int, state: int, vocab: int) -> Model:
    return Model(f"Mamba2 ({layers} layers, hidden {hidden}, {heads} heads of {head_dim}, state {state})",
                 "Mamba2Config", {"hidden_size": hidden, "num_hidden_layers": layers, "expand": 2,
                                  "num_heads": heads, "head_dim": head_dim, "n_groups": 1, "state_size": state,
                                  "vocab_size": vocab, "tie_word_embeddings": False,
                                  # Mamba2Config's default is 0.1: at 22 layers the activations grow until
                                  # fp32 rounding between the chunked prefill and the step-wise decode is
                                  # 4e-5 of what the past moves the logits (HF's own: 2e-5), past npuc's
                                  # decode-check bound of 1e-5 (NPUC-E0123). 0.02, as the other configs.
                                  "initializer_range": 0.02})


def qwen35(hidden: int, layers: int, heads: int, kv: int, head_dim: int, lin_k: int, lin_v: int, lin_dim: int,
           inter: int, vocab: int) -> Model:
    return Model(f"Qwen3.5-style hybrid ({layers} layers 3:1 Gated DeltaNet:attention, hidden {hidden})",
                 "Qwen3_5TextConfig",
                 {"hidden_size": hidden, "num_hidden_layers": layers, "layer_types": _hybrid_layers(layers),
                  "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
                  "linear_num_key_heads": lin_k, "linear_num_value_heads": lin_v, "linear_key_head_dim": lin_dim,
                  "linear_value_head_dim": lin_dim, "intermediate_size": inter, "vocab_size": vocab,
                  "tie_word_embeddings": False})


def qwen3(hidden: int, layers: int, heads: int, kv: int, head_dim: int, inter: int, vocab: int) -> Model:
    return Model(f"Qwen3 dense ({layers} layers, hidden {hidden})", "Qwen3Config",
                 {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                  "num_key_value_heads": kv, "head_dim": head_dim, "intermediate_size": inter, "vocab_size": vocab,
                  "tie_word_embeddings": False})


@dataclass(frozen=True)
class Plan:
    speed_models: tuple[Model, ...]
    prompt: int
    new: int
    max_seq_len: int
    hybrid: Model
    dense: Model
    compile_prompt: int
    compile_max_seq_len: int


FULL = Plan(
    speed_models=(mamba2(768, 22, 24, 64, 128, 32000),
                  qwen35(768, 12, 12, 4, 64, 6, 12, 64, 2048, 32000)),
    prompt=128, new=64, max_seq_len=256,
    hybrid=qwen35(2048, 16, 32, 8, 64, 8, 16, 128, 8192, 32000),
    dense=qwen3(2048, 16, 32, 8, 64, 8192, 32000),
    compile_prompt=2048, compile_max_seq_len=4096)
QUICK = Plan(
    speed_models=(mamba2(128, 2, 8, 32, 16, 1000),
                  qwen35(128, 4, 4, 2, 32, 2, 4, 32, 256, 1000)),
    prompt=32, new=16, max_seq_len=64,
    hybrid=qwen35(128, 4, 4, 2, 32, 2, 4, 32, 256, 1000),
    dense=qwen3(128, 4, 4, 2, 32, 256, 1000),
    compile_prompt=64, compile_max_seq_len=128)

# Runs in a child process: build the model from its config, seeded, and save it. argv[1]: a JSON
# object {"config", "args", "path"}. Prints its parameter count as JSON.
_BUILD = r"""
import json, sys, torch, transformers as tf
a = json.loads(sys.argv[1])
cfg = getattr(tf, a["config"])(**a["args"])
cfg.eos_token_id = None  # the generations run their whole length on both sides
torch.manual_seed(0)
model = tf.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
model.generation_config.eos_token_id = None
model.save_pretrained(a["path"])
print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "class": type(model).__name__}))
"""

# The worker: argv bench dir, kind (npuc|hf), threads, prompt ids as JSON, new tokens, the model
# path, the executor asked for ("" for npuc.load's choice). Its first line is JSON: the executor
# that runs (and the notice it printed, if any); then, per line it reads, one round as JSON:
# the prefill alone, then one generation's tokens, TTFT and decode steps.
_WORKER = r"""
import contextlib, io, json, sys, time
kind, threads, ids, new, path, executor = (sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5]),
                                           sys.argv[6], sys.argv[7])
import numpy as np, torch
torch.set_num_threads(threads)  # HF, and the torch interpreter should npuc fall back to it
if kind == "npuc":
    from npuc.runtime.executor import open_session
    from npuc.apps.generate import LAST_TOKEN, generation_info, steps
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        sess = open_session(path, threads=threads, executor=executor or None)
    ran = {"executor": "native" if type(sess).__name__ == "NativeSession" else "torch",
           "session": type(sess).__name__, "notice": err.getvalue().strip()}
    info = generation_info(sess)
    first = np.zeros((1, info.prefill_len), dtype=np.int64)
    first[0, :len(ids)] = ids
    feed = {info.ids_name: first}
    if info.takes_last:
        feed[LAST_TOKEN] = np.array([len(ids) - 1], dtype=np.int64)
    def prefill():
        sess.run(feed, "prefill", copy_outputs=False)
    def generate():
        t0, stamps, tokens = time.perf_counter(), [], []
        for tok, _ in steps(sess, ids, new, ignore_eos=True, keep_logits=False):
            stamps.append(time.perf_counter())
            tokens.append(int(tok))
        return tokens, t0, stamps
else:
    import transformers as tf
    from transformers.generation.streamers import BaseStreamer
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ran = {"executor": "hf", "session": type(model).__name__, "notice": ""}
    x = torch.tensor([ids])
    class Stamps(BaseStreamer):
        def __init__(self):
            self.seen, self.t = 0, []
        def put(self, value):
            self.seen += 1
            if self.seen > 1:  # the first put is the prompt
                self.t.append(time.perf_counter())
        def end(self):
            pass
    def prefill():
        with torch.no_grad():
            model(input_ids=x, use_cache=True, logits_to_keep=1)
    def generate():
        st = Stamps()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True,
                                 eos_token_id=None, pad_token_id=0, streamer=st)
        return [int(t) for t in out[0, len(ids):]], t0, st.t
prefill(); generate()  # warm-up
print(json.dumps(ran), flush=True)
for _ in sys.stdin:
    t0 = time.perf_counter(); prefill(); pf = time.perf_counter() - t0
    tokens, t0, stamps = generate()
    print(json.dumps({"prefill_s": pf, "ttft_s": stamps[0] - t0, "tokens": tokens,
                      "steps": [b - a for a, b in zip(stamps, stamps[1:])]}), flush=True)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _log(msg: str) -> None:
    print(f"[recurrent_ab] {msg}", file=sys.stderr, flush=True)


def build(model: Model, work: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint folder under `work` (built by a child process unless already there) and its build.json."""
    folder = work / "models" / model.key()
    if not (folder / "build.json").is_file():
        tmp = folder.with_name(folder.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _log(f"building {model.name} in {folder}")
        spec = {"config": model.config, "args": model.args, "path": str(tmp)}
        wall, rss = compile_scale.measure([sys.executable, "-c", _BUILD, json.dumps(spec)], log=tmp / "build.log",
                                          env=_env())
        lines = [ln for ln in (tmp / "build.log").read_text(errors="replace").splitlines() if ln.startswith("{")]
        info = {**json.loads(lines[-1]), "config": model.config, "args": model.args, "build_wall_s": wall,
                "build_peak_rss_bytes": rss}
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        (folder / "build.json").write_text(json.dumps(info, indent=2))
    return folder, json.loads((folder / "build.json").read_text())


def compile_child(folder: Path, out: Path, prompt: int, max_seq_len: int, log: Path) -> dict[str, Any]:
    """`npuc compile` of `folder` in a fresh process (fp32, cpu target): wall time, peak RSS, .om bytes."""
    cmd = [sys.executable, "-m", "npuc", "compile", str(folder), "--input_shape", f"input_ids:1,{prompt}",
           "--max_seq_len", str(max_seq_len), "--soc_version", "cpu", "--output", str(out), "--log", "null"]
    wall, rss = compile_scale.measure(cmd, log=log, env=_env())
    om = out.with_suffix(".om")
    return {"wall_s": wall, "peak_rss_bytes": rss, "om_bytes": om.stat().st_size, "om": str(om),
            "command": " ".join(["npuc", *cmd[3:]])}


def compile_here(folder: Path, out: Path, prompt: int, max_seq_len: int) -> dict[str, Any]:
    """`compile_model` in this process (fp32, cpu target): the speed part's, where the compile
    is not the figure and a child's start (torch, transformers) would double a quick run's."""
    from npuc.compiler.driver import compile_model

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's, about pytree internals
        om = compile_model(str(folder), input_shape=f"input_ids:1,{prompt}", max_seq_len=max_seq_len,
                           soc_version="cpu", output=str(out))
    return {"wall_s": time.perf_counter() - t0, "om": om, "om_bytes": os.path.getsize(om)}


# -- speed ----------------------------------------------------------------------------------------

def _start(kind: str, path: Path, threads: int, ids: list[int], new: int, executor: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _WORKER, str(BENCH), kind, str(threads), json.dumps(ids), str(new),
                             str(path), executor], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=_env())


def _ready(p: subprocess.Popen[str], what: str) -> dict[str, Any]:
    """The worker's first line: which executor runs it."""
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    try:
        ran: dict[str, Any] = json.loads(line)
    except json.JSONDecodeError:
        p.kill()
        raise RuntimeError(f"the {what} worker did not start (said {line!r}; its stderr is above)") from None
    return ran


def prompt_ids(n: int, vocab: int) -> list[int]:
    """A fixed pseudo-random prompt (no torch here: the parent stays light)."""
    x, out = 12345, []
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        out.append(3 + x % (vocab - 3))
    return out


def speed(model: Model, work: Path, plan: Plan, threads: int, rounds: int, executor: str, check: int
          ) -> dict[str, Any]:
    """One model: compiled, then npuc and HF timed in turn (module docstring)."""
    folder, info = build(model, work)
    scratch = work / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    _log(f"compiling {model.name}")
    from npuc.errors import NpucError

    try:
        comp = compile_here(folder, scratch / model.key(), plan.prompt, plan.max_seq_len)
    except NpucError as e:  # reported in its row; the other model still runs
        _log(f"WARNING: npuc refused {model.name}: {e}")
        return {"model": model.name, "config": model.config, "args": model.args, "params": info["params"],
                "error": str(e)}
    ids = prompt_ids(plan.prompt, model.args["vocab_size"])
    _log(f"timing {model.name}: npuc and HF in turn, {rounds} rounds")
    procs = {"npuc": _start("npuc", Path(comp["om"]), threads, ids, plan.new, executor),
             "hf": _start("hf", folder, threads, ids, plan.new, "")}
    runs: dict[str, list[dict[str, Any]]] = {"npuc": [], "hf": []}
    try:
        ran = {k: _ready(p, k) for k, p in procs.items()}
        for r in range(rounds):
            for k in (("npuc", "hf") if r % 2 == 0 else ("hf", "npuc")):
                runs[k].append(json.loads(decode_ab.ask(procs[k])))
    finally:
        decode_ab.stop_workers(procs.values(), 60)
        Path(comp["om"]).unlink(missing_ok=True)
    out: dict[str, Any] = {"model": model.name, "config": model.config, "args": model.args, "params": info["params"],
                           "hf_class": info["class"], "compile": comp, "rounds": rounds, "executor": ran["npuc"]}
    for k, rs in runs.items():
        tps = [len(g["steps"]) / sum(g["steps"]) for g in rs]
        out[k] = {"tok_per_s": statistics.median(tps), "tok_per_s_rounds": tps,
                  "prefill_ms": 1e3 * statistics.median(g["prefill_s"] for g in rs),
                  "prefill_ms_rounds": [round(1e3 * g["prefill_s"], 2) for g in rs],
                  "ttft_ms": 1e3 * statistics.median(g["ttft_s"] for g in rs),
                  "p50_step_ms": 1e3 * statistics.median(x for g in rs for x in g["steps"]),
                  "tokens": rs[0]["tokens"], "same_tokens_every_round": all(g["tokens"] == rs[0]["tokens"] for g in rs)}
    n, h = runs["npuc"], runs["hf"]
    out["decode_ratio"] = decode_ab.median_quartiles(
        [a / b for a, b in zip(out["npuc"]["tok_per_s_rounds"], out["hf"]["tok_per_s_rounds"], strict=True)])
    out["prefill_ratio"] = decode_ab.median_quartiles([a["prefill_s"] / b["prefill_s"] for a, b in zip(n, h, strict=True)])
    out["ttft_ratio"] = decode_ab.median_quartiles([a["ttft_s"] / b["ttft_s"] for a, b in zip(n, h, strict=True)])
    got, want = out["npuc"]["tokens"][:check], out["hf"]["tokens"][:check]
    out["first_tokens_match"] = got == want
    out["tokens_checked"] = check
    out["tokens_match_all"] = out["npuc"]["tokens"] == out["hf"]["tokens"]
    if got != want:
        i = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        out["first_mismatch"] = i
        _log(f"WARNING: {model.name}: npuc's first {check} greedy tokens differ from HF's at token {i}: "
             f"npuc {got}, HF {want}")
    if ran["npuc"]["notice"]:
        _log(f"npuc worker: {ran['npuc']['notice']}")
    return out


# -- compile time ---------------------------------------------------------------------------------

def compile_time(work: Path, plan: Plan, repeat: int) -> dict[str, Any]:
    """The hybrid and the dense model compiled in turn, each in a fresh process, `repeat` times."""
    scratch = work / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    models = {"hybrid": plan.hybrid, "dense": plan.dense}
    built = {k: build(m, work) for k, m in models.items()}
    seen: dict[str, list[dict[str, Any]]] = {k: [] for k in models}
    for i in range(repeat):
        for k in (("hybrid", "dense") if i % 2 == 0 else ("dense", "hybrid")):
            _log(f"compiling {models[k].name} ({k}), run {i + 1} of {repeat}: input_ids:1,{plan.compile_prompt}, "
                 f"--max_seq_len {plan.compile_max_seq_len}")
            r = compile_child(built[k][0], scratch / f"compile_{k}", plan.compile_prompt, plan.compile_max_seq_len,
                              scratch / f"compile_{k}.log")
            Path(r.pop("om")).unlink(missing_ok=True)
            seen[k].append(r)
            _log(f"  {r['wall_s']:.1f} s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
    out: dict[str, Any] = {"input_shape": f"input_ids:1,{plan.compile_prompt}",
                           "max_seq_len": plan.compile_max_seq_len, "repeat": repeat,
                           "rss_method": "os.wait4 rusage of each child (ru_maxrss)"}
    for k, rs in seen.items():
        info = built[k][1]
        out[k] = {"model": models[k].name, "config": models[k].config, "args": models[k].args,
                  "params": info["params"], "wall_s": statistics.median(r["wall_s"] for r in rs),
                  "wall_s_runs": [round(r["wall_s"], 2) for r in rs],
                  "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs), "om_bytes": rs[0]["om_bytes"],
                  "command": rs[0]["command"]}
    out["ratio_wall"] = out["hybrid"]["wall_s"] / out["dense"]["wall_s"]
    out["ratio_rss"] = out["hybrid"]["peak_rss_bytes"] / out["dense"]["peak_rss_bytes"]
    return out


# -- the report -----------------------------------------------------------------------------------

def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("npuc", "torch", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _q(r: dict[str, float]) -> str:
    return f"**{r['median']:.2f}x** ({r['q1']:.2f}-{r['q3']:.2f})"


def render(res: dict[str, Any]) -> str:
    """The report's section for docs/benchmarks.md."""
    cmd = "python bench/recurrent_ab.py" + (" --quick" if res["quick"] else "") + (
        f" --part {res['part']}" if res["part"] != "all" else "")
    lines = [BEGIN, "", "## Recurrent-state models (state-space and hybrid) against HF transformers", "",
             f"Generated by `{cmd}` on {res['date']}. Machine: {res['machine']}. Threads: {res['threads']} for "
             "every system. Versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()) + ".",
             "Models built from configs, random weights, fp32."]
    if res.get("speed"):
        p = res["plan"]
        ran = [s for s in res["speed"] if "error" not in s]
        ex = sorted({s["executor"]["executor"] for s in ran}) or ["none (every compile refused)"]
        lines += ["", f"### Speed: prompt {p['prompt']} tokens, {p['new']} new tokens, greedy", "",
                  f"npuc: compiled with `--input_shape input_ids:1,{p['prompt']} --max_seq_len {p['max_seq_len']}` "
                  f"(cpu target), run by `npuc.load`'s executor: **{' and '.join(ex)}** "
                  "(native: the C executor, libnpucrt; torch: the torch interpreter it falls back to), through "
                  "apps/generate.py. HF: `model.generate` (greedy, `use_cache=True`, transformers' default "
                  "attention and its torch fallbacks for the scans and delta rules). Each in its own process, "
                  f"timed in turn over {res['rounds']} rounds (order reversed on odd rounds): medians; "
                  "ratios are the median (quartiles) of the per-round ratios. Prefill: the prompt alone (npuc's "
                  "prefill program; HF one forward with `use_cache=True, logits_to_keep=1`). TTFT: from the "
                  "generate call to the first token. Decode: the steps after the first token.", "",
                  "| model | params | npuc executor | npuc tok/s | HF tok/s | decode npuc/HF | npuc prefill ms | "
                  "HF prefill ms | prefill time npuc/HF | npuc TTFT ms | HF TTFT ms | first tokens = HF's |",
                  "|" + "---|" * 12]
        for s in res["speed"]:
            if "error" in s:
                lines.append(f"| {s['model']} | {_params(s['params'])} | compile refused: {s['error']} |"
                             + " |" * 9)
                continue
            n, h = s["npuc"], s["hf"]
            match = "yes" if s["first_tokens_match"] else f"NO (from token {s.get('first_mismatch')})"
            lines.append(f"| {s['model']} | {_params(s['params'])} | {s['executor']['executor']} | "
                         f"{n['tok_per_s']:.1f} | {h['tok_per_s']:.1f} | {_q(s['decode_ratio'])} | "
                         f"{n['prefill_ms']:.1f} | {h['prefill_ms']:.1f} | {_q(s['prefill_ratio'])} | "
                         f"{n['ttft_ms']:.1f} | {h['ttft_ms']:.1f} | {match} ({s['tokens_checked']}) |")
        notices = {s["executor"]["notice"] for s in ran if s["executor"]["notice"]}
        lines += [""] + [f"npuc's notice: `{x}`" for x in sorted(notices)]
        lines += ["Compile (`compile_model`, in the harness's process, imports done): " + "; ".join(
            f"{s['model'].split(' (')[0]} {s['compile']['wall_s']:.1f} s" for s in ran) + "."]
    if res.get("compile"):
        c = res["compile"]
        lines += ["", f"### Compile time: hybrid against dense, `{c['input_shape']} --max_seq_len {c['max_seq_len']}`",
                  "", "`npuc compile` of the HF folder (fp32, cpu target), each a fresh process, the two in turn "
                  f"{c['repeat']} time(s): median wall time, largest peak RSS (`os.wait4`).", "",
                  "| model | params | wall s | peak RSS GiB | .om size |", "|---|---|---|---|---|"]
        for k in ("hybrid", "dense"):
            d = c[k]
            lines.append(f"| {d['model']} | {_params(d['params'])} | {d['wall_s']:.1f} | "
                         f"{d['peak_rss_bytes'] / 2**30:.2f} | {_size(d['om_bytes'])} |")
        lines += ["", f"Hybrid / dense: wall time **{c['ratio_wall']:.2f}x**, peak RSS **{c['ratio_rss']:.2f}x**."]
    lines += ["", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models, a smoke check (< 1 minute once cached)")
    ap.add_argument("--part", choices=("speed", "compile", "all"), default="all")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help=f"models and scratch (default {DEFAULT_WORK})")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None, help="speed rounds (default 5; --quick 3)")
    ap.add_argument("--executor", choices=("native", "torch"), default="",
                    help="force npuc's executor (default: npuc.load's choice)")
    ap.add_argument("--check-tokens", type=int, default=8, help="npuc's first N greedy tokens checked against HF's")
    ap.add_argument("--compile-prompt", type=int, default=None, help="compile part's prefill length (default 2048)")
    ap.add_argument("--compile-max-seq-len", type=int, default=None, help="compile part's --max_seq_len (default 4096)")
    ap.add_argument("--compile-repeat", type=int, default=None,
                    help="compiles of each model, in turn (default 3; --quick 1)")
    ap.add_argument("--doc", type=Path, default=None, help="write the section into this Markdown file, in place")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here as JSON")
    args = ap.parse_args(argv)
    import run as B  # machine facts and write_section (imports torch: after argument errors)

    plan = QUICK if args.quick else FULL
    if args.compile_prompt or args.compile_max_seq_len:
        cp = args.compile_prompt or plan.compile_prompt
        plan = Plan(**{**plan.__dict__, "compile_prompt": cp,
                       "compile_max_seq_len": args.compile_max_seq_len or max(2 * cp, plan.compile_max_seq_len)})
    rounds = args.rounds or (3 if args.quick else 5)
    work = args.work.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"quick": args.quick, "part": args.part, "threads": args.threads, "machine": B.machine(),
                           "date": datetime.date.today().isoformat(), "versions": _versions(), "work": str(work),
                           "plan": {k: v for k, v in asdict(plan).items() if k in (
                               "prompt", "new", "max_seq_len", "compile_prompt", "compile_max_seq_len")}}
    try:
        if args.part in ("speed", "all"):
            res["rounds"] = rounds
            res["speed"] = [speed(m, work, plan, args.threads, rounds, args.executor, args.check_tokens)
                            for m in plan.speed_models]
        if args.part in ("compile", "all"):
            res["compile"] = compile_time(work, plan, args.compile_repeat or (1 if args.quick else 3))
    finally:
        shutil.rmtree(work / "scratch", ignore_errors=True)
    res["wall_s"] = time.perf_counter() - t0
    section = render(res)
    print(section)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    if args.doc:
        B.write_section(args.doc, BEGIN, END, section)
        _log(f"wrote the section into {args.doc}")
    _log(f"done in {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
