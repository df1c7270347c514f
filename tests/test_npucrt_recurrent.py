"""libnpucrt's recurrences (npucrt/src/ops_recurrent.c) against the registry's torch kernels
(ir/recurrent_ops.py): selective_scan, gated_delta_rule, linear_attention, wkv and
linear_recurrence, pure and stateful.

The pure cases are packed into one `.om` (a graph of independent ops), run by the C executor
(NativeSession), by the torch interpreter with its native launchers (Session: the f32 cases
through ops_recurrent.c's flat entry points, the others through the reference kernels) and by
the torch interpreter alone (Session, use_native=False, the reference): f32 within 1e-5,
bf16/f16 within 2 ulps. The stateful ops run in a `.om` of four programs sharing seven states
(prefill into a slot, prefill of every slot, decode of 1 and of 3 rows), through a sequence of
runs on the three executors, every output and state compared after each; then the same prefill
and decode against the pure op over the whole sequence (the padding after `last` never enters
the state), and a `last` or slot out of range refused (NPUC-E0108) with the state left as it
was, by the C executor and by the launchers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from npuc.backend.lower import lower
from npuc.backend.targets import get_target
from npuc.backend.writer import write_om
from npuc.errors import NpucError
from npuc.ir import DType, Graph, TensorSource, TensorType, Value, all_ops, get_op
from npuc.runtime.om_validate import INPLACE
from npuc.runtime.session import Session

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HALF = (BF16, F16)
_G = torch.Generator().manual_seed(11)


def randn(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(*shape, generator=_G).to(dtype)


def scan_args(b: int, s: int, dc: int, h: int, g: int, n: int, a_full: bool = False,
              dts: tuple[torch.dtype, ...] = (F32,) * 6) -> list[torch.Tensor]:
    """x, dt (softplus'd: > 0), A (< 0: a decay), B, C, D as a Mamba layer makes them."""
    a = -torch.exp(randn(dc, n) if a_full else randn(h))
    vals = [randn(b, s, dc), F.softplus(randn(b, s, h)) * 0.5, a, randn(b, s, g, n), randn(b, s, g, n), randn(dc)]
    return [v.to(dt) for v, dt in zip(vals, dts, strict=True)]


def delta_args(b: int, s: int, h: int, k: int, v: int, g_key: bool = False,
               dts: tuple[torch.dtype, ...] = (F32,) * 5) -> list[torch.Tensor]:
    """q, k (l2-normalised; q scaled by K^-1/2), v, g (a log decay: < 0), beta (in (0, 1))."""
    q = F.normalize(randn(b, s, h, k), dim=-1) * k ** -0.5
    key = F.normalize(randn(b, s, h, k), dim=-1)
    g = F.logsigmoid(randn(b, s, h, k) if g_key else randn(b, s, h) + 2.0)
    vals = [q, key, randn(b, s, h, v), g, torch.sigmoid(randn(b, s, h))]
    return [t.to(dt) for t, dt in zip(vals, dts, strict=True)]


def lin_attn_args(b: int, s: int, h: int, k: int, v: int,
                  dts: tuple[torch.dtype, ...] = (F32,) * 4) -> list[torch.Tensor]:
    """q, k, v and g (a log decay per head) of linear attention: the delta rule's but beta."""
    return delta_args(b, s, h, k, v, dts=(*dts, F32))[:4]


def wkv_args(b: int, s: int, c: int, dts: tuple[torch.dtype, ...] = (F32,) * 4) -> list[torch.Tensor]:
    """k, v, w (a decay: -exp(time_decay) < 0), u (the current token's bonus), as RWKV has them."""
    vals = [randn(b, s, c) * 2, randn(b, s, c), -torch.exp(randn(c)), randn(c)]
    return [t.to(dt) for t, dt in zip(vals, dts, strict=True)]


def lin_args(b: int, s: int, c: int, dts: tuple[torch.dtype, ...] = (F32,) * 2) -> list[torch.Tensor]:
    """x, a (in (0, 1): RG-LRU's gated decay)."""
    vals = [randn(b, s, c), torch.sigmoid(randn(b, s, c) + 1.0)]
    return [t.to(dt) for t, dt in zip(vals, dts, strict=True)]


def _ttype(t: torch.Tensor) -> TensorType:
    return TensorType(tuple(t.shape), DType.from_torch(t.dtype))


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == BF16 else t.numpy()


def _from_native(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    t = torch.from_numpy(np.array(a))
    return t.view(torch.int16).view(BF16) if like.dtype == BF16 else t


def compare(nat: torch.Tensor, ref: torch.Tensor) -> None:
    assert nat.dtype == ref.dtype and nat.shape == ref.shape, (nat.dtype, nat.shape, ref.dtype, ref.shape)
    assert ref.isfinite().all() and ref.abs().max() > 0  # the case computes something
    if ref.dtype in HALF:
        a, b = nat.double(), ref.double()
        ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(torch.finfo(ref.dtype).tiny)))
                         - (7 if ref.dtype == BF16 else 10))
        bad = ~((a == b) | ((a - b).abs() <= 2 * ulp))
        assert not bad.any(), f"{int(bad.sum())} beyond 2 ulps: {a[bad][:6].tolist()} vs {b[bad][:6].tolist()}"
        return
    torch.testing.assert_close(nat, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def native_lib() -> None:
    from npuc.runtime.native_session import runtime_library

    if runtime_library() is None:
        pytest.skip("the native runtime cannot be built here (no C compiler, or NPUC_NATIVE=0)")


# -- the pure ops --------------------------------------------------------------------------------------

@dataclass
class Case:
    id: str
    op: str
    args: list[torch.Tensor]


H3 = (BF16, F16, F32, BF16, BF16, F16)  # x, dt, A, B, C, D
CASES = [
    Case("scan-mamba2-A-per-head", "selective_scan", scan_args(2, 5, 16, 4, 1, 16)),
    Case("scan-mamba-A-per-channel", "selective_scan", scan_args(1, 4, 6, 6, 1, 5, a_full=True)),
    Case("scan-groups-heads-straddle", "selective_scan", scan_args(2, 3, 24, 3, 2, 24)),  # heads of 8, groups of 12
    Case("scan-groups-A-per-channel", "selective_scan", scan_args(1, 3, 12, 4, 3, 11, a_full=True)),
    Case("scan-many-blocks", "selective_scan", scan_args(1, 3, 160, 5, 1, 128)),
    Case("scan-many-blocks-A-per-channel", "selective_scan", scan_args(2, 2, 136, 136, 2, 16, a_full=True)),
    Case("scan-half-operands", "selective_scan", scan_args(2, 4, 16, 4, 2, 8, dts=H3)),
    Case("scan-half-A-per-channel", "selective_scan", scan_args(1, 3, 8, 8, 1, 12, a_full=True, dts=H3)),
    Case("delta-g-per-head", "gated_delta_rule", delta_args(2, 5, 3, 8, 12)),
    Case("delta-g-per-key", "gated_delta_rule", delta_args(1, 4, 2, 16, 40, g_key=True)),
    Case("delta-wide-values", "gated_delta_rule", delta_args(1, 3, 2, 32, 200)),
    Case("delta-narrow", "gated_delta_rule", delta_args(3, 2, 1, 5, 3, g_key=True)),
    Case("delta-half-operands", "gated_delta_rule", delta_args(2, 3, 2, 8, 16, dts=(BF16, BF16, BF16, F32, F16))),
    Case("linattn", "linear_attention", lin_attn_args(2, 5, 3, 8, 40)),
    Case("linattn-half-operands", "linear_attention", lin_attn_args(1, 3, 2, 16, 12, dts=(BF16, BF16, F16, F32))),
    Case("wkv-one-block", "wkv", wkv_args(2, 5, 24)),
    Case("wkv-many-blocks", "wkv", wkv_args(1, 4, 600)),  # blocks of at most 256 channels, a ragged last one
    Case("wkv-half-operands", "wkv", wkv_args(2, 3, 41, dts=(BF16, F16, F32, BF16))),  # y takes v's dtype
    Case("lru-one-block", "linear_recurrence", lin_args(2, 6, 20)),
    Case("lru-many-blocks", "linear_recurrence", lin_args(2, 3, 520)),
    Case("lru-half-operands", "linear_recurrence", lin_args(1, 4, 33, dts=(BF16, F16))),
]


def _build_pure(cases: list[Case], path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    g = Graph("main")
    outs, feeds, results = {}, {}, []
    for k, c in enumerate(cases):
        vals = []
        for i, a in enumerate(c.args):
            v = g.add_input(f"c{k}_in{i}", _ttype(a))
            feeds[v.name] = a
            vals.append(v)
        node = g.add_node(c.op, vals, get_op(c.op).infer_types([v.type for v in vals], {}), names=f"c{k}_out")
        outs[c.id] = node.outputs[0].name
        results.append(node.outputs[0])
    g.set_outputs(results)
    write_om(lower(g, get_target("cpu")), str(path))
    return outs, feeds


@pytest.fixture(scope="module", params=[1, 3], ids=["threads1", "threads3"])
def pure_results(request: pytest.FixtureRequest, native_lib: None,
                 tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from npuc.runtime.native_session import NativeSession

    path = tmp_path_factory.mktemp("npucrt_recurrent") / "pure.om"
    names, feeds = _build_pure(CASES, path)
    ref = Session.load(str(path), use_native=False).run(feeds)
    nat = NativeSession.load(str(path), threads=request.param).run({k: _to_numpy(v) for k, v in feeds.items()})
    fast = _launched(str(path), request.param).run(feeds)
    return {c.id: (_from_native(nat[names[c.id]], ref[names[c.id]]), fast[names[c.id]], ref[names[c.id]])
            for c in CASES}


def _launched(path: str, threads: int) -> Session:
    """The torch interpreter with its native launchers, on `threads` of the pool (the launchers
    take torch's thread count at load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        s = Session.load(path)
    finally:
        torch.set_num_threads(before)
    assert s.launchers.threads == threads and s.launchers.lib is not None
    return s


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_pure_op(c: Case, pure_results: dict[str, Any]) -> None:
    nat, fast, ref = pure_results[c.id]
    compare(nat, ref)
    compare(fast, ref)


def test_f32_recurrences_launch_natively(native_lib: None, tmp_path: Path) -> None:
    """Every f32 case runs through a flat entry point in the torch interpreter; the others
    through the reference kernel."""
    _build_pure(CASES, tmp_path / "pure.om")
    s = Session.load(str(tmp_path / "pure.om"))
    kinds = {b.opdef.name + str(i): s.launchers._choose(b)[0] for i, b in enumerate(s._bound["main"])}
    want = {c.op + str(i): "native" if all(a.dtype == F32 for a in c.args) else "ref" for i, c in enumerate(CASES)}
    assert kinds == want


# -- the stateful ops: four programs over seven states -------------------------------------------------

SLOTS, S_PRE, S_DEC = 2, 6, 3
# name -> (op, the operands' dims after the batch and rows, per-row makers); states f32[slots, ...]
LAYERS: dict[str, dict[str, Any]] = {
    "ssm": {"op": "selective_scan_state", "state": (24, 16),  # Dc 24, N 16; A [H]: 4 heads; 2 groups
            "args": lambda b, s: scan_args(b, s, 24, 4, 2, 16)},
    "ssm_full": {"op": "selective_scan_state", "state": (6, 5),  # Mamba: dt per channel, A [Dc,N]
                 "args": lambda b, s: scan_args(b, s, 6, 6, 1, 5, a_full=True)},
    "delta": {"op": "gated_delta_rule_state", "state": (2, 8, 40),  # g [b,S,H]
              "args": lambda b, s: delta_args(b, s, 2, 8, 40)},
    "delta_key": {"op": "gated_delta_rule_state", "state": (3, 16, 8),  # g [b,S,H,K]
                  "args": lambda b, s: delta_args(b, s, 3, 16, 8, g_key=True)},
    "linattn": {"op": "linear_attention_state", "state": (2, 8, 24),
                "args": lambda b, s: lin_attn_args(b, s, 2, 8, 24)},
    "wkv": {"op": "wkv_state", "state": (3, 40),  # numerator, denominator, max exponent of 40 channels
            "args": lambda b, s: wkv_args(b, s, 40)},
    "lru": {"op": "linear_recurrence_state", "state": (36,),
            "args": lambda b, s: lin_args(b, s, 36)},
}
CONST = {"selective_scan_state": (2, 5), "wkv_state": (2, 3)}  # A and D, w and u are weights, as a model has them
PROGRAMS = {"prefill_slot": (1, S_PRE, True, True), "prefill_all": (SLOTS, S_PRE, True, False),
            "decode1": (SLOTS, 1, False, False), "decode3": (SLOTS, S_DEC, False, False)}

# the weights every program shares (same name and bytes: one tensor)
WEIGHTS = {name: spec["args"](1, 1) for name, spec in LAYERS.items()}


def _program(name: str) -> Graph:
    rows, s, last, slot = PROGRAMS[name]
    g = Graph(name)
    outs: list[Value] = []
    tail = [g.add_input("last_row", TensorType((1,), DType.i64))] if last else []
    if slot:  # not named "slot": the kernels' own check is what the refusal tests reach
        tail.append(g.add_input("slot_id", TensorType((1,), DType.i64)))
    for layer, spec in LAYERS.items():
        st = g.add_state(layer, TensorType((SLOTS, *spec["state"]), DType.f32))
        ops = []
        for i, a in enumerate(spec["args"](rows, s)):
            if i in CONST.get(spec["op"], ()):
                w = WEIGHTS[layer][i]
                ops.append(g.add_constant(f"{layer}.w{i}", _ttype(w), TensorSource(w)))
            else:
                ops.append(g.add_input(f"{layer}.in{i}", _ttype(a)))
        ins = [st, *ops, *tail]
        node = g.add_node(spec["op"], ins, get_op(spec["op"]).infer_types([v.type for v in ins], {}),
                          names=[f"{layer}.new", f"{layer}.y"])
        g.set_state_update(st, node.outputs[0])
        outs += [node.outputs[1], node.outputs[0]]
    g.set_outputs(outs)
    return g


def _feeds(name: str, last: int | None = None, slot: int | None = None) -> dict[str, torch.Tensor]:
    rows, s, _, _ = PROGRAMS[name]
    feeds = {}
    for layer, spec in LAYERS.items():
        for i, a in enumerate(spec["args"](rows, s)):
            if i not in CONST.get(spec["op"], ()):
                feeds[f"{layer}.in{i}"] = a
    if last is not None:
        feeds["last_row"] = torch.tensor([last])
    if slot is not None:
        feeds["slot_id"] = torch.tensor([slot])
    return feeds


@pytest.fixture(scope="module")
def stateful_om(native_lib: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("npucrt_recurrent") / "stateful.om"
    write_om(lower([_program(p) for p in PROGRAMS], get_target("cpu")), str(path))
    return path


def _run_all(ref: Session, nat: Any, program: str, feeds: dict[str, torch.Tensor],
             fast: Session | None = None) -> dict[str, torch.Tensor]:
    """One run on the reference, the C executor and (with `fast`) the launchers: every output
    and state compared; the C executor's outputs returned."""
    want = ref.run(feeds, program=program)
    got = nat.run({k: _to_numpy(v) for k, v in feeds.items()}, program=program)
    assert set(got) == set(want)
    for k in want:
        compare(_from_native(got[k], want[k]), want[k])
    if fast is not None:
        launched = fast.run(feeds, program=program)
        for k in want:
            compare(launched[k], want[k])
    return {k: torch.from_numpy(v) for k, v in got.items()}


def test_stateful_runs_as_reference(stateful_om: Path) -> None:
    """Prefill into a slot (last before the end, then at it), decode of 1 and 3 rows over both
    slots, a prefill of every slot, decode again: outputs and states after each run, on the
    C executor and through the launchers (every recurrence natively: f32 operands)."""
    from npuc.runtime.native_session import NativeSession

    ref, nat = Session.load(str(stateful_om), use_native=False), NativeSession.load(str(stateful_om), threads=2)
    fast = _launched(str(stateful_om), 2)
    for name, bound in fast._bound.items():
        kinds = {b.opdef.name: fast.launchers._choose(b)[0] for b in bound}
        assert kinds == {spec["op"]: "native" for spec in LAYERS.values()}, (name, kinds)
    out = _run_all(ref, nat, "prefill_slot", _feeds("prefill_slot", last=3, slot=1), fast)
    for layer in LAYERS:
        assert not out[f"{layer}.new"][0].any() and out[f"{layer}.new"][1].abs().max() > 0  # slot 1 only
    _run_all(ref, nat, "prefill_slot", _feeds("prefill_slot", last=S_PRE - 1, slot=0), fast)
    before = _run_all(ref, nat, "decode1", _feeds("decode1"), fast)
    after = _run_all(ref, nat, "decode3", _feeds("decode3"), fast)
    for layer in LAYERS:  # decode moved both slots
        assert all(not torch.equal(before[f"{layer}.new"][k], after[f"{layer}.new"][k]) for k in range(SLOTS))
    _run_all(ref, nat, "prefill_all", _feeds("prefill_all", last=2), fast)
    _run_all(ref, nat, "decode1", _feeds("decode1"), fast)


def _pure(op: str, args: list[torch.Tensor]) -> torch.Tensor:
    return get_op(op.removesuffix("_state")).run(args, {})[0]


def test_prefill_then_decode_is_the_whole_sequence(stateful_om: Path) -> None:
    """A 4-token prompt (2 rows of padding after it) into slot 1, then 1 and 3 decode rows: the
    rows of y are the pure op's over the 8 tokens; the padding never entered the state."""
    from npuc.runtime.native_session import NativeSession

    nat, fast = NativeSession.load(str(stateful_om), threads=2), _launched(str(stateful_om), 2)
    pre = _feeds("prefill_slot", last=3, slot=1)
    dec1, dec3 = _feeds("decode1"), _feeds("decode3")
    runs = (("prefill_slot", pre), ("decode1", dec1), ("decode3", dec3))
    c_runs = [{k: torch.from_numpy(v) for k, v in nat.run({k: _to_numpy(v) for k, v in f.items()}, program=p).items()}
              for p, f in runs]
    launched = [fast.run(f, program=p) for p, f in runs]
    for layer, spec in LAYERS.items():
        whole = []  # each operand over the 8 tokens of slot 1 (the weights as they are)
        for i, w in enumerate(WEIGHTS[layer]):
            name = f"{layer}.in{i}"
            whole.append(w if name not in pre else torch.cat([pre[name][:, :4], dec1[name][1:], dec3[name][1:]], 1))
        want = _pure(spec["op"], whole)[0]
        for got in (c_runs, launched):
            compare(torch.cat([got[0][f"{layer}.y"][0, :4], got[1][f"{layer}.y"][1], got[2][f"{layer}.y"][1]], 0), want)


@pytest.mark.parametrize("last,slot", [(S_PRE, 0), (-1, 0), (2, SLOTS), (2, -1)],
                         ids=["last-past-end", "last-negative", "slot-past-end", "slot-negative"])
def test_out_of_range_is_refused(last: int, slot: int, stateful_om: Path) -> None:
    from npuc.runtime.native_session import NativeSession

    ref, nat = Session.load(str(stateful_om), use_native=False), NativeSession.load(str(stateful_om), threads=2)
    fast = _launched(str(stateful_om), 2)
    _run_all(ref, nat, "prefill_slot", _feeds("prefill_slot", last=4, slot=1), fast)
    bad = _feeds("prefill_slot", last=last, slot=slot)
    with pytest.raises(NpucError) as e:
        nat.run({k: _to_numpy(v) for k, v in bad.items()}, program="prefill_slot")
    assert e.value.code == "NPUC-E0108"
    with pytest.raises(NpucError) as e:  # the launchers: the flat entry point's refusal
        fast.run(bad, program="prefill_slot")
    assert e.value.code == "NPUC-E0108" and "last or slot" in e.value.message
    _run_all(ref, nat, "decode1", _feeds("decode1"), fast)  # the refused runs left the states as they were


def test_inplace_table_is_the_registry() -> None:
    """runtime/om_validate.py's INPLACE (the check without the registry) names every in-place op."""
    assert INPLACE == {name: od.inplace for name, od in all_ops().items() if od.inplace is not None}
