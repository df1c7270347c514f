"""A checkpoint's multi-token-prediction (MTP) layer, compiled as draft programs (`--mtp`).

DeepSeek-V3 (and GLM-4.5, and any checkpoint laid out so) ships a layer after the last,
`model.layers.<L>` with L = num_hidden_layers, trained to predict the token after next:

    e = embed_tokens(t[p+1])                 the main model's embedding; zero at position 0
    x = eh_proj(concat(enorm(e), hnorm(h[p])))          h[p]: the main model's hidden state
    x = decoder_layer<L>(x, positions p)                one more layer of the model's own kind
    logits = shared_head.head(shared_head.norm(x))      the guess of t[p+2]; x chains on

(vLLM's DeepSeekMultiTokenPredictorLayer; `h` is the state after the final norm, what the LM
head reads.) transformers builds no such layer (its DeepSeek-V3 drops the weights), so npuc
builds the model with L + 1 layers, whose last is the checkpoint's `model.layers.<L>.*`
with every conversion the loader makes for the others (stacked experts included), adds the
five small modules beside it, and traces `MTPModule` over them: the embedding, the RoPE and
every weight are the checkpoint's, shared by name with the main programs.

Three programs join the `.om`, over one more cache of the same state region
(`mtp.kv_cache.0.*`, the layer's own keys and values or latents, a row per position):

- `mtp_prefill`: `input_ids [1, S]`, `hidden [1, S, H]`, `slot [1]`: a prompt's positions
  0..S-1 (token p + 1 and hidden state p each);
- `mtp`: `input_ids [B, 1]`, `hidden [B, 1, H]`, `position [B]`: one row of every slot;
- `mtp_verify`: the same at K + 1 rows of every slot (`position [B, K + 1]`), for the rows
  a slot catches up on after a verify step.

Each returns `logits` (every row's) and `hidden` (the layer's output, which the next drafted
token chains on). The main programs return their `hidden` too (passes/expose_hidden.py).
apps/mtp_draft.py drafts with them.

Position 0's embedding is zeroed as vLLM does; a trace at one position bakes that mask in,
so only the prefill program (positions 0..S-1) has it, and a decode step at position 0 (a
prompt of one token) runs unmasked: a draft there may differ from vLLM's, the checked output
cannot.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from npuc.compiler.loaders import (
    LoadedModel,
    SafetensorsSource,
    _parameters_without_memory,
    _safetensors_index,
    give_storage,
    load_hf_dir,
    parameter_owners,
)
from npuc.errors import EXIT_UNSUPPORTED, EXIT_USAGE, NpucError
from npuc.ir import DType, Graph
from npuc.passes.expose_hidden import HIDDEN, ExposeHidden
from npuc.passes.kv_cache import KVCache, LongTrace
from npuc.passes.manager import Pass

MTP_PREFILL, MTP_DECODE, MTP_VERIFY = "mtp_prefill", "mtp", "mtp_verify"
MTP_PREFIX = "mtp."  # the layer's cache states: mtp.kv_cache.0.*
MTP_HIDDEN = "mtp_hidden"  # the MTP programs' output a next step chains on (their input is `hidden`)
# The modules the checkpoint adds beside the decoder layer (model.layers.<L>.<name>.weight).
_EXTRA = ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")


def _refuse(why: str, hint: str, code: int = EXIT_UNSUPPORTED) -> NpucError:
    return NpucError("NPUC-E0164", f"--mtp: {why}", hint, exit_code=code)


def mtp_layer(model: Any) -> int:
    """L, the index of the checkpoint's MTP layer (`model.layers.<L>`, L = num_hidden_layers),
    refused (NPUC-E0164) where `model` is not a Hugging Face folder holding one."""
    return _find_layer(model)[0]


def _find_layer(model: Any) -> tuple[int, dict[str, Any]]:
    """mtp_layer's L, and the checkpoint's safetensors index it read."""
    if isinstance(model, (nn.Module, torch.export.ExportedProgram)) or not os.path.isdir(os.fspath(model)):
        raise _refuse("needs a Hugging Face checkpoint folder (the MTP layer's weights are read from its "
                      "safetensors)", "compile the checkpoint folder, or leave --mtp out", EXIT_USAGE)
    path = Path(os.fspath(model))
    try:
        config = json.loads((path / "config.json").read_text())
        layers = int(config.get("num_hidden_layers") or config.get("text_config", {})["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise _refuse(f"cannot read num_hidden_layers from {str(path / 'config.json')!r}",
                      "the folder should come from save_pretrained") from None
    index = _safetensors_index(path)
    missing = [f"model.layers.{layers}.{m}.weight" for m in _EXTRA if f"model.layers.{layers}.{m}.weight" not in index]
    if missing:
        raise _refuse(f"the checkpoint has no multi-token-prediction layer ({missing[0]} is not in its safetensors; "
                      f"num_nextn_predict_layers is {config.get('num_nextn_predict_layers', 0)})",
                      "compile a checkpoint that keeps its MTP weights (DeepSeek-V3, GLM-4.5), or leave --mtp out")
    return layers, index


class MTPModule(nn.Module):
    """The MTP layer over the main model's embedding and RoPE: (token ids, hidden states,
    positions) -> {logits, hidden} (module docstring). `model` is the causal LM built with
    L + 1 layers; parameter names stay the checkpoint's (`model.layers.<L>.*`)."""

    def __init__(self, model: nn.Module, layer: int) -> None:
        super().__init__()
        self.model: Any = model.model
        self.layer = layer

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        m: Any = self.model
        block: Any = m.layers[self.layer]
        e = m.embed_tokens(input_ids)
        e = e * (position_ids != 0).unsqueeze(-1).to(e.dtype)
        x = block.eh_proj(torch.cat([block.enorm(e), block.hnorm(hidden.to(e.dtype))], dim=-1))
        rope = m.rotary_emb(x, position_ids)
        out = block(x, attention_mask=None, position_ids=position_ids, position_embeddings=rope)
        x = out[0] if isinstance(out, tuple) else out
        return {"logits": block.shared_head.head(block.shared_head.norm(x)), MTP_HIDDEN: x}


