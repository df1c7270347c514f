"""The prefix pool (`--prefix_cache P`, issue 36; backend/lower.py, npucrt/src/prefix.c): P
entries beside the slots in the state region, each every positional cache of one sequence.
On both executors a prompt's first n positions saved from a slot and loaded back (into the
same slot or another, over another prompt) decode as the prompt straight after its prefill
(byte for byte on the C executor), and a shorter prefix plus the rest of the prompt through
decode gives the prefill's logits; the pool's bytes are in the state and in `npuc info`,
`dump --summary` and `plan`; bad arguments, damaged pools (the same refusal from the C
loader as from the Python one) and models with recurrent state are refused with codes."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from compile_pool import CompilePool
from hf_models import save_checkpoint

from npuc.backend.om_format import OmFile
from npuc.backend.om_schema import PREFIX_POOL
from npuc.backend.om_sections import MODEL_SECTIONS, join_model
from npuc.cli.main import main
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.runtime import Session
from npuc.runtime.native_session import NativeSession, runtime_library
from npuc.tools.om_tools import model_info, render_info
from tests import npucrt_util

ROOT = Path(__file__).resolve().parent.parent
PREFILL, MAX_SEQ, ENTRIES = 16, 64, 2
PROMPT = [5, 17, 3, 99, 42, 7, 64, 11, 2, 3]
OTHER = [9] * 12
EXECUTORS = ["torch", "c"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llamas (one slot, two, two with an int8 cache, two without a pool) and a DeepSeek-V3
    (MLA: one latent cache a layer), each with --max_seq_len 64 --prefix_cache 2."""
    root = tmp_path_factory.mktemp("prefix")
    for arch in ("llama", "deepseek_v3"):
        save_checkpoint(arch, str(root / arch))
    specs = {"one": ("llama", 1, {}), "slots": ("llama", 2, {}), "int8": ("llama", 2, {"kv_cache_dtype": "int8"}),
             "mla": ("deepseek_v3", 2, {}), "plain": ("llama", 2, {"prefix_cache": None})}
    with CompilePool() as pool:
        oms = {name: pool.compile(str(root / arch), input_shape=f"input_ids:{slots},{PREFILL}", max_seq_len=MAX_SEQ,
                                  output=str(root / name), **{"prefix_cache": ENTRIES, **kw})
               for name, (arch, slots, kw) in specs.items()}
        return {name: Path(om.result()) for name, om in oms.items()}


def _open(kind: str, om: Path) -> Any:
    if kind == "c" and runtime_library() is None:
        pytest.skip("no C compiler for libnpucrt")
    return NativeSession(str(om)) if kind == "c" else Session.load(str(om))


class _Seq:
    """Prefill and one-token decode steps of one slot of a session; the other slots are fed
    token 0 at the last position, a row no test reads."""

    def __init__(self, s: Any) -> None:
        self.s = s
        self.slots = int(s.programs["decode"].inputs[0].shape[0])
        self.inputs = {t.name for t in s.programs["prefill"].inputs}

    def prefill(self, slot: int, prompt: list[int]) -> np.ndarray:
        ids = np.zeros((1, PREFILL), dtype=np.int64)
        ids[0, :len(prompt)] = prompt
        feeds = {"input_ids": ids, "last_token": np.array([len(prompt) - 1]), "slot": np.array([slot])}
        out = self.s.run({k: v for k, v in feeds.items() if k in self.inputs}, "prefill")
        return _np(out["logits"]).reshape(-1)

    def decode(self, slot: int, token: int, pos: int) -> np.ndarray:
        ids = np.zeros((self.slots, 1), dtype=np.int64)
        at = np.full(self.slots, MAX_SEQ - 1, dtype=np.int64)
        ids[slot, 0], at[slot] = token, pos
        out = self.s.run({"input_ids": ids, "position": at}, "decode")
        return _np(out["logits"])[slot].reshape(-1)


