"""libnpucrt's loader (npucrt/src/{util,sha256,om,validate,model_api}.c) against the Python side.

The C loader ports the container checks (backend/om_format.py), the join of the model
sections (backend/om_sections.py) and runtime/om_validate.py's checks but for the per-op
shape rules and workspace sizes, which the executor's binders apply instead (the known op,
attributes and arity it checks against npucrt/src/op_schema.c, generated from the registry by
npucrt/gen_op_schema.py). So each file here is loaded by:

    the C loader       npuc_model_load_file, with a stub executor that accepts every op
    python (ported)    OmFile.open + join_model + validate_model with check_ops cut down to
                       the part C ports (op_def, op_attrs, arity, what is written where),
                       + check_rank
    python (full)      the same with every check, as Session.__init__ runs them

and the C loader must give the ported reference's code, and its message word for word (but
where noted in MESSAGE_MAY_DIFFER). Where the full reference refuses and the ported one
does not, the refusal is one of the binders' (a shape rule, a workspace size): counted, not
compared. The files: the fuzz corpus, the om_fuzz seeds, the hostile edits of
tests/test_om_validate.py, malformed tokenizer sections, and seeded om_fuzz mutants.
Then the same files and more mutants go through an ASan + UBSan build of the loader
(npucrt/tests/load_driver.c), which must report nothing.

Where C differs by design, the reference says what C says: a string the model keeps that holds
a NUL (C strings: the section "does not parse"), a rank past 8 (refused after the checks of
every dim), and a table that lies outside a table's dims (left to the shape rule). Asserted
on their own: more than 64 sections, and a tensor-parallel manifest (NPUC-E0150).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import random
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import npucrt_util
from tests.fuzz import om_fuzz

pytestmark = pytest.mark.skipif(npucrt_util.compiler() is None, reason="no C compiler")

_DAMAGED = "the file is damaged or was edited after compiling; recompile the model with `npuc compile`"
# Messages the C loader words differently, by design: Python names the program set in its
# hash order; a workspace outside the arena is refused without the size the op's rule needs.
MESSAGE_MAY_DIFFER = re.compile(r"names a program the model does not have|has a workspace of \d+ bytes in")


# ---------------------------------------------------------------- the Python references

def _ported_check_ops(path: str, m: Any, prog: Any, *_: Any) -> None:
    """om_validate.check_ops without the shape rules and workspace sizes: only what the C loader
    checks itself (its binders check the rest)."""
    from npuc.runtime.om_validate import E_INVALID, bad, op_attrs, op_def

    def writable(i: int, why: str) -> None:
        if m.tensors[i].region == "weights":
            raise bad(E_INVALID, f"{path}: tensor {m.tensors[i].name!r} {why} in program {prog.name!r} but lies in "
                                 "the read-only weights")

    for kind, ids in (("input", prog.inputs), ("output", prog.outputs)):
        names = [m.tensors[i].name for i in ids]
        if len(set(names)) != len(names):
            raise bad(E_INVALID, f"{path}: program {prog.name!r} has two {kind}s of one name: {names}")
    for i in prog.inputs:
        writable(i, "is an input")
        if m.tensors[i].region != "arena":
            raise bad(E_INVALID, f"{path}: input {m.tensors[i].name!r} of program {prog.name!r} is not in the arena")
    for i in prog.outputs:
        writable(i, "is an output")
    for op in prog.ops:
        od = op_def(path, op)
        op_attrs(path, op, od)
        if not od.arity_ok(len(op.inputs)):
            raise bad(E_INVALID, f"{path}: op {op.name!r} ({od.name}) has {len(op.inputs)} operands; it takes "
                                 f"{', '.join(od.inputs)}")
        for o in op.outputs:
            writable(o, f"is written by op {op.name!r}")
        if od.inplace is not None and len(op.inputs) > od.inplace:  # a cache or a recurrent state
            writable(op.inputs[od.inplace], f"is updated in place by op {op.name!r}")
        if op.HasField("workspace"):
            w = m.tensors[op.workspace]
            if w.region != "arena":
                raise bad(E_INVALID, f"{path}: op {op.name!r} has a workspace of {w.nbytes} bytes in {w.region}; "
                                     "it needs one in the arena")


def _kept_strings(name: str, msg: Any) -> Iterator[str]:
    """Every string of a model section that the C loader keeps (or compares): those may not hold
    a NUL there (C strings). Not kept: TensorDesc.format, and modeldef's op units and plans."""
    if name == "modeldef":
        yield from (msg.producer, msg.producer_version, msg.target)
        for t in msg.tensors:
            yield from (t.name, t.dtype, t.region)
        for p in msg.programs:
            yield p.name
            for op in p.ops:
                yield from (op.op, op.name)
                for a in op.attrs:
                    yield from (a.name, a.value.s, a.value.dtype)
        for e in msg.metadata:
            yield from (e.key, e.value)
    elif name == "plan":
        yield from (p.program for p in msg.plans)
    elif name == "tasks":
        for pt in msg.programs:
            yield pt.program
            yield from (t.unit for t in pt.tasks)
    else:
        for e in msg.entries:
            yield from (e.key, e.value)


