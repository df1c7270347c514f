"""The model-coverage matrix: every decoder-only, attention-based text family in the installed
transformers' causal-LM auto mapping, built tiny from its config class (random weights, nothing
downloaded), saved as a Hugging Face folder, compiled, and checked against HF eager.

    tests/test_model_matrix.py      runs `check` for every family in scope and compares each row
                                    with docs/models.md
    python docs/gen_models.py       runs that test and writes docs/models.md from its rows

Per family, one compile (`--max_seq_len 48 --prefill_logits all`, `input_ids:1,8`, the default
target): the prefill program's logits against HF eager's (1e-4), the fused ops it holds, and
`npuc generate` against HF `generate` (greedy, 32 new tokens). A family whose model the compile
refuses gets the error's code and message as its reason.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOL = 1e-4
RTOL = 1e-4  # and this much of a logit's size: f32 rounding of logits in the tens (CPM-Ant's)
TIE = 1e-5  # HF's two best logits closer than this: a tie, either token is greedy's
PREFILL = 8
MAX_SEQ = 48
NEW = 32

# Out of scope, with why (the scope: decoder-only, attention-based text models).
ENCODERS = ["bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
            "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm", "xlm-roberta",
            "xlm-roberta-xl", "xmod", "xlnet"]
ENCODER_DECODERS = ["bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
                    "plbart", "prophetnet", "trocr", "whisper"]
MULTIMODAL = ["dots3_note", "emu3", "fuyu", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "gemma4_assistant",
              "gemma4_unified_assistant", "git", "got_ocr2", "llama4", "mllama", "moshi", "moss_transcribe_diarize",
              "musicgen", "musicgen_melody", "phi4_multimodal", "qwen3_5", "qwen3_5_moe", "qwen4_exp"]
# Pure state-space and recurrent models are in scope (their scans are ops: compiler/recurrent.py)
# but xLSTM, whose mLSTM cell keeps a matrix memory with exponential gates and a normaliser that
# no rule of npuc's computes yet.
STATE_SPACE = ["xlstm"]
EXCLUDED: dict[str, str] = {
    **{f: "encoder (a BERT-like used as a decoder)" for f in ENCODERS},
    **{f: "the decoder of an encoder-decoder" for f in ENCODER_DECODERS},
    **{f: "multimodal (another modality's encoder, or a drafter for one)" for f in MULTIMODAL},
    **{f: "xLSTM (its mLSTM memory and normaliser: no recurrence rule yet)" for f in STATE_SPACE},
}

# Tiny sizes, under whatever name a family's config gives them.
SIZES: dict[str, Any] = {
    "hidden_size": 64, "hidden_size_global": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256, "ffn_dim": 128,
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "n_inner": 128, "d_model": 64, "n_heads": 4,
    "n_layers": 2, "expansion_ratio": 2, "max_seq_len": 256, "num_layers": 2, "attention_heads": 4, "head_dim": 16,
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1,
    # latent attention
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    # a sliding window wider than the prefill, narrower than the cache: decode must honour it
    "sliding_window": 12,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
# Where a family needs more than the above to be small and valid.
OVERRIDES: dict[str, dict[str, Any]] = {
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
    "dots1": {"n_shared_experts": 1},
    "ernie4_5_moe": {"moe_k": 2},
    "gemma3n_text": {"vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 0,
                     "layer_types": ["sliding_attention", "full_attention"]},
    "gemma4_text": {"vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 256},
    "inkling2_loop_text": {"unpadded_vocab_size": 128},
    "inkling2_text": {"unpadded_vocab_size": 128},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "longcat_flash": {"ffn_hidden_size": 128, "expert_ffn_hidden_size": 32, "zero_expert_num": 2},
    "blt": {"encoder_hash_byte_group_vocab": 128, "patch_size": 2, "max_patch_length": 4},
    "reformer": {"is_decoder": True, "axial_pos_shape": [16, 16], "axial_pos_embds_dim": [32, 32],
                 "attn_layers": ["local", "lsh"], "feed_forward_size": 128, "attention_head_size": 16},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["mamba", "hybrid", "hybrid"]},
    "zamba2": {"layers_block_type": ["mamba", "hybrid"]},
    # hybrids: a recurrent layer, then an attention (the defaults' pattern starts with several recurrent ones)
    **{f: {"layer_types": ["linear_attention", "full_attention"]}
       for f in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "kimi_linear", "bailing_hybrid")},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "bamba": {"attn_layer_indices": [1]},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2},
    "mamba2": {"num_heads": 8, "n_groups": 1, "state_size": 16, "chunk_size": 4},
    "zaya": {"num_experts_per_tok": 1},
}


def families() -> list[str]:
    """The installed transformers' causal-LM families, in name order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def in_scope() -> list[str]:
    return [f for f in families() if f not in EXCLUDED]