def load_mtp(model: Any) -> tuple[LoadedModel, int]:
    """The MTP module over the checkpoint `model`, its weights found as load_hf_dir finds the
    model's (shared by name), and its hidden size."""
    layer, index = _find_layer(model)
    path = Path(os.fspath(model))
    loaded = load_hf_dir(path, layers=layer + 1)
    lm: Any = loaded.module
    config = lm.config
    hidden = int(config.hidden_size)
    norm_type = type(lm.model.norm)
    eps = float(getattr(config, "rms_norm_eps", 1e-6))
    block = lm.model.layers[layer]
    with _parameters_without_memory():
        block.enorm = norm_type(hidden, eps=eps)
        block.hnorm = norm_type(hidden, eps=eps)
        block.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        block.shared_head = nn.Module()
        block.shared_head.norm = norm_type(hidden, eps=eps)
        block.shared_head.head = nn.Linear(hidden, int(config.vocab_size), bias=False)
    extra = nn.ModuleDict({"enorm": block.enorm, "hnorm": block.hnorm, "eh_proj": block.eh_proj,
                           "shared_head": block.shared_head})
    give_storage(extra, parameter_owners(extra)[1])
    dtype = next(p.dtype for p in lm.model.embed_tokens.parameters())
    for name, p in extra.named_parameters():
        key = f"model.layers.{layer}.{name}"
        file, layout = index[key]
        if layout is not None and layout[1] != tuple(p.shape):
            raise _refuse(f"{os.path.basename(file)}:{key} is stored as {list(layout[1])}; the config makes it "
                          f"{list(p.shape)}", "the checkpoint does not match its config.json")
        loaded.sources[key] = SafetensorsSource(file, key, dtype, layout)
    mtp = MTPModule(lm, layer).eval()
    return LoadedModel(mtp, "hf", {}, loaded.sources, {"input_ids": torch.int64, HIDDEN: dtype},
                       loaded.files), hidden


