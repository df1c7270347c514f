"""Write a lowered model as a `.om` file (container layout: `om_format`)."""

from __future__ import annotations

from npuc.backend.lower import Lowered, weight_chunks
from npuc.backend.om_format import WEIGHTS_ALIGN, OmWriter

MODELDEF = "modeldef"
WEIGHTS = "weights"


def write_om(low: Lowered, path: str) -> None:
    """Atomically write `path`: a failure leaves no partial file and any older file intact."""
    with OmWriter(path) as w:
        w.add_section(MODELDEF, low.model.SerializeToString(deterministic=True))
        w.add_streamed_section(WEIGHTS, weight_chunks(low), low.weights_bytes, WEIGHTS_ALIGN)
