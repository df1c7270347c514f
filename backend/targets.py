"""Targets are data: a TOML file per target (see backend/target_files/npu.toml).

`--soc_version NAME` picks a built-in; `--soc_version path/to/target.toml` reads a
user's own file with the same keys. Every key is checked, and a bad file is
refused naming the file and the key.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from npuc.errors import EXIT_COMPILE, EXIT_IO, EXIT_USAGE, NpucError
from npuc.ir import DType, Graph

BUILTIN_DIR = Path(__file__).parent / "target_files"
DEFAULT_TARGET = "npu"


@dataclass(frozen=True)
class Target:
    name: str
    alignment: int  # bytes; every arena buffer starts on this boundary
    matrix_tile: int = 16
    weight_alignment: int = 64
    max_head_dim: int = 256
    vector_width: int = 256
    capacity_bytes: int = 1 << 40
    bandwidth_gbps: float = 100.0
    dtypes: frozenset[DType] = frozenset(DType)
    # The activations of a quantized product (w8a16, w4a16) where the precision mode keeps
    # the model's dtype: the matrix unit's 16-bit input, or None (the model's own dtype).
    quant_activations: DType | None = DType.bf16
    description: str = ""
    path: str = ""


_KEYS: dict[tuple[str, ...], type | tuple[type, ...]] = {
    ("name",): str, ("matrix", "tile"): int, ("vector", "width_bytes"): int, ("memory", "alignment"): int,
    ("memory", "weight_alignment"): int, ("memory", "capacity_bytes"): int,
    ("memory", "bandwidth_gbps"): (int, float), ("dtypes", "supported"): list, ("attention", "max_head_dim"): int,
}


# matrix.quant_activations (optional; default bf16): "model" keeps the model's own dtype.
_QUANT_ACTIVATIONS: dict[str, DType | None] = {"bf16": DType.bf16, "f16": DType.f16, "model": None}


def builtin_targets() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def _bad(path: str, key: str, why: str) -> NpucError:
    return NpucError("NPUC-E0118", f"target file {path!r}: {key} {why}",
                     f"see {BUILTIN_DIR / 'npu.toml'} for every key", exit_code=EXIT_USAGE)


def load_target(path: str | os.PathLike[str]) -> Target:
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise NpucError("NPUC-E0401", f"cannot read target file {p!r}: {e.strerror}",
                        "give a built-in name or a readable .toml file", exit_code=EXIT_IO) from None
    except tomllib.TOMLDecodeError as e:
        raise _bad(p, "the file", f"is not valid TOML ({e})") from None
    values: dict[tuple[str, ...], Any] = {}
    for keys, kind in _KEYS.items():
        node: Any = data
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                raise _bad(p, ".".join(keys), "is missing")
            node = node[k]
        if not isinstance(node, kind) or isinstance(node, bool):
            raise _bad(p, ".".join(keys), f"must be a {getattr(kind, '__name__', 'number')}, not {node!r}")
        values[keys] = node
    for keys in (("matrix", "tile"), ("memory", "alignment"), ("memory", "weight_alignment")):
        v = values[keys]
        if v < 1 or (keys[0] == "memory" and v & (v - 1)):
            raise _bad(p, ".".join(keys), f"must be a positive{' power of two' if keys[0] == 'memory' else ''}, "
                       f"not {v}")
    names = {d.value: d for d in DType}
    unknown = [d for d in values[("dtypes", "supported")] if d not in names]
    if unknown:
        raise _bad(p, "dtypes.supported", f"has unknown dtypes {unknown} (known: {sorted(names)})")
    qact = data.get("matrix", {}).get("quant_activations", "bf16") if isinstance(data.get("matrix"), dict) else "bf16"
    if qact not in _QUANT_ACTIVATIONS:
        raise _bad(p, "matrix.quant_activations", f"must be one of {sorted(_QUANT_ACTIVATIONS)}, not {qact!r}")
    return Target(
        quant_activations=_QUANT_ACTIVATIONS[qact],
        name=values[("name",)], alignment=values[("memory", "alignment")], matrix_tile=values[("matrix", "tile")],
        weight_alignment=values[("memory", "weight_alignment")], max_head_dim=values[("attention", "max_head_dim")],
        vector_width=values[("vector", "width_bytes")], capacity_bytes=values[("memory", "capacity_bytes")],
        bandwidth_gbps=float(values[("memory", "bandwidth_gbps")]),
        dtypes=frozenset(names[d] for d in values[("dtypes", "supported")]),
        description=str(data.get("description", "")), path=p)


def get_target(name: str | None) -> Target:
    name = name or DEFAULT_TARGET
    if name.endswith(".toml") or os.sep in name:
        return load_target(name)
    if name not in builtin_targets():
        raise NpucError("NPUC-E0105", f"unknown --soc_version {name!r}",
                        f"built-in targets: {', '.join(builtin_targets())}, or a path to a target .toml",
                        exit_code=EXIT_USAGE)
    return load_target(BUILTIN_DIR / f"{name}.toml")


def check_fits(target: Target, weights: int, arena: int, state: int = 0) -> None:
    """Refuse a model that does not fit the target's memory, with the breakdown."""
    need = weights + arena + state
    if need > target.capacity_bytes:
        raise NpucError("NPUC-E0119", f"the model needs {need:,} bytes (weights {weights:,} + arena {arena:,} + "
                        f"state {state:,}) but target {target.name!r} has {target.capacity_bytes:,}",
                        "use a smaller --input_shape, a lower precision (--precision_mode), or a bigger target",
                        exit_code=EXIT_COMPILE)


def dtypes_used(graphs: Sequence[Graph]) -> dict[str, set[str]]:
    """dtype name -> the values of that dtype, for the target's dtype check."""
    used: dict[str, set[str]] = {}
    for g in graphs:
        for v in g.values():
            used.setdefault(v.type.dtype.value, set()).add(v.name)
    return used


def check_dtypes(target: Target, used: dict[str, set[str]]) -> None:
    """Refuse dtypes the target cannot hold; `used` maps dtype names to the values using them."""
    bad = {d: names for d, names in used.items() if DType(d) not in target.dtypes}
    if bad:
        listing = "; ".join(f"{d}: {', '.join(sorted(n)[:3])}{'...' if len(n) > 3 else ''}"
                            for d, n in sorted(bad.items()))
        raise NpucError("NPUC-E0122", f"target {target.name!r} does not support {', '.join(sorted(bad))} ({listing})",
                        "choose --precision_mode to convert, or --soc_version cpu", exit_code=EXIT_COMPILE)
