"""Write a lowered model as a `.om` file (container layout: `om_format`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from npuc.backend.lower import Lowered, weight_chunks
from npuc.backend.om_format import WEIGHTS_ALIGN, OmWriter
from npuc.backend.om_sections import split_model

WEIGHTS = "weights"


def write_om(low: Lowered, path: str, extra: Mapping[str, bytes] | None = None,
             on_bytes: Callable[[int], None] | None = None) -> None:
    """Atomically write `path`: a failure leaves no partial file and any older file intact.
    `extra` sections (a tokenizer) go between the model definition and the weights."""
    with OmWriter(path) as w:
        for name, data in split_model(low.model).items():
            w.add_section(name, data)
        for name in sorted(extra or {}):
            w.add_section(name, (extra or {})[name])
        chunks = weight_chunks(low)
        if on_bytes is not None:
            chunks = _counted(chunks, on_bytes)
        w.add_streamed_section(WEIGHTS, chunks, low.weights_bytes, WEIGHTS_ALIGN, first=low.image is not None)


def _counted(chunks: Iterator[bytes | memoryview], report: Callable[[int], None]) -> Iterator[bytes | memoryview]:
    for c in chunks:
        yield c
        report(len(c))