def _np(x: Any) -> np.ndarray:
    return (x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)).astype(np.float32)


def _model(om: Path) -> Any:
    with OmFile.open(str(om)) as f:
        return join_model(str(om), {n: bytes(f.section(n)) for n in MODEL_SECTIONS})


# --- the .om -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["slots", "int8", "mla"])
def test_pool_tensors_and_metadata(name: str, models: dict[str, Path]) -> None:
    """Every state has a pool tensor [P, *its shape[1:]] of its dtype after it in the state
    region, named in metadata prefix_pool with its position axis, and no program uses one."""
    m = _model(models[name])
    meta = {e.key: e.value for e in m.metadata}
    states = {t.name: (i, t) for i, t in enumerate(m.tensors) if t.region == "state" and not t.HasField("base")}
    caches = {n: t for n, (_, t) in states.items() if not n.startswith(PREFIX_POOL + ".")}
    assert caches and all(n.startswith("kv_cache.") for n in caches)
    assert {n.endswith(".latent") for n in caches} == {name == "mla"}
    assert meta[PREFIX_POOL] == ",".join(f"{n}:2" for n in caches)
    pools = set()
    for n, t in caches.items():
        i, p = states[f"{PREFIX_POOL}.{n}"]
        assert (list(p.shape), p.dtype) == ([ENTRIES, *t.shape[1:]], t.dtype)
        assert p.offset >= max(c.offset + c.nbytes for c in caches.values())
        pools.add(i)
    used = {i for p in m.programs for i in [*p.inputs, *p.outputs, *(j for o in p.ops for j in [*o.inputs,
                                                                                                  *o.outputs])]}
    assert not used & pools
    assert not any(t.HasField("base") and t.base in pools for t in m.tensors)
    if name == "int8":
        assert {t.dtype for t in caches.values()} == {"i8"}


def test_pool_bytes_in_the_state_info_dump_and_plan(models: dict[str, Path], tmp_path: Path) -> None:
    """The pool is P slots' worth of every cache; the state grows by it (and alignment), the KV
    figures per token and per slot do not; `npuc info`, `dump --summary` and `npuc plan` say so."""
    info, plain = model_info(str(models["slots"])), model_info(str(models["plain"]))
    pool = info["prefix_pool_bytes"]
    assert info["prefix_pool_entries"] == ENTRIES and plain["prefix_pool_entries"] == 0
    assert pool == ENTRIES * info["kv_cache_bytes_per_slot"] > 0
    assert 0 <= info["state_bytes"] - plain["state_bytes"] - pool < 512 * 16  # alignment of each pool tensor
    for k in ("kv_cache_bytes_per_token", "kv_cache_bytes_per_slot", "kv_slots"):
        assert info[k] == plain[k]
    text = render_info(str(models["slots"]), info)
    assert f"prefix pool  {ENTRIES} entries, {pool:,} B of the state" in text
    assert "prefix pool" not in render_info(str(models["plain"]), plain)
    r = CliRunner().invoke(main, ["info", str(models["slots"])])
    assert r.exit_code == 0 and f"{pool:,} B" in r.output
    r = CliRunner().invoke(main, ["dump", "--summary", str(models["slots"])])
    assert r.exit_code == 0 and f"of which prefix pool {pool:,} B ({ENTRIES} entries)" in r.output, r.output
    for s in (Session.load(str(models["slots"])), _open("c", models["slots"])):
        assert (s.prefix_entries, s.prefix_pool_bytes, s.state_bytes) == (ENTRIES, pool, info["state_bytes"])
    plans: list[Any] = []
    compile_model(str(models["slots"].parent / "llama"), input_shape=f"input_ids:2,{PREFILL}", max_seq_len=MAX_SEQ,
                  prefix_cache=ENTRIES, output="plan", plan=plans)
    assert (plans[0].prefix_pool_bytes, plans[0].state_bytes) == (pool, info["state_bytes"])


