"""`npuc compile` with ATC's flags, and `npuc check` (the precheck).

    npuc compile --model=model.onnx --framework=5 --input_shape="input_ids:1,2048" --output=build/model \
                 --soc_version=npu --precision_mode=allow_fp32_to_fp16 --log=info
    npuc compile --mode=1 --om build/model.om --json model.json      # the .om as JSON (ATC --mode=1)
    npuc compile --mode=1 --model model.onnx --json model.json       # the imported graph as JSON
    npuc compile --mode=3 --model model.onnx --input_shape ...       # precheck only (= npuc check)
    npuc compile --mode=6 --om build/model.om                        # model info (= npuc info)
    npuc compile --config npuc.toml [--print-config]

`--flag=value` and `--flag value` both work, and every snake_case flag has a
kebab-case spelling. A `--config` TOML file gives any option by its flag name
(`input_shape = "input_ids:1,16"`); flags on the command line win.
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from collections.abc import Callable
from typing import Any

import click

from npuc.cli.diagnostics import LOG_LEVELS, handle_errors, report, setup
from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, NpucError

# ATC's --framework numbers; npuc reads ONNX (5) and, beyond ATC, torch programs and HF folders.
FRAMEWORKS = {"5": "onnx", "onnx": "onnx", "pt2": "pt2", "hf": "hf", "gguf": "gguf"}
ATC_ONLY = {"0": "Caffe", "1": "MindSpore", "3": "TensorFlow"}
MODES = {"0": "compile", "1": "to JSON", "3": "precheck", "6": "model info"}


def detect_framework(path: str) -> str:
    if path.endswith(".onnx"):
        return "onnx"
    if path.endswith(".pt2"):
        return "pt2"
    if path.lower().endswith(".gguf"):
        return "gguf"
    if os.path.isdir(path):
        return "hf"
    raise NpucError("NPUC-E0103", f"cannot tell what kind of model {path!r} is",
                    "give an .onnx or .pt2 file or a Hugging Face checkpoint folder, or say --framework",
                    exit_code=EXIT_USAGE)


def check_framework(framework: str | None, path: str) -> str | None:
    """The model's kind, from --framework checked against the file (None: the path does
    not exist; the loader says so with its own error)."""
    if not os.path.exists(path):
        return None
    found = detect_framework(path)
    if framework is None:
        return found
    f = framework.strip().lower()
    if f in ATC_ONLY:
        raise NpucError("NPUC-E0130", f"--framework {framework} ({ATC_ONLY[f]}) is not supported",
                        "npuc reads ONNX (--framework 5 or onnx), .pt2 (pt2) and Hugging Face folders (hf)",
                        exit_code=EXIT_UNSUPPORTED)
    if f not in FRAMEWORKS:
        raise NpucError("NPUC-E0130", f"unknown --framework {framework!r}",
                        "use 5 or onnx, pt2, or hf", exit_code=EXIT_USAGE)
    if FRAMEWORKS[f] != found:
        raise NpucError("NPUC-E0130", f"--framework {framework} says {FRAMEWORKS[f]}, but {path!r} is {found}",
                        "leave --framework out to detect it from the file", exit_code=EXIT_USAGE)
    return found


def _load_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Eager: the config file's values become the defaults of every other option."""
    if value is None:
        return None
    try:
        with open(value, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise click.BadParameter(f"cannot read {value!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise click.BadParameter(f"{value!r} is not valid TOML: {e}") from None
    known = {p.name: p for p in ctx.command.params if p.name not in ("config", "print_config")}
    options = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise click.BadParameter(f"{value!r} sets unknown option(s) {', '.join(unknown)}; "
                                 f"known: {', '.join(sorted(known))}")
    ctx.default_map = {**(ctx.default_map or {}), **options}
    return value


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def effective_config(params: dict[str, Any]) -> str:
    """The options in force, as TOML that --config reads back."""
    skip = {"config", "print_config", "model"}
    lines = [f"{k} = {_toml_value(v)}" for k, v in sorted(params.items())
             if k not in skip and v is not None and v is not False and v != ()]
    return "\n".join(lines) + "\n"


# What `compile` and `check` both take: the model's shapes, target and options, and
# how to report. One list, so the precheck checks what a compile would be given.
_MODEL_OPTIONS = [
    click.option("--input_shape", "--input-shape", "input_shape", help='Static input shapes: "name:d0,d1;name2:d0".'),
    click.option("--input_format", "--input-format", "input_format", default="ND",
                 help="ND (default) or NCHW (4-D inputs)."),
    click.option("--soc_version", "--soc-version", "soc_version", default=None,
                 help="Target: npu (default), cpu, or a target .toml file."),
    click.option("--precision_mode", "--precision-mode", "precision_mode", default="must_keep_origin_dtype",
                 help="must_keep_origin_dtype (default), force_fp32, force_fp16, allow_fp32_to_fp16, "
                      "allow_mix_precision_bf16 (also spelled allow_fp32_to_bf16)."),
    click.option("--keep_dtype", "--keep-dtype", "keep_dtype", metavar="FILE",
                 help="A file of op (node) names, one a line, that keep their original precision."),
    click.option("--out_nodes", "--out-nodes", "out_nodes", default=None, metavar='"NAME;NAME:INDEX"',
                 help="The graph outputs: value names, or node:output index, separated by ';'."),
    click.option("--max_seq_len", "--max-seq-len", "max_seq_len", type=int, default=None, metavar="N",
                 help="Causal LMs: also emit a one-token decode program over a KV cache of N positions "
                      "(prefill + decode in one .om, for `npuc generate`)."),
    click.option("--prefill_logits", "--prefill-logits", "prefill_logits", default=None, metavar="last|all",
                 help="With --max_seq_len: last (default) computes prefill's logits for the row its last_token "
                      "input names only; all computes every row's."),
    click.option("--decode_tokens", "--decode-tokens", "decode_tokens", type=int, default=None, metavar="C",
                 help="With --max_seq_len: the tokens of each slot a decode step runs (default 1). C > 1 lets a "
                      "new request's prompt go through the decode steps beside the slots decoding (chunked "
                      "prefill, `npuc serve`)."),
    click.option("--speculative_tokens", "--speculative-tokens", "speculative_tokens", type=int, default=None,
                 metavar="K",
                 help="With --max_seq_len: also emit a `verify` program of K + 1 tokens of each slot, for "
                      "speculative decoding (n-gram, or a draft model) and prompt chunks after a prefix-cache hit."),
    click.option("--mtp", "mtp", is_flag=True, default=False,
                 help="With --speculative_tokens: also compile the checkpoint's multi-token-prediction layer "
                      "(DeepSeek-V3's model.layers.<num_hidden_layers>) as draft programs: `--speculative mtp`."),
    click.option("--mixed_tokens", "--mixed-tokens", "mixed_tokens", type=int, default=None, metavar="C",
                 help="With --max_seq_len: also emit a `mixed` program of one token of each slot plus C prompt "
                      "tokens, which `npuc serve` runs while it admits a request beside the slots decoding "
                      "(steady inter-token latency; docs/serving.md)."),
    click.option("--prefix_cache", "--prefix-cache", "prefix_cache", type=int, default=None, metavar="P",
                 help="With --max_seq_len: keep up to P prompt prefixes' KV in the state region, for `npuc serve` "
                      "to reuse across requests (each up to --max_seq_len positions)."),
    click.option("--kv_cache_dtype", "--kv-cache-dtype", "kv_cache_dtype", default=None,
                 metavar="auto|f32|bf16|f16|int8",
                 help="With --max_seq_len: the KV cache's dtype. auto (default) follows --precision_mode (f32, or "
                      "bf16/f16 under the mixed modes); int8 stores each head's row per token as int8 codes with an "
                      "f32 scale, a quarter of f32's bytes (docs/precision.md)."),
    click.option("--tp", "tp", type=int, default=None, metavar="N",
                 help="Tensor parallel over N ranks: one .om per rank (<output>.rankR.om) and <output>.om naming "
                      "them; run with `torchrun --nproc-per-node N -m npuc ...` or `npuc generate --tp N` "
                      "(docs/parallel.md)."),
    click.option("--ep", "ep", type=int, default=None, metavar="N",
                 help="With --tp N: --ep N splits MoE experts across the ranks (expert parallel); 1 (the "
                      "default) splits each expert's FFN instead."),
    click.option("--quant_type", "--quant-type", "quant_type", default=None, metavar="w8a16|w4a16|w8a8|w4a8",
                 help="Quantization: int8 per output channel (w8a16) or int4 per group (w4a16) with 16-bit "
                      "activations; w8a8 and w4a8 (groups of 32) also quantize each product's activations to "
                      "int8 per block of 32 and multiply in integers, faster and less accurate "
                      "(docs/quantization.md)."),
    click.option("--group_size", "--group-size", "group_size", type=int, default=None, metavar="32|64|128",
                 help="With --quant_type: weights per scale along K (w4a16 default 128; w8a16 default per channel; "
                      "w8a8 and w4a8 default 32)."),
    click.option("--quant_exclude", "--quant-exclude", "quant_exclude", default=None, metavar="FILE",
                 help="A file of node or weight names, one a line, left unquantized."),
    click.option("--quant_strict", "--quant-strict", "quant_strict", is_flag=True, default=False,
                 help="Refuse a weight whose K the group size does not divide (default: store it in int8)."),
    click.option("--trust-pickle", "--trust_pickle", "trust_pickle", is_flag=True, default=False,
                 help="Load a .pt2 whose payload needs pickle: this runs code from the file, so only for files "
                      "you trust (refused by default, NPUC-E0318)."),
    click.option("--diagnostics-format", "--diagnostics_format", "diagnostics_format", default="text",
                 type=click.Choice(["text", "json"]), help="json: errors and logs as JSON lines, nothing else on stderr."),
]


def model_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_MODEL_OPTIONS):
        fn = option(fn)
    return fn


@click.command("compile")
@click.argument("model", required=False)
@click.option("--config", callback=_load_config, is_eager=True, expose_value=True, metavar="FILE",
              help="A TOML file of options (flag names as keys); command-line flags win.")
@click.option("--print-config", "--print_config", "print_config", is_flag=True,
              help="Print the options in force (as TOML) and exit.")
@click.option("--model", "model_opt", help="Model path (ATC spelling; same as the argument).")
@click.option("--framework", default=None, help="5 or onnx, pt2, hf, gguf (detected from the file when omitted).")
@click.option("--mode", default="0", type=click.Choice(list(MODES)),
              help="0 compile (default), 1 convert to JSON, 3 precheck only, 6 model info.")
@click.option("--om", "om", default=None, help="--mode 1/6: the .om to read.")
@model_options
@click.option("--json", "json_out", default=None, metavar="FILE",
              help="--mode 1: the JSON to write; --mode 3: the precheck report.")
@click.option("--output", default=None,
              help="Output prefix: writes <output>.om (default: the model's name, in the current folder).")
@click.option("--depfile", default=None, metavar="FILE",
              help="Write Make rules naming every file the compile read (for Make, Ninja, CMake DEPFILE).")
@click.option("--log", "log", default="warning", type=click.Choice(list(LOG_LEVELS)),
              help="Log level on stderr: debug, info, warning (default), error, null.")
@click.option("--debug", is_flag=True, help="Verify the IR after every pass; show tracebacks.")
@click.option("--dump-ir-after", "--dump_ir_after", "dump_ir_after", metavar="all|PASS[,PASS...]",
              help="Write the textual IR after these passes (and the frontend's, as 00-input.ir) into --dump-dir.")
@click.option("--dump-dir", "--dump_dir", "dump_dir", metavar="DIR", help="Folder for --dump-ir-after's NN-PASS.ir files.")
@click.option("--time-passes", "--time_passes", "time_passes", is_flag=True,
              help="Print each pass's wall time, and the total, to stderr.")
@click.option("--fusion-report", "--fusion_report", "fusion_report", metavar="FILE",
              help="Write a JSON report: each rewrite rule's matches and refusals, what each fusion replaced, op counts.")
@click.pass_context
@handle_errors
def compile_cmd(ctx: click.Context, **opts: Any) -> None:
    """Compile MODEL (.onnx, .pt2 or Hugging Face checkpoint folder) to a .om file."""
    setup(opts["log"], opts["diagnostics_format"])
    if opts["print_config"]:
        click.echo(effective_config({**opts, "model": None}), nl=False)
        return
    mode = opts["mode"]
    if mode == "6":
        return _mode_info(opts)
    if mode == "1":
        return _mode_json(opts)
    source = opts["model"] or opts["model_opt"]
    if not source:
        raise NpucError("NPUC-E0109", "no model given", "npuc compile MODEL --input_shape ... --output PREFIX",
                        exit_code=EXIT_USAGE)
    check_framework(opts["framework"], source)
    common = dict(input_shape=opts["input_shape"], soc_version=opts["soc_version"],
                  precision_mode=opts["precision_mode"], keep_dtype=opts["keep_dtype"],
                  max_seq_len=opts["max_seq_len"], prefill_logits=opts["prefill_logits"],
                  decode_tokens=opts["decode_tokens"], speculative_tokens=opts["speculative_tokens"],
                  mtp=opts["mtp"], mixed_tokens=opts["mixed_tokens"],
                  prefix_cache=opts["prefix_cache"], out_nodes=opts["out_nodes"],
                  input_format=opts["input_format"], quant_type=opts["quant_type"], group_size=opts["group_size"],
                  quant_exclude=opts["quant_exclude"], quant_strict=opts["quant_strict"],
                  kv_cache_dtype=opts["kv_cache_dtype"], trust_pickle=opts["trust_pickle"])
    if mode == "3":
        return _precheck(source, opts["json_out"], common, opts["diagnostics_format"])
    from npuc.compiler import weight_image

    output = opts["output"]
    if output is None:
        output = os.path.splitext(os.path.basename(os.path.normpath(source)))[0] or "model"
    # The weights' opening bytes start copying into the output now, while the compiler is
    # imported and runs (compiler/weight_image.py).
    image = weight_image.start(source, output, tp=opts["tp"], ep=opts["ep"], quant_type=opts["quant_type"],
                               precision_mode=opts["precision_mode"])
    try:
        from npuc.compiler.driver import compile_model
        from npuc.compiler.progress import NullProgress, RichProgress

        show = sys.stderr.isatty() and opts["diagnostics_format"] == "text" and opts["log"] != "null"
        progress = RichProgress() if show else NullProgress()
        try:
            path = compile_model(source, output=output, debug=opts["debug"], dump_ir_after=opts["dump_ir_after"],
                                 dump_dir=opts["dump_dir"], time_passes=opts["time_passes"],
                                 fusion_report=opts["fusion_report"], depfile=opts["depfile"],
                                 extra_deps=[opts["config"]] if opts["config"] else [], progress=progress,
                                 tp=opts["tp"], ep=opts["ep"], weight_image=image, **common)
        finally:
            progress.done()
    finally:
        weight_image.discard(image)
    click.echo(f"wrote {path}")


def _precheck(source: str, json_out: str | None, common: dict[str, Any], fmt: str) -> None:
    from npuc.compiler import instrument
    from npuc.compiler.precheck import precheck

    rep = precheck(source, **common)
    if json_out:
        instrument.ensure_parent(json_out, "--json")
        instrument.write_text_atomic(json_out, json.dumps(rep.as_dict(), indent=2, sort_keys=True) + "\n", "--json")
    click.echo(rep.render())
    if fmt == "json":
        for p in rep.problems:
            report(p, fmt)
    if not rep.ok:
        sys.exit(max(p.exit_code for p in rep.problems))


def _mode_info(opts: dict[str, Any]) -> None:
    if not opts["om"]:
        raise NpucError("NPUC-E0109", "--mode 6 needs --om MODEL.om", "npuc compile --mode=6 --om build/model.om",
                        exit_code=EXIT_USAGE)
    from npuc.tools.om_tools import model_info, render_info

    click.echo(render_info(opts["om"], model_info(opts["om"])))


def _mode_json(opts: dict[str, Any]) -> None:
    om, model = opts["om"], opts["model"] or opts["model_opt"]
    if bool(om) == bool(model) or not opts["json_out"]:
        raise NpucError("NPUC-E0109", "--mode 1 needs --json FILE and one of --om MODEL.om or --model MODEL",
                        "npuc compile --mode=1 --om build/model.om --json model.json", exit_code=EXIT_USAGE)
    from npuc.compiler import instrument

    if om:
        from npuc.tools.om_tools import dump_json

        text = dump_json(om)
    else:
        from npuc.compiler.driver import build_graph
        from npuc.ir.printer import graph_to_json

        check_framework(opts["framework"], model)
        graph, _ = build_graph(model, opts["input_shape"])
        text = json.dumps(graph_to_json(graph), indent=2, sort_keys=True)
    try:
        instrument.ensure_parent(opts["json_out"], "--json")
        instrument.write_text_atomic(opts["json_out"], text + "\n", "--json")
    except OSError as e:
        raise NpucError("NPUC-E0406", f"cannot write {opts['json_out']!r}: {e.strerror}", "check the path",
                        exit_code=EXIT_IO) from None
    click.echo(f"wrote {opts['json_out']}")


@click.command("check")
@click.argument("model")
@model_options
@click.option("--json", "json_out", default=None, metavar="FILE", help="Write the report as JSON.")
@click.option("--debug", is_flag=True)
@handle_errors
def check_cmd(model: str, json_out: str | None, diagnostics_format: str, debug: bool, **common: Any) -> None:
    """Precheck MODEL: list every problem a compile would hit, without writing a .om."""
    setup("warning", diagnostics_format)
    from npuc.compiler.sharded import check_parallel

    check_parallel(common.pop("tp"), common.pop("ep"))  # the split itself is checked by a compile
    _precheck(model, json_out, common, diagnostics_format)
