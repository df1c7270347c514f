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

Where a program keeps recurrent state (the recurrences compiler/recurrent.py recognises:
passes/recurrent_state.py) or attends without positions (NoPE, or positions a one-token
trace baked in), the check runs token by token instead: prefill(t0 .. t[s-1]) gives every
row's logits A_k; decode from the states prefill keeps after t0 alone (its last_token 0)
runs t1, t2, .. (C tokens a step, up to 4 steps) at positions 1, 2, .., and each step's
logits must equal A_k within 1e-3 |A - A'| + 1e-6 |A| (a deep model's rounding at other
product shapes reaches 4e-5 of the past over the steps; a state not carried, 0.1 to 1).
The op screen then refuses only what no rule recognised: a float cumsum, a slice_scatter
along the tokens, a product of two activations that are not weights an MoE gathers.

The prefill program records what the decode program is checked against in the `probe`
the two passes share (the driver runs prefill's pipeline first; where the prompt is longer
than driver.PROBE_TOKENS, on a short prefill of the same trace instead, and the prompt-long
prefill's check only screens its ops: `record`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from npuc.errors import EXIT_UNSUPPORTED, InternalError, NpucError
from npuc.ir import DType, Graph, Node, Value
from npuc.ir.evaluate import run_graph
from npuc.passes.kv_cache import SLOT
from npuc.passes.last_token_logits import LAST_TOKEN
from npuc.passes.manager import Pass, PassResult
from npuc.passes.recurrent_state import has_recurrent_state

_OF_PAST = {False: 1e-5, True: 1e-2}  # by whether the graph computes in a half dtype
# Token by token (recurrences, NoPE) the rounding of a deep model's products at other shapes
# adds up over the steps: 4e-5 of the past in a 22-layer Mamba2 at its default init (HF's own
# prefill and cached step differ by 2e-5 there), while a state not carried moves the logits by
# a share of the past itself (0.1 to 1 in the models of docs/models.md)
_OF_PAST_STEPWISE = {False: 1e-3, True: 1e-2}
# What scans the sequence in the chunked and unrolled forms of those recurrences (Mamba's
# segment sums, DeltaNet's chunk loop): refused outright, before the numeric check, which
# a recurrence that moves the logits little in a small model could pass.
_SCANS = frozenset({"cumsum", "slice_scatter", "scatter_nd"})
_NOISE = {False: 1e-6, True: 3e-2}
# Decode steps the check runs from empty states, where it runs them (recurrences, NoPE)
_STEPS = 4


def _refuse(msg: str) -> NpucError:
    return NpucError("NPUC-E0123", f"cannot compile a decode program: {msg}",
                     "--max_seq_len needs every token mixer's past in the cache (attention, a causal "
                     "convolution); compile without --max_seq_len for a single program",
                     exit_code=EXIT_UNSUPPORTED)


@dataclass
class DecodeProbe:
    """What prefill computed for the check: the token ids, A (every row's logits), |A - A'|,
    and the states decode starts from (after the prompt without its last token, or token by
    token after t0 alone)."""

    tokens: torch.Tensor | None = None
    want: torch.Tensor | None = None
    past: float = 0.0
    states: dict[str, torch.Tensor] = field(default_factory=dict)


def _zeros(g: Graph) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(v.type.shape, dtype=v.type.dtype.torch) for n, v in g.states.items()}


def _ids(g: Graph) -> str:
    # a prefill into one of several slots: slot 0 here; the last row: the prompt's
    ids = [v for v in g.inputs if v.name not in (SLOT, LAST_TOKEN)]
    if len(ids) != 1 or ids[0].type.rank != 2 or ids[0].type.dtype.is_float:
        raise _refuse(f"the {g.name} program's inputs are not token ids alone, so decode cannot be "
                      "checked against prefill")
    return ids[0].name


def _half(g: Graph) -> bool:
    return any(o.type.dtype in (DType.bf16, DType.f16) for n in g.nodes for o in n.outputs)


# Ops through which a weight stays a weight: views, casts, and the rows an index picks of it
_WEIGHT_PATH = frozenset({"reshape", "transpose", "cast", "slice", "expand", "gather", "index", "squeeze",
                          "unsqueeze", "broadcast_to"})


