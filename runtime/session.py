"""The runtime: load a `.om`, allocate its arena once, execute its op stream.

Needs torch, numpy and protobuf only: the model definition and the weights come
from the file. Each step's kernel is chosen once, at load (runtime/launch.py): native
CPU kernels built for the host where a C compiler is found, else the op registry's
out-kernels and reference kernels. Weights are viewed in place in the memory-mapped
file (no copy; prefill's GEMMs may keep a packed copy, see `load`). Every intermediate lives at
the offset the compiler planned in one arena, so a wrong plan shows up as a
wrong result, not as hidden extra memory.

A model with a KV cache has several programs (prefill, decode) over one state
region, allocated and zeroed once at load, which persists across runs until
`reset_state()`. The arena is allocated once, for the largest program.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from npuc.backend.om_format import OmFile
from npuc.backend.om_schema import ROLLBACK_SUFFIX
from npuc.backend.om_sections import MODEL_SECTIONS, join_model
from npuc.errors import EXIT_IO, EXIT_USAGE, NpucError
from npuc.ir import DType, OpDef, get_op
from npuc.runtime import native
from npuc.runtime.launch import Bound, Launchers, tail_rows_read
from npuc.runtime.om_validate import E_INVALID, attr_value, position_rows, validate_model


def check_prefix_args(entries: int, slots: int, rows: int, slot: int, entry: int, n: int) -> None:
    """A prefix copy's arguments (npuc_session_prefix_save's and _load's checks, worded alike)."""
    if not entries:
        raise NpucError("NPUC-E0108", "the model has no prefix pool",
                        "compile it with --prefix_cache P (and --max_seq_len N)", exit_code=EXIT_USAGE)
    if not 0 <= entry < entries:
        raise NpucError("NPUC-E0108", f"prefix entry {entry} is outside the model's {entries} entries",
                        f"entries are 0..{entries - 1}", exit_code=EXIT_USAGE)
    if not 0 <= slot < slots:
        raise NpucError("NPUC-E0108", f"slot {slot} is outside the model's {slots} slots",
                        f"slots are 0..{slots - 1}", exit_code=EXIT_USAGE)
    if not 1 <= n <= rows:
        raise NpucError("NPUC-E0108", f"a prefix of {n} positions: the model caches 1 to {rows}",
                        "a prefix is 1 to --max_seq_len positions", exit_code=EXIT_USAGE)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    region: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Step:
    opdef: OpDef
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    attrs: Mapping[str, Any]  # with the schema's defaults filled in
    workspace: int | None = None
    name: str = ""


@dataclass(frozen=True)
class Program:
    name: str
    proto: Any
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    input_ids: list[int]
    output_ids: list[int]
    steps: list[_Step]