def tiny_config(family: str) -> Any:
    import transformers as tf

    cls = tf.CONFIG_MAPPING[family]
    return cls(**_tiny_kwargs(cls, OVERRIDES.get(family, {})))


def _tiny_kwargs(cls: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters
    kw = {k: v for k, v in SIZES.items() if k in params}
    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():  # a family built of sub-models
        kw[name] = _tiny_kwargs(sub, {})
    if "kv_lora_rank" in params:  # latent attention: as in every published config, a KV head per head;
        kw["num_key_value_heads"] = kw["num_attention_heads"]  # its head_dim is the rotary part's
        kw.pop("head_dim", None)
    kw.update(overrides)
    return kw


@dataclass
class Row:
    family: str
    kind: str = "-"  # dense | MoE
    status: str = "ok"  # ok | no generate | refused | mismatch | generate differs | crashed | no tiny model
    #                     | no reference
    reason: str = ""  # one line, for every status but ok
    layers: int = 0
    attention: int = 0  # fused attention ops in the prefill program
    norm: int = 0
    mlp: int = 0
    max_err: float | None = None
    generate: str = "-"
    native: str = "-"  # the C executor against the torch interpreter, on a family that generates

    def cells(self) -> list[str]:
        fused = f"{self.attention} / {self.norm} / {self.mlp}" if self.layers else "-"
        err = "-" if self.max_err is None else f"{self.max_err:.0e}"
        return [f"`{self.family}`", self.kind, self.status, str(self.layers or "-"), fused, err, self.generate,
                self.native.replace("|", "\\|"), self.reason.replace("|", "\\|")]


ATTENTION_OPS = {"fused_attention", "mla_attention"}
NORM_OPS = {"rms_norm", "layer_norm"}
MLP_OPS = {"swiglu", "fused_moe", "qmoe"}


def _one_line(e: BaseException) -> str:
    from npuc.errors import NpucError

    text = f"{e.code}: {e.message}" if isinstance(e, NpucError) else f"{type(e).__name__}: {e}"
    text = " ".join(text.split())
    text = re.sub(r"/tmp/\S+", "<tmp>", text)  # no machine paths in the doc
    return text if len(text) <= 200 else text[:197] + "..."


def check(family: str, work: Path) -> Row:
    """Build, save, compile, run and compare one family (see the module docstring)."""
    import torch
    import transformers as tf

    from npuc.apps.generate import steps
    from npuc.compiler.driver import compile_model
    from npuc.errors import NpucError
    from npuc.runtime import Session

    row = Row(family)
    folder = work / family
    try:
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
        with torch.no_grad():  # noise on every weight: a router initialised to zeros would tie every
            for p in model.parameters():  # expert, and which of tied experts top-k picks is unspecified
                p.add_(torch.randn_like(p) * 0.02)
            for mod in model.modules():  # but a padding row stays zero (some families re-zero it on load)
                if isinstance(mod, torch.nn.Embedding) and mod.padding_idx is not None:
                    mod.weight[mod.padding_idx].zero_()
        n = sum(p.numel() for p in model.parameters())
        if n > 10_000_000:  # a size the table above does not name: a real model's default
            raise ValueError(f"{n} parameters at the tiny sizes")
        model.save_pretrained(str(folder))
    except Exception as e:  # transformers' own, before npuc runs
        row.status, row.reason = "no tiny model", _one_line(e)
        return row
    row.kind = "MoE" if any("expert" in name.lower() for name, _ in model.named_modules()) else "dense"
    del model
    no_decode = None
    try:
        try:
            om = compile_model(str(folder), input_shape=f"input_ids:1,{PREFILL}", output=str(folder / "m"),
                               max_seq_len=MAX_SEQ, prefill_logits="all")
        except NpucError as e:
            if e.code != "NPUC-E0123":
                raise
            no_decode = e  # no decode program: the logits are still checked, from a plain compile
            om = compile_model(str(folder), input_shape=f"input_ids:1,{PREFILL}", output=str(folder / "m"))
        sess = Session.load(om)
    except NpucError as e:
        row.status, row.reason = "refused", _one_line(e)
        return row
    except Exception as e:  # an npuc bug: a crash, not a refusal
        row.status, row.reason = "crashed", _one_line(e)
        return row
    prefill = sess.programs["prefill" if no_decode is None else next(iter(sess.programs))]
    ops = [st.opdef.name for st in prefill.steps]
    row.layers = int(getattr(tiny_config(family), "num_hidden_layers", 0) or 2)
    row.attention = sum(o in ATTENTION_OPS for o in ops)
    row.norm = sum(o in NORM_OPS for o in ops)
    row.mlp = sum(o in MLP_OPS for o in ops)

    ids = torch.randint(3, 100, (1, PREFILL), generator=torch.Generator().manual_seed(3))
    # The whole-sequence logits without a cache (a few families' cached path differs from it, Dory's).
    try:
        ref = tf.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval()
        with torch.no_grad():
            want = ref(ids, use_cache=False).logits
    except Exception:  # transformers' eager path fails for a few families: its default one is the reference
        ref = tf.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        with torch.no_grad():
            want = ref(ids, use_cache=False).logits
    # a recurrent model's prefill takes the prompt's last row (the state it keeps), with every row's logits
    feeds = {prefill.inputs[0].name: ids, **({"last_token": torch.tensor([PREFILL - 1])}
                                           if any(t.name == "last_token" for t in prefill.inputs) else {})}
    (got,) = sess.run(feeds, prefill.name).values()
    row.max_err = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    if not (got.shape == want.shape and bool(((got - want).abs() <= TOL + RTOL * want.abs()).all())):
        row.status, row.reason = "mismatch", f"prefill logits differ from HF by {row.max_err:.2g}"
        return row
    if no_decode is not None:
        row.status, row.generate, row.reason = "no generate", "refused", _one_line(no_decode)
        return row

    prompt = [(7 * i + 3) % 90 + 4 for i in range(PREFILL)]

    def hf_generate(model: Any) -> tuple[list[int], list[torch.Tensor]]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        return [int(t) for t in out.sequences[0, len(prompt):]], [lg[0] for lg in out.logits]

    try:
        hf_tokens, hf_logits = hf_generate(ref)
    except Exception:  # as above: transformers' default attention then
        try:
            hf_tokens, hf_logits = hf_generate(tf.AutoModelForCausalLM.from_pretrained(str(folder)).eval())
        except Exception as e:
            row.status, row.generate, row.reason = "no reference", "-", "HF generate fails: " + _one_line(e)
            return row
    got = list(steps(sess, prompt, NEW, ignore_eos=True))
    row.native = native_parity(om, [t for t, _ in got], [lg for _, lg in got], prompt)
    same = next((i for i, ((a, _), b) in enumerate(zip(got, hf_tokens, strict=True)) if a != b), None)
    row.generate = f"{NEW}/{NEW}"
    if same is not None:
        # Two tokens whose HF logits tie to float noise, with npuc's logits on HF's: either is the
        # greedy choice, and the sequences part there (random tiny models tie now and then).
        lg, want = got[same][1], hf_logits[same]
        top2 = want.topk(2).values
        if float((lg - want).abs().max()) <= TOL and float(top2[0] - top2[1]) <= TIE:
            row.generate = f"{same}/{NEW}, then a tie"
        else:
            row.generate = f"differs at {same + 1}"
            row.status, row.reason = "generate differs", f"greedy token {same + 1} of {NEW} differs from HF generate"
    return row


def checked(family: str, work: Path) -> Row:
    """check(), then its folder removed (the matrix's workers call this)."""
    import shutil

    row = check(family, work)
    shutil.rmtree(work / family, ignore_errors=True)
    return row


def native_parity(om: str, tokens: list[int], logits: list[Any], prompt: list[int]) -> str:
    """The C executor (libnpucrt) on the same .om against the torch interpreter's tokens and
    logits: "NEW/NEW" when every token is the same and every logit within NATIVE_TOL; its
    refusal (NPUC-E0413: the op it has no kernel for) otherwise, or where they part."""
    import numpy as np

    from npuc.apps.generate import steps
    from npuc.errors import NpucError
    from npuc.runtime.native_session import NativeSession, runtime_library

    if runtime_library() is None:
        return "not built"
    try:
        c = NativeSession(om)
    except NpucError as e:
        if e.code != "NPUC-E0413":
            return "crashed: " + _one_line(e)
        op = re.search(r"\(([a-z_0-9]+)\) has no kernel", e.message)
        return f"refused: {op.group(1) if op else e.code}"
    got = list(steps(c, prompt, len(tokens), ignore_eos=True))
    for i, ((t, lg), t2, lg2) in enumerate(zip(got, tokens, logits, strict=True)):
        err = float(np.abs(np.asarray(lg) - lg2.numpy()).max())
        if t != t2 or err > NATIVE_TOL:
            return f"differs at {i + 1} ({err:.0e})"
    return f"{len(got)}/{len(tokens)}"


MATCHED = ("ok", "no generate", "generate differs", "no reference")  # the logits match HF's
HEADER = ["family", "kind", "status", "layers", "fused attention / norm / MLP", "max err", "generate", "native",
          "reason"]
NATIVE_TOL = 1e-5  # the C executor against the torch interpreter, fp32


def render(rows: list[Row], version: str) -> str:
    inside = [r for r in rows if r.family not in EXCLUDED]
    n = max(len(inside), 1)
    match = sum(r.status in MATCHED for r in inside)
    ok = sum(r.status == "ok" for r in inside)
    native = sum(r.status == "ok" and r.native == f"{NEW}/{NEW}" for r in inside)
    lines = [
        "# Model coverage",
        "",
        "Generated by `python docs/gen_models.py` (which runs `tests/test_model_matrix.py`; the test checks this",
        "file against what the code does). Do not edit by hand.",
        "",
        f"transformers {version}: of {len(inside)} in-scope causal-LM families, **{match} ({100 * match / n:.0f}%)** "
        f"compile from a Hugging Face folder and match HF within {TOL:g} (+ {RTOL:g} of a logit's size) in fp32; "
        f"**{ok} ({100 * ok / n:.0f}%)** also "
        f"generate HF's greedy tokens for {NEW} steps over the KV cache. Every other row's reason is npuc's coded "
        "refusal, or says what else stopped it. "
        f"**{native} of the {ok}** run on the C executor with the torch interpreter's tokens and logits.",
        "",
        "Each family is built tiny from its config class (hidden 64, 2 layers, 4 heads, vocab 128, 4 experts",
        "where it has experts, a sliding window of 12 where it has one; random weights, with noise added",
        "so that no router starts with tied experts), saved with",
        "`save_pretrained`, and compiled once with",
        f"`--input_shape input_ids:1,{PREFILL} --max_seq_len {MAX_SEQ} --prefill_logits all` for the default target.",
        "Columns:",
        "",
        "- **status**: `ok`; `refused` (npuc's coded error, in reason); `mismatch` (logits off HF eager);",
        "  `generate differs`; `crashed` (an npuc bug); `no tiny model` (transformers could not build the",
        "  family at the tiny sizes: the matrix's config, not npuc, is what is missing); `no reference`",
        "  (transformers' own `generate` fails for the family, so npuc's tokens cannot be checked).",
        "- **fused attention / norm / MLP**: fused ops in the prefill program (`fused_attention` or",
        "  `mla_attention`; `rms_norm` or `layer_norm`; `swiglu`, `fused_moe`). One attention per layer is",
        "  the aim; non-gated MLPs have no fused op.",
        f"- **generate**: `npuc generate`'s greedy tokens against HF `generate` for {NEW} new tokens; \"k/{NEW}, "
        f"then a tie\": the k tokens agree, then HF's two best logits are within {TIE:g} (npuc's logits within",
        f"  {TOL:g} of HF's), so either token is the greedy one and the sequences part.",
        "- **native**: the C executor (libnpucrt, what `npuc generate` runs) against the torch interpreter on the",
        f"  same `.om`: \"{NEW}/{NEW}\" when the greedy tokens are the same and every logit of the prefill and each",
        f"  decode step is within {NATIVE_TOL:g}; `refused: OP` where the library has no kernel for an op of the",
        "  model (its load refuses it, naming the op, and `npuc generate` runs the torch interpreter with a notice).",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in sorted(inside, key=lambda r: r.family)]
    lines += ["", "## Out of scope", "",
              "Families in transformers' causal-LM mapping that are not decoder-only attention text models:", ""]
    by_reason: dict[str, list[str]] = {}
    for f in families():
        if f in EXCLUDED:
            by_reason.setdefault(EXCLUDED[f], []).append(f)
    lines += [f"- {why}: " + ", ".join(f"`{f}`" for f in fs) for why, fs in by_reason.items()]
    return "\n".join(lines) + "\n"


def documented(text: str) -> tuple[str, dict[str, list[str]]]:
    """The transformers version and the rows (their cells, by family) that a models.md holds."""
    m = re.search(r"^transformers (\S+):", text, re.M)
    version = m.group(1) if m else ""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[cells[0].strip("`")] = cells
    return version, rows
