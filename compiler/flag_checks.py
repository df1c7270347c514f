"""The compile options' checks (`npuc compile` flags that shape the programs): each value,
and the flags it needs beside it, refused with a coded usage error before any work is done.
compiler/driver.py applies them; compiler/precheck.py (`npuc compile --check`) collects them."""

from __future__ import annotations

from typing import Any

from npuc.errors import EXIT_USAGE, NpucError
from npuc.ir import DType, Graph

__all__ = ["INPUT_FORMATS", "KV_CACHE_DTYPES", "KV_CACHE_DTYPE_NAMES", "MAX_PREFIX_CACHE", "MAX_SPECULATIVE_TOKENS",
           "PREFILL_LOGITS", "VERIFY", "check_decode_tokens", "check_input_format", "check_input_layout",
           "check_kv_cache_dtype", "check_max_seq_len", "check_prefill_logits", "check_prefix_cache",
           "check_speculative_tokens", "MIXED", "check_mixed_tokens"]


def check_max_seq_len(max_seq_len: Any) -> None:
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)
                                    or max_seq_len < 1):
        raise NpucError("NPUC-E0124", f"--max_seq_len {max_seq_len!r} is not a positive integer",
                        "give the longest sequence (prompt + generated tokens) to cache, e.g. --max_seq_len 2048",
                        exit_code=EXIT_USAGE)


def check_decode_tokens(decode_tokens: Any, max_seq_len: int | None) -> None:
    if decode_tokens is None:
        return
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) or not 1 <= decode_tokens <= 64:
        raise NpucError("NPUC-E0124", f"--decode_tokens {decode_tokens!r} is not an integer from 1 to 64",
                        "give the tokens of each slot a decode step runs, e.g. --decode_tokens 4", exit_code=EXIT_USAGE)
    if max_seq_len is None:
        raise NpucError("NPUC-E0124", "--decode_tokens needs --max_seq_len", "add --max_seq_len N",
                        exit_code=EXIT_USAGE)


# The program --speculative_tokens adds (apps/speculative.py runs it).
VERIFY = "verify"
MAX_SPECULATIVE_TOKENS = 15


def _check_count(flag: str, v: Any, most: int, hint: str, max_seq_len: int | None, tp: Any) -> None:
    """An option that needs --max_seq_len and no --tp, whose value is an integer 1..most."""
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
        raise NpucError("NPUC-E0124", f"{flag} {v!r} is not an integer from 1 to {most}", hint, exit_code=EXIT_USAGE)
    if max_seq_len is None:
        raise NpucError("NPUC-E0124", f"{flag} needs --max_seq_len", "add --max_seq_len N", exit_code=EXIT_USAGE)
    if tp is not None and tp > 1:
        raise NpucError("NPUC-E0124", f"{flag} with --tp is not supported yet", "compile without one of them",
                        exit_code=EXIT_USAGE)


def check_speculative_tokens(k: Any, max_seq_len: int | None, tp: Any = None) -> None:
    _check_count("--speculative_tokens", k, MAX_SPECULATIVE_TOKENS,
                 "give the drafted tokens a verify step checks, e.g. --speculative_tokens 7", max_seq_len, tp)


# The program --mixed_tokens adds (apps/scheduler.py runs it while a prompt is admitted).
MIXED = "mixed"
MAX_MIXED_TOKENS = 64


def check_mixed_tokens(c: Any, max_seq_len: int | None, tp: Any = None) -> None:
    _check_count("--mixed_tokens", c, MAX_MIXED_TOKENS,
                 "give the prompt tokens a mixed step runs beside one token of each slot, e.g. --mixed_tokens 4",
                 max_seq_len, tp)


MAX_PREFIX_CACHE = 1024


def check_prefix_cache(n: Any, max_seq_len: int | None, tp: Any = None) -> None:
    _check_count("--prefix_cache", n, MAX_PREFIX_CACHE,
                 "give the prompt prefixes to keep, e.g. --prefix_cache 4 (each holds up to --max_seq_len positions "
                 "of the KV cache: `npuc info` shows the bytes)", max_seq_len, tp)


# --kv_cache_dtype's choices: auto (None: the model's dtype, converted by the precision mode)
# and the cache layouts of ir/fused_ops.py (int8: packed rows with their scales).
KV_CACHE_DTYPES: dict[str, DType | None] = {"auto": None, "f32": DType.f32, "bf16": DType.bf16,
                                            "f16": DType.f16, "int8": DType.i8}
KV_CACHE_DTYPE_NAMES = {dt: name for name, dt in KV_CACHE_DTYPES.items() if dt is not None}


def check_kv_cache_dtype(value: str | None, max_seq_len: int | None) -> DType | None:
    """--kv_cache_dtype as the KV-cache pass takes it: None for auto (or not given)."""
    if value is None:
        return None
    v = str(value).strip().lower()
    if v not in KV_CACHE_DTYPES:
        raise NpucError("NPUC-E0133", f"--kv_cache_dtype {value!r} is not one npuc knows",
                        "use one of: " + ", ".join(KV_CACHE_DTYPES), exit_code=EXIT_USAGE)
    dt = KV_CACHE_DTYPES[v]
    if dt is not None and max_seq_len is None:
        raise NpucError("NPUC-E0133", f"--kv_cache_dtype {v} needs --max_seq_len: without it the .om has no KV "
                        "cache", "add --max_seq_len N, or leave --kv_cache_dtype out", exit_code=EXIT_USAGE)
    return dt


PREFILL_LOGITS = ("last", "all")


def check_prefill_logits(value: str | None, max_seq_len: int | None) -> str | None:
    """--prefill_logits as given (None: not given), checked. It shapes the prefill program
    of a --max_seq_len compile; a single program computes every row, so "last" without one
    is a mistake and "all" says nothing."""
    if value is None:
        return None
    v = str(value).strip().lower()
    if v not in PREFILL_LOGITS:
        raise NpucError("NPUC-E0129", f"--prefill_logits {value!r} is not one npuc knows",
                        "use last (the logits of the last_token row only) or all (every row)", exit_code=EXIT_USAGE)
    if v == "last" and max_seq_len is None:
        raise NpucError("NPUC-E0129", "--prefill_logits last needs --max_seq_len: without it the .om has one "
                        "program, which computes every row", "add --max_seq_len N, or leave --prefill_logits out",
                        exit_code=EXIT_USAGE)
    return v


INPUT_FORMATS = ("ND", "NCHW")


def check_input_format(fmt: str | None) -> str:
    f = (fmt or "ND").upper()
    if f not in INPUT_FORMATS:
        raise NpucError("NPUC-E0128", f"--input_format {fmt!r} is not one npuc knows",
                        f"use one of {', '.join(INPUT_FORMATS)} (ND for token ids and other plain tensors)",
                        exit_code=EXIT_USAGE)
    return f


def check_input_layout(g: Graph, fmt: str) -> None:
    """NCHW names the axes of 4-D inputs; saying it of another input is a mistake."""
    if fmt == "NCHW":
        bad = [f"{v.name}: {v.type}" for v in g.inputs if v.type.rank != 4]
        if bad:
            raise NpucError("NPUC-E0128", f"--input_format NCHW needs 4-D inputs, but {', '.join(bad)}",
                            "use --input_format ND", exit_code=EXIT_USAGE)
