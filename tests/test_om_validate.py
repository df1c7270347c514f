"""The one `.om` check (runtime/om_validate.py): files edited the way an attacker would,
with every checksum re-sealed, are refused by `Session.load` and `npuc validate` alike,
with the same coded error, before anything is allocated or run."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from om_edit import Edit, rewrite

from npuc.errors import NpucError
from npuc.runtime import Session
from npuc.tools.om_tools import validate_om


@pytest.fixture(scope="module")
def gen_om(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from npuc.compiler.driver import compile_model

    out = tmp_path_factory.mktemp("validate") / "llama"
    return Path(compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", output=str(out),
                              max_seq_len=32, soc_version="cpu"))


def _tensor(m: Any, pred: Callable[[Any], bool]) -> Any:
    return next(t for t in m.tensors if pred(t))


def _op(m: Any, name: str) -> Any:
    return next(o for p in m.programs for o in p.ops if o.op == name)


def _input_in_weights(m: Any) -> None:
    t = m.tensors[m.programs[0].inputs[0]]
    t.region, t.offset = "weights", 0


def _output_in_weights(m: Any) -> None:
    t = m.tensors[_op(m, "rms_norm").outputs[0]]
    t.region, t.offset = "weights", 0
    t.ClearField("base")


def _cache_in_weights(m: Any) -> None:
    """kv_write updates its cache operand in place: a cache in the weights would be written."""
    for t in m.tensors:
        if t.region == "state":
            t.region, t.offset = "weights", 0
    m.state_bytes = 0


def _state_too_big(m: Any) -> None:
    m.state_bytes = 1 << 32


def _arena_huge(m: Any) -> None:
    m.programs[0].plan.arena_bytes = (1 << 63) - 1


def _unknown_dtype(m: Any) -> None:
    m.tensors[3].dtype = "f128"


def _negative_dims(m: Any) -> None:
    t = _tensor(m, lambda t: len(t.shape) >= 2 and t.shape[-1] > 1 and t.shape[-2] > 1)
    t.shape[-1], t.shape[-2] = -t.shape[-1], -t.shape[-2]  # the product, and so nbytes, unchanged


def _wrapping_dims(m: Any) -> None:
    t = m.tensors[m.programs[0].inputs[0]]
    del t.shape[:]
    t.shape.extend([1 << 32, 1 << 32, 1 << 32, 1 << 32])  # an int64 product wraps to 0


def _missing_operand(m: Any) -> None:
    del _op(m, "linear").inputs[-1]


def _wrong_attr_kind(m: Any) -> None:
    a = next(a for a in _op(m, "rms_norm").attrs if a.name == "eps")
    a.value.Clear()
    a.value.s = "tiny"


def _unknown_attr(m: Any) -> None:
    _op(m, "rms_norm").attrs.add(name="gamma").value.f = 1.0


def _output_shape_lies(m: Any) -> None:
    t = m.tensors[_op(m, "rms_norm").outputs[0]]
    shape = list(t.shape)
    del t.shape[:]
    t.shape.extend(list(reversed(shape)))  # same bytes, another shape


def _unknown_op(m: Any) -> None:
    _op(m, "rms_norm").op = "launch_missiles"


def _meta(key: str, value: str) -> Edit:
    def edit(m: Any) -> None:
        for e in m.metadata:
            if e.key == key:
                e.value = value
                return
        m.metadata.add(key=key, value=value)

    return edit


def _no_max_seq_len(m: Any) -> None:
    keep = [(e.key, e.value) for e in m.metadata if e.key != "max_seq_len"]
    del m.metadata[:]
    for k, v in keep:
        m.metadata.add(key=k, value=v)


CASES: list[tuple[str, Edit, str, str]] = [
    ("input_in_weights", _input_in_weights, "NPUC-E0410", "read-only weights"),
    ("output_in_weights", _output_in_weights, "NPUC-E0410", "read-only weights"),
    ("cache_in_weights", _cache_in_weights, "NPUC-E0410", "read-only weights"),
    ("state_too_big", _state_too_big, "NPUC-E0410", "state bytes"),
    ("arena_huge", _arena_huge, "NPUC-E0410", "more than"),
    ("unknown_dtype", _unknown_dtype, "NPUC-E0405", "unknown dtype"),
    ("negative_dims", _negative_dims, "NPUC-E0410", "dims must not be negative"),
    ("wrapping_dims", _wrapping_dims, "NPUC-E0404", "says it has"),
    ("missing_operand", _missing_operand, "NPUC-E0410", "operands"),
    ("wrong_attr_kind", _wrong_attr_kind, "NPUC-E0410", "is not a float"),
    ("unknown_attr", _unknown_attr, "NPUC-E0410", "unknown attribute"),
    ("output_shape_lies", _output_shape_lies, "NPUC-E0410", "its operands make"),
    ("unknown_op", _unknown_op, "NPUC-E0408", "launch_missiles"),
    ("max_seq_len_abc", _meta("max_seq_len", "abc"), "NPUC-E0411", "max_seq_len"),
    ("max_seq_len_negative", _meta("max_seq_len", "-5"), "NPUC-E0411", "max_seq_len"),
    ("max_seq_len_arabic_digits", _meta("max_seq_len", "\u0661\u0662"), "NPUC-E0411", "max_seq_len"),
    ("eos_not_ids", _meta("eos_token_id", "2,x"), "NPUC-E0411", "eos_token_id"),
    ("programs_unknown", _meta("programs", "prefill,decode,evil"), "NPUC-E0411", "programs"),
    ("max_seq_len_past_the_cache", _meta("max_seq_len", "1000"), "NPUC-E0411", "longer than the KV cache"),
    ("max_seq_len_below_the_prefill", _meta("max_seq_len", "4"), "NPUC-E0411", "does not fit max_seq_len"),
]


@pytest.mark.parametrize(("edit", "code", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_load_and_validate_refuse_alike(gen_om: Path, tmp_path: Path, edit: Edit, code: str, says: str) -> None:
    bad = rewrite(gen_om, tmp_path / "bad.om", edit)
    with pytest.raises(NpucError) as v:
        validate_om(str(bad))
    with pytest.raises(NpucError) as ld:
        Session.load(str(bad))
    assert v.value.code == ld.value.code == code, (v.value, ld.value)
    assert says in str(v.value) and says in str(ld.value), (v.value, ld.value)


@pytest.mark.parametrize(("tokenizer", "says"), [
    (b"not json", "is not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps({"tokenizer.json": "@@not base64@@"}).encode(), "is not base64"),
    (json.dumps({"../../etc/passwd": base64.b64encode(b"x").decode()}).encode(), "names a file"),
    (json.dumps({"tokenizer.json": 7}).encode(), "is not base64"),
])
def test_a_malformed_tokenizer_section_is_refused(gen_om: Path, tmp_path: Path, tokenizer: bytes, says: str) -> None:
    bad = rewrite(gen_om, tmp_path / "bad.om", sections={"tokenizer": tokenizer})
    for check in (validate_om, Session.load):
        with pytest.raises(NpucError) as e:
            check(str(bad))
        assert e.value.code == "NPUC-E0411" and says in str(e.value)


def test_without_max_seq_len_the_programs_run_and_generate_refuses(gen_om: Path, tmp_path: Path) -> None:
    from npuc.apps.generate import generate

    other = rewrite(gen_om, tmp_path / "other.om", _no_max_seq_len)
    assert validate_om(str(other)).startswith("ok: ")
    with pytest.raises(NpucError) as e:
        generate(Session.load(str(other)), [1, 2], 2)
    assert e.value.code == "NPUC-E0111"


def test_the_memory_cap(gen_om: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file may not ask for more than the cap (default: the machine's memory)."""
    Session.load(str(gen_om))
    monkeypatch.setenv("NPUC_MAX_MEMORY", "1K")
    with pytest.raises(NpucError) as e:
        Session.load(str(gen_om))
    assert e.value.code == "NPUC-E0410" and "NPUC_MAX_MEMORY" in e.value.hint