def _from_weights(v: Value) -> bool:
    """A constant, or rows of one (an MoE's experts gathered by its router), viewed or cast."""
    while not v.is_const:
        n = v.producer
        if n is None or n.op not in _WEIGHT_PATH or not n.inputs:
            return False
        v = n.inputs[0]
    return True


def _along_tokens(n: Node, tokens: int) -> bool:
    """A scan marker that may run along the tokens: a cumsum or scatter (an unrolled loop's
    slice_scatter writes part of an axis as long as the program's tokens)."""
    if n.op != "slice_scatter":
        return True
    axis = n.attrs["axis"] % n.outputs[0].type.rank
    return n.outputs[0].type.shape[axis] == tokens


def _positionless(g: Graph) -> bool:
    """An attention with no RoPE and no ALiBi: NoPE, or positions the trace baked in."""
    attn = [n for n in g.nodes if n.op in ("fused_attention", "cached_attention", "mla_attention")]
    return bool(attn) and not any(n.op == "rope_lut" for n in g.nodes) and not any(n.attrs.get("alibi")
                                                                                  for n in attn)


@dataclass(frozen=True)
class DecodeCheck(Pass):
    name = "decode-check"
    role: str = "prefill"  # "prefill" records, "decode" compares
    probe: DecodeProbe = field(default_factory=DecodeProbe, compare=False)
    seed: int = 0
    # The decode program reads position ids from its position (LongTrace.decode_positions):
    # positions that move with the token, so an attention without RoPE needs no check.
    position_ids: bool = False
    # A prefill role that records the probe (False: a short prefill of the same trace did,
    # LongTrace.probe, and this one only screens its ops)
    record: bool = True

    def _stepwise(self, g: Graph) -> bool:
        """Decode checked token by token from empty states: recurrent state, or NoPE."""
        return has_recurrent_state(g) or (_positionless(g) and not self.position_ids)

    def call(self, g: Graph) -> PassResult:
        stepwise = self._stepwise(g)
        if not any(name.startswith("conv_cache.") for name in g.states) and not stepwise:
            return PassResult(g, False)
        # (an integer cumsum counts tokens, a mask's positions: the numeric check below covers it;
        # a product of weights an MoE gathers by its routing is no scan, nor a slice_scatter that
        # assembles a head from its parts along an axis that is not the tokens')
        tokens = next((v.type.shape[1] for v in g.inputs if v.type.rank == 2 and not v.type.dtype.is_float), 0)
        scan = next((n for n in g.nodes if n.op in _SCANS and n.outputs[0].type.dtype.is_float
                     and _along_tokens(n, tokens)
                     or n.op in ("matmul", "einsum") and not any(_from_weights(v) for v in n.inputs)), None)
        if scan is not None:
            raise _refuse(f"{scan.op} {scan.name} beside a cached convolution: the scan of a state-space or "
                          "linear-attention layer that npuc does not recognise (compiler/recurrent.py "
                          "names the ones it does)")
        if self.role == "prefill":
            if self.record:
                self._record(g)
            return PassResult(g, False, {"recorded": self.record})
        p = self.probe
        if p.tokens is None or p.want is None:
            raise InternalError("decode-check ran on decode before prefill recorded its probe")
        diff = self._steps(g) if stepwise else self._last_step(g)
        half = _half(g)
        last = p.want[:, -1]
        share = (_OF_PAST_STEPWISE if stepwise else _OF_PAST)[half]
        if not diff <= share * p.past + _NOISE[half] * float(last.abs().max()):
            what = ("a token mixer carries state that npuc does not cache (the recurrence of a state-space or "
                    "linear-attention layer after its short convolution)") if not stepwise or \
                has_recurrent_state(g) else ("an attention without RoPE whose positions the one-token trace "
                                             "baked in (a learned position table, not NoPE)")
            raise _refuse(f"decode's logits differ from prefill's by {diff / max(p.past, 1e-30):.1e} of what "
                          f"the earlier tokens move them: {what}")
        return PassResult(g, False, {"difference": diff, "past": p.past})

    def _decode_feeds(self, g: Graph) -> tuple[str, int, int]:
        ids = [v for v in g.inputs if v.name != "position"]
        if len(ids) != 1:
            raise _refuse("the decode program's inputs are not a token id and its position")
        rows, c = ids[0].type.shape
        return ids[0].name, rows, c

    def _last_step(self, g: Graph) -> float:
        """prefill(t0 .. t[s-2], 0) then decode(t[s-1] at s-1), against prefill's last row."""
        p = self.probe
        assert p.tokens is not None and p.want is not None
        ids, rows, _ = self._decode_feeds(g)
        seq = p.tokens.shape[1]
        # With slots, decode runs every slot: the probe's sequence is slot 0 (what prefill filled)
        step = {v.name: v for v in g.inputs}
        feeds = {**_zeros(g), **{n: t.clone() for n, t in p.states.items() if n in g.states},
                 ids: p.tokens[:, -1:].expand(rows, 1).clone(),
                 "position": torch.full(step["position"].type.shape, seq - 1, dtype=torch.int64)}
        outs, _ = run_graph(g, feeds)
        got = next(iter(outs.values()))[:p.want.shape[0], -1].float()
        return float((p.want[:, -1] - got).abs().max())

    def _steps(self, g: Graph) -> float:
        """Decode of t1, t2, .. (C tokens a step) after prefill's states of t0 alone (its
        last_token 0), each step's logits against prefill's rows: the states carry what the
        earlier tokens contributed, or not. From position 1: decode never runs at position 0
        (a prompt's first token is prefill's), where some models differ on purpose (RG-LRU's
        reset); a position table baked into the decode trace still shows from the next step."""
        p = self.probe
        assert p.tokens is not None and p.want is not None
        ids, rows, c = self._decode_feeds(g)
        seq = p.tokens.shape[1]
        steps = min(seq - 1, max(c, _STEPS)) // c
        if steps == 0:
            return self._last_step(g)
        shape = next(v for v in g.inputs if v.name == "position").type.shape
        # copies: a stateful op updates its state in place, and the verify program is checked
        # from the same states after decode
        states, diff = {**_zeros(g), **{n: t.clone() for n, t in p.states.items() if n in g.states}}, 0.0
        for k in range(1, 1 + steps * c, c):
            pos = torch.arange(k, k + c, dtype=torch.int64).expand(rows, c).reshape(shape).clone()
            feeds = {**states, ids: p.tokens[:, k:k + c].expand(rows, c).clone(), "position": pos}
            outs, new = run_graph(g, feeds)
            states = {**states, **new}
            got = next(iter(outs.values()))[:p.want.shape[0]].float()
            diff = max(diff, float((p.want[:, k:k + c] - got).abs().max()))
        return diff

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
        dtype = next(v for v in g.inputs if v.name == ids).type.dtype.torch
        tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(dtype)

        extra = {SLOT: torch.zeros(1, dtype=torch.int64), LAST_TOKEN: torch.full((1,), seq - 1, dtype=torch.int64)}
        extra = {k: v for k, v in extra.items() if any(i.name == k for i in g.inputs)}

        def rows(t: torch.Tensor, last: int = seq - 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            kept = {LAST_TOKEN: torch.full((1,), last, dtype=torch.int64)} if LAST_TOKEN in extra else {}
            outs, states = run_graph(g, {ids: t, **extra, **kept, **_zeros(g)})
            return next(iter(outs.values())).float(), states

        want, _ = rows(tokens)
        other = torch.randint(0, vocab, (batch, seq), generator=gen).to(dtype)
        other[:, -1] = tokens[:, -1]
        p = self.probe
        p.tokens, p.want = tokens, want
        p.past = float((want[:, -1] - rows(other)[0][:, -1]).abs().max())
        if self._stepwise(g):  # the states after t0: recurrent ones keep row last_token's
            p.states = rows(tokens, 0)[1]
        else:
            shorter = tokens.clone()
            shorter[:, -1] = 0
            p.states = rows(shorter)[1]
