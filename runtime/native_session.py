"""The C executor from Python: libnpucrt (npucrt/, include/npucrt.h) through ctypes.

`NativeSession` is what `npuc.load`, `npuc run`, `npuc generate` and `npuc serve` run on:
the library loads and checks the `.om` and runs its programs; Python only passes numpy
buffers in and out. It imports neither torch nor the compiler, so the runtime commands
work where torch is not installed. The torch interpreter (runtime/session.py) stays as
the reference that `npuc verify` and the tests compare against, and runs a model the
library refuses (an op it has no kernel for: NPUC-E0413), with a one-line notice.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from npuc.errors import EXIT_IO, EXIT_USAGE, NpucError

# npuc_dtype -> (name, numpy dtype); bf16 travels as its 16 bits (numpy has no bfloat16).
DTYPES = {0: ("f64", np.float64), 1: ("f32", np.float32), 2: ("f16", np.float16), 3: ("bf16", np.uint16),
          4: ("i64", np.int64), 5: ("i32", np.int32), 6: ("i16", np.int16), 7: ("i8", np.int8),
          8: ("u8", np.uint8), 9: ("bool", np.bool_)}
MAX_RANK = 8
E_NO_KERNEL = "NPUC-E0413"


class _Error(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("message", ctypes.c_char * 768), ("hint", ctypes.c_char * 256)]


class _TensorInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int), ("rank", ctypes.c_int32),
                ("shape", ctypes.c_int64 * MAX_RANK), ("nbytes", ctypes.c_uint64)]


class _LoadOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("verify_checksums", ctypes.c_int32),
                ("max_memory", ctypes.c_uint64)]


class _SessionOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("threads", ctypes.c_int32), ("prepack", ctypes.c_int32)]


class _GenInfo(ctypes.Structure):
    _fields_ = [("slots", ctypes.c_int32), ("max_seq_len", ctypes.c_int32), ("prefill_len", ctypes.c_int32),
                ("decode_tokens", ctypes.c_int32), ("vocab", ctypes.c_int64), ("logits_width", ctypes.c_int64),
                ("n_eos", ctypes.c_int32), ("eos", ctypes.POINTER(ctypes.c_int64))]


class _Sequence(ctypes.Structure):
    """npuc_sequence (npuc_generate's), its sampling a pointer to an npuc_sampling (NULL: greedy)."""

    _fields_ = [("prompt", ctypes.POINTER(ctypes.c_int64)), ("prompt_len", ctypes.c_int32),
                ("max_new_tokens", ctypes.c_int32), ("ignore_eos", ctypes.c_int32),
                ("out_tokens", ctypes.POINTER(ctypes.c_int64)), ("n_out", ctypes.c_int32),
                ("finish_reason", ctypes.c_int32), ("sampling", ctypes.c_void_p)]


class Speculation(ctypes.Structure):
    """npuc_speculation (npuc_generate_speculative's): drafted tokens a step (0: off), the n-gram
    sizes, and the expected gain below which a step runs plain decode."""

    _fields_ = [("tokens", ctypes.c_int32), ("ngram_min", ctypes.c_int32), ("ngram_max", ctypes.c_int32),
                ("min_gain", ctypes.c_float)]


class SpeculationStats(ctypes.Structure):
    """npuc_speculation_stats: steps, verify steps, draft tokens checked and kept, tokens chosen."""

    _fields_ = [("steps", ctypes.c_int64), ("verify_steps", ctypes.c_int64), ("drafted", ctypes.c_int64),
                ("accepted", ctypes.c_int64), ("tokens", ctypes.c_int64)]


# Exit codes by family, as errors.py's callers give them.
def _exit_code(code: int) -> int:
    return EXIT_USAGE if 100 <= code < 200 else EXIT_IO


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    P, I32, I64, U64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
    E = ctypes.POINTER(_Error)
    sigs: dict[str, list[Any]] = {
        "npuc_abi_version": [],
        "npuc_model_load_file": [ctypes.c_char_p, ctypes.POINTER(_LoadOptions), ctypes.POINTER(P), E],
        "npuc_model_free": [P],
        "npuc_model_program_count": [P, ctypes.POINTER(I32)],
        "npuc_model_program_name": [P, I32, ctypes.POINTER(ctypes.c_char_p)],
        "npuc_model_input_count": [P, I32, ctypes.POINTER(I32)],
        "npuc_model_output_count": [P, I32, ctypes.POINTER(I32)],
        "npuc_model_input": [P, I32, I32, ctypes.POINTER(_TensorInfo)],
        "npuc_model_output": [P, I32, I32, ctypes.POINTER(_TensorInfo)],
        "npuc_model_memory": [P, ctypes.POINTER(U64), ctypes.POINTER(U64), ctypes.POINTER(U64)],
        "npuc_model_metadata": [P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)],
        "npuc_model_section": [P, ctypes.c_char_p, ctypes.POINTER(P), ctypes.POINTER(U64)],
        "npuc_model_generation_info": [P, ctypes.POINTER(_GenInfo), E],
        "npuc_session_create": [P, ctypes.POINTER(_SessionOptions), ctypes.POINTER(P), E],
        "npuc_session_free": [P],
        "npuc_session_reset": [P],
        "npuc_session_extra_bytes": [P, ctypes.POINTER(U64)],
        "npuc_session_run": [P, I32, ctypes.POINTER(P), ctypes.POINTER(U64), I32, ctypes.POINTER(P),
                             ctypes.POINTER(U64), I32, E],
        "npuc_session_output_view": [P, I32, I32, ctypes.POINTER(P)],
        "npuc_session_profile": [P, I32],
        "npuc_session_profile_read": [P, I32, ctypes.POINTER(U64), ctypes.POINTER(U64)],
        "npuc_session_profile_step": [P, I32, I32, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p),
                                      ctypes.POINTER(U64)],
        "npuc_generate": [P, P, I32, P, P, E],
        "npuc_generate_speculative": [P, P, I32, ctypes.POINTER(Speculation), ctypes.POINTER(SpeculationStats), P,
                                      P, E],
        "npuc_prefill": [P, I32, P, I32, P, P, E],
        "npuc_decode_step": [P, P, P, P, P, P, E],
        "npuc_sampling_check": [P, I64, E],
        "npuc_session_copy_slot": [P, I32, I32, E],
        "npuc_session_rollback": [P, I32, I32, E],
        "npuc_model_prefix_pool": [P, ctypes.POINTER(I32), ctypes.POINTER(U64), E],
        "npuc_session_prefix_save": [P, I32, I32, I64, E],
        "npuc_session_prefix_load": [P, I32, I32, I64, E],
        "npuc_sample": [P, I64, P, P, I32, P, I32, P, ctypes.c_size_t, P, E],
        "npuc_sampling_process": [P, I64, P, P, I32, P, I32, P, E],
    }
    for name, args in sigs.items():
        f = getattr(lib, name)
        f.argtypes = args
        f.restype = ctypes.c_int
    lib.npuc_model_free.restype = ctypes.c_int
    lib.npuc_sample_work_bytes.argtypes, lib.npuc_sample_work_bytes.restype = [I64], ctypes.c_size_t
    lib.npuc_sample_uniform.argtypes, lib.npuc_sample_uniform.restype = [U64, I64], ctypes.c_double
    return lib


