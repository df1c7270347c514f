"""Decode checked against prefill, where npuc cannot vouch for the cache by structure.

An attention is cached whole: its KV cache holds everything the past contributes. A
convolution over the sequence is cached by its inputs (kv_cache.py), but the same short
convolution opens every state-space and linear-attention mixer (Mamba, gated DeltaNet,
RG-LRU), whose recurrence after it has no state in the `.om`: decode would run those
layers as if each token were the first. Nothing in a graph marks that recurrence
reliably, so where the programs cache a convolution this pass refuses, first, the ops
their scans are written with (a cumsum, the slice_scatter of an unrolled loop, a product
of two activations outside fused attention: Mamba's segment sums, DeltaNet's chunks,
RG-LRU's steps), then runs both programs, right after kv-cache (in the model's own
dtype, before precision and alignment), with the reference kernels on random tokens t:

    prefill(t0 .. t[s-1])                                  -> logits at s-1    A
    prefill(u0 .. u[s-2], t[s-1])                          -> logits at s-1    A'  (another past)
    prefill(t0 .. t[s-2], 0) ; decode(t[s-1] at s-1)       -> logits           B

and refuses the decode program (NPUC-E0123) unless |A - B| <= 1e-5 |A - A'| + 1e-6 |A|
(max norms): decode may differ from prefill by rounding, not by a share of what the
earlier tokens contribute. In a half dtype the bounds are 1e-2 and 3e-2. It costs three
prefills and one decode step of the model at compile time, and runs only where a
convolution is cached. Neither screen proves the absence of a recurrence: one spelled
otherwise whose effect at the probe is below the bound would pass (decode is then that
close to prefill there). In the tiny models of docs/models.md the numeric check alone
separates LFM2's 4e-7 from the hybrids' 3e-6 (Falcon-H1, whose Mamba layers move its
logits little) to 0.8; the op screen refuses every one of those hybrids first.

The prefill program records what the decode program is checked against in the `probe`
the two passes share (the driver runs prefill's pipeline first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from npuc.errors import EXIT_UNSUPPORTED, InternalError, NpucError
from npuc.ir import DType, Graph
from npuc.ir.evaluate import run_graph
from npuc.passes.kv_cache import SLOT
from npuc.passes.manager import Pass, PassResult

_OF_PAST = {False: 1e-5, True: 1e-2}  # by whether the graph computes in a half dtype
# What scans the sequence in the chunked and unrolled forms of those recurrences (Mamba's
# segment sums, DeltaNet's chunk loop): refused outright, before the numeric check, which
# a recurrence that moves the logits little in a small model could pass.
_SCANS = frozenset({"cumsum", "slice_scatter", "scatter_nd"})
_NOISE = {False: 1e-6, True: 3e-2}


def _refuse(msg: str) -> NpucError:
    return NpucError("NPUC-E0123", f"cannot compile a decode program: {msg}",
                     "--max_seq_len needs every token mixer's past in the cache (attention, a causal "
                     "convolution); compile without --max_seq_len for a single program",
                     exit_code=EXIT_UNSUPPORTED)


@dataclass
class DecodeProbe:
    """What prefill computed for the check: the token ids, A, |A - A'|, and the states
    after the prompt without its last token."""

    tokens: torch.Tensor | None = None
    want: torch.Tensor | None = None
    past: float = 0.0
    states: dict[str, torch.Tensor] = field(default_factory=dict)


def _zeros(g: Graph) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(v.type.shape, dtype=v.type.dtype.torch) for n, v in g.states.items()}


def _ids(g: Graph) -> str:
    ids = [v for v in g.inputs if v.name != SLOT]  # a prefill into one of several slots: slot 0 here
    if len(ids) != 1 or ids[0].type.rank != 2 or ids[0].type.dtype.is_float:
        raise _refuse(f"the {g.name} program's inputs are not token ids alone, so decode cannot be "
                      "checked against prefill")
    return ids[0].name


def _half(g: Graph) -> bool:
    return any(o.type.dtype in (DType.bf16, DType.f16) for n in g.nodes for o in n.outputs)


@dataclass(frozen=True)
class DecodeCheck(Pass):
    name = "decode-check"
    role: str = "prefill"  # "prefill" records, "decode" compares
    probe: DecodeProbe = field(default_factory=DecodeProbe, compare=False)
    seed: int = 0

    def call(self, g: Graph) -> PassResult:
        if not any(name.startswith("conv_cache.") for name in g.states):
            return PassResult(g, False)
        scan = next((n for n in g.nodes if n.op in _SCANS or n.op in ("matmul", "einsum")
                     and all(not v.is_const for v in n.inputs)), None)
        if scan is not None:
            raise _refuse(f"{scan.op} {scan.name} beside a cached convolution: the scan of a state-space or "
                          "linear-attention layer, whose recurrent state npuc does not cache")
        if self.role == "prefill":
            self._record(g)
            return PassResult(g, False, {"recorded": True})
        p = self.probe
        if p.tokens is None or p.want is None:
            raise InternalError("decode-check ran on decode before prefill recorded its probe")
        ids = [v.name for v in g.inputs if v.name != "position"]
        if len(ids) != 1:
            raise _refuse("the decode program's inputs are not a token id and its position")
        seq = p.tokens.shape[1]
        # With slots, decode runs every slot: the probe's sequence is slot 0 (what prefill filled)
        step = {v.name: v for v in g.inputs}
        rows = step[ids[0]].type.shape[0]
        feeds = {**_zeros(g), **{n: t for n, t in p.states.items() if n in g.states},
                 ids[0]: p.tokens[:, -1:].expand(rows, 1).clone(),
                 "position": torch.full(step["position"].type.shape, seq - 1, dtype=torch.int64)}
        outs, _ = run_graph(g, feeds)
        got = next(iter(outs.values()))[:p.want.shape[0], -1].float()
        diff = float((p.want - got).abs().max())
        half = _half(g)
        if not diff <= _OF_PAST[half] * p.past + _NOISE[half] * float(p.want.abs().max()):
            raise _refuse(f"decode's logits differ from prefill's by {diff / max(p.past, 1e-30):.1e} of what "
                          "the earlier tokens move them: a token mixer carries state that npuc does not cache "
                          "(the recurrence of a state-space or linear-attention layer after its short "
                          "convolution)")
        return PassResult(g, False, {"difference": diff, "past": p.past})

    def _record(self, g: Graph) -> None:
        ids = _ids(g)
        batch, seq = next(v for v in g.inputs if v.name == ids).type.shape
        if seq < 2:
            raise _refuse("a prefill of one token cannot be checked against decode: give --input_shape a "
                          "prefill of at least 2")
        out = g.outputs[0].type
        if out.rank != 3 or out.shape[:2] != (batch, seq) or not out.dtype.is_float:
            raise _refuse(f"the prefill program's first output {out} is not logits [batch, {seq}, vocab]")
        # token ids the model embeds: the rows of the table its ids index, within the logits' width
        vocab = min([out.shape[-1]] + [n.inputs[0].type.shape[0] for n in g.nodes
                                       if n.op == "gather" and len(n.inputs) == 2 and n.inputs[1].name == ids])
        gen = torch.Generator().manual_seed(self.seed)
        dtype = g.inputs[0].type.dtype.torch
        tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(dtype)

        slot = {SLOT: torch.zeros(1, dtype=torch.int64)} if any(v.name == SLOT for v in g.inputs) else {}

        def last_row(t: torch.Tensor, row: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            outs, states = run_graph(g, {ids: t, **slot, **_zeros(g)})
            return next(iter(outs.values()))[:, row].float(), states

        want, _ = last_row(tokens, seq - 1)
        other = torch.randint(0, vocab, (batch, seq), generator=gen).to(dtype)
        other[:, -1] = tokens[:, -1]
        shorter = tokens.clone()
        shorter[:, -1] = 0
        p = self.probe
        p.tokens, p.want = tokens, want
        p.past = float((want - last_row(other, seq - 1)[0]).abs().max())
        p.states = last_row(shorter, seq - 2)[1]
