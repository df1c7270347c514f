"""The `npuc` command line.

    npuc compile MODEL --input_shape "input_ids:1,16" --output build/model   # -> build/model.om
    npuc compile MODEL ... --dump-ir-after=all --dump-dir ir/ --time-passes --fusion-report fusion.json
    npuc compile HF_DIR --input_shape "input_ids:1,16" --max_seq_len 256 --output build/lm
    npuc generate build/lm.om --prompt-ids 1,2,3 --max-new-tokens 32    # or --prompt TEXT
    npuc run build/model.om --input input_ids=ids.npy --output-dir out/
    npuc dump build/model.om                 # --json: the whole model definition
    npuc info build/model.om                 # sizes, op counts, metadata (--json)
    npuc validate build/model.om             # checksums, bounds, memory plan
    npuc export-onnx build/model.om model.onnx   # --program decode, --weights external
    npuc check MODEL --input_shape ...       # precheck: every problem, no .om
    npuc plan config.json --input_shape ... --tp 8 --ep 8   # each rank's bytes, no weights needed
    npuc ops                                 # the supported operators (docs/ops.md)
    npuc verify build/model.om --against MODEL [--per-layer]

A user mistake prints one line (`error NPUC-E####: ...`) and a hint, and exits
with the error's code; only `--debug` shows a traceback.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import secrets
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import click

import npuc
from npuc.cli.compile_cmd import check_cmd, compile_cmd
from npuc.cli.diagnostics import handle_errors, report, setup
from npuc.cli.ops_cmd import ops_cmd
from npuc.cli.plan_cmd import plan_cmd
from npuc.errors import EXIT_IO, EXIT_USAGE, NpucError


class NpucGroup(click.Group):
    """Click's own usage errors (an unknown flag, a bad value) as npuc diagnostics:
    one line with a code and a hint, or JSON with --diagnostics-format json."""

    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> Any:  # type: ignore[override]
        if args is None:  # the process's own command line (the `npuc` script, python -m npuc)
            try:
                self._main(None, prog_name, **extra)
            except SystemExit as e:
                _exit_now(e.code)
            _exit_now(0)
        return self._main(args, prog_name, **extra)

    def _main(self, args: Any, prog_name: str | None, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        pairs = zip(argv, [*argv[1:], ""], strict=True)
        fmt = "json" if any(f"{a}={b}" in ("--diagnostics-format=json", "--diagnostics_format=json")
                            or a in ("--diagnostics-format=json", "--diagnostics_format=json") for a, b in pairs) \
            else "text"
        try:
            return super().main(args=argv, prog_name=prog_name or "npuc", standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            sys.exit(1)
        except click.UsageError as e:
            cmd = e.ctx.command_path if e.ctx is not None else "npuc"
            report(NpucError("NPUC-E0100", e.format_message(), f"see `{cmd} --help`", exit_code=EXIT_USAGE), fmt)
            sys.exit(EXIT_USAGE)
        except click.ClickException as e:
            report(NpucError("NPUC-E0100", e.format_message(), "see `npuc --help`", exit_code=EXIT_USAGE), fmt)
            sys.exit(EXIT_USAGE)


def _exit_now(code: str | int | None) -> None:
    """End the process as `sys.exit(code)` would, less the interpreter's teardown: with
    torch imported, freeing every module's objects takes 0.4-0.7 s after the work is done
    (measured on `npuc compile`; docs/performance.md). The atexit handlers still run (temporary
    folders, logging), and Python's and C's output buffers are flushed. Where a thread
    other than daemons is still running, or a profiler or tracer (coverage) is on, the
    normal exit runs instead."""
    if sys.getprofile() is not None or sys.gettrace() is not None \
            or any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)  # a profiler or coverage writes its data at exit
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    try:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        ctypes.CDLL(None).fflush(None)  # a C library's buffered stdout (libnpucrt)
    except Exception:  # noqa: BLE001 - a closed pipe: nothing more can be said, exit as Python would
        sys.exit(code)
    os._exit(status)


@click.group(cls=NpucGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(npuc.__version__, "--version", prog_name="npuc", message="%(prog)s %(version)s")
def main() -> None:
    """npuc: an ahead-of-time compiler for transformer LLMs."""


main.add_command(compile_cmd)
main.add_command(check_cmd)
main.add_command(plan_cmd)
main.add_command(ops_cmd)


@main.command()
@click.argument("om")
@click.option("--against", required=True, metavar="SOURCE",
              help="The model the .om was compiled from: .onnx, .pt2 or a Hugging Face folder.")
@click.option("--inputs", "inputs_dir", default=None, metavar="DIR",
              help="A folder with <input name>.npy per model input (default: random, seeded).")
@click.option("--atol", type=float, default=1e-4, show_default=True, help="Absolute tolerance.")
@click.option("--rtol", type=float, default=1e-3, show_default=True, help="Relative tolerance.")
@click.option("--per-layer", "--per_layer", "per_layer", is_flag=True,
              help="Also compare intermediates at fusion boundaries and name the first op that diverges.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--trust-pickle", "--trust_pickle", "trust_pickle", is_flag=True, default=False,
              help="Load a .pt2 source whose payload needs pickle: this runs code from the file (refused by default).")
@click.option("--json", "as_json", is_flag=True, help="The report as one JSON object.")
@click.option("--diagnostics-format", "--diagnostics_format", "diagnostics_format", default="text",
              type=click.Choice(["text", "json"]))
@click.option("--debug", is_flag=True)
@handle_errors
def verify(om: str, against: str, inputs_dir: str | None, atol: float, rtol: float, per_layer: bool,
           seed: int, trust_pickle: bool, as_json: bool, diagnostics_format: str, debug: bool) -> None:
    """Run a .om and its source (onnxruntime, or torch) on the same inputs and compare the outputs:
    max abs and rel error and cosine per output; exit 1 past --atol/--rtol."""
    from npuc.tools.verify import render_report, report_json, verify_failure
    from npuc.tools.verify import verify as run_verify

    setup("warning", diagnostics_format)
    rep = run_verify(om, against, inputs_dir, atol, rtol, per_layer, seed, trust_pickle=trust_pickle)
    click.echo(json.dumps(report_json(rep), indent=2, sort_keys=True) if as_json else render_report(rep))
    if not rep.ok:
        raise verify_failure(rep)


@main.command("export-onnx")
@click.argument("om")
@click.argument("out")
@click.option("--program", default=None, help="Which program to export (prefill or decode); the first by default.")
@click.option("--weights", type=click.Choice(["auto", "embed", "external"]), default="auto", show_default=True,
              help="Weights in the .onnx (embed, below 2 GiB), in OUT.data beside it (external), "
                   "or embedded up to 1.5 GiB (auto).")
@click.option("--debug", is_flag=True)
@handle_errors
def export_onnx_cmd(om: str, out: str, program: str | None, weights: str, debug: bool) -> None:
    """Write a .om's optimised graph as ONNX (opset 18; fused ops in the custom domain npuc), to view in
    Netron. KV caches become inputs <state> and outputs <state>.out."""
    from npuc.tools.export_onnx import export_onnx

    click.echo(export_onnx(om, out, program=program, weights=weights).render())


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

    from npuc.runtime.executor import open_session

    parallel = _parallel(device)
    sess = open_session(om, device=device)
    feeds = {}
    leader = parallel is None or parallel.is_leader()
    if leader:  # rank 0 reads the inputs and hands them to the others
        for name, path in _parse_input_flag(inputs).items():
            try:
                feeds[name] = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as e:
                raise NpucError("NPUC-E0401", f"cannot read input {name!r} from {path!r}: {e}",
                                "inputs are .npy files written by numpy.save", exit_code=EXIT_IO) from None
    outs = sess.run(parallel.share(feeds) if parallel is not None else feeds, program)
    if parallel is not None:
        parallel.finish()
    if not leader:
        return
    os.makedirs(output_dir, exist_ok=True)
    kinds = {t.name: str(t.dtype) for t in sess._program(program).outputs}
    for name, t in outs.items():
        fname = "".join(c if c.isalnum() or c in "._-" else "_" for c in name) + ".npy"
        arr = t if isinstance(t, np.ndarray) else t.cpu().numpy()
        np.save(os.path.join(output_dir, fname), arr)
        shape = ",".join(map(str, t.shape))
        click.echo(f"{name}: {kinds[name]}[{shape}] -> {os.path.join(output_dir, fname)}")


def _parallel(device: str) -> Any:
    """runtime/parallel (torch.distributed) where this process is a rank of torchrun; None
    otherwise, so that a single-device run never imports torch."""
    if "WORLD_SIZE" not in os.environ:
        return None
    from npuc.runtime import parallel

    parallel.init_from_env(device)  # under torchrun: each rank runs its part of a --tp model
    return parallel


# One id, then more after a comma or spaces (a comma may have spaces around it). ASCII
# only: int() alone would also take "١٢", "+1", "1_0" and " 1 ".
_ID = r"[0-9]+"
_IDS = re.compile(rf"[ \t]*{_ID}(?:(?:[ \t]*,[ \t]*|[ \t]+){_ID})*[ \t]*", re.ASCII)


def _parse_ids(text: str) -> list[int]:
    if not _IDS.fullmatch(text):
        bad = next((t for t in re.split(r"[ \t]*,[ \t]*|[ \t]+", text.strip(" \t"))
                    if not re.fullmatch(_ID, t, re.ASCII)), text)
        what = "an empty item" if bad == "" else f"{bad!r} is not an ASCII decimal token id"
        raise NpucError("NPUC-E0125", f"--prompt-ids {text!r}: {what}",
                        "write non-negative decimal ids separated by commas or spaces, e.g. --prompt-ids 1,2,3",
                        exit_code=EXIT_USAGE)
    return [int(t) for t in re.findall(_ID, text, re.ASCII)]


def _speculative_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """generate's and serve's speculative-decoding flags (docs/serving.md)."""
    options = [
        click.option("--speculative", type=click.Choice(["ngram", "draft", "mtp", "off"]), default=None,
                     help="Speculative decoding where the .om has a verify program (--speculative_tokens): n-gram "
                          "prompt lookup, a draft model (--draft; the default where one is given) or the model's own MTP "
                          "layer (a .om compiled with --mtp: the default there, else ngram); "
                          "switched off by itself while its drafts are not accepted."),
        click.option("--draft", "draft", default=None, metavar="OM",
                     help="A draft model's .om (the same vocabulary and slots) for --speculative draft."),
        click.option("--ngram-max", "--ngram_max", "ngram_max", type=click.IntRange(1, 32), default=4,
                     show_default=True, help="The longest suffix the n-gram drafter looks up."),
        click.option("--ngram-min", "--ngram_min", "ngram_min", type=click.IntRange(1, 32), default=2,
                     show_default=True, help="The shortest suffix the n-gram drafter looks up."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _speculative_config(speculative: str | None, draft: str | None, ngram_min: int, ngram_max: int) -> Any:
    """The scheduler's SpeculativeConfig from the flags (NPUC-E0162, NPUC-E0163 for ones that
    do not go together)."""
    from npuc.apps.speculative import SpeculativeConfig

    spec = SpeculativeConfig(method=speculative or ("draft" if draft else "auto"), ngram_min=ngram_min,
                             ngram_max=ngram_max)
    spec.check()
    if draft is not None and spec.method != "draft":
        raise NpucError("NPUC-E0163", f"--draft with --speculative {spec.method}", "drop one of them",
                        exit_code=EXIT_USAGE)
    return spec


@main.command()
@click.argument("om")
@click.option("--prompt-ids", "--prompt_ids", "prompt_ids", metavar="ID,ID,...", multiple=True,
              help="A prompt as token ids, separated by commas or spaces (repeat it for several prompts).")
@click.option("--prompt", "prompt", default=None, metavar="TEXT", multiple=True,
              help="A prompt as text (the .om must hold a tokenizer; repeat it for several prompts).")
@click.option("--prompts", "prompts_file", default=None, metavar="FILE.jsonl",
              help='Prompts, one JSON a line: a list of token ids, {"prompt_ids": [...]} or {"prompt": "text"}.')
@click.option("--max-new-tokens", "--max_new_tokens", "max_new_tokens", type=click.IntRange(min=1), default=32,
              show_default=True)
@click.option("--ignore-eos", "--ignore_eos", "ignore_eos", is_flag=True, help="Do not stop at end-of-sequence.")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0: greedy; above 0: sampled from softmax(logits / T).")
@click.option("--top-p", "--top_p", "top_p", type=float, default=1.0, show_default=True,
              help="Keep the most likely tokens whose mass reaches P (1: off).")
@click.option("--top-k", "--top_k", "top_k", type=int, default=0, show_default=True,
              help="Keep the K most likely tokens (0: off).")
@click.option("--min-p", "--min_p", "min_p", type=float, default=0.0, show_default=True,
              help="Drop tokens less likely than P times the most likely one (0: off).")
@click.option("--repetition-penalty", "--repetition_penalty", "repetition_penalty", type=float, default=1.0,
              show_default=True, help="Over the prompt and the output: a logit > 0 divided by it, else multiplied.")
@click.option("--presence-penalty", "--presence_penalty", "presence_penalty", type=float, default=0.0,
              show_default=True)
@click.option("--frequency-penalty", "--frequency_penalty", "frequency_penalty", type=float, default=0.0,
              show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=None,
              help="Sample reproducibly (prompt i with seed S + i); without it, a random seed.")
@_speculative_options
@click.option("--stats", is_flag=True, help="Print the decode steps' counts (steps, drafted and accepted tokens, "
                                             "tokens per step) to stderr as JSON.")
@click.option("--device", default="cpu", help="cpu, or cuda when torch sees a GPU.")
@click.option("--tp", "tp", type=click.IntRange(min=1), default=None, metavar="N",
              help="Run a model compiled with --tp N as N local ranks (what torchrun --nproc-per-node N does).")
@click.option("--debug", is_flag=True)
@handle_errors
def generate(om: str, prompt_ids: tuple[str, ...], prompt: tuple[str, ...], prompts_file: str | None,
             max_new_tokens: int, ignore_eos: bool, temperature: float, top_p: float, top_k: int, min_p: float,
             repetition_penalty: float, presence_penalty: float, frequency_penalty: float, seed: int | None,
             speculative: str | None, draft: str | None, ngram_max: int, ngram_min: int, stats: bool,
             device: str, tp: int | None, debug: bool) -> None:
    """Decoding with a .om compiled with --max_seq_len: greedy, or sampled (--temperature
    above 0, and the filters and penalties; docs/serving.md). One prompt: prints the new
    token ids (and the text, for a text prompt). Several (repeated flags, or --prompts):
    decodes them together over the model's slots (--input_shape input_ids:B,S compiles B)
    and prints one JSON line each, in order: {"index", "token_ids"[, "text"]}."""
    from npuc.apps.generate import generation_info, load_tokenizer
    from npuc.apps.sampling import SamplingParams
    from npuc.apps.sampling import check as check_sampling
    from npuc.apps.scheduler import generate_many
    from npuc.apps.speculative import SpeculationStats
    from npuc.runtime.executor import open_session

    if tp is not None and tp > 1 and "WORLD_SIZE" not in os.environ:
        from npuc.runtime import parallel as launcher

        sys.exit(launcher.launch(tp, _without_tp(sys.argv[1:])))
    parallel = _parallel(device)
    leader = parallel is None or parallel.is_leader()
    items = _prompt_items(prompt_ids, prompt, prompts_file) if leader else []  # usage errors before the load
    sess = open_session(om, device=device)
    encode = decode = None
    if leader and any(isinstance(p, str) for p in items):
        encode, decode = load_tokenizer(sess)
    ids = [encode(p) if isinstance(p, str) and encode is not None else p for p in items]
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                              repetition_penalty=repetition_penalty, seed=seed)
    if not sampling.plain and seed is None:  # one seed for every rank of a --tp run
        sampling = replace(sampling, seed=secrets.randbits(63))
    if parallel is not None:
        ids, sampling = parallel.share((ids, sampling))  # rank 0's; every rank runs the same steps
    check_sampling(sampling, generation_info(sess).vocab)
    spec = _speculative_config(speculative, draft, ngram_min, ngram_max)
    draft_sess = open_session(draft, device=device) if draft is not None else None
    counts = SpeculationStats()
    outs = generate_many(sess, [list(p) for p in ids], max_new_tokens, ignore_eos, sampling, spec, counts,
                         draft_sess)
    if stats and leader:
        click.echo(json.dumps(counts.as_dict()), err=True)
    if parallel is not None:
        parallel.finish()
    if not leader:
        return
    if len(items) == 1 and prompts_file is None:
        click.echo(" ".join(map(str, outs[0])))
        if decode is not None:
            click.echo(decode(outs[0]))
        return
    for i, (item, out) in enumerate(zip(items, outs, strict=True)):
        line: dict[str, Any] = {"index": i, "token_ids": out}
        if isinstance(item, str) and decode is not None:
            line["text"] = decode(out)
        click.echo(json.dumps(line))


@main.command()
@click.argument("om")
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-queue", "--max_queue", "max_queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a slot; past that, 429 with Retry-After.")
@click.option("--device", default="cpu", help="cpu, or cuda when torch sees a GPU.")
@click.option("--tool-call-parser", "--tool_call_parser", "tool_parser",
              type=click.Choice(["hermes", "llama3_json", "mistral"]), default=None,
              help="The tool-call format the model writes (default: read from its chat template).")
@_speculative_options
@click.option("--debug", is_flag=True)
@handle_errors
def serve(om: str, host: str, port: int, max_queue: int, device: str, tool_parser: str | None,
          speculative: str | None, draft: str | None, ngram_max: int, ngram_min: int, debug: bool) -> None:
    """An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /health,
    /metrics) over a .om compiled with --max_seq_len; its slots decode requests together
    (docs/serving.md). Needs npuc[serve]."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise NpucError("NPUC-E0104", "npuc serve needs Starlette and uvicorn", "pip install 'npuc[serve]'",
                        exit_code=EXIT_USAGE) from None
    spec = _speculative_config(speculative, draft, ngram_min, ngram_max)
    from npuc.apps.serve import run

    run(om, host, port, max_queue, device, tool_parser, spec, draft)