_LIB: ctypes.CDLL | None = None


def runtime_library() -> ctypes.CDLL | None:
    """libnpucrt with its C API declared, or None where it cannot be built (no compiler,
    NPUC_NATIVE=0)."""
    global _LIB
    from npuc.runtime import native

    lib = native.library()  # None while NPUC_NATIVE=0, whatever an earlier call found
    if lib is None or not hasattr(lib, "npuc_abi_version"):
        return None
    if _LIB is not lib:  # declared once per loaded library
        _LIB = _declare(lib)
    return _LIB


def _raise(err: _Error, rc: int) -> None:
    code = err.code or rc
    msg = err.message.decode("utf-8", "replace") or f"the native runtime returned {code}"
    raise NpucError(f"NPUC-E{code:04d}", msg, err.hint.decode("utf-8", "replace"), exit_code=_exit_code(code))


@dataclass(frozen=True)
class IOInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def np_dtype(self) -> Any:
        return next(np.dtype(t) for n, t in DTYPES.values() if n == self.dtype)


@dataclass(frozen=True)
class ProgramInfo:
    index: int
    name: str
    inputs: list[IOInfo]
    outputs: list[IOInfo]


@dataclass(frozen=True)
class NativeGeneration:
    slots: int
    max_seq_len: int
    prefill_len: int
    decode_tokens: int
    vocab: int
    logits_width: int
    eos: frozenset[int]


