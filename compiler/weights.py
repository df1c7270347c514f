"""Reading weights from their files in bounded pieces.

Sources whose bytes already sit in a file in the layout the `.om` wants (ONNX
external data, safetensors) hand the backend file ranges, so a weight is copied
into the `.om` 8 MiB at a time and never held whole in memory.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Iterator

from npuc.errors import EXIT_IO, NpucError

CHUNK_BYTES = 8 << 20


def file_range_chunks(path: str, offset: int, length: int, what: str) -> Iterator[bytes]:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a device or fifo has no end, and opening a fifo blocks
            raise NpucError("NPUC-E0401", f"{what}: {path!r} is not a regular file",
                            "keep the weights files beside the model", exit_code=EXIT_IO)
        size = st.st_size
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


_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_layout(path: str) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """key -> (npuc dtype name or '', shape, absolute offset, length), from the file's header alone.
    A header that is not what the format says (a regular file, a sane header length, JSON
    whose ranges lie inside the file) is refused, never read past."""
    def bad(why: str) -> NpucError:
        return NpucError("NPUC-E0407", f"{path!r} is not a valid safetensors file: {why}",
                         "save the checkpoint with save_pretrained or safetensors", exit_code=EXIT_IO)

    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise bad("not a regular file")
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < n <= min(_MAX_HEADER, st.st_size - 8):
                raise bad(f"a header of {n} bytes in a file of {st.st_size}")
            header = json.loads(f.read(n))
        out = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= st.st_size - 8 - n) \
                    or any(d < 0 for d in shape):
                raise bad(f"tensor {str(key)[:80]!r} lies outside the file or has a negative dim")
            size = _ST_ITEMSIZE.get(info["dtype"])
            if size is not None and end - start != size * math.prod(shape):
                raise bad(f"tensor {str(key)[:80]!r} is {info['dtype']}{list(shape)} in {end - start} bytes")
            out[key] = (_ST_DTYPES.get(info["dtype"], ""), shape, 8 + n + start, end - start)
        return out
    except NpucError:
        raise
    except OSError as e:
        raise NpucError("NPUC-E0401", f"cannot read {path!r}: {e.strerror}", "check the file",
                        exit_code=EXIT_IO) from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # not JSON, or not the format's fields
        raise bad(f"{type(e).__name__}: {str(e)[:120]}") from None