# --- the copies --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", EXECUTORS)
@pytest.mark.parametrize("name", ["one", "slots", "int8", "mla"])
def test_a_loaded_prompt_decodes_as_after_its_prefill(kind: str, name: str, models: dict[str, Path]) -> None:
    """The whole prompt saved from slot 0, another prompt over it (and over the last slot),
    the entry loaded into the last slot: two decode steps give the logits they give straight
    after the prompt's prefill, exactly on the C executor (the bytes are copied)."""
    s = _open(kind, models[name])
    q = _Seq(s)
    q.prefill(0, PROMPT)
    want = [q.decode(0, 1, len(PROMPT)), q.decode(0, 2, len(PROMPT) + 1)]
    s.reset_state()
    q.prefill(0, PROMPT)
    s.save_prefix(0, ENTRIES - 1, len(PROMPT))
    last = q.slots - 1
    for k in {0, last}:
        q.prefill(k, OTHER)
    s.load_prefix(ENTRIES - 1, last, len(PROMPT))
    got = [q.decode(last, 1, len(PROMPT)), q.decode(last, 2, len(PROMPT) + 1)]
    for a, b in zip(got, want, strict=True):
        if kind == "c":
            assert np.array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", EXECUTORS)
@pytest.mark.parametrize("name", ["slots", "int8", "mla"])
def test_a_shorter_prefix_and_the_rest_through_decode(kind: str, name: str, models: dict[str, Path]) -> None:
    """Four positions loaded, the prompt's other six tokens fed one decode step each: the last
    step's logits are the prefill's, and the next step's those after the prefill (the rows
    after the prefix in the slot, another prompt's, are never read)."""
    s = _open(kind, models[name])
    q = _Seq(s)
    full = q.prefill(1, PROMPT)
    after = q.decode(1, 1, len(PROMPT))
    s.save_prefix(1, 0, 4)
    q.prefill(0, OTHER)
    s.load_prefix(0, 0, 4)
    for i in range(4, len(PROMPT)):
        rest = q.decode(0, PROMPT[i], i)
    # int8: prefill attends its own keys unquantized, decode the cache's codes (about 0.3% of the
    # largest logit, |logit| <= 0.4 here)
    atol = 5e-3 if name == "int8" else 1e-4
    np.testing.assert_allclose(rest, full, rtol=0, atol=atol)
    np.testing.assert_allclose(q.decode(0, 1, len(PROMPT)), after, rtol=0, atol=atol)