@dataclass
class MTPPrograms:
    """The three programs, imported, each with the LongTrace its KV-cache pass takes."""

    graphs: dict[str, Graph]
    traces: dict[str, LongTrace]


# trace(loaded, shapes, fixed kwargs) -> the imported graph (the driver's static export)
Trace = Callable[[LoadedModel, Mapping[str, tuple[int, ...]], Mapping[str, Any]], Graph]


def build_mtp_programs(model: Any, slots: int, prefill_len: int, verify_rows: int, max_seq_len: int,
                       decode_position: int, trace: Trace, long_trace: Callable[[Graph], LongTrace]
                       ) -> MTPPrograms:
    """The MTP programs of checkpoint `model` for `slots` sequences, prompts of `prefill_len`
    and verify steps of `verify_rows` tokens a slot; decode traced at `decode_position`
    (the driver's DECODE_TRACE_POSITION), the RoPE tables from a trace at max_seq_len."""
    loaded, hidden = load_mtp(model)
    slots = max(slots, 1)

    def at(batch: int, rows: int, start: int) -> Graph:
        pos = (start + torch.arange(rows)).repeat(batch, 1)
        return trace(loaded, {"input_ids": (batch, rows), HIDDEN: (batch, rows, hidden)}, {"position_ids": pos})

    base = replace(long_trace(at(1, max_seq_len, 0)), layers=1, slots=slots)
    graphs = {MTP_PREFILL: at(1, prefill_len, 0), MTP_DECODE: at(slots, 1, decode_position),
              MTP_VERIFY: at(slots, verify_rows, decode_position)}
    traces = {MTP_PREFILL: base, MTP_DECODE: base, MTP_VERIFY: replace(base, decode_tokens=verify_rows)}
    for name, g in graphs.items():
        g.name = name
    return MTPPrograms(graphs, traces)


def check_mtp(mtp: bool, speculative_tokens: int | None, tp: Any = None) -> None:
    """--mtp drafts for the verify program: it needs --speculative_tokens, and one rank."""
    if not mtp:
        return
    if not speculative_tokens:
        raise _refuse("the MTP layer drafts tokens that a verify program checks",
                      "give --speculative_tokens K too (e.g. 3)", EXIT_USAGE)
    if tp not in (None, 1):
        raise _refuse("not with --tp yet", "leave --mtp or --tp out", EXIT_USAGE)


def mtp_pipelines(progs: MTPPrograms, pipeline: Callable[[KVCache], list[Pass]], cache_len: int,
                  decode_position: int, kv_cache_dtype: DType | None) -> dict[str, list[Pass]]:
    """Each MTP program's passes: `pipeline(kv_cache)` (the driver's default pipeline, without
    a last-token pass or a decode check: the tests compare the programs with the layer in
    torch) over a cache of `cache_len` rows named MTP_PREFIX."""
    out = {}
    for name, t in progs.traces.items():
        role, position = ("prefill", 0) if name == MTP_PREFILL else ("decode", decode_position)
        out[name] = pipeline(KVCache(role, cache_len, t.tables, position, t.windows, t.decode_positions, t.layers,
                                     t.alibi, t.slots, t.decode_tokens, kv_cache_dtype, prefix=MTP_PREFIX))
    return out


def with_hidden(passes: list[Pass]) -> list[Pass]:
    """A main program's passes with ExposeHidden before its KV-cache pass."""
    at = next(i for i, p in enumerate(passes) if isinstance(p, KVCache))
    return [*passes[:at], ExposeHidden(), *passes[at:]]