def _nul_section(sections: dict[str, bytes]) -> str | None:
    """The first model section, in the order they are parsed, that upb parses but that holds a
    NUL in a string C keeps (the C loader refuses it as not parsing); None if none does
    before one that does not parse at all."""
    from npuc.backend.om_schema import Metadata, ModelDef, Plans, Tasks

    for name, cls in (("modeldef", ModelDef), ("plan", Plans), ("tasks", Tasks), ("metadata", Metadata)):
        msg = cls()
        try:
            msg.ParseFromString(sections[name])
        except Exception:  # noqa: BLE001 - join_model refuses it, as C does
            return None
        if any("\0" in s for s in _kept_strings(name, msg)):
            return name
    return None


class _Upto:
    """The first `k` tensors when iterated; every one when indexed (a base names any of them)."""

    def __init__(self, m: Any, k: int) -> None:
        self.weights_bytes, self.state_bytes, self._t, self._k = m.weights_bytes, m.state_bytes, m.tensors, k

    @property
    def tensors(self) -> Any:
        outer = self

        class View:
            def __iter__(self) -> Iterator[Any]:
                return iter(list(outer._t)[:outer._k])

            def __len__(self) -> int:
                return len(outer._t)

            def __getitem__(self, i: int) -> Any:
                return outer._t[i]

        return View()


def _check_tensors_c(full: Any) -> Any:
    """check_tensors, plus the C loader's refusal of a rank past 8 after that tensor's checks."""
    def check(path: str, m: Any, weights_len: int, arena: int) -> Any:
        from npuc.runtime.om_validate import E_INVALID, bad

        k = next((i for i, t in enumerate(m.tensors) if len(t.shape) > 8), None)
        if k is not None:
            full(path, _Upto(m, k + 1), weights_len, arena)
            t = m.tensors[k]
            raise bad(E_INVALID, f"{path}: tensor {t.name!r} has rank {len(t.shape)}; this runtime takes at most 8")
        return full(path, m, weights_len, arena)

    return check


def _check_index_c(full: Any) -> Any:
    """_check_index, but for a table of too few dims, which the op's shape rule (C: its binder)
    refuses before (Python indexes past its shape there when check_ops is cut down)."""
    def check(path: str, m: Any, op: Any, which: tuple[int, int, int], *rest: Any) -> Any:
        if len(m.tensors[op.inputs[which[1]]].shape) <= which[2]:
            return None
        return full(path, m, op, which, *rest)

    return check


@contextlib.contextmanager
def _ported_only() -> Iterator[None]:
    from npuc.runtime import om_validate

    full = om_validate.check_ops, om_validate.check_tensors, om_validate._check_index
    om_validate.check_ops = _ported_check_ops
    om_validate.check_tensors = _check_tensors_c(full[1])
    om_validate._check_index = _check_index_c(full[2])
    try:
        yield
    finally:
        om_validate.check_ops, om_validate.check_tensors, om_validate._check_index = full


def _offsets(data: bytes) -> list[tuple[str, int]]:
    """Each section's name and offset, from the table of a well-formed file."""
    count = om_fuzz._HEADER.unpack_from(data, 0)[3]
    entries = [om_fuzz._ENTRY.unpack_from(data, om_fuzz._HEADER.size + om_fuzz._ENTRY.size * i) for i in range(count)]
    return [(raw.rstrip(b"\0").decode(), off) for raw, off, _, _ in entries]


def python_load(path: str, ported: bool) -> tuple[int, str, str]:
    """(code, message, hint) of the Python side's load without running anything; (0, "", "")
    when it loads; (-1, what, "") when it raises something other than NpucError."""
    from npuc.backend.om_format import OmFile
    from npuc.backend.om_sections import MODEL_SECTIONS, join_model
    from npuc.errors import NpucError
    from npuc.runtime import parallel
    from npuc.runtime.om_validate import validate_model

    try:
        with OmFile.open(path) as om:
            sections = {name: bytes(om.section(name)) for name in MODEL_SECTIONS}
            nul = _nul_section(sections)
            if nul is not None:
                return 405, f"{om.path}: the {nul} section does not parse", _DAMAGED
            model = join_model(om.path, sections)
            tokenizer = bytes(om.section("tokenizer")) if "tokenizer" in om.section_names() else None
            with om.section("weights") as weights, (_ported_only() if ported else contextlib.nullcontext()):
                validate_model(str(om.path), model, weights, tokenizer)
            parallel.check_rank(om.path, {e.key: e.value for e in model.metadata})
        return 0, "", ""
    except NpucError as e:
        return int(e.code.removeprefix("NPUC-E")), e.message, e.hint
    except Exception as e:  # noqa: BLE001 - a crash of the reference: reported by the caller
        return -1, f"{type(e).__name__}: {e}", ""


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("npucrt")
    path = npucrt_util.build(out, sources=npucrt_util.LOADER_SOURCES, stub_exec=True, warnings=True)
    return npucrt_util.open_lib(path)


@pytest.fixture(scope="module")
def seeds() -> list[Path]:
    return om_fuzz.seed_files()


def _write(dirpath: Path, name: str, data: bytes) -> Path:
    p = dirpath / name
    p.write_bytes(data)
    return p


