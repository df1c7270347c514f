"""Reading weights from their files in bounded pieces.

Sources whose bytes already sit in a file in the layout the `.om` wants (ONNX
external data, safetensors) hand the backend file ranges, so a weight is copied
into the `.om` 8 MiB at a time and never held whole in memory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

from npuc.errors import EXIT_IO, NpucError

CHUNK_BYTES = 8 << 20


def file_range_chunks(path: str, offset: int, length: int, what: str) -> Iterator[bytes]:
    try:
        size = os.path.getsize(path)
        if offset + length > size:
            raise NpucError("NPUC-E0404", f"{what}: {path!r} has {size} bytes, the weight needs bytes "
                            f"{offset}..{offset + length}", "the weights file is truncated", exit_code=EXIT_IO)
        with open(path, "rb") as f:
            f.seek(offset)
            left = length
            while left:
                chunk = f.read(min(CHUNK_BYTES, left))
                if not chunk:
                    raise NpucError("NPUC-E0404", f"{what}: {path!r} ended early", "the weights file is truncated",
                                    exit_code=EXIT_IO)
                left -= len(chunk)
                yield chunk
    except OSError as e:
        raise NpucError("NPUC-E0401", f"cannot read {path!r} ({what}): {e.strerror}",
                        "keep the weights files beside the model", exit_code=EXIT_IO) from None


_ST_DTYPES = {"F64": "f64", "F32": "f32", "F16": "f16", "BF16": "bf16", "I64": "i64", "I32": "i32",
              "I16": "i16", "I8": "i8", "U8": "u8", "BOOL": "bool"}


def safetensors_layout(path: str) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """key -> (npuc dtype name or '', shape, absolute offset, length), from the file's header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[key] = (_ST_DTYPES.get(info["dtype"], ""), tuple(info["shape"]), 8 + n + start, end - start)
    return out
