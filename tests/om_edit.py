"""`.om` files edited the way an attacker would: the model definition changed, every checksum
re-sealed, so that only the runtime's own checks stand between the file and a crash."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from npuc.backend.om_format import WEIGHTS_ALIGN, OmFile, OmWriter
from npuc.backend.om_sections import MODEL_SECTIONS, join_model, split_model

Edit = Callable[[Any], None]


def rewrite(src: Path, dst: Path, edit: Edit | None = None, sections: dict[str, bytes] | None = None) -> Path:
    """A copy of `src` with its model definition edited and sections replaced or added,
    every checksum valid (as an attacker re-seals them)."""
    with OmFile.open(src) as om:
        m = join_model(str(src), {name: bytes(om.section(name)) for name in MODEL_SECTIONS})
        if edit is not None:
            edit(m)
        extra = {n: bytes(om.section(n)) for n in om.section_names()
                 if n not in MODEL_SECTIONS and n not in ("weights", "weights.xxh3", "modeldef")}  # the writer's own
        extra.update(sections or {})
        with om.section("weights") as w, OmWriter(dst) as out:
            for name, data in split_model(m).items():
                out.add_section(name, data)
            for name, data in extra.items():
                out.add_section(name, data)
            out.add_section("weights", w, WEIGHTS_ALIGN)
    return dst