class Session:
    def __init__(self, om: OmFile, model: Any, device: str = "cpu", use_native: bool = True,
                 prepack: bool | None = None) -> None:
        self.om = om
        self.model = model
        self.device = torch.device(device)
        # Nothing below runs on an unchecked definition (runtime/om_validate.py).
        tokenizer = bytes(om.section("tokenizer")) if "tokenizer" in om.section_names() else None
        checked = validate_model(str(om.path), model, om.section("weights"), tokenizer)
        self.tensors = [
            TensorInfo(t.name, DType(t.dtype), tuple(t.shape), t.region, t.offset, t.nbytes) for t in model.tensors]
        self.programs: dict[str, Program] = {}
        for prog in model.programs:
            steps = [_Step(od, tuple(o.inputs), tuple(o.outputs),
                           od.full_attrs({a.name: attr_value(a.value) for a in o.attrs}),
                           o.workspace if o.HasField("workspace") else None, o.name)
                     for o in prog.ops for od in (get_op(o.op),)]
            self.programs[prog.name] = Program(
                prog.name, prog, [self.tensors[i] for i in prog.inputs], [self.tensors[i] for i in prog.outputs],
                list(prog.inputs), list(prog.outputs), steps)
        first = next(iter(self.programs.values()))
        # The default program's surface (one-program models use nothing else).
        self.program = first.proto
        self.inputs, self.outputs = first.inputs, first.outputs
        self.arena_bytes = checked.arena_bytes
        self.state_bytes = checked.state_bytes
        self._cache_rows = position_rows(model)
        # --prefix_cache's pool: state tensors beside the caches, which no program uses (_pools: their indices)
        self._prefix = checked.prefix
        self._pools = {p for _, p, _ in self._prefix.states} if self._prefix is not None else set()
        # Sequences the KV cache holds (its batch), where prefill fills one by its `slot` input.
        self._slots = min((int(t.shape[0]) for i, t in enumerate(model.tensors)
                           if t.region == "state" and len(t.shape) == 4 and i not in self._pools), default=0)
        self._index_rows = {p.name: self._tables(p) for p in self.programs.values()}
        self.arena = torch.empty(self.arena_bytes, dtype=torch.uint8, device=self.device)
        self.state = torch.zeros(self.state_bytes, dtype=torch.uint8, device=self.device)
        weights = om.section("weights")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the map is read-only and we never write weights
            self._weights = torch.frombuffer(weights, dtype=torch.uint8) if len(weights) else torch.empty(0, dtype=torch.uint8)
        if self.device.type != "cpu":
            self._weights = self._weights.to(self.device)
        self.views = [self._view(t) for t in self.tensors]
        # Each step's operand views, bound once, and its kernel chosen once (runtime/launch.py):
        # a run then only calls kernels.
        state = {i for i, t in enumerate(self.tensors) if t.region == "state"}
        self._bound = {}
        for name, p in self.programs.items():
            tails = tail_rows_read(p.steps, state | set(p.output_ids))
            self._bound[name] = [Bound(st.opdef, st.attrs, [self.views[i] for i in st.inputs],
                                       [self.views[o] for o in st.outputs],
                                       self.views[st.workspace] if st.workspace is not None else None, tails.get(j))
                                 for j, st in enumerate(p.steps)]
        cpu = self.device.type == "cpu"
        if prepack is None:
            prepack = os.environ.get("NPUC_PREPACK", "1") != "0"
        self.launchers = Launchers(native.library() if cpu and use_native else None,
                                   prepack=cpu and use_native and prepack)
        self._per_step = {name: [self.launchers.choose(b) for b in bound] for name, bound in self._bound.items()}
        self._launch = {name: [f for f in fs if f is not None] for name, fs in self._per_step.items()}

    @classmethod
    def load(cls, path: str, device: str = "cpu", use_native: bool = True, prepack: bool | None = None,
             inspect_rank: int | None = None) -> Session:
        """`use_native=False` runs every op with the registry's torch kernels (the native
        CPU kernels are also off where they cannot be built, or with NPUC_NATIVE=0).
        `prepack` (default: on, unless NPUC_PREPACK=0) keeps a copy of the matrix weights
        packed for the host's GEMM, for products of many rows (prefill): faster, at the
        cost of that copy's memory (`launchers.packed_bytes`). `path` may be the manifest of a
        tensor-parallel compile: each rank of torch.distributed's group then loads its own
        file (runtime/parallel.py); `inspect_rank` loads that rank's file (or a rank file)
        outside any process group, for tools that list it (its collectives would refuse to run)."""
        from npuc.runtime import parallel

        om, _ = parallel.open_for_rank(path, inspect_rank)  # a tensor-parallel manifest: this rank's file
        model = join_model(om.path, {name: bytes(om.section(name)) for name in MODEL_SECTIONS})
        s = cls(om, model, device, use_native, prepack)  # validates the file, its parallel.* metadata too
        if inspect_rank is None:
            parallel.check_rank(om.path, {e.key: e.value for e in model.metadata})
        return s

    def _view(self, t: TensorInfo) -> torch.Tensor:
        base = {"arena": self.arena, "weights": self._weights, "state": self.state}[t.region]
        raw = base[t.offset:t.offset + t.nbytes]
        return raw.view(t.dtype.torch).reshape(t.shape)

    def reset_state(self) -> None:
        """Forget the KV cache (a new sequence), and the prefix pool's entries."""
        self.state.zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot src's KV cache into slot dst (n > 1 continuations of one prefill): every state
        tensor but the prefix pool's is [slots, ...] (npuc_session_copy_slot's rule)."""
        slots = self._slots
        if not (0 <= src < slots and 0 <= dst < slots):
            raise NpucError("NPUC-E0108", f"copy from slot {src} to slot {dst}", f"slots are 0..{slots - 1}")
        pools = self._pools
        pooled = {(self.tensors[p].offset, self.tensors[p].nbytes) for p in pools}
        regions = {(t.offset, t.nbytes) for t in self.tensors if t.region == "state"} - pooled
        if any(t.region == "state" and i not in pools and (not t.shape or t.shape[0] != slots)
               for i, t in enumerate(self.tensors)):
            raise NpucError("NPUC-E0108", "a state tensor is not one row per slot",
                            "only a state laid out [slots, ...] can be copied by slot")
        for off, n in sorted(regions):
            row = n // slots
            self.state[off + dst * row:off + (dst + 1) * row] = self.state[off + src * row:off + (src + 1) * row]

    def rollback(self, slot: int, row: int) -> None:
        """Slot `slot`'s recurrent states as they were after row `row` of the last verify step:
        each `<state>.by_row` [slots, 1, K, n] (passes/recurrent_state.py) gives its copy back,
        row K (all kept) none (npuc_session_rollback's rule and refusals)."""
        pairs, bad = self._rollback_pairs
        if bad is not None:  # nothing is copied from a model whose copies are not all well formed
            raise NpucError(E_INVALID, bad, "recompile the model with this npuc")
        if not pairs:
            raise NpucError("NPUC-E0108", "the model keeps no recurrent state by verify row: there is nothing to "
                            "roll back", "compile the model with --speculative_tokens K")
        k = pairs[0][1].shape[2]  # the verify step's rows but its last (whose state is the state's own)
        if not (0 <= slot < self._slots and 0 <= row <= k):
            raise NpucError("NPUC-E0108", f"roll slot {slot} back to row {row}",
                            f"slots are 0..{self._slots - 1}, rows 0..{k}")
        if row == k:
            return
        for state, by_row in pairs:
            state[slot].copy_(by_row[slot, 0, row].reshape(state.shape[1:]))

    @functools.cached_property
    def _rollback_pairs(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str | None]:
        """(state, its copies by verify row) views, found once (rollback runs every step), by
        libnpucrt's rules (decode.c, rollback_setup): each `<name>.by_row` [B, 1, K, n] beside the
        state `<name>` [B, ...] of n values a slot, the same dtype, every pair with the same K.
        A `.by_row` state that is not such a copy: no pairs, and why (the model still runs; its
        rollbacks are refused)."""
        tensors = self.model.tensors
        own = [i for i, t in enumerate(tensors)
               if t.region == "state" and not t.HasField("base") and i not in self._pools]
        states: dict[str, int] = {}
        for i in own:
            states.setdefault(tensors[i].name, i)
        b, k = self._slots, 0
        pairs = []
        for i in own:
            r = tensors[i]
            if not r.name.endswith(ROLLBACK_SUFFIX):
                continue
            j = states.get(r.name[:-len(ROLLBACK_SUFFIX)], -1)
            t = tensors[j] if j >= 0 else None
            if (t is None or t.dtype != r.dtype or len(r.shape) != 4 or r.shape[0] != b or r.shape[1] != 1
                    or r.shape[2] < 1 or len(t.shape) < 1 or t.shape[0] != b or t.nbytes % b
                    or r.nbytes % (b * r.shape[2]) or r.nbytes // b // r.shape[2] != t.nbytes // b):
                return [], f"state {r.name} does not hold one copy of its state per slot and verify row"
            if k and r.shape[2] != k:
                return [], f"state {r.name} keeps {r.shape[2]} rows, another {k}"
            k = r.shape[2]
            pairs.append((self.views[j], self.views[i]))
        return pairs, None

    @property
    def prefix_entries(self) -> int:
        """Prompt prefixes the model's pool holds (--prefix_cache; 0: none)."""
        return self._prefix.entries if self._prefix is not None else 0

    @property
    def prefix_pool_bytes(self) -> int:
        return self._prefix.nbytes if self._prefix is not None else 0

    def save_prefix(self, slot: int, entry: int, n: int) -> None:
        """Positions 0..n-1 of every cache of `slot` into prefix pool entry `entry`: a prompt
        prefix of n tokens, for load_prefix (npuc_session_prefix_save)."""
        for state, pool, axis in self._prefix_args(slot, entry, n):
            pool[entry].narrow(axis - 1, 0, n).copy_(state[slot].narrow(axis - 1, 0, n))

    def load_prefix(self, entry: int, slot: int, n: int) -> None:
        """Positions 0..n-1 of prefix pool entry `entry` into every cache of `slot`: the slot's
        next decode step continues at position n (npuc_session_prefix_load)."""
        for state, pool, axis in self._prefix_args(slot, entry, n):
            state[slot].narrow(axis - 1, 0, n).copy_(pool[entry].narrow(axis - 1, 0, n))

    def _prefix_args(self, slot: int, entry: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        check_prefix_args(self.prefix_entries, self._slots, self._cache_rows, slot, entry, n)
        assert self._prefix is not None
        return [(self.views[s], self.views[p], axis) for s, p, axis in self._prefix.states]

    def _program(self, name: str | None) -> Program:
        if name is None:
            return next(iter(self.programs.values()))
        if name not in self.programs:
            raise NpucError("NPUC-E0111", f"the model has no program {name!r}",
                            "its programs are " + ", ".join(self.programs), exit_code=EXIT_USAGE)
        return self.programs[name]

    def _tables(self, p: Program) -> dict[str, tuple[int, bool]]:
        """Input name -> (rows, whether a weight table), for each input that directly indexes
        a tensor: a weight table (`gather`: token ids into an embedding) or an axis of a
        computed tensor (`index`: prefill's last_token picks one of its S rows)."""
        names = dict(zip(p.input_ids, (t.name for t in p.inputs), strict=True))
        found: dict[str, tuple[int, bool]] = {}
        for st in p.steps:
            if st.opdef.name == "gather" and len(st.inputs) > 1 and st.inputs[1] in names:
                table = self.tensors[st.inputs[0]]
                if table.region == "weights" and table.shape:
                    found.setdefault(names[st.inputs[1]],
                                     (int(table.shape[int(st.attrs.get("axis", 0)) % len(table.shape)]), True))
            elif st.opdef.name == "index":
                x = self.tensors[st.inputs[0]]
                for axis, i in enumerate(st.inputs[1:len(x.shape) + 1]):
                    if i in names:
                        found.setdefault(names[i], (int(x.shape[axis]), x.region == "weights"))
        return found

    def index_rows(self, program: str | None = None) -> dict[str, int]:
        """The rows each input of `program` indexes directly: of a weight table (an embedding:
        its token ids must lie in 0..rows-1), or of a computed tensor (prefill's last_token:
        0..S-1); inputs that index nothing are absent."""
        return {name: rows for name, (rows, _) in self._index_rows[self._program(program).name].items()}

    def run(self, inputs: Mapping[str, Any], program: str | None = None, copy_outputs: bool = True,
            on_step: Callable[[str, str, list[torch.Tensor]], None] | None = None) -> dict[str, torch.Tensor]:
        """Run `program` (the first one by default) on `inputs` (name -> array). With
        `copy_outputs=False` the outputs are views of the arena, valid until the next run
        (a decode loop then allocates nothing). `on_step(op name, op, outputs)` is called
        after each op with views of its results (valid only during the call), for tools
        that compare intermediates (`npuc verify --per-layer`)."""
        p = self._program(program)
        names = {t.name for t in p.inputs}
        unknown = sorted(set(inputs) - names)
        missing = sorted(names - set(inputs))
        if unknown or missing:
            raise NpucError("NPUC-E0107", f"inputs do not match the model: missing {missing}, unknown {unknown}",
                            "the model's inputs are " + ", ".join(f"{t.name}: {t.dtype}{list(t.shape)}"
                                                                   for t in p.inputs), exit_code=EXIT_USAGE)
        for tid, t in zip(p.input_ids, p.inputs, strict=True):
            x = inputs[t.name]
            # np.require keeps 0-d arrays 0-d (ascontiguousarray would make them 1-d).
            x = torch.from_numpy(np.require(x, requirements="C")) if isinstance(x, np.ndarray) else torch.as_tensor(x)
            if tuple(x.shape) != t.shape:
                raise NpucError("NPUC-E0108", f"input {t.name!r} has shape {list(x.shape)}, the model was "
                                f"compiled for {list(t.shape)}", "npuc models have static shapes; recompile "
                                "with the --input_shape you need", exit_code=EXIT_USAGE)
            if x.dtype != t.dtype.torch and not (x.dtype.is_floating_point == t.dtype.is_float):
                raise NpucError("NPUC-E0108", f"input {t.name!r} has dtype {x.dtype}, the model expects {t.dtype}",
                                "convert the input", exit_code=EXIT_USAGE)
            if t.name == "position" and self._cache_rows:
                if any(not 0 <= pos < self._cache_rows for pos in x.reshape(-1).tolist()):
                    raise NpucError("NPUC-E0108", f"position {x.tolist()} is outside the "
                                    f"{self._cache_rows} positions the model caches",
                                    "positions run from 0 to --max_seq_len - 1",
                                    exit_code=EXIT_USAGE)
            if t.name == "slot" and self._slots and not all(0 <= k < self._slots for k in x.reshape(-1).tolist()):
                raise NpucError("NPUC-E0108", f"slot {x.tolist()} is outside the model's {self._slots} slots",
                                f"slots run from 0 to {self._slots - 1} (the --input_shape batch - 1)",
                                exit_code=EXIT_USAGE)
            rows, table = self._index_rows[p.name].get(t.name, (0, True))
            # The kernels count a negative index from the end; the row of last_token (which
            # generate and verify feed) is 0..S-1, as documented.
            low = 0 if t.name == "last_token" else -rows
            bad = next((i for i in x.reshape(-1).tolist() if not low <= i < rows), None) if rows else None
            if bad is not None and table:
                raise NpucError("NPUC-E0108", f"input {t.name!r} holds {bad}, outside the {rows} rows of the table "
                                "it indexes", f"its values index an embedding: 0..{rows - 1}", exit_code=EXIT_USAGE)
            if bad is not None:
                raise NpucError("NPUC-E0108", f"input {t.name!r} holds {bad}, outside the {rows} rows it picks from",
                                f"its values are rows {low}..{rows - 1}" + (" (the prompt's last position: its "
                                "length - 1)" if t.name == "last_token" else ""), exit_code=EXIT_USAGE)
            self.views[tid].copy_(x)
        views = self.views
        with torch.no_grad():
            try:
                if on_step is None:
                    for launch in self._launch[p.name]:
                        launch()
                else:  # every step, views included, each with its callback
                    for launch, b, st in zip(self._per_step[p.name], self._bound[p.name], p.steps, strict=True):
                        if launch is not None:
                            launch()
                        on_step(st.name, st.opdef.name, b.outs)
            except NpucError:
                raise
            except (RuntimeError, ValueError, IndexError, KeyError, TypeError, ArithmeticError, MemoryError) as e:
                # A validated file whose computed values a kernel refuses (an index out of range);
                # torch's kernels check what they read, so this is a refusal, not a crash.
                raise NpucError("NPUC-E0412", f"program {p.name!r} failed in a kernel: {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}"[:300],
                                "the file may be damaged (recompile it); if it was just compiled, this is a bug "
                                "in npuc: rerun with --debug and report it", exit_code=EXIT_IO) from e
        return {t.name: views[i].clone() if copy_outputs else views[i]
                for i, t in zip(p.output_ids, p.outputs, strict=True)}
