"""A mutation fuzzer for the `.om` reader: validate, info, load, run and generate on mutants.

    python -m tests.fuzz.om_fuzz --execs 1000000 --seed 0 --jobs 2 --save-corpus

Seeds are three tiny Llama `.om` files (plain; prefill + decode with a KV cache; w4a16),
compiled once and cached under the temp folder, keyed by npuc's version. Each mutant
is one of: bit flips anywhere, a truncation, a section-table edit (table checksum
re-sealed), a protobuf field edit of modeldef / plan / tasks / metadata, a tokenizer or
weights edit, a raw edit of one section (the weights' chunk digests too); every structured
edit re-seals as `OmWriter` does (the header sections' SHA-256s, the weights' XXH3-128
chunk digests and their digest in the weights entry, the table's SHA-256), so mutants get
past the checksum gate and reach the validator.

Each mutant is made and run in a worker process (tests/fuzz/pool.py; RLIMIT_AS 2 GiB,
10 s per execution; a worker that dies is replaced) through `validate_om`, `model_info`, `Session.load`, one run of
each program, and `generation_info` + a 2-token greedy generate. Outcomes:

    ok        every call succeeded or raised NpucError, and validate and load agree
    npuc      (counted within ok) some call raised NpucError
    exception an exception other than NpucError (type, message, top frame recorded)
    crash     the worker died on a signal (SIGSEGV, SIGBUS, ...)
    hang      an execution over the timeout
    memory    MemoryError, or the worker killed at the cap
    disagree  validate_om accepted and load or run failed, or load accepted and validate refused

Everything but ok/npuc is a failure; `--save-corpus` keeps each failure's file as
tests/fuzz/corpus/om/<class>-<hash>.om (tests/test_fuzz_om.py replays them). The run is
deterministic from --seed: mutant i depends only on (seed, i).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import xxhash

from tests.fuzz.pool import Died, Pool

CORPUS = Path(__file__).parent / "corpus" / "om"
MEMORY_CAP = 2 << 30
TIMEOUT_S = 10.0
FAILURES = ("exception", "crash", "hang", "memory", "disagree")

# The container, as backend/om_format.py lays it out (kept here so the fuzzer can
# write files the writer never would).
_HEADER = struct.Struct("<8sIIII32s8s")
_ENTRY = struct.Struct("<16sQQ32s")
_ALIGN = {"weights": 4096}
_DEFAULT_ALIGN = 64
_CHUNKS = "weights.xxh3"  # chunk size u64, count u64, an XXH3-128 per chunk of the weights
_CHUNK = 4 << 20
_PROTO_SECTIONS = {"modeldef": "ModelDef", "plan": "Plans", "tasks": "Tasks", "metadata": "Metadata"}


# ---------------------------------------------------------------- seeds

def _tiny_checkpoint(path: Path) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         eos_token_id=2, bos_token_id=1)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def seed_files() -> list[Path]:
    """The seed `.om` files, compiled on first use and cached per npuc version and .om format."""
    import npuc
    from npuc.backend.om_format import FORMAT_VERSION

    root = Path(tempfile.gettempdir()) / f"npuc-om-fuzz-seeds-{npuc.__version__}-om{FORMAT_VERSION}"
    want = {"plain": {}, "kv": {"max_seq_len": 16}, "w4": {"max_seq_len": 16, "quant_type": "w4a16",
                                                           "group_size": 32}}
    paths = [root / f"{name}.om" for name in want]
    if all(p.is_file() for p in paths):
        return paths
    from npuc.compiler.driver import compile_model

    root.mkdir(parents=True, exist_ok=True)
    ckpt = root / "llama"
    if not (ckpt / "config.json").is_file():
        _tiny_checkpoint(ckpt)
    for name, opts in want.items():
        compile_model(str(ckpt), input_shape="input_ids:1,4", output=str(root / name), **opts)
    return paths


# ---------------------------------------------------------------- the container

@dataclass
class OmImage:
    sections: list[tuple[str, bytes]]

    @classmethod
    def parse(cls, data: bytes) -> OmImage:
        _, _, _, count, _, _, _ = _HEADER.unpack_from(data, 0)
        out = []
        for i in range(count):
            raw, off, size, _ = _ENTRY.unpack_from(data, _HEADER.size + _ENTRY.size * i)
            out.append((raw.rstrip(b"\0").decode("ascii"), data[off:off + size]))
        return cls(out)

    def seal(self, rechunk: bool = True) -> bytes:
        """Lay the sections out and checksum them as OmWriter does. With `rechunk` the
        weights' chunk digests are made afresh from the weights (at the chunk size the
        file names, where that is one a reader takes); without, they are left as they are
        (an edit of the digests themselves) and only their SHA-256 is re-sealed."""
        weights, chunks = self.get("weights"), self.get(_CHUNKS)
        if rechunk and weights is not None and chunks is not None:
            size = struct.unpack_from("<Q", chunks)[0] if len(chunks) >= 8 else 0
            self.put(_CHUNKS, chunk_table(weights, size if 4096 <= size <= 1 << 30 and not size & (size - 1)
                                          else _CHUNK))
        chunks = self.get(_CHUNKS)
        table_end = _HEADER.size + _ENTRY.size * len(self.sections)
        pos, offsets = table_end, []
        for name, data in self.sections:
            a = _ALIGN.get(name, _DEFAULT_ALIGN)
            pos = (pos + a - 1) // a * a
            offsets.append(pos)
            pos += len(data)

        def digest(name: str, data: bytes) -> bytes:
            if name != "weights":
                return hashlib.sha256(data).digest()
            return xxhash.xxh3_128_digest(chunks) + bytes(16) if chunks is not None else bytes(32)

        table = b"".join(_ENTRY.pack(n.encode("ascii")[:16], off, len(d), digest(n, d))
                         for (n, d), off in zip(self.sections, offsets, strict=True))
        out = bytearray(pos)
        out[:table_end] = _HEADER.pack(b"NPUCOM\x00\x01", 2, 0, len(self.sections), 0,
                                       hashlib.sha256(table).digest(), bytes(8)) + table
        for (_, d), off in zip(self.sections, offsets, strict=True):
            out[off:off + len(d)] = d
        return bytes(out)

    def get(self, name: str) -> bytes | None:
        return next((d for n, d in self.sections if n == name), None)

    def put(self, name: str, data: bytes) -> None:
        self.sections = [(n, data if n == name else d) for n, d in self.sections]


def chunk_table(weights: bytes, chunk: int = _CHUNK) -> bytes:
    """The weights.xxh3 payload of `weights` in chunks of `chunk` bytes."""
    n = -(-len(weights) // chunk)
    return struct.pack("<QQ", chunk, n) + b"".join(xxhash.xxh3_128_digest(weights[k * chunk:(k + 1) * chunk])
                                                   for k in range(n))


def _reseal_table(data: bytearray) -> None:
    count = _HEADER.unpack_from(data, 0)[3]
    end = _HEADER.size + _ENTRY.size * count
    if end <= len(data):
        data[16 + 8:16 + 8 + 32] = hashlib.sha256(bytes(data[_HEADER.size:end])).digest()


# ---------------------------------------------------------------- mutators

_BIG = [0, 1, -1, 2, 3, 7, 64, 4095, 4096, 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**40, 2**62, 2**63 - 1,
        -2**31, -2**63]  # int64 fields; uint64 ones take _U64
_U64 = [0, 1, 2, 63, 64, 4096, 2**20, 2**32, 2**40, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
_REGIONS = ["weights", "arena", "state", "", "bogus", "WEIGHTS"]
_DTYPES = ["f32", "f16", "bf16", "i64", "i32", "i8", "u8", "bool", "i4", "", "f64", "complex64", "x" * 40]
_META_VALUES = ["abc", "-5", "0", "1", "-1", "2", "99999999999999999999", "", " 3", "1,,2", "x", "١٢", "nan",
                "1e9", "2147483648", "3.5"]


def _pick(rng: random.Random, xs: list[Any]) -> Any:
    return xs[rng.randrange(len(xs))]


def mutate_bits(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4, 16])):
        i = rng.randrange(len(out))
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def mutate_truncate(rng: random.Random, data: bytes) -> bytes:
    return data[:rng.randrange(len(data))]


def mutate_table(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    count = _HEADER.unpack_from(out, 0)[3]
    choice = rng.randrange(5)
    if choice == 0 or count == 0:  # the count itself
        struct.pack_into("<I", out, 20, _pick(rng, [0, count - 1, count + 1, 2**32 - 1, 1000]) & 0xFFFFFFFF)
    else:
        at = _HEADER.size + _ENTRY.size * rng.randrange(count)
        field_ = rng.randrange(3)
        if field_ == 0:
            name = _pick(rng, [b"weights", b"modeldef", b"plan", b"tasks", b"metadata", b"tokenizer", b"x", b"",
                               b"../x", b"\xff\xfe"])
            out[at:at + 16] = name.ljust(16, b"\0")[:16]
        else:
            off = at + 16 + 8 * (field_ - 1)
            old = struct.unpack_from("<Q", out, off)[0]
            new = _pick(rng, [old + 1, max(old - 1, 0), old + 64, max(old - 64, 0), old + 4096, 0, 2**63, 2**64 - 1,
                              len(data), old * 2])
            struct.pack_into("<Q", out, off, new & (2**64 - 1))
        if rng.random() < 0.5:  # also re-seal that entry's section checksum when it still lies in the file
            name_, off_, size_, _ = _ENTRY.unpack_from(out, at)
            # (the weights entry's digest is of the chunk digests, not of its payload: it stays)
            if off_ + size_ <= len(out) and name_.rstrip(b"\0") != b"weights":
                out[at + 32:at + 64] = hashlib.sha256(bytes(out[off_:off_ + size_])).digest()
    _reseal_table(out)
    return bytes(out)


def _proto(name: str) -> Any:
    from npuc.backend import om_schema

    return getattr(om_schema, _PROTO_SECTIONS[name])()


def _edit_tensor(rng: random.Random, m: Any) -> None:
    if not m.tensors:
        return
    t = m.tensors[rng.randrange(len(m.tensors))]
    k = rng.randrange(7)
    if k == 0 and len(t.shape):
        numel = 1
        for d in t.shape:
            numel *= d
        item = t.nbytes // numel if numel > 0 else 0
        i = rng.randrange(len(t.shape))
        t.shape[i] = _pick(rng, _BIG)
        if rng.random() < 0.5 and len(t.shape) > 1:  # pairs of negatives keep the product
            j = (i + 1) % len(t.shape)
            t.shape[i], t.shape[j] = -abs(t.shape[i] or 1), -abs(t.shape[j] or 1)
        if rng.random() < 0.5:  # keep nbytes consistent (mod 2**64, as an overflowing writer would)
            numel = 1
            for d in t.shape:
                numel *= d
            t.nbytes = (numel * item) % 2**64
    elif k == 1:
        t.shape.extend([2**32, 2**32] if rng.random() < 0.5 else [2**62, 4])  # products past int64
    elif k == 2:
        t.dtype = _pick(rng, _DTYPES)
    elif k == 3:
        t.region = _pick(rng, _REGIONS)
    elif k == 4:
        t.offset = _pick(rng, _U64)
    elif k == 5:
        t.nbytes = _pick(rng, _U64)
    else:
        t.base = _pick(rng, [-1, 0, len(m.tensors), len(m.tensors) - 1, 2**31 - 1])


def _to_weights(rng: random.Random, m: Any) -> None:
    """Move a program input, output or op output into the read-only weights."""
    if not m.programs:
        return
    p = m.programs[rng.randrange(len(m.programs))]
    pool = list(p.inputs) + list(p.outputs) + [o for op in p.ops for o in op.outputs]
    if pool:
        i = _pick(rng, pool)
        if 0 <= i < len(m.tensors):
            m.tensors[i].region = "weights"
            m.tensors[i].offset = _pick(rng, [0, 64, 4096])


def _edit_op(rng: random.Random, m: Any) -> None:
    if not m.programs:
        return
    p = m.programs[rng.randrange(len(m.programs))]
    if not p.ops:
        return
    op = p.ops[rng.randrange(len(p.ops))]
    n = len(m.tensors)
    k = rng.randrange(9)
    if k == 0:
        op.op = _pick(rng, ["matmul", "add", "nonexistent", "", "rms_norm", "rope", "embedding", "softmax"])
    elif k == 1 and len(op.inputs):
        op.inputs[rng.randrange(len(op.inputs))] = _pick(rng, [-1, n, n + 5, 0, rng.randrange(max(n, 1))])
    elif k == 2 and len(op.outputs):
        op.outputs[rng.randrange(len(op.outputs))] = _pick(rng, [-1, n, 0, rng.randrange(max(n, 1))])
    elif k == 3:
        if len(op.inputs) and rng.random() < 0.5:
            del op.inputs[-1]
        else:
            op.inputs.append(rng.randrange(max(n, 1)))
    elif k == 4 and len(op.attrs):
        a = op.attrs[rng.randrange(len(op.attrs))]
        which = rng.randrange(6)
        if which == 0:
            a.value.i = _pick(rng, _BIG)
        elif which == 1:
            a.value.f = _pick(rng, [float("nan"), float("inf"), -1.0, 0.0, 1e308])
        elif which == 2:
            a.value.s = _pick(rng, ["", "x", "bogus"])
        elif which == 3:
            a.value.ints.values.extend([_pick(rng, _BIG)])
        elif which == 4:
            a.value.dtype = _pick(rng, _DTYPES)
        else:
            a.name = _pick(rng, ["", "axis", "bogus", a.name + "x"])
    elif k == 5 and len(op.attrs):
        del op.attrs[rng.randrange(len(op.attrs))]
    elif k == 6:
        op.workspace = _pick(rng, [-1, 0, n, rng.randrange(max(n, 1)), 2**31 - 1])
    elif k == 7:
        op.attrs.add(name=_pick(rng, ["axis", "eps", "bogus"])).value.i = _pick(rng, _BIG)
    else:
        op.name = _pick(rng, ["", "x" * 1000, "\u0000", op.name + "!"])


def _edit_program(rng: random.Random, m: Any) -> None:
    if not m.programs:
        return
    p = m.programs[rng.randrange(len(m.programs))]
    n = len(m.tensors)
    k = rng.randrange(5)
    if k == 0:
        p.name = _pick(rng, ["", "prefill", "decode", "main", "x"])
    elif k == 1 and len(p.inputs):
        p.inputs[rng.randrange(len(p.inputs))] = _pick(rng, [-1, n, 0, rng.randrange(max(n, 1))])
    elif k == 2 and len(p.outputs):
        p.outputs[rng.randrange(len(p.outputs))] = _pick(rng, [-1, n, 0, rng.randrange(max(n, 1))])
    elif k == 3:
        if rng.random() < 0.5 and len(p.ops):
            del p.ops[rng.randrange(len(p.ops))]
        elif len(p.ops):
            i, j = rng.randrange(len(p.ops)), rng.randrange(len(p.ops))
            a, b = type(p.ops[0])(), type(p.ops[0])()
            a.CopyFrom(p.ops[i])
            b.CopyFrom(p.ops[j])
            p.ops[i].CopyFrom(b)
            p.ops[j].CopyFrom(a)
    else:
        if rng.random() < 0.5:
            m.state_bytes = _pick(rng, _U64)
        else:
            m.weights_bytes = _pick(rng, _U64)


def _edit_plans(rng: random.Random, plans: Any) -> None:
    if not plans.plans:
        return
    p = plans.plans[rng.randrange(len(plans.plans))]
    k = rng.randrange(4)
    if k == 0:
        p.arena_bytes = _pick(rng, _U64)
    elif k == 1:
        p.lower_bound_bytes = _pick(rng, _U64)
    elif k == 2:
        p.alignment = _pick(rng, [0, 1, 3, 64, 2**63])
    elif len(p.buffers):
        b = p.buffers[rng.randrange(len(p.buffers))]
        setattr(b, _pick(rng, ["tensor", "first_step", "last_step"]), _pick(rng, [-1, 0, 1, 2**31 - 1, 10**6]))


def _edit_metadata(rng: random.Random, meta: Any) -> None:
    keys = ["max_seq_len", "eos_token_id", "bos_token_id", "option.prefill_logits", "vocab_size"]
    key = _pick(rng, keys + [e.key for e in meta.entries])
    for e in meta.entries:
        if e.key == key:
            e.value = _pick(rng, _META_VALUES)
            return
    meta.entries.add(key=key, value=_pick(rng, _META_VALUES))


def mutate_proto(rng: random.Random, data: bytes) -> bytes:
    img = OmImage.parse(data)
    which = _pick(rng, ["modeldef", "modeldef", "modeldef", "plan", "tasks", "metadata"])
    raw = img.get(which)
    if raw is None:
        return data
    msg = _proto(which)
    msg.ParseFromString(raw)
    if which == "modeldef":
        _pick(rng, [_edit_tensor, _edit_tensor, _to_weights, _edit_op, _edit_op, _edit_program])(rng, msg)
    elif which == "plan":
        _edit_plans(rng, msg)
    elif which == "metadata":
        _edit_metadata(rng, msg)
    elif msg.programs:
        pt = msg.programs[rng.randrange(len(msg.programs))]
        if len(pt.tasks):
            t = pt.tasks[rng.randrange(len(pt.tasks))]
            t.unit = _pick(rng, ["", "vector", "cube", "bogus"])
            t.flops = _pick(rng, _U64)
    img.put(which, msg.SerializeToString())
    return img.seal()


def mutate_section_bytes(rng: random.Random, data: bytes) -> bytes:
    """Raw edits inside one section (protobuf bytes too), re-sealed."""
    img = OmImage.parse(data)
    name, raw = img.sections[rng.randrange(len(img.sections))]
    b = bytearray(raw)
    if b:
        for _ in range(rng.choice([1, 2, 8])):
            b[rng.randrange(len(b))] = rng.randrange(256)
    img.put(name, bytes(b))
    return img.seal(rechunk=name != _CHUNKS)


def mutate_weights(rng: random.Random, data: bytes) -> bytes:
    img = OmImage.parse(data)
    raw = img.get("weights")
    if raw is None:
        return data
    b = bytearray(raw)
    k = rng.randrange(3)
    if k == 0 and b:  # NaN/inf/huge values
        i = rng.randrange(max(len(b) - 4, 1))
        b[i:i + 4] = _pick(rng, [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\xff\xff\x7f\x7f", b"\xff\xff\xff\xff"])
    elif k == 1:
        b = b[:rng.randrange(len(b) + 1)]
    else:
        b += bytes(_pick(rng, [1, 64, 4096]))
    img.put("weights", bytes(b))
    return img.seal()


def mutate_tokenizer(rng: random.Random, data: bytes) -> bytes:
    img = OmImage.parse(data)
    bad = _pick(rng, [b"!!!not base64!!!", b"bm90IGpzb24=", b"", b"e30=", b"\xff\xfe", b"W10=",
                      b"eyJhIjogMX0="])
    if img.get("tokenizer") is None:
        img.sections.append(("tokenizer", bad))
    else:
        img.put("tokenizer", bad)
    return img.seal()


MUTATORS: list[tuple[str, Callable[[random.Random, bytes], bytes], int]] = [
    ("bits", mutate_bits, 2), ("truncate", mutate_truncate, 1), ("table", mutate_table, 2),
    ("proto", mutate_proto, 8), ("section", mutate_section_bytes, 2), ("weights", mutate_weights, 1),
    ("tokenizer", mutate_tokenizer, 1)]


def mutant(seeds: list[bytes], seed: int, i: int) -> tuple[str, bytes]:
    rng = random.Random(seed * 1_000_003 + i)
    data = seeds[rng.randrange(len(seeds))]
    names = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        name, fn, _ = rng.choices(MUTATORS, weights=[w for *_, w in MUTATORS])[0]
        names.append(name)
        try:
            data = fn(rng, data) or data
        except Exception:  # a mutant too broken for a structured edit stays as it is
            pass
    return "+".join(names), data


# ---------------------------------------------------------------- execution (in the worker)

def _feeds(sess: Any, prog: Any) -> dict[str, Any]:
    import torch

    feeds = {}
    for t in prog.inputs:
        dt = t.dtype.torch
        x = torch.zeros(t.shape, dtype=dt)
        if t.name == "input_ids":
            x += 1
        feeds[t.name] = x
    return feeds


def execute(path: str) -> dict[str, Any]:
    """Every reader entry point on one file; what each did."""
    from npuc.apps.generate import generate, generation_info
    from npuc.errors import NpucError
    from npuc.runtime import Session
    from npuc.tools.om_tools import model_info, validate_om

    res: dict[str, Any] = {"npuc": [], "exc": None, "validate": None, "load": None, "run": None}

    def guard(stage: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        try:
            return True, fn()
        except NpucError as e:
            res["npuc"].append(f"{stage}:{e.code}")
            return False, None
        except MemoryError:
            raise
        except Exception as e:  # the failures this fuzzer is for
            tb = traceback.extract_tb(e.__traceback__)
            top = tb[-1] if tb else None
            where = f"{Path(top.filename).name}:{top.lineno}:{top.name}" if top else "?"
            res["exc"] = res["exc"] or f"{stage}: {type(e).__name__} at {where}: {str(e)[:120]}"
            return False, None

    res["validate"], _ = guard("validate", lambda: validate_om(path))
    guard("info", lambda: model_info(path))
    ok, sess = guard("load", lambda: Session.load(path))
    res["load"] = ok
    if ok:
        ran = True
        for name, prog in sess.programs.items():
            ran &= guard(f"run[{name}]", lambda p=prog, n=name: sess.run(_feeds(sess, p), n))[0]
        meta = {e.key for e in sess.model.metadata}
        if {"prefill", "decode"} <= set(sess.programs) and "max_seq_len" in meta:  # else generate refuses (E0111)
            ran &= guard("generation_info", lambda: generation_info(sess))[0]
            ran &= guard("generate", lambda: generate(sess, [1], 2, ignore_eos=True))[0]
        res["run"] = ran
    return res


def _worker(conn: Connection, seed_paths: list[str], tmp: str) -> None:
    """Answers ("mutant", seed, i): makes mutant i of `seed` here (the driver only counts)
    and runs it from a file in `tmp`; ("path", p): runs the file p."""
    import resource

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    import torch

    torch.set_num_threads(1)
    import npuc.apps.generate  # noqa: F401  (import once, before the first execution)
    import npuc.tools.om_tools  # noqa: F401

    seeds = [Path(p).read_bytes() for p in seed_paths]
    mine = os.path.join(tmp, f"w{os.getpid()}.om")
    conn.send("ready")
    while (job := conn.recv()) is not None:
        if job[0] == "mutant":
            _, data = mutant(seeds, job[1], job[2])
            Path(mine).write_bytes(data)
            path = mine
        else:
            path = job[1]
        try:
            out = execute(path)
        except MemoryError:
            out = {"memory": True}
        conn.send(out)


# ---------------------------------------------------------------- the driver

@dataclass
class Outcome:
    cls: str  # ok | npuc | exception | crash | hang | memory | disagree
    signature: str


def classify(res: dict[str, Any] | Died) -> Outcome:
    if isinstance(res, Died):
        return Outcome(res.cls, res.detail)
    if res.get("memory"):
        return Outcome("memory", "MemoryError")
    if res["exc"]:
        if "MemoryError" in res["exc"] or "can't allocate memory" in res["exc"]:
            return Outcome("memory", res["exc"])
        return Outcome("exception", res["exc"])
    if res["validate"] and not (res["load"] and res["run"]):
        return Outcome("disagree", "validate ok, " + ("run failed: " if res["load"] else "load refused: ")
                       + ",".join(res["npuc"]))
    if res["load"] and not res["validate"]:
        return Outcome("disagree", "load ok, validate refused: " + ",".join(res["npuc"]))
    return Outcome("npuc" if res["npuc"] else "ok", ",".join(res["npuc"]))


@dataclass
class Summary:
    execs: int = 0
    seconds: float = 0.0
    classes: Counter[str] = field(default_factory=Counter)
    signatures: Counter[tuple[str, str]] = field(default_factory=Counter)
    saved: list[str] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return sum(self.classes[c] for c in FAILURES)

    def render(self) -> str:
        lines = [f"executions: {self.execs} in {self.seconds:.1f} s ({self.execs / max(self.seconds, 1e-9):.1f}/s)",
                 "classes: " + ", ".join(f"{c} {n}" for c, n in sorted(self.classes.items()))]
        bad = [(k, n) for k, n in self.signatures.most_common() if k[0] in FAILURES]
        if bad:
            lines.append(f"distinct failure signatures: {len(bad)}")
            lines += [f"  {n:6d}  {c}: {s}" for (c, s), n in bad]
        if self.saved:
            lines.append(f"saved {len(self.saved)} corpus files under {CORPUS}")
        return "\n".join(lines)


def _normalise(sig: str) -> str:
    """One signature per bug: numbers and file names vary between mutants."""
    import re

    sig = re.sub(r"/\S+\.om", "FILE.om", sig)
    return re.sub(r"\b\d{3,}\b", "N", sig)


def _build_native() -> None:
    """Build libnpucrt (cached by its sources' hash) here, before the workers: a build in a
    worker, after a source changed, takes longer than an execution may and reads as a hang."""
    from npuc.runtime import native

    native.library()


def fuzz(execs: int, seed: int = 0, jobs: int = 1, save_corpus: bool = False, timeout: float = TIMEOUT_S,
         log: Callable[[str], None] | None = None, start_at: int = 0) -> Summary:
    """Mutants start_at .. start_at + execs - 1 of `seed` (each is a function of (seed, i) alone,
    so a long run splits into shards that together are the one run)."""
    paths = [str(p) for p in seed_files()]
    _build_native()
    summary = Summary()
    start = time.monotonic()
    seen_sigs: set[tuple[str, str]] = set()
    with tempfile.TemporaryDirectory(prefix="npuc-om-fuzz-") as tmp, \
            Pool[tuple[str, int, int]](_worker, jobs, timeout, lambda k: (paths, tmp)) as pool:
        jobs_ = (("mutant", seed, i) for i in range(start_at, start_at + execs))
        for (_, _, i), answer in pool.run(jobs_):
            out = classify(answer)
            summary.execs += 1
            summary.classes[out.cls] += 1
            if log and summary.execs % 10000 == 0:
                log(f"[{summary.execs} executions, {time.monotonic() - start:.0f} s] "
                    + ", ".join(f"{k} {v}" for k, v in sorted(summary.classes.items())))
            key = (out.cls, _normalise(out.signature))
            summary.signatures[key] += 1
            if out.cls in FAILURES:
                if log and key not in seen_sigs:
                    log(f"[{i}] {out.cls}: {out.signature}")
                if save_corpus and key not in seen_sigs:
                    _, data = mutant([Path(p).read_bytes() for p in paths], seed, i)
                    CORPUS.mkdir(parents=True, exist_ok=True)
                    name = CORPUS / f"{out.cls}-{hashlib.sha256(data).hexdigest()[:16]}.om"
                    name.write_bytes(data)
                    summary.saved.append(name.name)
                seen_sigs.add(key)
    summary.seconds = time.monotonic() - start
    return summary


def replay(paths: list[str], timeout: float = TIMEOUT_S) -> dict[str, Outcome]:
    """Each file through the same checks, in a worker (tests/test_fuzz_om.py replays the corpus)."""
    _build_native()
    with tempfile.TemporaryDirectory(prefix="npuc-om-replay-") as tmp, \
            Pool[tuple[str, str]](_worker, 1, timeout, lambda k: ([], tmp)) as pool:
        return {job[1]: classify(answer) for job, answer in pool.run(("path", p) for p in paths)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz.om_fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--execs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first mutant index (to split a long run into shards)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S)
    ap.add_argument("--save-corpus", action="store_true", help="keep each new failure under tests/fuzz/corpus/om/")
    a = ap.parse_args(argv)
    s = fuzz(a.execs, a.seed, a.jobs, a.save_corpus, a.timeout, log=lambda m: print(m, flush=True), start_at=a.start)
    print(s.render())
    return 1 if s.failures else 0


if __name__ == "__main__":
    sys.exit(main())
