"""The `npuc` command line.

    npuc compile MODEL --input_shape "input_ids:1,16" --output build/model   # -> build/model.om
    npuc compile MODEL ... --dump-ir-after=all --dump-dir ir/ --time-passes --fusion-report fusion.json
    npuc compile HF_DIR --input_shape "input_ids:1,16" --max_seq_len 256 --output build/lm
    npuc generate build/lm.om --prompt-ids 1,2,3 --max-new-tokens 32    # or --prompt TEXT
    npuc run build/model.om --input input_ids=ids.npy --output-dir out/
    npuc dump build/model.om                 # --json: the whole model definition
    npuc info build/model.om                 # sizes, op counts, metadata (--json)
    npuc validate build/model.om             # checksums, bounds, memory plan

A user mistake prints one line (`error NPUC-E####: ...`) and a hint, and exits
with the error's code; only `--debug` shows a traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

import click

import npuc
from npuc.errors import EXIT_COMPILE, EXIT_IO, EXIT_USAGE, InternalError, NpucError

REPORT_URL = "the npuc issue tracker"


def _fail(e: NpucError) -> None:
    click.echo(f"npuc: {e.render()}", err=True)
    sys.exit(e.exit_code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = kwargs.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except NpucError as e:
            if debug:
                raise
            _fail(e)
        except Exception as e:  # anything else is our bug: say so, in one line
            if debug or isinstance(e, (click.exceptions.Exit, click.ClickException)):
                raise
            kind = "an internal invariant broke" if isinstance(e, InternalError) else type(e).__name__
            click.echo(f"npuc: internal error ({kind}): {str(e).splitlines()[0] if str(e) else ''}\n"
                       f"  this is a bug in npuc, not in your model: rerun with --debug and report it to {REPORT_URL}",
                       err=True)
            sys.exit(EXIT_COMPILE)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(npuc.__version__, "--version", prog_name="npuc", message="%(prog)s %(version)s")
def main() -> None:
    """npuc: an ahead-of-time compiler for transformer LLMs."""


@main.command()
@click.argument("model", required=False)
@click.option("--model", "model_opt", help="Model path (ATC spelling; same as the argument).")
@click.option("--input_shape", "--input-shape", "input_shape", help='Static input shapes: "name:d0,d1;name2:d0".')
@click.option("--output", default=None,
              help="Output prefix: writes <output>.om (default: the model's name, in the current folder).")
@click.option("--soc_version", "--soc-version", "soc_version", default=None, help="Target: npu (default) or cpu.")
@click.option("--debug", is_flag=True, help="Verify the IR after every pass; show tracebacks.")
@click.option("--dump-ir-after", "--dump_ir_after", "dump_ir_after", metavar="all|PASS[,PASS...]",
              help="Write the textual IR after these passes (and the frontend's, as 00-input.ir) into --dump-dir.")
@click.option("--dump-dir", "--dump_dir", "dump_dir", metavar="DIR", help="Folder for --dump-ir-after's NN-PASS.ir files.")
@click.option("--time-passes", "--time_passes", "time_passes", is_flag=True,
              help="Print each pass's wall time, and the total, to stderr.")
@click.option("--fusion-report", "--fusion_report", "fusion_report", metavar="FILE",
              help="Write a JSON report: each rewrite rule's matches and refusals, what each fusion replaced, op counts.")
@click.option("--precision_mode", "--precision-mode", "precision_mode", default="must_keep_origin_dtype",
              help="must_keep_origin_dtype (default), force_fp32, force_fp16, allow_fp32_to_fp16, "
                   "allow_mix_precision_bf16.")
@click.option("--max_seq_len", "--max-seq-len", "max_seq_len", type=int, default=None, metavar="N",
              help="Causal LMs: also emit a one-token decode program over a KV cache of N positions "
                   "(prefill + decode in one .om, for `npuc generate`).")
@click.option("--keep_dtype", "--keep-dtype", "keep_dtype", metavar="FILE",
              help="A file of op (node) names, one a line, that keep their original precision.")
@handle_errors
def compile(model: str | None, model_opt: str | None, input_shape: str | None, output: str | None,  # noqa: A001
            soc_version: str | None, debug: bool, dump_ir_after: str | None, dump_dir: str | None,
            time_passes: bool, fusion_report: str | None, precision_mode: str, keep_dtype: str | None,
            max_seq_len: int | None) -> None:
    """Compile MODEL (.onnx, .pt2 or Hugging Face checkpoint folder) to a .om file."""
    _quiet_libraries()
    source = model or model_opt
    if not source:
        raise NpucError("NPUC-E0109", "no model given", "npuc compile MODEL --input_shape ... --output PREFIX",
                        exit_code=EXIT_USAGE)
    from npuc.compiler.driver import compile_model

    if output is None:
        output = os.path.splitext(os.path.basename(os.path.normpath(source)))[0] or "model"
    path = compile_model(source, input_shape=input_shape, output=output, soc_version=soc_version, debug=debug,
                         dump_ir_after=dump_ir_after, dump_dir=dump_dir, time_passes=time_passes,
                         fusion_report=fusion_report, precision_mode=precision_mode, keep_dtype=keep_dtype,
                         max_seq_len=max_seq_len)
    click.echo(f"wrote {path}")


def _parse_input_flag(items: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for it in items:
        name, sep, path = it.partition("=")
        if not sep or not name or not path:
            raise NpucError("NPUC-E0110", f"bad --input {it!r}", "write --input NAME=FILE.npy", exit_code=EXIT_USAGE)
        out[name] = path
    return out


@main.command()
@click.argument("om")
@click.option("--input", "inputs", multiple=True, help="NAME=FILE.npy, once per model input.")
@click.option("--output-dir", "--output_dir", "output_dir", required=True, help="Writes <output name>.npy here.")
@click.option("--device", default="cpu", help="cpu, or cuda when torch sees a GPU.")
@click.option("--program", default=None, help="Which program to run (prefill or decode); the first by default.")
@click.option("--debug", is_flag=True)
@handle_errors
def run(om: str, inputs: tuple[str, ...], output_dir: str, device: str, program: str | None, debug: bool) -> None:
    """Run a compiled .om on .npy inputs."""
    import numpy as np

    from npuc.ir import DType
    from npuc.runtime import Session

    sess = Session.load(om, device=device)
    feeds = {}
    for name, path in _parse_input_flag(inputs).items():
        try:
            feeds[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise NpucError("NPUC-E0401", f"cannot read input {name!r} from {path!r}: {e}",
                            "inputs are .npy files written by numpy.save", exit_code=EXIT_IO) from None
    outs = sess.run(feeds, program)
    os.makedirs(output_dir, exist_ok=True)
    for name, t in outs.items():
        fname = "".join(c if c.isalnum() or c in "._-" else "_" for c in name) + ".npy"
        np.save(os.path.join(output_dir, fname), t.cpu().numpy())
        shape = ",".join(map(str, t.shape))
        click.echo(f"{name}: {DType.from_torch(t.dtype)}[{shape}] -> {os.path.join(output_dir, fname)}")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        ids = []
    if not ids or any(i < 0 for i in ids):
        raise NpucError("NPUC-E0125", f"--prompt-ids {text!r} is not a list of token ids",
                        "write --prompt-ids 1,2,3", exit_code=EXIT_USAGE)
    return ids


@main.command()
@click.argument("om")
@click.option("--prompt-ids", "--prompt_ids", "prompt_ids", metavar="ID,ID,...", help="The prompt as token ids.")
@click.option("--prompt", default=None, metavar="TEXT", help="The prompt as text (the .om must hold a tokenizer).")
@click.option("--max-new-tokens", "--max_new_tokens", "max_new_tokens", type=click.IntRange(min=1), default=32,
              show_default=True)
@click.option("--ignore-eos", "--ignore_eos", "ignore_eos", is_flag=True, help="Do not stop at end-of-sequence.")
@click.option("--device", default="cpu", help="cpu, or cuda when torch sees a GPU.")
@click.option("--debug", is_flag=True)
@handle_errors
def generate(om: str, prompt_ids: str | None, prompt: str | None, max_new_tokens: int, ignore_eos: bool,
             device: str, debug: bool) -> None:
    """Greedy decoding with a .om compiled with --max_seq_len: prints the new token ids
    (and the text, with --prompt)."""
    from npuc.runtime import Session
    from npuc.runtime.generate import load_tokenizer, stream

    if (prompt_ids is None) == (prompt is None):
        raise NpucError("NPUC-E0125", "give exactly one of --prompt-ids and --prompt",
                        "npuc generate model.om --prompt-ids 1,2,3 --max-new-tokens 32", exit_code=EXIT_USAGE)
    sess = Session.load(om, device=device)
    if prompt is not None:
        encode, decode = load_tokenizer(sess)
        ids = encode(prompt)
        out = list(stream(sess, ids, max_new_tokens, ignore_eos))
        click.echo(" ".join(map(str, out)))
        click.echo(decode(out))
        return
    ids = _parse_ids(prompt_ids or "")
    tokens = []
    for t in stream(sess, ids, max_new_tokens, ignore_eos):
        tokens.append(t)
    click.echo(" ".join(map(str, tokens)))


@main.command()
@click.argument("om")
@click.option("--summary", is_flag=True, help="Only the header and op counts.")
@click.option("--json", "as_json", is_flag=True,
              help="The section table and the whole model definition as JSON (ignores --summary).")
@click.option("--debug", is_flag=True)
@handle_errors
def dump(om: str, summary: bool, as_json: bool, debug: bool) -> None:
    """Print the compiled program: ops, shapes and planned offsets."""
    if as_json:
        from npuc.runtime.om_tools import dump_json

        click.echo(dump_json(om))
        return
    from npuc.runtime.listing import render_listing

    click.echo(render_listing(om, summary=summary))


@main.command()
@click.argument("om")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with sorted keys.")
@click.option("--debug", is_flag=True)
@handle_errors
def info(om: str, as_json: bool, debug: bool) -> None:
    """Summarise a .om: sections, weight/arena/lower-bound bytes, op and unit counts, metadata."""
    import json

    from npuc.runtime.om_tools import model_info, render_info

    facts = model_info(om)
    click.echo(json.dumps(facts, indent=2, sort_keys=True) if as_json else render_info(om, facts))


@main.command()
@click.argument("om")
@click.option("--debug", is_flag=True)
@handle_errors
def validate(om: str, debug: bool) -> None:
    """Check a .om end to end: checksums, tensor bounds, and the memory plan re-validated."""
    from npuc.runtime.om_tools import validate_om

    click.echo(validate_om(om))


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


if __name__ == "__main__":
    main()