def compare(lib: Any, path: Path, stats: Counter[str] | None = None) -> None:
    """The C loader against the ported reference: its code, and its message and hint word for
    word but where they may differ."""
    code, message, hint = npucrt_util.load_raw(lib, path)
    want, want_msg, want_hint = python_load(str(path), ported=True)
    if stats is not None:
        full, _, _ = python_load(str(path), ported=False)
        stats["loads" if full == 0 else ("refused: ported check" if full == want else "refused: binders' check")] += 1
        stats[f"C {code}"] += 1
    assert want != -1, f"{path.name}: the ported reference crashed: {want_msg}"
    assert code == want, f"{path.name}: C says {code} {message!r}, Python {want} {want_msg!r}"
    if not MESSAGE_MAY_DIFFER.search(want_msg):
        py = want_msg.encode()
        assert message == py[:767], f"{path.name}:\n C: {message!r}\n Py: {py!r}"
        assert hint == want_hint.encode()[:255], f"{path.name}: hint {hint!r}, Python's {want_hint!r}"


def _mutants(seeds: list[Path], seed: int, n: int) -> Iterator[tuple[str, bytes]]:
    data = [p.read_bytes() for p in seeds]
    for i in range(n):
        yield om_fuzz.mutant(data, seed, i)


# ---------------------------------------------------------------- (a) SHA-256

def test_sha256_matches_hashlib(tmp_path: Path) -> None:
    """Both block functions (SHA-NI where the CPU has it, and the portable rounds), one call and
    incremental, against hashlib: every length 0..300 and a few MB."""
    rng = random.Random(7)
    inputs = [rng.randbytes(n) for n in range(301)] + [rng.randbytes(3 << 20), rng.randbytes((2 << 20) + 77)]
    for defines in ((), ("NPUC_NO_SHA_NI",)):
        exe = npucrt_util.build_exe(tmp_path, "npucrt/tests/sha_driver.c", sanitize=False, sources=["sha256.c"],
                                    name="sha" + "_".join(defines), defines=defines)
        for data in inputs:
            out = subprocess.run([str(exe)], input=data, capture_output=True, check=True, timeout=60).stdout.split()
            want = hashlib.sha256(data).hexdigest().encode()
            assert out == [want, want], (defines, len(data))


def test_xxh3_128_matches_python_xxhash(tmp_path: Path) -> None:
    """The weights' chunk checksum in C (the vendored xxhash.h, inlined in sha256.c) against
    Python's xxhash: every length 0..300 (each of XXH3's length classes) and a few MB, built
    under the loader's warnings and, once, the sanitizers."""
    import xxhash

    rng = random.Random(8)
    inputs = [rng.randbytes(n) for n in range(301)] + [rng.randbytes(4 << 20), rng.randbytes((1 << 20) + 77)]
    for sanitize in (False, True):
        exe = npucrt_util.build_exe(tmp_path, "npucrt/tests/xxh3_driver.c", sanitize=sanitize, sources=["sha256.c"],
                                    name=f"xxh3_{sanitize}")
        for data in inputs if not sanitize else inputs[::17]:
            out = subprocess.run([str(exe)], input=data, capture_output=True, check=True, timeout=60).stdout.split()
            assert out == [xxhash.xxh3_128_hexdigest(data).encode()], (sanitize, len(data))


# ---------------------------------------------------------------- (b) the same answers as Python

def test_seeds_and_corpus_agree(lib: Any, seeds: list[Path], tmp_path: Path) -> None:
    corpus = sorted(om_fuzz.CORPUS.glob("*.om"))
    for p in [*seeds, *corpus]:
        compare(lib, p)
    for p in seeds:  # a valid file loads in C too
        assert npucrt_util.load(lib, p) == (0, ""), p


# The fuzzer's files that C loaded and Python refused (tests/fuzz/om_fuzz_c.py), by what they hold.
_SCHEMA_REPRODUCERS = {
    "c-disagree-08573c7f953a402b.om": "unknown attribute", "c-disagree-5aba0cc9d88cd1ee.om": "missing attribute",
    "c-disagree-3d522bedb39d85ba.om": "repeats an attribute", "c-disagree-528bb87557937e35.om": "operands; it takes",
}


def test_op_schema_reproducers_agree(lib: Any) -> None:
    """C refuses an op's unknown, missing or repeated attribute and extra operands as the full
    Python side does: same code, same words."""
    for name, words in _SCHEMA_REPRODUCERS.items():
        p = om_fuzz.CORPUS / name
        code, message, hint = npucrt_util.load_raw(lib, p)
        want, want_msg, want_hint = python_load(str(p), ported=False)
        assert words in want_msg and (code, message, hint) == (want, want_msg.encode(), want_hint.encode()), \
            (name, code, message, want, want_msg)


