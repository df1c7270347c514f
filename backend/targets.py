"""Target descriptions. v0 knows two built-ins; target files come later."""

from __future__ import annotations

from dataclasses import dataclass

from npuc.errors import EXIT_USAGE, NpucError


@dataclass(frozen=True)
class Target:
    name: str
    alignment: int  # bytes; every arena buffer starts on this boundary
    matrix_tile: int = 16
    weight_alignment: int = 64
    max_head_dim: int = 256


TARGETS = {
    "npu": Target("npu", alignment=512),
    "cpu": Target("cpu", alignment=64, matrix_tile=1),
}
DEFAULT_TARGET = "npu"


def get_target(name: str | None) -> Target:
    name = name or DEFAULT_TARGET
    if name not in TARGETS:
        raise NpucError("NPUC-E0105", f"unknown --soc_version {name!r}",
                        f"built-in targets: {', '.join(sorted(TARGETS))}", exit_code=EXIT_USAGE)
    return TARGETS[name]