def _without_tp(argv: Sequence[str]) -> list[str]:
    """`argv` without its --tp N / --tp=N (the ranks are launched with the rest)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--tp":
            skip = True
        elif not a.startswith("--tp="):
            out.append(a)
    return out


def _prompt_items(prompt_ids: Sequence[str], prompts: Sequence[str], path: str | None) -> list[list[int] | str]:
    """The prompts: token id lists, or texts for the stored tokenizer."""
    given = [bool(prompt_ids), bool(prompts), path is not None]
    if sum(given) != 1:
        raise NpucError("NPUC-E0125", "give the prompts one way: --prompt-ids, --prompt or --prompts",
                        "npuc generate model.om --prompt-ids 1,2,3 --max-new-tokens 32", exit_code=EXIT_USAGE)
    if path is None:
        return [_parse_ids(t) for t in prompt_ids] if prompt_ids else list(prompts)
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise NpucError("NPUC-E0125", f"--prompts {path!r} cannot be read: {getattr(e, 'strerror', None) or e}",
                        "give a UTF-8 JSON Lines file", exit_code=EXIT_USAGE) from None
    items: list[list[int] | str] = []
    for n, line in lines:
        try:
            v = json.loads(line)
        except ValueError:
            v = None
        if isinstance(v, dict) and set(v) == {"prompt"} and isinstance(v["prompt"], str):
            items.append(v["prompt"])
            continue
        ids = v.get("prompt_ids") if isinstance(v, dict) and set(v) == {"prompt_ids"} else v
        if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
            raise NpucError("NPUC-E0125", f"--prompts {path}:{n}: {line.strip()[:80]!r} is not a list of token ids, "
                            '{"prompt_ids": [...]} or {"prompt": "text"}', 'write e.g. {"prompt_ids": [1, 2, 3]}',
                            exit_code=EXIT_USAGE)
        items.append(ids)
    if not items:
        raise NpucError("NPUC-E0125", f"--prompts {path!r} holds no prompt", "write one JSON a line",
                        exit_code=EXIT_USAGE)
    return items


@main.command()
@click.argument("om")
@click.option("--summary", is_flag=True, help="Only the header and op counts.")
@click.option("--json", "as_json", is_flag=True,
              help="The section table and the whole model definition as JSON (ignores --summary).")
@click.option("--rank", type=int, default=None, metavar="R",
              help="A tensor-parallel model (--tp): list rank R's program (default 0).")
@click.option("--debug", is_flag=True)
@handle_errors
def dump(om: str, summary: bool, as_json: bool, rank: int | None, debug: bool) -> None:
    """Print the compiled program: ops, shapes and planned offsets."""
    if as_json:
        from npuc.tools.om_tools import dump_json

        click.echo(dump_json(om, rank))
        return
    from npuc.tools.listing import render_listing

    click.echo(render_listing(om, summary=summary, rank=rank))


@main.command()
@click.argument("om")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with sorted keys.")
@click.option("--debug", is_flag=True)
@handle_errors
def info(om: str, as_json: bool, debug: bool) -> None:
    """Summarise a .om: sections, weight/arena/lower-bound bytes, op and unit counts, metadata."""
    from npuc.tools.om_tools import model_info, render_info

    facts = model_info(om)
    click.echo(json.dumps(facts, indent=2, sort_keys=True) if as_json else render_info(om, facts))


@main.command()
@click.argument("om")
@click.option("--debug", is_flag=True)
@handle_errors
def validate(om: str, debug: bool) -> None:
    """Check a .om end to end: checksums, tensor bounds, and the memory plan re-validated."""
    from npuc.tools.om_tools import validate_om

    click.echo(validate_om(om))


if __name__ == "__main__":
    main()