def test_op_schema_refusals_agree(lib: Any, seeds: list[Path], tmp_path: Path) -> None:
    """Edits of a seed's ops against each schema check, in check_ops' order: an unknown op, an
    undecodable dtype, each wrong kind (with Python's reprs of the value), None, arity."""
    from npuc.backend.om_schema import ModelDef

    img = om_fuzz.OmImage.parse(seeds[1].read_bytes())
    base = ModelDef()
    base.ParseFromString(img.get("modeldef"))
    values = [("i", 3), ("i", -1), ("f", 0.1), ("f", 1e16), ("f", 1.5e-5), ("f", -0.0), ("f", float("inf")),
              ("f", 2.0), ("f", 123456.789), ("f", float("nan")), ("s", "it's"), ("b", True), ("b", False),
              ("dtype", "f16"), ("dtype", "f99"), ("ints", [1]), ("ints", []), ("ints", [1, -2, 3]),
              ("floats", [0.5]), ("floats", []), ("floats", [1e-7, 3.0]), ("none", True), (None, None)]
    edits = []
    for k, op in enumerate(base.programs[0].ops):
        for j in range(len(op.attrs)):
            for field, v in values:
                edits.append((k, j, field, v))
    rng = random.Random(3)
    cases = rng.sample(edits, min(len(edits), 150))
    for n, (k, j, field, v) in enumerate(cases):
        m = ModelDef()
        m.CopyFrom(base)
        a = m.programs[0].ops[k].attrs[j].value
        a.Clear()
        if field in ("ints", "floats"):
            getattr(a, field).values.extend(v)
            getattr(a, field).SetInParent()
        elif field is not None:
            setattr(a, field, v)
        img.put("modeldef", m.SerializeToString())
        compare(lib, _write(tmp_path, f"v{n}.om", img.seal()))
    for n, edit in enumerate(["op", "drop_input", "add_input", "drop_attr", "unknown_attr", "no_inputs"]):
        for k in range(len(base.programs[0].ops)):
            m = ModelDef()
            m.CopyFrom(base)
            op = m.programs[0].ops[k]
            if edit == "op":
                op.op = "no_such_op"
            elif edit == "drop_input" and op.inputs:
                del op.inputs[-1]
            elif edit == "add_input":
                op.inputs.append(op.inputs[0] if op.inputs else 0)
            elif edit == "drop_attr" and op.attrs:
                del op.attrs[0]
            elif edit == "unknown_attr":
                op.attrs.add(name="zz").value.i = 1
            elif edit == "no_inputs":
                del op.inputs[:]
            img.put("modeldef", m.SerializeToString())
            compare(lib, _write(tmp_path, f"e{n}_{k}.om", img.seal()))


