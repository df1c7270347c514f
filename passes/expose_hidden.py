"""Expose the hidden state: the LM head's input becomes an output, `hidden`, beside the logits.

A multi-token-prediction (MTP) layer drafts the token after next from the main model's last
hidden state at each position (compiler/mtp.py). The prefill, decode and verify programs of
a model compiled with `--mtp` so also return what their LM head reads, each row's: the
hidden state after the final norm (vLLM's `target_hidden_states` for DeepSeek's MTP).

    graph decode(%input_ids : i64[4,1], %position : i64[4]) {
      %n : f32[4,1,64] = rms_norm[axis=2](%h, @model.norm.weight)
      %logits : f32[4,1,128] = linear(%n, @lm_head.weight)
      return %logits
    }
  ->
      return %logits, %n                    the second output named `hidden`

Runs once attention is fused and before the last-token pass, which then leaves the norm on
every row (its output is read) and picks the head's input row after it: prefill's `hidden`
keeps all S rows, its logits one. The LM head is found as that pass finds it (a product of
the [b, S, H] hidden state by a constant weight, row-wise ops after it); a program whose
`logits` output is not so computed is refused with NPUC-E0164.
"""

from __future__ import annotations

from dataclasses import dataclass

from npuc.errors import EXIT_UNSUPPORTED, NpucError
from npuc.ir import Graph
from npuc.passes.last_token_logits import lm_head_input
from npuc.passes.manager import Pass, PassResult

# The output's name: the drafter (apps/mtp_draft.py) reads it by this name.
HIDDEN = "hidden"


@dataclass(frozen=True)
class ExposeHidden(Pass):
    name = "expose-hidden"

    def call(self, g: Graph) -> PassResult:
        logits = next((v for v in g.outputs if v.name == "logits"), None)
        ids = [v for v in g.inputs if not v.type.dtype.is_float and v.type.rank == 2]
        if logits is None or len(ids) != 1:
            raise _refuse("the program has no `logits` output or no single [batch, seq] token-ids input")
        if any(v.name == HIDDEN for v in g.values()):
            raise _refuse(f"the model already has a value named {HIDDEN!r}")
        b, s = ids[0].type.shape
        hidden = lm_head_input(logits, b, s)
        if isinstance(hidden, str):
            raise _refuse(hidden)
        g.rename(hidden, HIDDEN)
        g.set_outputs([*g.outputs, hidden])
        return PassResult(g, True, {"hidden": list(hidden.type.shape)})


def _refuse(why: str) -> NpucError:
    return NpucError("NPUC-E0164", f"--mtp: cannot find the hidden state the LM head reads: {why}",
                     "compile without --mtp", exit_code=EXIT_UNSUPPORTED)
