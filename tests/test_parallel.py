"""Tensor and expert parallel (issue 19): --tp/--ep compiles, run as ranks on torch.distributed
(gloo on CPU), against the single-device .om and HF; the shard sizes; the manifest and its
tools; the errors (a split that does not divide, a wrong world size or rank, a file from
another compile, a dead peer); and the config-only plan of a full-size DeepSeek-V3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from compile_pool import CompilePool
from hf_models import COMMON, hf_greedy, make_config, moe_config

from npuc.compiler.driver import compile_model
from npuc.runtime import Session
from npuc.tools.om_tools import model_info, validate_om

HERE = Path(__file__).parent
PROMPT = [3, 17, 5, 99, 42, 7]
PREFILL, MAX_SEQ = 8, 48


def _tf() -> Any:
    import transformers

    return transformers


def _v2_config() -> Any:
    from test_deepseek_v2 import v2_config

    return v2_config()


def _llama8() -> Any:
    import transformers as tf

    return tf.LlamaConfig(**{**COMMON, "num_attention_heads": 8, "hidden_size": 128})  # 8 heads, 2 KV heads


# name -> (config, world, ep)
MODELS: dict[str, tuple[Any, int, int | None]] = {
    "llama": (lambda: make_config("llama"), 2, None),
    "qwen2": (lambda: make_config("qwen2"), 2, None),
    "mistral": (lambda: make_config("mistral"), 2, None),
    "deepseek_v3_moe": (moe_config, 2, 2),
    "deepseek_v2": (_v2_config, 2, 2),
    "llama_8_heads_tp4": (_llama8, 4, None),
    "phi3": (lambda: make_config("phi3"), 2, None),  # fused q/k/v and gate/up products
    "qwen3": (lambda: _tf().Qwen3Config(**COMMON, head_dim=16), 2, None),  # per-head q/k norms
    "gemma": (lambda: _tf().GemmaConfig(**COMMON, head_dim=16), 2, None),  # GeGLU, tied LM head
    # GPT-2: Conv1D's [in, out] weights, one q/k/v product, a GELU FFN, biases, learned positions
    "gpt2": (lambda: _tf().GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                       bos_token_id=1, eos_token_id=2), 2, None),
    "deepseek_v3_moe_ep1": (moe_config, 2, 1),  # each expert's FFN split instead of the experts
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(HERE),
            "GLOO_SOCKET_IFNAME": "lo", **extra}


def _ranks(world: int, argv: list[str], timeout: float = 300, **extra: str) -> list[subprocess.CompletedProcess[str]]:
    """Run `python argv` as `world` ranks; each one's result."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, *argv], env=_env(r, world, port, **extra), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]
    out = []
    for p in procs:
        so, se = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def _npuc(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "npuc", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


@pytest.fixture(scope="session")
def tp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each model: its checkpoint, HF module, single-device .om and --tp manifest."""
    import transformers as tf

    out = {}
    with CompilePool() as pool:  # in worker processes, while this one builds the next checkpoint
        for name, (config, world, ep) in MODELS.items():
            root = tmp_path_factory.mktemp(name)
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(config()).eval()
            model.save_pretrained(root / "ckpt")
            one = pool.compile(str(root / "ckpt"), input_shape=f"input_ids:1,{PREFILL}", output=str(root / "one"),
                               max_seq_len=MAX_SEQ)
            tp = pool.compile(str(root / "ckpt"), input_shape=f"input_ids:1,{PREFILL}", output=str(root / "tp"),
                              max_seq_len=MAX_SEQ, tp=world, ep=ep)
            out[name] = {"root": root, "hf": model, "one": one, "tp": tp, "world": world}
        for m in out.values():
            m["one"], m["tp"] = m["one"].result(), m["tp"].result()
    return out


def _single(path: str, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prefill and decode logits of the single-device .om, and its decode step's allocations."""
    from npuc.tools.alloc_profile import profile_run

    s = Session.load(path)
    n = ids.shape[1]
    feeds: dict[str, Any] = {"input_ids": ids}
    if "last_token" in {t.name for t in s.programs["prefill"].inputs}:
        feeds["last_token"] = np.array([n - 1], dtype=np.int64)
    prefill = s.run(feeds, "prefill")["logits"]
    token = int(prefill.reshape(-1, prefill.shape[-1])[-1].argmax())
    step = {"input_ids": np.array([[token]], dtype=np.int64), "position": np.array([n], dtype=np.int64)}
    decode = s.run(step, "decode")["logits"]
    return prefill, decode, profile_run(s, step, "decode", copy_outputs=False).count


@pytest.mark.parametrize("name", list(MODELS))
def test_ranks_match_the_single_device_model_and_hf(tp_models: dict[str, dict[str, Any]], name: str) -> None:
    """Prefill and decode logits of N gloo ranks within 1e-4 of the single-device .om; the
    decode step allocates nothing the single device's does not (gloo's own buffers apart);
    `npuc generate --tp N` gives HF's 32 greedy tokens."""
    m = tp_models[name]
    ids = np.random.default_rng(5).integers(0, 128, (1, PREFILL), dtype=np.int64)
    np.save(m["root"] / "ids.npy", ids)
    res = _ranks(m["world"], [str(HERE / "tp_worker.py"), m["tp"], str(m["root"] / "ids.npy"),
                              str(m["root"] / "ranks.json")])
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    got = json.loads((m["root"] / "ranks.json").read_text())
    want_prefill, want_decode, single_allocs = _single(m["one"], ids)
    assert got["world"] == m["world"]
    assert (torch.tensor(got["prefill"]) - want_prefill).abs().max().item() < 1e-4
    assert (torch.tensor(got["decode"]) - want_decode).abs().max().item() < 1e-4
    assert got["alloc_count"] <= single_allocs, got["alloc_bytes"]
    assert got["collective_alloc_count"] > 0  # the profiler does see the library's (so ours would show)
    gen = _npuc("generate", m["tp"], "--tp", str(m["world"]), "--prompt-ids", ",".join(map(str, PROMPT)),
                "--max-new-tokens", "32", "--ignore-eos")
    assert gen.returncode == 0, gen.stderr
    assert [int(t) for t in gen.stdout.split()] == hf_greedy(m["hf"], PROMPT, 32)


def test_torchrun_runs_a_program(tp_models: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 4 -m npuc run` on the 4-rank model: rank 0 writes what the
    single-device .om computes."""
    m = tp_models["llama_8_heads_tp4"]
    ids = np.arange(PREFILL, dtype=np.int64).reshape(1, PREFILL) + 3
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "last.npy", np.array([PREFILL - 1], dtype=np.int64))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                        str(_free_port()), "-m", "npuc", "run", m["tp"], "--program", "prefill",
                        "--input", f"input_ids={tmp_path / 'ids.npy'}", "--input", f"last_token={tmp_path / 'last.npy'}",
                        "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("logits: f32[1,1,128]") == 1  # rank 0 alone reports
    want, _, _ = _single(m["one"], ids)
    assert np.abs(np.load(tmp_path / "out" / "logits.npy") - want.numpy()).max() < 1e-4


def test_onnx_with_past_export_splits_too(tmp_path: Path) -> None:
    """optimum's with-past Llama export (ONNX MatMul weights stored [in, out]) at --tp 2: the
    ranks' logits within 1e-4 of the single-device .om, and the same 24 tokens."""
    onnx = str(HERE / "data/optimum/llama_with_past_opset18.onnx")
    one = compile_model(onnx, input_shape=f"input_ids:1,{PREFILL}", output=str(tmp_path / "one"), max_seq_len=32)
    tp = compile_model(onnx, input_shape=f"input_ids:1,{PREFILL}", output=str(tmp_path / "tp"), max_seq_len=32, tp=2)
    ids = np.random.default_rng(1).integers(0, 128, (1, PREFILL), dtype=np.int64)
    np.save(tmp_path / "ids.npy", ids)
    res = _ranks(2, [str(HERE / "tp_worker.py"), tp, str(tmp_path / "ids.npy"), str(tmp_path / "r.json")])
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    got = json.loads((tmp_path / "r.json").read_text())
    want_prefill, want_decode, _ = _single(one, ids)
    assert (torch.tensor(got["prefill"]) - want_prefill).abs().max().item() < 1e-4
    assert (torch.tensor(got["decode"]) - want_decode).abs().max().item() < 1e-4
    args = ["--prompt-ids", "5,6,7", "--max-new-tokens", "24", "--ignore-eos"]
    a, b = _npuc("generate", tp, "--tp", "2", *args), _npuc("generate", one, *args)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and len(a.stdout.split()) == 24


def test_slots_decode_together_over_ranks(tp_models: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """4 slots (--input_shape input_ids:4,8) at --tp 2: three prompts decoded together over
    the ranks get the tokens the single-device slots give them."""
    ckpt = str(tp_models["llama"]["root"] / "ckpt")
    one = compile_model(ckpt, input_shape=f"input_ids:4,{PREFILL}", output=str(tmp_path / "one"), max_seq_len=MAX_SEQ)
    tp = compile_model(ckpt, input_shape=f"input_ids:4,{PREFILL}", output=str(tmp_path / "tp"), max_seq_len=MAX_SEQ,
                       tp=2)
    args = ["--prompt-ids", "1,2,3", "--prompt-ids", "4,5,6,7,8", "--prompt-ids", "9", "--max-new-tokens", "12",
            "--ignore-eos"]
    a, b = _npuc("generate", tp, "--tp", "2", *args), _npuc("generate", one, *args)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.count("token_ids") == 3


def _replicated(meta: dict[str, str]) -> set[str]:
    return set(meta["parallel.replicated"].split(","))


@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_holds_its_share_of_the_weights(tp_models: dict[str, dict[str, Any]], name: str) -> None:
    """Every rank's weights are at most 1.1/N of the single device's split part plus the
    replicated part, which the metadata lists and counts: norms, the embedding, RoPE tables,
    the latent attention's down projections and router; never a split projection."""
    m = tp_models[name]
    one = model_info(m["one"])["weights_bytes"]
    info = model_info(m["tp"])
    n = m["world"]
    assert info["parallel"]["world"] == n and len(info["ranks"]) == n
    for r, rank in enumerate(info["ranks"]):
        meta = model_info(str(m["root"] / rank["file"]))["metadata"]
        assert meta["parallel.rank"] == str(r) and meta["parallel.world"] == str(n)
        rep = int(meta["parallel.replicated_bytes"])
        assert rank["weights_bytes"] <= 1.1 * (one - rep) / n + rep, (rank["weights_bytes"], one, rep)
        names = _replicated(meta)
        if name not in ("gemma", "gpt2"):  # theirs are folded (Gemma's 1 + w norms, GPT-2's positions)
            assert {"model.embed_tokens.weight", "model.norm.weight"} <= names, names
        split = ("q_proj", "o_proj", "q_b_proj", "gate_proj", "up_proj", "down_proj", "experts", "lm_head",
                 "c_attn", "c_fc", "c_proj")
        tied = {x for x in names if f"{x}.tp{r}" in names}  # an embedding that is also the LM head
        assert not [x for x in names - tied if x.endswith("weight") and any(s in x for s in split)], names
    if name == "llama_8_heads_tp4":  # 2 KV heads over 4 ranks: each KV head replicated on two, and counted
        assert {"model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"} <= names


def test_tools_read_the_manifest(tp_models: dict[str, dict[str, Any]]) -> None:
    m = tp_models["deepseek_v3_moe"]
    assert validate_om(m["tp"]).startswith(f"ok: {m['tp']}: manifest of 2 ranks (tp 2, ep 2)")
    dump = _npuc("dump", m["tp"], "--rank", "1")
    assert dump.returncode == 0, dump.stderr
    listing = dump.stdout
    assert "rank 1 of 2" in listing and "all_reduce" in listing and "all_gather" in listing
    # Experts 4..7 on rank 1: a fused_moe over 4 of the 8 experts, routing over all 8.
    moe = next(line for line in listing.splitlines() if "fused_moe" in line and "expert_offset=4" in line)
    assert moe
    info = _npuc("info", m["tp"])
    assert info.returncode == 0 and "2 ranks (tp 2, ep 2)" in info.stdout and "tp.rank1.om" in info.stdout
    js = json.loads(_npuc("dump", "--json", m["tp"]).stdout)
    assert js["manifest"]["world"] == 2 and js["rank"] == 0
    r = _npuc("export-onnx", m["tp"], str(Path(m["tp"]).with_name("x.onnx")))  # one model only: a rank's file
    assert r.returncode == 2 and "NPUC-E0150" in r.stderr and "tp.rank0.om" in r.stderr


def test_split_that_does_not_divide_is_refused(tp_models: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    ckpt = tp_models["llama"]["root"] / "ckpt"
    r = _npuc("compile", str(ckpt), "--input_shape", "input_ids:1,8", "--max_seq_len", "32", "--tp", "3",
              "--output", str(tmp_path / "m"))
    assert r.returncode == 3 and "NPUC-E0151" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []  # no rank file left behind
    r = _npuc("compile", str(ckpt), "--input_shape", "input_ids:1,8", "--tp", "2", "--ep", "3",
              "--output", str(tmp_path / "m"))
    assert r.returncode == 2 and "NPUC-E0124" in r.stderr


def test_a_failed_compile_keeps_the_previous_output(tp_models: dict[str, dict[str, Any]], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills while rank 1's file is written: a coded error, and the previous
    compile's manifest and rank files are left as they were (no new file, no partial one)."""
    import npuc.compiler.driver as drv
    from npuc.errors import NpucError

    ckpt = str(tp_models["llama"]["root"] / "ckpt")
    compile_model(ckpt, input_shape=f"input_ids:1,{PREFILL}", output=str(tmp_path / "m"), max_seq_len=32, tp=2)
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    real, calls = drv._write, []

    def full_disk(low: Any, path: str, *args: Any) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", path)
        real(low, path, *args)

    monkeypatch.setattr(drv, "_write", full_disk)
    with pytest.raises(NpucError) as e:
        compile_model(ckpt, input_shape=f"input_ids:1,{PREFILL}", output=str(tmp_path / "m"), max_seq_len=48, tp=2)
    assert e.value.code == "NPUC-E0406" and len(calls) == 2
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == before


def test_wrong_world_size_or_rank_is_refused(tp_models: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    m = tp_models["llama"]
    r = _npuc("generate", m["tp"], "--prompt-ids", "1,2,3")
    assert r.returncode == 2 and "NPUC-E0150" in r.stderr and "--nproc-per-node 2" in r.stderr
    r = _npuc("generate", m["tp"], "--tp", "3", "--prompt-ids", "1,2,3")
    assert r.returncode == 2 and "NPUC-E0150" in r.stderr
    # Both ranks handed rank 0's own file: rank 1 refuses it.
    ids = tmp_path / "ids.npy"
    np.save(ids, np.ones((1, PREFILL), dtype=np.int64))
    rank0 = str(Path(m["tp"]).with_name("tp.rank0.om"))
    res = _ranks(2, [str(HERE / "tp_worker.py"), rank0, str(ids), str(tmp_path / "o.json")], timeout=120,
                 NPUC_DIST_TIMEOUT="20")
    assert res[1].returncode != 0 and "NPUC-E0150" in res[1].stderr and "rank 0" in res[1].stderr


def test_rank_file_of_another_compile_is_refused(tp_models: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    import shutil

    src = Path(tp_models["llama"]["tp"]).parent
    for f in ("tp.om", "tp.rank0.om", "tp.rank1.om"):
        shutil.copy(src / f, tmp_path / f)
    shutil.copy(Path(tp_models["qwen2"]["tp"]).with_name("tp.rank1.om"), tmp_path / "tp.rank1.om")
    r = _npuc("validate", str(tmp_path / "tp.om"))
    assert r.returncode == 4 and "NPUC-E0152" in r.stderr
    r = _npuc("generate", str(tmp_path / "tp.om"), "--tp", "2", "--prompt-ids", "1,2,3")
    assert r.returncode != 0 and "NPUC-E0152" in r.stderr


def test_hostile_manifest_is_refused(tmp_path: Path) -> None:
    from npuc.backend.manifest import MANIFEST
    from npuc.backend.om_format import OmWriter

    bad = {"format": "npuc-ranks", "world": 2, "tp": 2, "ep": 1,
           "ranks": [{"file": "../../etc/passwd", "fingerprint": "0" * 64, "weights_bytes": 1},
                     {"file": "m.rank1.om", "fingerprint": "0" * 64, "weights_bytes": 1}]}
    for doc in (bad, {**bad, "world": 10**9}, {**bad, "ranks": "x"}, "not json"):
        with OmWriter(str(tmp_path / "m.om")) as w:
            w.add_section(MANIFEST, (json.dumps(doc) if not isinstance(doc, str) else doc).encode())
        r = _npuc("info", str(tmp_path / "m.om"))
        assert r.returncode == 4 and "NPUC-E0405" in r.stderr and "Traceback" not in r.stderr


def test_a_dead_peer_makes_the_others_exit(tp_models: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """Rank 1 dies after loading: rank 0's first collective fails with NPUC-E0153 within the
    timeout, instead of waiting forever."""
    m = tp_models["llama"]
    np.save(tmp_path / "ids.npy", np.ones((1, PREFILL), dtype=np.int64))
    t0 = time.monotonic()
    res = _ranks(2, [str(HERE / "tp_worker.py"), m["tp"], str(tmp_path / "ids.npy"), str(tmp_path / "o.json"),
                     "die"], timeout=120, NPUC_DIST_TIMEOUT="20")
    assert time.monotonic() - t0 < 90
    assert res[1].returncode == 9
    assert res[0].returncode != 0 and "NPUC-E0153" in res[0].stderr, res[0].stderr[-2000:]


def test_launcher_stops_the_ranks_when_one_fails(tp_models: dict[str, dict[str, Any]]) -> None:
    """`npuc generate --tp 2` with a prompt id past the vocabulary: a coded error, a non-zero
    exit, and no rank left running (the command returns)."""
    m = tp_models["llama"]
    r = _npuc("generate", m["tp"], "--tp", "2", "--prompt-ids", "1,2,100000", timeout=120)
    assert r.returncode != 0 and "NPUC-E0" in r.stderr and "Traceback" not in r.stderr


def _peak_rss_kib(*args: str) -> int:
    """Peak RSS (KiB) of `npuc args` run in a fresh process."""
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True); "
            "sys.stderr.write(r.stderr.decode()); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
            "sys.exit(r.returncode)")
    r = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "npuc", *args], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


def test_tp_compile_does_not_hold_the_model_twice(tmp_path: Path) -> None:
    """A --tp 2 compile's peak RSS within 1.2x of the single-device compile's, on a model whose
    weights (380 MB) dominate it: each rank's shard streams from the checkpoint when its file
    is written, one rank at a time."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=256)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "ckpt")
    common = [str(tmp_path / "ckpt"), "--input_shape", "input_ids:1,16", "--max_seq_len", "64"]
    one = _peak_rss_kib("compile", *common, "--output", str(tmp_path / "one"))
    two = _peak_rss_kib("compile", *common, "--output", str(tmp_path / "two"), "--tp", "2")
    weights = model_info(str(tmp_path / "one.om"))["weights_bytes"]
    assert weights > 300e6
    assert two <= 1.2 * one, (one, two)


# -- the config-only plan of a full-size DeepSeek-V3 ------------------------------------------

def test_full_size_deepseek_v3_plan_matches_the_config_arithmetic(tmp_path: Path) -> None:
    """DeepSeek-V3's published dimensions (4 of its 61 layers: 3 dense, 1 MoE, to keep CI
    short; docs/parallel.md has all 61) at --tp 8 --ep 8, planned from config.json alone:
    each rank's weight bytes, KV bytes per token and decode collective bytes are what the
    config's arithmetic says."""
    cfg = json.loads((HERE.parent / "examples/deepseek-v3/config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = _npuc("plan", str(tmp_path / "config.json"), "--input_shape", "input_ids:1,16", "--max_seq_len", "256",
              "--tp", "8", "--ep", "8", "--json", str(tmp_path / "plan.json"), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    plans = json.loads((tmp_path / "plan.json").read_text())
    assert len(plans) == 8
    h, v, inter, moe_i, e, heads = 7168, 129280, 18432, 2048, 256, 128
    q_lora, kv_lora, rope, nope, vd = 1536, 512, 64, 128, 128
    n, dense, moe_layers, bf16 = 8, 3, 1, 2
    layers = dense + moe_layers
    attn_rep = q_lora * h + q_lora + (kv_lora + rope) * h + kv_lora + 2 * h  # q_a, its norm, kv_a, its norm, 2 norms
    attn_split = heads * (nope + rope) * q_lora + heads * nope * kv_lora + heads * kv_lora * vd + h * heads * vd
    dense_split = 3 * h * inter
    moe_split = (e * 3 * h * moe_i) + 3 * h * moe_i  # routed experts, the shared one
    router = e * h * 4 + e * 4  # the router and its correction bias, both f32 (as transformers keeps them)
    replicated = (v * h + h + layers * attn_rep) * bf16 + moe_layers * router
    split = (v * h + layers * attn_split + dense * dense_split + moe_layers * moe_split) * bf16
    tables = 1 << 20  # RoPE tables, positions: small replicated constants, and alignment
    for p in plans:
        assert replicated <= p["replicated_bytes"] <= replicated + tables, (p["replicated_bytes"], replicated)
        assert split // n <= p["weights_bytes"] - p["replicated_bytes"] <= split // n + tables
        assert p["kv_bytes_per_token"] == layers * (kv_lora + rope) * bf16  # the latent, on every rank
        # Per decode step: an all-reduce of [1,1,H] after attention and the FFN (and the shared
        # expert beside the routed ones), and the vocab-parallel logits gathered.
        reduces = 2 * dense + 3 * moe_layers
        assert p["collectives"]["decode"] == reduces + 1
        assert p["wire_bytes"]["decode"] == reduces * 2 * (n - 1) * h * bf16 // n + (n - 1) * v * bf16 // n


# -- the pass on textual IR ------------------------------------------------------------------

BLOCK = """
    graph main(%x : f32[1,4,8]) {
      const @wq : f32[8,8]
      const @wk : f32[4,8]
      const @wv : f32[4,8]
      const @wo : f32[8,8]
      const @wg : f32[8,8]
      const @wu : f32[8,8]
      const @wd : f32[8,8]
      const @head : f32[12,8]
      %q : f32[1,4,8] = linear(%x, @wq)
      %qh : f32[1,4,4,2] = reshape[shape=[1,4,4,2]](%q)
      %qt : f32[1,4,4,2] = transpose[perm=[0,2,1,3]](%qh)
      %k : f32[1,4,4] = linear(%x, @wk)
      %kh : f32[1,4,2,2] = reshape[shape=[1,4,2,2]](%k)
      %kt : f32[1,2,4,2] = transpose[perm=[0,2,1,3]](%kh)
      %v : f32[1,4,4] = linear(%x, @wv)
      %vh : f32[1,4,2,2] = reshape[shape=[1,4,2,2]](%v)
      %vt : f32[1,2,4,2] = transpose[perm=[0,2,1,3]](%vh)
      %a : f32[1,4,4,2] = fused_attention[causal=true, scale=0.5](%qt, %kt, %vt)
      %at : f32[1,4,4,2] = transpose[perm=[0,2,1,3]](%a)
      %am : f32[1,4,8] = reshape[shape=[1,4,8]](%at)
      %o : f32[1,4,8] = linear(%am, @wo)
      %h : f32[1,4,8] = add(%x, %o)
      %g : f32[1,4,8] = linear(%h, @wg)
      %u : f32[1,4,8] = linear(%h, @wu)
      %s : f32[1,4,8] = swiglu(%g, %u)
      %d : f32[1,4,8] = linear(%s, @wd)
      %y : f32[1,4,8] = add(%h, %d)
      %logits : f32[1,4,12] = linear(%y, @head)
      return %logits
    }
    """


def _lockstep(graphs: list[Any], feeds: dict[str, torch.Tensor]) -> torch.Tensor:
    """Run every rank's graph node by node together, the collectives computed across them
    (a sum; a concatenation in rank order): what N processes would compute."""
    from npuc.ir import get_op

    envs = []
    for g in graphs:
        env = {id(v): feeds[v.name] for v in g.inputs}
        env.update({id(c): c.const.load() for c in g.constants.values()})
        envs.append(env)
    for nodes in zip(*(g.nodes for g in graphs), strict=True):
        ins = [[env[id(v)] for v in n.inputs] for n, env in zip(nodes, envs, strict=True)]
        for r, (n, env) in enumerate(zip(nodes, envs, strict=True)):
            if n.op == "all_reduce":
                out = [sum(x[0] for x in ins)]
            elif n.op == "all_gather":
                out = [torch.cat([x[0] for x in ins], dim=n.attrs["axis"])]
            else:
                out = get_op(n.op).run(ins[r], n.attrs)
            env.update({id(o): t for o, t in zip(n.outputs, out, strict=True)})
    return envs[0][id(graphs[0].outputs[0])]


@pytest.mark.parametrize("world", [2, 4])
def test_pass_splits_heads_and_ffn_and_sums_partials(world: int) -> None:
    """Column-parallel q/k/v and gate/up over each rank's heads and FFN columns, row-parallel
    o/down followed by an all_reduce, the LM head vocab-parallel and gathered; at 4 ranks the
    2 KV heads are each held by the 2 ranks whose queries read them. Together the ranks
    compute what the unsplit graph does."""
    from test_fusion_passes import interpret, ir, load

    from npuc.ir import TensorSource, print_graph, verify
    from npuc.ir.graph import clone_graph
    from npuc.passes.tensor_parallel import TensorParallel

    g = load(BLOCK)
    gen = torch.Generator().manual_seed(0)
    for c in g.constants.values():
        c.const = TensorSource(0.3 * torch.randn(c.type.shape, generator=gen))
    ranks = []
    for r in range(world):
        res = TensorParallel(r, world)(clone_graph(g))
        verify(res.graph)
        ranks.append(res.graph)
        assert res.details["sharded"] == {"column": 6, "row": 2, "experts": 0, "attention": 1, "all_reduce": 2,
                                          "all_gather": 1}
    if world == 2:
        assert print_graph(ranks[1]) == ir(EXPECTED_RANK1_OF_2)
    x = torch.randn(1, 4, 8, generator=gen)
    want = interpret(g, {"x": x})[0]
    torch.testing.assert_close(_lockstep(ranks, {"x": x}), want, atol=1e-5, rtol=1e-4)  # another sum order


EXPECTED_RANK1_OF_2 = """
    graph main(%x : f32[1,4,8]) {
      const @wq : f32[4,8]
      const @wk : f32[2,8]
      const @wv : f32[2,8]
      const @wo : f32[8,4]
      const @wg : f32[4,8]
      const @wu : f32[4,8]
      const @wd : f32[8,4]
      const @head : f32[6,8]
      %q : f32[1,4,4] = linear(%x, @wq)
      %qh : f32[1,4,2,2] = reshape[shape=[1,4,2,2]](%q)
      %qt : f32[1,2,4,2] = transpose[perm=[0,2,1,3]](%qh)
      %k : f32[1,4,2] = linear(%x, @wk)
      %kh : f32[1,4,1,2] = reshape[shape=[1,4,1,2]](%k)
      %kt : f32[1,1,4,2] = transpose[perm=[0,2,1,3]](%kh)
      %v : f32[1,4,2] = linear(%x, @wv)
      %vh : f32[1,4,1,2] = reshape[shape=[1,4,1,2]](%v)
      %vt : f32[1,1,4,2] = transpose[perm=[0,2,1,3]](%vh)
      %a : f32[1,2,4,2] = fused_attention[causal=true, scale=0.5](%qt, %kt, %vt)
      %at : f32[1,4,2,2] = transpose[perm=[0,2,1,3]](%a)
      %am : f32[1,4,4] = reshape[shape=[1,4,4]](%at)
      %o : f32[1,4,8] = linear(%am, @wo)
      %o.sum : f32[1,4,8] = all_reduce[world=2](%o)
      %h : f32[1,4,8] = add(%x, %o.sum)
      %g : f32[1,4,4] = linear(%h, @wg)
      %u : f32[1,4,4] = linear(%h, @wu)
      %s : f32[1,4,4] = swiglu(%g, %u)
      %d : f32[1,4,8] = linear(%s, @wd)
      %d.sum : f32[1,4,8] = all_reduce[world=2](%d)
      %y : f32[1,4,8] = add(%h, %d.sum)
      %logits.part : f32[1,4,6] = linear(%y, @head)
      %logits : f32[1,4,12] = all_gather[axis=2, world=2](%logits.part)
      return %logits
    }
    """


def test_pass_refuses_what_it_cannot_split() -> None:
    from test_fusion_passes import load

    from npuc.errors import NpucError
    from npuc.ir.graph import clone_graph
    from npuc.passes.tensor_parallel import TensorParallel

    g = load(BLOCK)
    with pytest.raises(NpucError) as e:  # 4 query heads, 2 KV heads over 3 ranks
        TensorParallel(0, 3)(clone_graph(g))
    assert e.value.code == "NPUC-E0151" and "3" in e.value.message


# -- what earlier compiles of the output left (issue 35) ------------------------------------

@pytest.fixture(scope="module")
def llama8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 heads, so --tp 4 and --tp 2 both split it (no tp_models: the sweeps need only a compile)."""
    import transformers as tf

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama8") / "ckpt"
    tf.AutoModelForCausalLM.from_config(_llama8()).save_pretrained(path)
    return path


def _named_by_manifest(out: Path) -> set[str]:
    from npuc.backend.manifest import read_manifest
    from npuc.backend.om_format import OmFile

    with OmFile.open(str(out), verify=True) as om:
        manifest = read_manifest(om)
    assert manifest is not None
    return {out.name, *(r.file for r in manifest.ranks)}


def test_a_smaller_tp_over_a_larger_one_leaves_no_rank_file_unnamed(llama8_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.om"
    for tp in (4, 2):
        compile_model(str(llama8_ckpt), input_shape=f"input_ids:1,{PREFILL}", output=str(tmp_path / "m"),
                      max_seq_len=32, tp=tp)
        assert {f.name for f in tmp_path.iterdir()} == _named_by_manifest(out)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["m.om", "m.rank0.om", "m.rank1.om"]
    (tmp_path / "other.rank3.om").write_bytes(b"not ours")  # another output's name: kept
    compile_model(str(llama8_ckpt), input_shape=f"input_ids:1,{PREFILL}", output=str(tmp_path / "m"),
                  max_seq_len=32, tp=2)
    assert (tmp_path / "other.rank3.om").exists()


def test_a_killed_tp_compile_leaves_nothing_the_next_one_keeps(llama8_ckpt: Path, tmp_path: Path) -> None:
    """SIGKILL skips the cleanup that removes the .part files of the ranks written so far; the
    next compile of the output sweeps them (their process is gone), as the .om writer sweeps its own."""
    import signal
    import time

    argv = [sys.executable, "-m", "npuc", "compile", str(llama8_ckpt), "--input_shape", f"input_ids:1,{PREFILL}",
            "--max_seq_len", "32", "--tp", "4", "--output", str(tmp_path / "m")]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not any(f.name.endswith(".part") for f in tmp_path.iterdir()):
        assert proc.poll() is None, "the compile ended before it wrote a rank's .part file"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = [f.name for f in tmp_path.iterdir()]
    assert any(n.endswith(".part") for n in left) and "m.om" not in left, left
    live = tmp_path / f".m.rank0.om.{os.getppid()}.part"  # a live compile's (pytest's parent): kept
    live.write_bytes(b"")
    compile_model(str(llama8_ckpt), input_shape=f"input_ids:1,{PREFILL}", output=str(tmp_path / "m"),
                  max_seq_len=32, tp=2)
    live.unlink()
    assert {f.name for f in tmp_path.iterdir()} == _named_by_manifest(tmp_path / "m.om")