def test_op_schema_is_current() -> None:
    """npucrt/src/op_schema.c is what npucrt/gen_op_schema.py makes of the registry now."""
    import importlib.util

    root = npucrt_util.ROOT
    spec = importlib.util.spec_from_file_location("gen_op_schema", root / "npucrt/gen_op_schema.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (root / "npucrt/src/op_schema.c").read_text() == gen.render(), \
        "regenerate with: python npucrt/gen_op_schema.py"


def test_container_errors_agree(lib: Any, seeds: list[Path], tmp_path: Path) -> None:
    data = seeds[0].read_bytes()
    img = om_fuzz.OmImage.parse(data)
    cases = {
        "empty": b"", "short_magic": data[:5], "short_header": data[:40], "foreign": b"PK\x03\x04" + bytes(100),
        "foreign_short": b"GIF89a", "just_header": data[:64], "truncated": data[:-1], "extra": data + b"\0",
        "version": data[:8] + (3).to_bytes(4, "little") + data[12:],
        "version_1": data[:8] + (1).to_bytes(4, "little") + data[12:],
        "flags": data[:12] + (0x1f).to_bytes(4, "little") + data[16:],
        "reserved": data[:20] + b"\1" + data[21:], "pad": data[:63] + b"\1" + data[64:],
        "table_hash": data[:24] + bytes(32) + data[56:],
        "payload": data[:-1] + bytes([data[-1] ^ 1]),
    }
    weights_at = next(off for n, off in _offsets(data) if n == "weights")
    cases["weight_flip"] = data[:weights_at + 5000] + bytes([data[weights_at + 5000] ^ 4]) + data[weights_at + 5001:]
    chunks = img.get("weights.xxh3")
    assert chunks is not None
    cases.update({
        f"chunks_{k}": om_fuzz.OmImage([(n, edit if n == "weights.xxh3" else d) for n, d in img.sections]).seal(
            rechunk=False)
        for k, edit in (("size", (3000).to_bytes(8, "little") + chunks[8:]),
                        ("count", chunks[:8] + (9).to_bytes(8, "little") + chunks[16:]),
                        ("short", chunks[:10]), ("digest", chunks[:-1] + bytes([chunks[-1] ^ 1])))})
    cases["no_chunks"] = om_fuzz.OmImage([(n, d) for n, d in img.sections if n != "weights.xxh3"]).seal()
    no_weights = om_fuzz.OmImage([(n, d) for n, d in img.sections if n not in ("weights", "weights.xxh3")]).seal()
    cases["chunks_alone"] = om_fuzz.OmImage([(n, d) for n, d in img.sections if n != "weights"]).seal()
    no_plan = om_fuzz.OmImage([(n, d) for n, d in img.sections if n != "plan"]).seal()
    cases.update(no_weights=no_weights, no_plan=no_plan,
                 renamed=om_fuzz.OmImage([("bad name!" if n == "tasks" else n, d) for n, d in img.sections]).seal(),
                 twice=om_fuzz.OmImage([*img.sections[:1], *img.sections]).seal(),
                 quote=om_fuzz.OmImage([("it's" if n == "tasks" else n, d) for n, d in img.sections]).seal())
    for name, blob in cases.items():
        compare(lib, _write(tmp_path, f"{name}.om", blob))
    compare(lib, tmp_path)  # a directory
    compare(lib, tmp_path / "missing.om")
    fifo = tmp_path / "fifo.om"
    os.mkfifo(fifo)
    compare(lib, fifo)  # refused, never waited on
    code, message = npucrt_util.load(lib, tmp_path / "version_1.om")
    assert code == 403 and "has .om format version 1; this npuc reads version 2" in message, message
    code, message = npucrt_util.load(lib, tmp_path / "weight_flip.om")
    assert code == 405 and "section 'weights' (chunk 0, bytes 0.." in message, message
    # More sections than the model struct holds (a writer makes seven): refused once the first 64
    # pass, where Python reads on; a bad entry among the first 64 is refused alike.
    many = om_fuzz.OmImage([*img.sections, *[(f"x{i}", b"") for i in range(70)]]).seal()
    code, message = npucrt_util.load(lib, _write(tmp_path, "many.om", many))
    assert code == 404 and message.endswith(f"it has {len(img.sections) + 70} sections; this runtime reads at most "
                                            "64"), message
    compare(lib, _write(tmp_path, "many_bad.om", om_fuzz.OmImage(
        [*img.sections[:2], ("bad/name", b""), *img.sections[2:], *[(f"x{i}", b"") for i in range(70)]]).seal()))
    # A tensor-parallel manifest is for torchrun: refused by name (the Python side: NPUC-E0150 too).
    manifest = om_fuzz.OmImage([("manifest", b'{"format": "npuc-ranks"}'), *img.sections]).seal()
    code, message = npucrt_util.load(lib, _write(tmp_path, "manifest.om", manifest))
    assert code == 150 and "manifest of a tensor-parallel model" in message, message


def test_hostile_edits_agree(lib: Any, seeds: list[Path], tmp_path: Path) -> None:
    """tests/test_om_validate.py's attacker edits (every checksum re-sealed), on the kv seed."""
    from tests.test_om_validate import CASES, rewrite

    kv = next(p for p in seeds if p.name == "kv.om")
    for name, edit, _, _ in CASES:
        with contextlib.suppress(StopIteration):  # an edit that needs an op the tiny seed lacks
            compare(lib, rewrite(kv, tmp_path / f"{name}.om", edit))
    for name, edit in EDITS:
        compare(lib, rewrite(kv, tmp_path / f"{name}.om", edit))


def test_inplace_operands_agree(lib: Any, seeds: list[Path], tmp_path: Path) -> None:
    """Every in-place op of the registry (OpDef.inplace; validate.c's INPLACE) with the operand it
    updates pointed at a weight: C refuses it as the ported reference does, naming the update.
    kv_write on the kv seed; the recurrences on a program of every stateful recurrence."""
    from npuc.backend.lower import lower
    from npuc.backend.targets import get_target
    from npuc.backend.writer import write_om
    from npuc.ir import all_ops
    from tests.test_npucrt_recurrent import LAYERS, _program
    from tests.test_om_validate import rewrite

    recurrent = tmp_path / "recurrent.om"
    write_om(lower([_program("decode1")], get_target("cpu")), str(recurrent))
    assert npucrt_util.load(lib, recurrent) == (0, "")
    inplace = {name: od.inplace for name, od in all_ops().items() if od.inplace is not None}
    assert set(inplace) == {"kv_write", *(spec["op"] for spec in LAYERS.values())}  # a new one: add it here
    kv = next(p for p in seeds if p.name == "kv.om")

    def into_weights(name: str) -> Any:
        def edit(m: Any) -> None:
            op = next(o for p in m.programs for o in p.ops if o.op == name)
            op.inputs[inplace[name]] = next(i for i, t in enumerate(m.tensors) if t.region == "weights")

        return edit

    for name in inplace:
        path = rewrite(kv if name == "kv_write" else recurrent, tmp_path / f"{name}.om", into_weights(name))
        compare(lib, path)
        _, message, _ = python_load(str(path), ported=True)
        assert "is updated in place by op" in message and "read-only weights" in message, (name, message)


def test_plan_overlaps_agree(lib: Any, seeds: list[Path], tmp_path: Path) -> None:
    """Buffers moved onto each other: the same pair reported (Python's heap order) and the same
    arena and lower-bound findings."""
    from tests.test_om_validate import rewrite

    rng = random.Random(9)
    kv = next(p for p in seeds if p.name == "kv.om")

    def edit(m: Any) -> None:
        prog = m.programs[rng.randrange(len(m.programs))]
        arena = prog.plan.arena_bytes
        a = prog.plan.alignment
        for _ in range(rng.choice([1, 1, 2, 3])):
            ti = prog.plan.buffers[rng.randrange(len(prog.plan.buffers))].tensor
            t = m.tensors[ti]
            if t.nbytes < arena:
                t.offset = rng.randrange((arena - t.nbytes) // a + 1) * a
                for u in m.tensors:  # its views move with it
                    if u.HasField("base") and u.base == ti:
                        u.offset = t.offset
        if rng.random() < 0.2:
            prog.plan.arena_bytes += 64

    for i in range(40):
        compare(lib, rewrite(kv, tmp_path / f"o{i}.om", edit))


# Raw protobuf appended to a section: upb's limits and leniencies (groups 100 deep, tags of 32
# bits, 10-byte varints, wire types, UTF-8) that the C decoder must share.
PROTO_TAILS: list[tuple[str, bytes]] = [
    ("metadata", b"\x0b" * 100 + b"\x0c" * 100), ("metadata", b"\x0b" * 101 + b"\x0c" * 101),
    ("metadata", b"\x0a\xc6\x01" + b"\x1b" * 99 + b"\x1c" * 99),
    ("metadata", b"\x0a\xc8\x01" + b"\x1b" * 100 + b"\x1c" * 100),
    ("metadata", b"\x0b\x0c\x0c"), ("metadata", b"\x0c"), ("metadata", b"\x0b\x14"), ("metadata", b"\x0b"),
    ("metadata", b"\xf8\xff\xff\xff\x0f\x01"), ("metadata", b"\x80\x80\x80\x80\x10"),
    ("metadata", b"\xf8\xff\xff\xff\x1f\x01"), ("metadata", b"\x02\x00"),
    ("metadata", b"\x10" + b"\xff" * 9 + b"\x7f"), ("metadata", b"\x10" + b"\xff" * 10 + b"\x01"),
    ("metadata", b"\x0e"), ("metadata", b"\x0f"), ("metadata", b"\x0d\x00\x00\x00"), ("metadata", b"\x09" + bytes(8)),
    ("metadata", b"\x0a\x03\x0a\x01\xff"), ("metadata", b"\x0a\x05\x0a\x03\xed\xa0\x80"),
    ("metadata", b"\x0a\x04\x0a\x02\xc0\xaf"), ("metadata", b"\x0a\x06\x0a\x04\xf4\x90\x80\x80"),
    ("metadata", b"\x0a\x06\x0a\x04\xf0\x9f\x98\x80"), ("metadata", b"\x0a\x03\x1a\x01\xff"),
    ("metadata", b"\x0a\x03\x08\x01\x00"), ("metadata", b"\x0a\x80\x80\x80\x80\x10"), ("metadata", b"\x0a\x05\x0a\x01"),
    ("metadata", b"\x88\x00\x05"), ("metadata", b"\xc2\x80\x80\x80\x00\x00"), ("metadata", b"\x0a\x00"),
    ("metadata", b"\x0a\x02\x12\x00\x0a\x02\x0a\x00"),
    ("modeldef", b"\x22\x02\x1a\x00"), ("modeldef", b"\x22\x03\x1a\x01\x80"), ("modeldef", b"\x22\x02\x18\x01"),
    ("modeldef", b"\x22\x03\x40\xff\x01"), ("modeldef", b"\x22\x0b\x40" + b"\xff" * 9 + b"\x01"),
    ("modeldef", b"\x22\x06\x1a\x04\x01\x02\x03\x04"), ("modeldef", b"\x30\x05"), ("modeldef", b"\x31" + bytes(8)),
    ("modeldef", b"\x2a\x02\x12\x01"), ("modeldef", b"\x2a\x04\x22\x02\x2a\x00"),
    ("modeldef", b"\x2a\x0a\x22\x08\x2a\x06\x12\x04\x3a\x02\x0a\x01"),
    ("modeldef", b"\x2a\x0b\x22\x09\x2a\x07\x12\x05\x3a\x03\x0a\x01\x00"),
    ("modeldef", b"\x2a\x06\x22\x04\x2a\x02\x12\x00"), ("plan", b"\x0a\x02\x22\x00"), ("tasks", b"\x0a\x02\x12\x00"),
    ("tasks", b"\x12\x00"), ("plan", b"\x0a\x03\x2a\x01\x00"),
]


def test_protobuf_edges_agree(lib: Any, seeds: list[Path], tmp_path: Path) -> None:
    img = om_fuzz.OmImage.parse(seeds[0].read_bytes())
    for i, (name, tail) in enumerate(PROTO_TAILS):
        edited = om_fuzz.OmImage(list(img.sections))
        edited.put(name, (edited.get(name) or b"") + tail)
        compare(lib, _write(tmp_path, f"p{i}.om", edited.seal()))


def _add_tensor(shape: list[int], nbytes: int | None = None, dtype: str = "f32") -> Any:
    def edit(m: Any) -> None:
        t = m.tensors.add(name="extra", dtype=dtype, region="arena", offset=0)
        t.shape.extend(shape)
        t.nbytes = nbytes if nbytes is not None else 4 * (0 if any(d == 0 for d in shape) else
                                                          __import__("math").prod(shape))

    return edit


def _set(path: str, value: Any) -> Any:
    """An edit setting a field by a dotted path from the model (`programs.0.ops.3.workspace`)."""
    def edit(m: Any) -> None:
        *head, last = path.split(".")
        obj = m
        for part in head:
            obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
        if last.isdigit():
            obj[int(last)] = value
        else:
            setattr(obj, last, value)

    return edit


def _edits(*edits: Any) -> Any:
    def edit(m: Any) -> None:
        for e in edits:
            e(m)

    return edit


def _meta_edit(key: str, value: str) -> Any:
    def edit(m: Any) -> None:
        m.metadata.add(key=key, value=value)

    return edit


EDITS: list[tuple[str, Any]] = [
    ("rank9", _add_tensor([1] * 9)), ("rank9_negative", _add_tensor([1] * 8 + [-1], 4)),
    ("rank12_mismatch", _add_tensor([2] * 12, 8)), ("rank9_empty", _add_tensor([0] * 9, 0)),
    ("dims_past_2_40", _add_tensor([1 << 41])), ("dims_wrap", _add_tensor([1 << 32] * 4, 0)),
    ("f16_odd_offset", lambda m: m.tensors.add(name="odd", dtype="f16", region="arena", offset=1, nbytes=2,
                                               shape=[1])),
    ("base_minus_1", _set("tensors.0.base", -1)), ("base_self_base", _set("tensors.1.base", 1)),
    ("base_far", _set("tensors.0.base", 1 << 30)), ("workspace_minus_1", _set("programs.0.ops.0.workspace", -1)),
    ("workspace_weights", _set("programs.0.ops.0.workspace", 0)),
    ("input_minus_1", _set("programs.0.inputs.0", -1)), ("buffer_far", _set("programs.0.plan.buffers.0.tensor", 99999)),
    ("alignment_0", _set("programs.0.plan.alignment", 0)), ("alignment_3", _set("programs.0.plan.alignment", 3)),
    ("arena_off", _set("programs.0.plan.arena_bytes", 12345)),
    ("lower_bound_off", _set("programs.0.plan.lower_bound_bytes", 1)),
    ("buffer_late", _set("programs.1.plan.buffers.0.first_step", 3)),
    ("buffer_reversed", _set("programs.1.plan.buffers.2.last_step", -7)),
    ("buffer_twice", lambda m: m.programs[0].plan.buffers.append(m.programs[0].plan.buffers[0])),
    ("program_empty_name", _set("programs.1.name", "")), ("program_twice", _set("programs.1.name", "prefill")),
    ("quote_name", _set("programs.0.ops.0.name", "it's \"x\" \\ \t\x7f\x85\u00e9\u200b\U0001f600")),
    ("producer_nul", _set("producer", "a\0b")), ("format_nul", _set("tensors.0.format", "x\0")),
    ("meta_nul", _meta_edit("x\0y", "1")), ("eos_bad", _meta_edit("eos_token_id", "1,,2")),
    ("eos_empty", _meta_edit("eos_token_id", "")), ("world_2", _meta_edit("parallel.world", "2")),
    ("rank_1", _meta_edit("parallel.rank", "1")), ("world_0", _meta_edit("parallel.world", "0")),
    ("programs_meta", _meta_edit("programs", "prefill,,decode")),
    ("long_meta", _meta_edit("max_seq_len", "\u00e9" * 200)),
    ("repr_single", _edits(_set("tensors.3.name", "it's"), _set("tensors.3.dtype", "f128"))),
    ("repr_both", _edits(_set("tensors.3.name",
                              "it's \"x\" \\ \t\x7f\x85\xa0\xad\u00e9\u200b\u2028\ue000\U0001f600\U000e0001"),
                         _set("tensors.3.dtype", "f128"))),
    ("repr_long", _edits(_set("tensors.3.name", "\U0001f600" * 300), _set("tensors.3.dtype", "x" * 500))),
]


def _tokenizers() -> list[bytes]:
    b64 = base64.b64encode(b"tokenizer bytes").decode()
    texts = [
        b"not json", b"[1, 2]", b"", b"   ", b"{}", b"null", b"\xff\xfe", b"e30=", b"{\"a\": 1}",
        json.dumps({"tokenizer.json": "@@not base64@@"}).encode(),
        json.dumps({"../../etc/passwd": base64.b64encode(b"x").decode()}).encode(),
        json.dumps({"tokenizer.json": 7}).encode(), json.dumps({"tokenizer.json": b64}).encode(),
        b'{"a": "QQ==", "b": "QQ==", "a": "!"}', b'{"a": "QQ==", "a": "QUFB", "b": 1}',
        b'{"a": "QQ==", "b": 1, "a": 2}', json.dumps({".hidden": b64}).encode(), json.dumps({"": b64}).encode(),
        json.dumps({"x\u0000y": b64}).encode(), json.dumps({"d/e": b64}).encode(),
        json.dumps({"\ud800": b64}).encode(), json.dumps({"caf\u00e9 \u2028 '\"": "!"}).encode(),
        "{\"é\": \"QQ==\"}".encode("utf-16"), "{\"é\": 1}".encode("utf-16-le"), "{\"a\": 2}".encode("utf-32"),
        "{\"a\": 2}".encode("utf-32-be"), b"\xef\xbb\xbf{\"a\": 3}", b'{"a": [1, {"b": [NaN, -Infinity]}], "c": 0}',
        b'{"a": -0.5e+3}', b'{"a": 01}', b'{"a": 1.}', b'{"a": .5}', b'{"a": "\\u00e9\\ud83d\\ude00"}',
        b'{"a": "\\x"}', b'{"a": "tab\there"}', b'{"a": "x",}', b'{"a" "x"}', b'{a: "x"}', b"[" * 50 + b"]" * 50,
        b'{"a": "QUJD\\nREVG"}', b'{"\\u0041": "QUJD", "A": 5}', b'{"a": "AAAA=="}', b'{"a": "A=AA"}',
        b'{"a": "AAA=="}', b'{"a": "AA"}', b'{"a": "=AAA"}', b'{"a": "AAAAA"}', b'{"a": "\xc3\xa9"}', b"{} x",
        b'{"a": tru}', b'{"a": true} ', b'\t{"a": "QQ=="}\r\n', b'{"a": "\xed\xa0\x80"}', b'{"a": "\xc0\xaf"}',
        b'{"a": ' + b"7" * 4300 + b'}', b'{"a": -' + b"7" * 4301 + b'}', b'{"a": ' + b"7" * 5000 + b'.5}',
    ]
    rng = random.Random(3)
    alphabet = list('{}[]":,. -+01eE\\u"abAQ=/ \n') + ["null", "true", "NaN", '"QQ=="', '"a"']
    for _ in range(120):
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 24))).encode())
    return texts