def test_the_cli_says_it_in_one_line(gen_om: Path, tmp_path: Path) -> None:
    """What used to be a segfault (an input placed in the read-only weights) is a coded refusal."""
    bad = rewrite(gen_om, tmp_path / "bad.om", _input_in_weights)
    ids = tmp_path / "ids.npy"
    import numpy as np

    np.save(ids, np.zeros((1, 8), dtype=np.int64))
    for args in (["validate", str(bad)], ["run", str(bad), "--input", f"input_ids={ids}", "--output-dir", str(tmp_path / "out")],
                 ["generate", str(bad), "--prompt-ids", "1,2", "--max-new-tokens", "2"]):
        r = subprocess.run([sys.executable, "-m", "npuc", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 4, (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.startswith("npuc: error NPUC-E0410: "), (args, r.stderr)
    assert not (tmp_path / "out").exists()


def test_a_fresh_file_passes(gen_om: Path, tmp_path: Path) -> None:
    """The re-sealing itself changes nothing: an unedited copy validates, loads and generates."""
    from npuc.apps.generate import stream

    same = rewrite(gen_om, tmp_path / "same.om")
    assert validate_om(str(same)).startswith("ok: ")
    assert len(list(stream(Session.load(str(same)), [1, 2, 3], 4, ignore_eos=True))) == 4
