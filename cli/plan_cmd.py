"""`npuc plan`: what a compile would hold on each rank, without weights or output.

    npuc plan deepseek-v3/config.json --input_shape input_ids:1,128 --max_seq_len 4096 --tp 8 --ep 8

A config alone is enough (every weight is a shape and a dtype, never read): the model
is traced, fused, split and planned exactly as `npuc compile` would, and each rank's
weight bytes (and how many of them every rank holds whole), arena, KV cache, KV bytes
per token and the bytes its collectives send per decode step are printed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

import click

from npuc.cli.diagnostics import handle_errors, setup
from npuc.errors import EXIT_USAGE, NpucError


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def render_plan(path: str, plans: list[Any], device_gib: float | None) -> str:
    rows = [("rank", "weights", "replicated", "arena", "KV cache", "KV/token", "total", "decode wire", "collectives")]
    for p in plans:
        dec = "decode" if "decode" in p.wire_bytes else next(iter(p.wire_bytes))
        rows.append((str(p.rank), _gib(p.weights_bytes), _gib(p.replicated_bytes), _gib(p.arena_bytes),
                     _gib(p.state_bytes), f"{p.kv_bytes_per_token:,} B", _gib(p.total_bytes),
                     f"{p.wire_bytes[dec]:,} B", str(p.collectives[dec])))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [f"plan of {path}: {len(plans)} rank{'s' if len(plans) > 1 else ''}"]
    lines += ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(r, widths,
                                                                                              strict=True)))
              for r in rows]
    pool = max(p.prefix_pool_bytes for p in plans)
    if pool:
        lines.append(f"of the KV cache: a prefix pool of {_gib(pool)} (--prefix_cache)")
    worst = max(p.total_bytes for p in plans)
    total_weights = sum(p.weights_bytes for p in plans) - (len(plans) - 1) * plans[0].replicated_bytes
    lines.append(f"weights over all ranks: {_gib(total_weights)} (the replicated part counted once); "
                 f"largest rank: {_gib(worst)}")
    cap = device_gib * 2**30 if device_gib is not None else plans[0].capacity_bytes
    what = f"a {device_gib:g} GiB device" if device_gib is not None else "the target's memory"
    lines.append(f"{'fits' if worst <= cap else 'does not fit'} {what} ({_gib(int(cap))}) per rank"
                 + ("" if worst <= cap else f": about {math.ceil(worst / cap * len(plans))} ranks of it would be "
                    "needed at this split's proportions"))
    return "\n".join(lines)


@click.command("plan")
@click.argument("model")
@click.option("--input_shape", "--input-shape", "input_shape", required=True, metavar='"NAME:D0,D1;..."')
@click.option("--max_seq_len", "--max-seq-len", "max_seq_len", type=int, default=None, metavar="N")
@click.option("--prefix_cache", "--prefix-cache", "prefix_cache", type=int, default=None, metavar="P",
              help="With --max_seq_len: a pool of P prompt prefixes in the state (as npuc compile's).")
@click.option("--tp", "tp", type=int, default=None, metavar="N", help="Ranks (tensor parallel).")
@click.option("--ep", "ep", type=int, default=None, metavar="N", help="--ep N: experts split across the ranks.")
@click.option("--quant_type", "--quant-type", "quant_type", default=None, metavar="w8a16|w4a16")
@click.option("--group_size", "--group-size", "group_size", type=int, default=None)
@click.option("--soc_version", "--soc-version", "soc_version", default=None, metavar="TARGET")
@click.option("--device-memory", "--device_memory", "device_gib", type=float, default=None, metavar="GiB",
              help="Say whether each rank fits a device of this many GiB (default: the target's capacity).")
@click.option("--json", "json_out", default=None, metavar="FILE", help="Also write the plan as JSON.")
@click.option("--diagnostics-format", "--diagnostics_format", "diagnostics_format", default="text",
              type=click.Choice(["text", "json"]))
@click.option("--debug", is_flag=True)
@handle_errors
def plan_cmd(model: str, input_shape: str, max_seq_len: int | None, prefix_cache: int | None, tp: int | None,
             ep: int | None, quant_type: str | None, group_size: int | None, soc_version: str | None,
             device_gib: float | None, json_out: str | None, diagnostics_format: str, debug: bool) -> None:
    """Plan MODEL (a checkpoint, or its config.json alone) over --tp ranks: each rank's
    weights, arena, KV cache and collective traffic, and whether it fits; writes no .om."""
    setup("warning", diagnostics_format)
    from npuc.compiler import instrument
    from npuc.compiler.driver import compile_model

    if device_gib is not None and not device_gib > 0:
        raise NpucError("NPUC-E0124", f"--device-memory {device_gib!r} is not valid", "GiB, above 0",
                        exit_code=EXIT_USAGE)
    plans: list[Any] = []
    compile_model(model, input_shape=input_shape, output="plan", max_seq_len=max_seq_len,
                  prefix_cache=prefix_cache, tp=tp, ep=ep,
                  quant_type=quant_type, group_size=group_size, soc_version=soc_version, plan=plans)
    if json_out:
        instrument.ensure_parent(json_out, "--json")
        instrument.write_text_atomic(json_out, json.dumps([asdict(p) | {"total_bytes": p.total_bytes}
                                                          for p in plans], indent=2) + "\n", "--json")
    click.echo(render_plan(model, plans, device_gib))