@pytest.mark.parametrize("kind", EXECUTORS)
def test_copy_slot_beside_the_pool(kind: str, models: dict[str, Path]) -> None:
    """copy_slot copies the slots' caches and leaves the pool (no [slots, ...] tensor) alone."""
    s = _open(kind, models["slots"])
    q = _Seq(s)
    q.prefill(1, OTHER)
    s.save_prefix(1, 1, len(OTHER))
    q.prefill(0, PROMPT)
    s.copy_slot(0, 1)
    assert np.array_equal(q.decode(1, 1, len(PROMPT)), q.decode(0, 1, len(PROMPT)))
    s.load_prefix(1, 0, len(OTHER))  # the pool kept what was saved before the copy
    q2 = _Seq(_open(kind, models["slots"]))
    q2.prefill(0, OTHER)
    np.testing.assert_allclose(q.decode(0, 4, len(OTHER)), q2.decode(0, 4, len(OTHER)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", EXECUTORS)
def test_bad_arguments_are_coded_errors(kind: str, models: dict[str, Path]) -> None:
    s = _open(kind, models["slots"])
    cases = [((0, ENTRIES, 1), "prefix entry 2 is outside the model's 2 entries"),
             ((0, -1, 1), "prefix entry -1 is outside"), ((2, 0, 1), "slot 2 is outside the model's 2 slots"),
             ((-1, 0, 1), "slot -1 is outside"), ((0, 0, 0), "a prefix of 0 positions: the model caches 1 to 64"),
             ((0, 0, MAX_SEQ + 1), "a prefix of 65 positions")]
    for (slot, entry, n), msg in cases:
        with pytest.raises(NpucError) as e:
            s.save_prefix(slot, entry, n)
        with pytest.raises(NpucError) as e2:
            s.load_prefix(entry, slot, n)
        for err in (e.value, e2.value):
            assert err.code == "NPUC-E0108" and msg in err.message, err.message
    s.save_prefix(1, 1, MAX_SEQ)  # every position: the largest prefix
    s.load_prefix(1, 0, MAX_SEQ)
    plain = _open(kind, models["plain"])
    assert plain.prefix_entries == 0
    with pytest.raises(NpucError, match="the model has no prefix pool") as e:
        plain.save_prefix(0, 0, 1)
    assert e.value.code == "NPUC-E0108" and "--prefix_cache" in e.value.hint


# --- other models ------------------------------------------------------------------------------

def test_conv_caches_are_pooled(tmp_path: Path) -> None:
    """A causal conv's cache of its inputs (LFM2's short conv: conv_cache.<i>) is kept by
    position, so it is pooled and restored as the KV caches are."""
    from test_conv_cache import ConvLM, _compile

    om = _compile(ConvLM(), tmp_path / "conv", prefix_cache=ENTRIES)
    m = _model(Path(om))
    assert {e.key: e.value for e in m.metadata}[PREFIX_POOL] == "conv_cache.0:2,conv_cache.1:2"
    s = Session.load(om)
    ids = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    first = s.run({"input_ids": ids, "last_token": np.array([7])}, "prefill")["logits"]
    want = s.run({"input_ids": np.array([[7]]), "position": np.array([8])}, "decode")["logits"]
    s.run({"input_ids": ids, "last_token": np.array([7])}, "prefill")
    s.save_prefix(0, 1, 8)
    s.run({"input_ids": ids[:, ::-1].copy(), "last_token": np.array([7])}, "prefill")
    s.load_prefix(1, 0, 8)
    got = s.run({"input_ids": np.array([[7]]), "position": np.array([8])}, "decode")["logits"]
    assert first.shape[-1] == got.shape[-1] and torch.equal(got, want)


def test_recurrent_state_refuses_a_prefix_cache(tmp_path: Path) -> None:
    """A state-space model keeps each slot's state as of its last token: no prefix of it can be
    restored, so --prefix_cache is refused when lowering, naming the state (NPUC-E0123)."""
    import transformers as tf
    from model_matrix import tiny_config

    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(tiny_config("mamba2")).save_pretrained(str(tmp_path / "mamba2"))
    with pytest.raises(NpucError) as e:
        compile_model(str(tmp_path / "mamba2"), input_shape="input_ids:1,8", max_seq_len=48, prefix_cache=2,
                      output=str(tmp_path / "m"))
    assert e.value.code == "NPUC-E0123" and "ssm_state.0" in e.value.message and "--prefix_cache" in e.value.hint
    assert not (tmp_path / "m.om").exists()


# --- the loaders and the C library under the sanitizers ---------------------------------------

def _edits() -> list[tuple[str, Any]]:
    def meta(value: str | None) -> Any:
        def edit(m: Any) -> None:
            for e in list(m.metadata):
                if e.key == PREFIX_POOL:
                    if value is None:
                        m.metadata.remove(e)
                    else:
                        e.value = value
        return edit

    def pool_tensor(fn: Any) -> Any:
        def edit(m: Any) -> None:
            fn(m, next(t for t in m.tensors if t.name.startswith(PREFIX_POOL + ".")),
               next(i for i, t in enumerate(m.tensors) if t.name.startswith(PREFIX_POOL + ".")))
        return edit

    def transpose(m: Any, t: Any, i: int) -> None:
        t.shape[2], t.shape[3] = t.shape[3], t.shape[2]

    def into_program(m: Any, t: Any, i: int) -> None:
        op = next(o for o in m.programs[1].ops if o.op == "kv_write")
        op.inputs[0] = i

    def other_entries(m: Any, t: Any, i: int) -> None:  # the first pool tensor holds 1 entry, the others 2
        t.shape[0], t.nbytes = 1, t.nbytes // 2

    def drop_first(m: Any) -> None:
        e = next(e for e in m.metadata if e.key == PREFIX_POOL)
        e.value = e.value.split(",", 1)[1]

    return [("malformed", meta("kv_cache.0.k")), ("empty", meta("")), ("repeated", meta("a:2,a:2")),
            ("axis", meta("kv_cache.0.k:123")), ("unknown", meta("nope:2")), ("axis0", meta("kv_cache.0.k:0")),
            ("axis4", meta("kv_cache.0.k:4")), ("pool of a pool", meta("prefix_pool.kv_cache.0.k:2,kv_cache.0.k:2")),
            ("not listed", drop_first), ("no metadata", meta(None)), ("layout", pool_tensor(transpose)),
            ("entries", pool_tensor(other_entries)), ("used", pool_tensor(into_program))]


def test_damaged_pools_are_refused_alike(models: dict[str, Path], tmp_path: Path) -> None:
    """Edits of the pool's metadata and tensors: the C loader (held to -Werror -Wconversion)
    refuses each with the Python loader's code and message."""
    if npucrt_util.compiler() is None:
        pytest.skip("no C compiler")
    from tests.test_npucrt_loader import compare, python_load
    from tests.test_om_validate import rewrite

    lib = npucrt_util.open_lib(npucrt_util.build(tmp_path / "lib", sources=npucrt_util.LOADER_SOURCES,
                                                 stub_exec=True, warnings=True))
    assert npucrt_util.load(lib, models["slots"]) == (0, "")
    codes = {}
    for name, edit in _edits():
        path = rewrite(models["slots"], tmp_path / f"{name.replace(' ', '_')}.om", edit)
        compare(lib, path)
        codes[name] = python_load(str(path), ported=False)[:2]
    # without its metadata the pool is two more states no program uses, [2, ...] as the slots: loadable
    assert codes.pop("no metadata") == (0, "")
    assert all(code in (410, 411) for code, _ in codes.values()), codes
    assert "is not a list of state:axis entries" in codes["malformed"][1]
    assert "uses prefix pool tensor 'prefix_pool.kv_cache.0.k'" in codes["used"][1]
    assert "state 'kv_cache.0.k' is not in the prefix pool" in codes["not listed"][1]


def test_the_c_copies_under_the_sanitizers(models: dict[str, Path], tmp_path: Path) -> None:
    """npucrt/tests/prefix_driver.c under ASan and UBSan (prefix.c also under the loader's
    warnings): the C decode loop's prefill, save, load into another slot, a step it idles, the
    rest of the prompt and two tokens, against the same without the pool; the refusals, the
    whole cache both ways, and copy_slot."""
    cc = npucrt_util.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    subprocess.run([cc, "-std=c11", "-fsyntax-only", *npucrt_util.WARNINGS, f"-I{ROOT / 'include'}",
                    f"-I{ROOT / 'npucrt' / 'src'}", str(ROOT / "npucrt/src/prefix.c"),
                    str(ROOT / "npucrt/tests/prefix_driver.c")], check=True, capture_output=True, timeout=120)
    exe = npucrt_util.build_exe(tmp_path, "npucrt/tests/prefix_driver.c", sanitize=True, warnings=False)
    for name in ("slots", "int8", "mla"):
        for n in (10, 4, 1):
            atol = "5e-3" if name == "int8" else "1e-4"  # as test_a_shorter_prefix_and_the_rest_through_decode
            r = subprocess.run([str(exe), str(models[name]), str(n), atol], capture_output=True, text=True,
                               timeout=300)
            assert (r.returncode, r.stdout) == (0, "ok\n"), f"{name} n={n}: {r.stderr[-2000:]}"

