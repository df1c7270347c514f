"""`npuc info`, `npuc validate` and `npuc dump --json`: what they report agrees with the runtime, and
validate catches a plan that is wrong even when every checksum is right."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import npuc
from npuc.backend.memory_plan import Buffer, lower_bound
from npuc.backend.om_format import WEIGHTS_ALIGN, OmFile, OmWriter
from npuc.backend.om_sections import MODEL_SECTIONS, join_model, split_model


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "npuc", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def om_path(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("om") / "llama"
    return Path(npuc.compile(str(hf_checkpoints["llama"]), input_shape="input_ids:1,16", output=str(out)))


def _one_line_error(r: subprocess.CompletedProcess[str], code: str) -> str:
    assert r.returncode == 4, r.stderr
    assert "Traceback" not in r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith(f"npuc: error {code}: "), r.stderr
    assert len(r.stderr.splitlines()) == 2 and r.stderr.splitlines()[1].startswith("  hint: "), r.stderr
    return first


# --- info ------------------------------------------------------------------------


def test_info_json_agrees_with_the_runtime(om_path: Path) -> None:
    r = cli("info", "--json", str(om_path))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert r.stdout.strip() == json.dumps(info, indent=2, sort_keys=True)  # sorted keys, no extras
    assert cli("info", "--json", str(om_path)).stdout == r.stdout  # deterministic

    sess = npuc.load(str(om_path), executor="torch")
    prog, plan = sess.program, sess.program.plan
    assert info["arena_bytes"] == sess.arena_bytes == plan.arena_bytes
    assert info["lower_bound_bytes"] == plan.lower_bound_bytes
    assert 0 < info["lower_bound_bytes"] <= info["arena_bytes"]
    assert info["state_bytes"] == 0
    assert info["weights_bytes"] == sess.model.weights_bytes == len(sess.om.section("weights"))
    assert info["op_counts"] == dict(Counter(o.op for o in prog.ops)) and info["op_total"] == len(prog.ops)
    assert info["unit_counts"] == dict(Counter(o.unit for o in prog.ops))
    assert info["target"] == sess.model.target == "npu"
    assert (info["producer"], info["producer_version"]) == ("npuc", npuc.__version__)
    assert info["metadata"] == {e.key: e.value for e in sess.model.metadata} and info["metadata"]
    assert [(s["name"], s["offset"], s["size"]) for s in info["sections"]] == [
        (s.name, s.offset, s.size) for s in sess.om.section_info()]
    assert info["file_bytes"] == om_path.stat().st_size
    assert info["inputs"] == [{"name": "input_ids", "dtype": "i64", "shape": [1, 16]}]


def test_info_table(om_path: Path) -> None:
    r = cli("info", str(om_path))
    assert r.returncode == 0, r.stderr
    sess = npuc.load(str(om_path), executor="torch")
    out = r.stdout

    def row(key: str, value: str) -> bool:
        return re.search(rf"^{re.escape(key)}\s+{re.escape(value)}$", out, re.M) is not None

    assert row("arena", f"{sess.arena_bytes:,} B")
    assert row("lower bound", f"{sess.program.plan.lower_bound_bytes:,} B")
    assert row("weights", f"{sess.model.weights_bytes:,} B")
    assert row("state", "0 B") and row("target", "npu") and row("producer", f"npuc {npuc.__version__}")
    for op, n in Counter(o.op for o in sess.program.ops).items():
        assert row(op, str(n)), op
    for s in sess.om.section_info():
        assert re.search(rf"^{re.escape(s.name)}\s+{s.offset:,}\s+{s.size:,}\s+{s.checksum}\s+{s.digest[:16]}$", out,
                         re.M), s.name
    assert {s.name: s.checksum for s in sess.om.section_info()}["weights"] == "xxh3-128"
    # The key column is aligned: every value of the head table starts in the same column.
    head = out.split("\n\n")[0].splitlines()
    starts = [m.end() for ln in head if (m := re.search(r"\S\s{2,}", ln))]
    assert len(starts) == len(head) > 8 and len(set(starts)) == 1, head


# --- validate --------------------------------------------------------------------


def test_validate_accepts_a_fresh_file(om_path: Path) -> None:
    r = cli("validate", str(om_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"ok: {om_path}: ") and len(r.stdout.splitlines()) == 1
    assert "memory plan of" in r.stdout


def _rewrite(src: Path, dst: Path, edit: Callable[[Any], None]) -> Path:
    """A copy of `src` whose model definition `edit` changed, with valid checksums throughout."""
    with OmFile.open(src) as om:
        m = join_model(str(src), {name: bytes(om.section(name)) for name in MODEL_SECTIONS})
        edit(m)
        with om.section("weights") as w, OmWriter(dst) as out:
            for name, data in split_model(m).items():
                out.add_section(name, data)
            out.add_section("weights", w, WEIGHTS_ALIGN)
    return dst


def _buffers(m: Any) -> list[Buffer]:
    return [Buffer(b.tensor, max(m.tensors[b.tensor].nbytes, 1), b.first_step, b.last_step)
            for b in m.programs[0].plan.buffers]


def _overlap(m: Any) -> None:
    """Move tensor A onto B, where both are live at once and A is no larger than B (so A stays in the arena)."""
    t = m.tensors
    bufs = _buffers(m)
    a, b = next((a, b) for a in bufs for b in bufs
                if a.id != b.id and a.start <= b.end and b.start <= a.end and a.size <= b.size
                and t[a.id].offset != t[b.id].offset)
    t[a.id].offset = t[b.id].offset


def _short_lifetime(m: Any) -> None:
    """End a buffer before its last use, and fix up the recorded lower bound so only the lifetime is wrong."""
    pm = m.programs[0].plan
    b = next(b for b in pm.buffers if b.last_step > b.first_step and m.tensors[b.tensor].region == "arena")
    b.last_step = b.first_step
    pm.lower_bound_bytes = lower_bound(_buffers(m), pm.alignment)


def _arena_too_big(m: Any) -> None:
    m.programs[0].plan.arena_bytes += m.programs[0].plan.alignment


def _wrong_lower_bound(m: Any) -> None:
    m.programs[0].plan.lower_bound_bytes -= m.programs[0].plan.alignment


@pytest.mark.parametrize(("edit", "says"), [
    (_overlap, "overlap in time and space"),
    (_short_lifetime, "is used by op"),
    (_arena_too_big, "arena_bytes is"),
    (_wrong_lower_bound, "records lower bound"),
], ids=["overlap", "lifetime", "arena_bytes", "lower_bound"])
def test_validate_rejects_a_wrong_plan_with_valid_checksums(
        om_path: Path, tmp_path: Path, edit: Callable[[Any], None], says: str) -> None:
    bad = _rewrite(om_path, tmp_path / "bad.om", edit)
    assert cli("info", str(bad)).returncode == 0  # the container and its checksums are fine
    first = _one_line_error(cli("validate", str(bad)), "NPUC-E0409")
    assert f"the memory plan in {bad} is invalid: " in first and says in first, first


@pytest.mark.parametrize(("damage", "code"), [
    ("bitflip_modeldef", "NPUC-E0405"), ("bitflip_weights", "NPUC-E0405"), ("truncate", "NPUC-E0404")])
def test_validate_rejects_a_damaged_file(om_path: Path, tmp_path: Path, damage: str, code: str) -> None:
    data = bytearray(om_path.read_bytes())
    with OmFile.open(om_path) as om:
        where = {s.name: s.offset + s.size // 2 for s in om.section_info()}
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[where[damage.removeprefix("bitflip_")]] ^= 0x10
    bad = tmp_path / "bad.om"
    bad.write_bytes(bytes(data))
    first = _one_line_error(cli("validate", str(bad)), code)
    if damage == "bitflip_modeldef":  # info and dump --json check the model definition's checksum too
        _one_line_error(cli("info", str(bad)), "NPUC-E0405")
        _one_line_error(cli("dump", "--json", str(bad)), "NPUC-E0405")
    if damage == "bitflip_weights":  # caught by its chunk's XXH3-128; info never reads the weights
        assert "section 'weights' (chunk 0, bytes " in first, first
        assert cli("info", str(bad)).returncode == 0


# --- dump --json -----------------------------------------------------------------


def test_dump_json_has_the_whole_model(om_path: Path) -> None:
    r = cli("dump", "--json", str(om_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert r.stdout.strip() == json.dumps(doc, indent=2, sort_keys=True)
    assert cli("dump", str(om_path), "--json").stdout == r.stdout
    sess = npuc.load(str(om_path), executor="torch")
    prog = doc["modeldef"]["programs"][0]
    assert [(o["op"], o["name"], o["unit"]) for o in prog["ops"]] == [
        (o.op, o.name, o.unit) for o in sess.program.ops]
    assert len(doc["modeldef"]["tensors"]) == len(sess.tensors)
    assert [s["name"] for s in doc["sections"]] == ["modeldef", "plan", "tasks", "metadata", "weights.xxh3",
                                                    "weights"]
    assert [s["checksum"] for s in doc["sections"]] == ["sha256"] * 5 + ["xxh3-128"]
    assert int(prog["plan"]["arena_bytes"]) == sess.arena_bytes  # proto3 JSON writes 64-bit ints as strings
    views = [t for t in doc["modeldef"]["tensors"] if "base" in t]
    assert views and all(t["region"] == "arena" for t in views)  # reshapes share their operand's buffer
    assert len(prog["plan"]["buffers"]) == sum(t.region == "arena" for t in sess.tensors) - len(views)
    meta = {e["key"]: e["value"] for e in doc["modeldef"]["metadata"]}
    assert meta["target"] == "npu" and len(meta["source_xxh3"]) == 32 and meta["option.input_shape"]


def test_om_tools_need_only_the_runtime_dependencies() -> None:
    code = ("import sys, npuc.tools.om_tools; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'onnx', 'transformers', 'networkx', 'click'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