def test_tokenizer_sections_agree(lib: Any, seeds: list[Path], tmp_path: Path) -> None:
    img = om_fuzz.OmImage.parse(seeds[1].read_bytes())
    for i, text in enumerate(_tokenizers()):
        sections = [(n, d) for n, d in img.sections if n != "tokenizer"]
        sections.insert(len(sections) - 1, ("tokenizer", text))  # before the weights, as the writer puts it
        compare(lib, _write(tmp_path, f"tok{i}.om", om_fuzz.OmImage(sections).seal()))


def test_memory_cap_agrees(lib: Any, seeds: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    for cap in ("1K", " 2m ", "100000", "64kb", "1T", "junk", "99999999999999999999999G"):
        monkeypatch.setenv("NPUC_MAX_MEMORY", cap)
        compare(lib, seeds[1])


def test_mutants_agree(lib: Any, seeds: list[Path], tmp_path: Path) -> None:
    """om_fuzz's mutants (bit flips, truncation, table and protobuf edits, raw section bytes,
    weights and tokenizer edits, all re-sealed), seeded."""
    stats: Counter[str] = Counter()
    for i, (kind, data) in enumerate(_mutants(seeds, 11, 400)):
        path = _write(tmp_path, f"m{i}.om", data)
        try:
            compare(lib, path, stats)
        except AssertionError as e:
            raise AssertionError(f"mutant {i} ({kind}): {e}") from None
        path.unlink()
    assert stats["refused: ported check"] > 100, stats


def test_section_bytes_agree(lib: Any, seeds: list[Path], tmp_path: Path) -> None:
    """The protobuf decoder against upb's: random bytes edits inside the model sections."""
    rng = random.Random(5)
    images = [om_fuzz.OmImage.parse(p.read_bytes()) for p in seeds]
    for i in range(300):
        img = om_fuzz.OmImage(list(rng.choice(images).sections))
        name = rng.choice(["modeldef", "modeldef", "plan", "tasks", "metadata"])
        raw = bytearray(img.get(name) or b"")
        if not raw:
            continue
        for _ in range(rng.choice([1, 1, 2, 3])):
            k = rng.randrange(4)
            at = rng.randrange(len(raw))
            if k == 0:
                raw[at] = rng.randrange(256)
            elif k == 1:
                raw[at] = rng.choice([0x08, 0x0a, 0x10, 0x12, 0x1a, 0x22, 0x0b, 0x0c, 0x80, 0xff, 0x00, 0x7f])
            elif k == 2:
                del raw[at:at + rng.randrange(1, 4)]
            else:
                raw[at:at] = rng.randbytes(rng.randrange(1, 4))
        img.put(name, bytes(raw))
        path = _write(tmp_path, f"s{i}.om", img.seal())
        compare(lib, path)
        path.unlink()


def test_full_library_refuses_alike(seeds: list[Path], tmp_path: Path) -> None:
    """With the real executor (exec.c, once it exists), what the loader refuses is refused the same."""
    if not (npucrt_util.SRC / "exec.c").exists():
        pytest.skip("npucrt/src/exec.c is not written yet")
    full = npucrt_util.open_lib(npucrt_util.build(tmp_path / "full"))
    stub = npucrt_util.open_lib(npucrt_util.build(tmp_path / "stub", sources=npucrt_util.LOADER_SOURCES,
                                                  stub_exec=True))
    for i, (_, data) in enumerate(_mutants(seeds, 13, 60)):
        p = _write(tmp_path, f"f{i}.om", data)
        got = npucrt_util.load(stub, p)
        if got[0]:
            assert npucrt_util.load(full, p) == got


# ---------------------------------------------------------------- (c) sanitizers

def test_loader_under_sanitizers(seeds: list[Path], tmp_path: Path) -> None:
    """ASan + UBSan over the corpus, the seeds and a few hundred mutants: no report, exit 0,
    and the file and buffer loads agree (npucrt/tests/load_driver.c)."""
    exe = npucrt_util.build_exe(tmp_path, "npucrt/tests/load_driver.c", sanitize=True,
                                sources=npucrt_util.LOADER_SOURCES, stub_exec=True)
    files = [str(p) for p in (*seeds, *sorted(om_fuzz.CORPUS.glob("*.om")))]
    mutants = tmp_path / "mutants"
    mutants.mkdir()
    for i, (_, data) in enumerate(_mutants(seeds, 12, 300)):
        files.append(str(_write(mutants, f"m{i}.om", data)))
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=86",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87")
    r = subprocess.run([str(exe), "-b", *files], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "runtime error" not in r.stderr and "Sanitizer" not in r.stderr, r.stderr[-4000:]
    codes = Counter(line.split("\t")[0] for line in r.stdout.splitlines())
    assert len(r.stdout.splitlines()) == len(files) and codes["0"] >= len(seeds), codes