class NativeSession:
    """One loaded model and one session of the C executor (its arena, state and packed weights)."""

    def __init__(self, path: str, threads: int | None = None, verify: bool = True) -> None:
        lib = runtime_library()
        if lib is None:
            raise NpucError("NPUC-E0413", "the native runtime is not available (no C compiler, or NPUC_NATIVE=0)",
                            "install a C compiler, or run with the torch interpreter", exit_code=EXIT_IO)
        self.lib = lib
        self.path = path
        self._model = ctypes.c_void_p()
        self._session = ctypes.c_void_p()
        err = _Error()
        opts = _LoadOptions(ctypes.sizeof(_LoadOptions), int(verify), 0)
        rc = lib.npuc_model_load_file(os.fsencode(path), ctypes.byref(opts), ctypes.byref(self._model),
                                      ctypes.byref(err))
        if rc:
            _raise(err, rc)
        try:
            sopts = _SessionOptions(ctypes.sizeof(_SessionOptions), int(threads or 0), 1)
            rc = lib.npuc_session_create(self._model, ctypes.byref(sopts), ctypes.byref(self._session),
                                         ctypes.byref(err))
            if rc:
                _raise(err, rc)
            self.programs = self._programs()
        except BaseException:
            self.close()
            raise
        first = next(iter(self.programs.values()))
        self.inputs, self.outputs = first.inputs, first.outputs
        a, s, w = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        lib.npuc_model_memory(self._model, ctypes.byref(a), ctypes.byref(s), ctypes.byref(w))
        self.arena_bytes, self.state_bytes, self.weights_bytes = a.value, s.value, w.value
        entries, pool = ctypes.c_int32(), ctypes.c_uint64()
        lib.npuc_model_prefix_pool(self._model, ctypes.byref(entries), ctypes.byref(pool), None)
        self._prefix_entries, self.prefix_pool_bytes = entries.value, pool.value
        self._views: dict[str, dict[str, np.ndarray]] = {}

    @classmethod
    def load(cls, path: str, threads: int | None = None) -> NativeSession:
        return cls(path, threads)

    def close(self) -> None:
        if self._session:
            self.lib.npuc_session_free(self._session)
            self._session = ctypes.c_void_p()
        if self._model:
            self.lib.npuc_model_free(self._model)
            self._model = ctypes.c_void_p()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _io(self, prog: int, n: int, fn: Any) -> list[IOInfo]:
        out = []
        for i in range(n):
            ti = _TensorInfo()
            fn(self._model, prog, i, ctypes.byref(ti))
            out.append(IOInfo(ti.name.decode(), DTYPES[ti.dtype][0], tuple(ti.shape[:ti.rank]), ti.nbytes))
        return out

    def _programs(self) -> dict[str, ProgramInfo]:
        lib, n = self.lib, ctypes.c_int32()
        lib.npuc_model_program_count(self._model, ctypes.byref(n))
        progs = {}
        for p in range(n.value):
            name, ni, no = ctypes.c_char_p(), ctypes.c_int32(), ctypes.c_int32()
            lib.npuc_model_program_name(self._model, p, ctypes.byref(name))
            lib.npuc_model_input_count(self._model, p, ctypes.byref(ni))
            lib.npuc_model_output_count(self._model, p, ctypes.byref(no))
            assert name.value is not None
            progs[name.value.decode()] = ProgramInfo(p, name.value.decode(), self._io(p, ni.value, lib.npuc_model_input),
                                                     self._io(p, no.value, lib.npuc_model_output))
        return progs

    def metadata(self, key: str) -> str | None:
        v = ctypes.c_char_p()
        if self.lib.npuc_model_metadata(self._model, key.encode(), ctypes.byref(v)):
            return None
        return v.value.decode("utf-8", "replace") if v.value is not None else None

    def section(self, name: str) -> bytes | None:
        data, size = ctypes.c_void_p(), ctypes.c_uint64()
        if self.lib.npuc_model_section(self._model, name.encode(), ctypes.byref(data), ctypes.byref(size)):
            return None
        return ctypes.string_at(data.value, size.value) if size.value and data.value else b""

    def generation(self) -> NativeGeneration:
        gi, err = _GenInfo(), _Error()
        rc = self.lib.npuc_model_generation_info(self._model, ctypes.byref(gi), ctypes.byref(err))
        if rc:
            _raise(err, rc)
        return NativeGeneration(gi.slots, gi.max_seq_len, gi.prefill_len, gi.decode_tokens, gi.vocab, gi.logits_width,
                                frozenset(gi.eos[i] for i in range(gi.n_eos)))

    def reset_state(self) -> None:
        self.lib.npuc_session_reset(self._session)

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot src's KV cache into slot dst (n > 1 continuations of one prefill)."""
        err = _Error()
        rc = self.lib.npuc_session_copy_slot(self._session, src, dst, ctypes.byref(err))
        if rc:
            _raise(err, rc)

    def rollback(self, slot: int, row: int) -> None:
        """Slot `slot`'s recurrent states as they were after row `row` of the last verify step
        (npuc_session_rollback)."""
        err = _Error()
        slot, row = (max(min(int(x), 2**31 - 1), -(2**31)) for x in (slot, row))
        rc = self.lib.npuc_session_rollback(self._session, slot, row, ctypes.byref(err))
        if rc:
            _raise(err, rc)

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 speculation: tuple[int, int, int, float] | None = None,
                 samplings: list[Any] | None = None) -> tuple[list[list[int]], SpeculationStats]:
        """The C library's own decode loop (npuc_generate_speculative) over `prompts`, each to
        max_new_tokens (end-of-sequence ids ignored): each prompt's tokens and the speculation
        counts. `speculation`: (tokens, ngram_min, ngram_max, min_gain), None for none;
        `samplings`: each prompt's npuc_sampling structure (apps/sampling.TokenChooser's), or
        None for greedy."""
        keep: list[Any] = []
        seqs = (_Sequence * len(prompts))()
        for q, p in enumerate(prompts):
            pa, out = (ctypes.c_int64 * len(p))(*p), (ctypes.c_int64 * max_new_tokens)()
            keep += [pa, out]
            one = samplings[q] if samplings else None
            seqs[q] = _Sequence(pa, len(p), max_new_tokens, 1, out, 0, 0,
                                ctypes.addressof(one) if one is not None else None)
        stats, err = SpeculationStats(), _Error()
        sp = ctypes.byref(Speculation(*speculation)) if speculation else None
        rc = self.lib.npuc_generate_speculative(self._session, ctypes.cast(seqs, ctypes.c_void_p), len(prompts), sp,
                                                ctypes.byref(stats), None, None, ctypes.byref(err))
        if rc:
            _raise(err, rc)
        return [[int(seqs[q].out_tokens[i]) for i in range(seqs[q].n_out)] for q in range(len(prompts))], stats

    @property
    def prefix_entries(self) -> int:
        """Prompt prefixes the model's pool holds (--prefix_cache; 0: none)."""
        return self._prefix_entries

    def save_prefix(self, slot: int, entry: int, n: int) -> None:
        """Positions 0..n-1 of every cache of `slot` into prefix pool entry `entry`."""
        self._prefix_call(self.lib.npuc_session_prefix_save, slot, entry, n)

    def load_prefix(self, entry: int, slot: int, n: int) -> None:
        """Positions 0..n-1 of prefix pool entry `entry` into `slot`, whose next decode step
        continues at position n."""
        self._prefix_call(self.lib.npuc_session_prefix_load, entry, slot, n)

    def _prefix_call(self, fn: Any, a: int, b: int, n: int) -> None:
        # out of the C types' range: the same refusal as any other out-of-range value
        a, b = (max(min(int(x), 2**31 - 1), -(2**31)) for x in (a, b))
        err = _Error()
        rc = fn(self._session, a, b, max(min(int(n), 2**63 - 1), -(2**63)), ctypes.byref(err))
        if rc:
            _raise(err, rc)

    @property
    def extra_bytes(self) -> int:
        v = ctypes.c_uint64()
        self.lib.npuc_session_extra_bytes(self._session, ctypes.byref(v))
        return v.value

    def _program(self, name: str | None) -> ProgramInfo:
        if name is None:
            return next(iter(self.programs.values()))
        if name not in self.programs:
            raise NpucError("NPUC-E0111", f"the model has no program {name!r}",
                            "its programs are " + ", ".join(self.programs), exit_code=EXIT_USAGE)
        return self.programs[name]

    def _feed(self, p: ProgramInfo, inputs: Mapping[str, Any]) -> list[np.ndarray]:
        names = {t.name for t in p.inputs}
        unknown, missing = sorted(set(inputs) - names), sorted(names - set(inputs))
        if unknown or missing:
            raise NpucError("NPUC-E0107", f"inputs do not match the model: missing {missing}, unknown {unknown}",
                            "the model's inputs are " + ", ".join(f"{t.name}: {t.dtype}{list(t.shape)}"
                                                                   for t in p.inputs), exit_code=EXIT_USAGE)
        arrays = []
        for t in p.inputs:
            x = inputs[t.name]
            x = x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else np.asarray(x)
            if tuple(x.shape) != t.shape:
                raise NpucError("NPUC-E0108", f"input {t.name!r} has shape {list(x.shape)}, the model was "
                                f"compiled for {list(t.shape)}", "npuc models have static shapes; recompile "
                                "with the --input_shape you need", exit_code=EXIT_USAGE)
            want = t.np_dtype
            if x.dtype != want:
                if (x.dtype.kind == "f") != (want.kind == "f") or t.dtype == "bf16":
                    raise NpucError("NPUC-E0108", f"input {t.name!r} has dtype {x.dtype}, the model expects "
                                    f"{t.dtype}", "convert the input", exit_code=EXIT_USAGE)
                x = x.astype(want)
            arrays.append(np.ascontiguousarray(x))
        return arrays

    def run(self, inputs: Mapping[str, Any], program: str | None = None, copy_outputs: bool = True
            ) -> dict[str, np.ndarray]:
        """Run `program` (the first by default) on `inputs` (name -> array). With
        `copy_outputs=False` the outputs are views of the arena, valid until the next run."""
        p = self._program(program)
        arrays = self._feed(p, inputs)
        n = len(arrays)
        ptrs = (ctypes.c_void_p * max(n, 1))(*[a.ctypes.data for a in arrays])
        sizes = (ctypes.c_uint64 * max(n, 1))(*[a.nbytes for a in arrays])
        err = _Error()
        rc = self.lib.npuc_session_run(self._session, p.index, ptrs, sizes, n, None, None, 0, ctypes.byref(err))
        if rc:
            _raise(err, rc)
        views = self._views.get(p.name)
        if views is None:
            views = {}
            for i, t in enumerate(p.outputs):
                ptr = ctypes.c_void_p()
                self.lib.npuc_session_output_view(self._session, p.index, i, ctypes.byref(ptr))
                buf = memoryview((ctypes.c_char * max(t.nbytes, 1)).from_address(ptr.value or 0)).cast("B")
                views[t.name] = np.frombuffer(buf, dtype=t.np_dtype, count=int(np.prod(t.shape, dtype=np.int64))
                                              ).reshape(t.shape)
            self._views[p.name] = views
        return {k: v.copy() for k, v in views.items()} if copy_outputs else dict(views)

    def profile(self, enable: bool = True) -> None:
        self.lib.npuc_session_profile(self._session, int(enable))

    def profile_steps(self, program: str) -> list[tuple[str, str, int]]:
        """(op, name, nanoseconds) of each step that ran, since profile() turned it on."""
        out, k = [], 0
        op, name, ns = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_uint64()
        index = self._program(program).index
        while not self.lib.npuc_session_profile_step(self._session, index, k, ctypes.byref(op), ctypes.byref(name),
                                                     ctypes.byref(ns)):
            out.append(((op.value or b"").decode(), (name.value or b"").decode(), ns.value))
            k += 1
        return out

    def profile_read(self, program: str) -> tuple[int, int]:
        """(nanoseconds the kernels took, runs) since profile() turned it on."""
        ns, runs = ctypes.c_uint64(), ctypes.c_uint64()
        self.lib.npuc_session_profile_read(self._session, self._program(program).index, ctypes.byref(ns),
                                           ctypes.byref(runs))
        return ns.value, runs.value


def check_ops(path: str) -> None:
    """Load `path` in the C library and free it: its every check, each op against its kernel's
    shape rule included (what `npuc validate` and `dump` run where torch, and so the op
    registry, cannot be imported)."""
    lib = runtime_library()
    if lib is None:
        raise NpucError("NPUC-E0413", f"{path}: neither the op registry (torch) nor the native runtime (a C "
                        "compiler) is available to check its ops", "install torch, or a C compiler", exit_code=EXIT_IO)
    model, err = ctypes.c_void_p(), _Error()
    opts = _LoadOptions(ctypes.sizeof(_LoadOptions), 1, 0)
    rc = lib.npuc_model_load_file(os.fsencode(path), ctypes.byref(opts), ctypes.byref(model), ctypes.byref(err))
    if rc:
        _raise(err, rc)
    lib.npuc_model_free(model)
