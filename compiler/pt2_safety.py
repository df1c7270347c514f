"""Refuse `.pt2` archives that would run code from the file while torch loads them.

`torch.export.load` is pickle under the hood. In torch 2.13 a loaded archive runs
code from the file when it holds any of:

    data/weights/<cfg>.json   "use_pickle": true          -> torch.load(weights_only=False)
    data/constants/<cfg>.json "use_pickle": true, or a path_name custom_obj_* / opaque_obj_*
                                                          -> torch.load(weights_only=False) / pickle.loads
    data/weights/<m>.pt, data/constants/<m>.pt (legacy)   -> torch.load, falling back to weights_only=False
    data/sample_inputs/<m>.pt not loadable weights-only   -> the same fallback
    data/aotinductor/...                                  -> a native library, dlopen'ed
    models/<m>.json "expr_str"                            -> sympy.sympify, which is eval
    models/<m>.json "guards_code"                         -> exec'ed by ep.module()
    models/<m>.json a node target that is not an operator -> any torch.* callable, called on run

A plain `torch.export.save` of an nn.Module holds none of these: raw tensor bytes
under data/weights/ and data/constants/ that JSON configs describe (use_pickle
false), models/model.json with aten targets, data/sample_inputs/model.pt (a
weights-only-loadable torch.save), and small version files. `check_pt2` reads the
archive with `zipfile`, bounded, and accepts only that; everything else is refused
with NPUC-E0318 naming the entry, unless the user passes `--trust-pickle`.
"""

from __future__ import annotations

import io
import json
import logging
import re
import zipfile
from collections.abc import Iterator
from typing import Any

from npuc.errors import EXIT_IO, EXIT_UNSUPPORTED, NpucError

E_PICKLE = "NPUC-E0318"
E_READ = "NPUC-E0407"

# Bounds on what the check itself reads: a zip that claims more is refused, not read.
MAX_ENTRIES = 100_000
MAX_JSON_BYTES = 256 << 20
MAX_SAMPLE_INPUT_BYTES = 256 << 20
MAX_TOTAL_BYTES = 1 << 40
MAX_RATIO = 200  # deflated entries: torch stores, so a high ratio is a zip bomb

_METADATA = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id",
             ".format_version", ".storage_alignment"}
_PAYLOAD_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_TENSOR_PREFIXES = ("weight_", "tensor_")

# What torch's sympify and guard exec may see: integers, arithmetic, comparisons, symbol
# names and the sympy functions torch's deserializer registers. No strings, attributes
# (but .size()/.stride() in guards), subscripts (but L['x']), dunders or builtins.
_EXPR_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?(?:e[+-]?\d+)?)|([A-Za-z_]\w*)|('[A-Za-z0-9_]*')"
                         r"|(\*\*|//|==|!=|<=|>=|[-+*/%()<>,\[\].&|~]))")
_EXPR_NAMES = {
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt",
    "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal",
    "ToFloat", "Identity", "Max", "Min", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not",
    "Abs", "oo", "True", "False", "and", "or", "not", "floor", "ceiling", "sqrt", "Integer",
}
_GUARD_NAMES = {"L", "size", "stride", "storage_offset", "numel", "dim", "math", "inf"}
_SYMBOL = re.compile(r"[a-z]+\d+")
_OPERATOR_FNS = {"getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pos", "pow", "eq",
                 "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "abs", "lshift",
                 "rshift"}
_MATH_FNS = {"ceil", "floor", "trunc", "sqrt", "exp", "log", "sin", "cos", "tan", "fabs", "pow"}


def _refuse(entry: str, why: str) -> NpucError:
    return NpucError(E_PICKLE, f"the .pt2 entry {entry!r} {why}, which runs code from the file",
                     "npuc refuses such archives; re-export the model with plain tensors, or pass "
                     "--trust-pickle if you trust whoever made this file", exit_code=EXIT_UNSUPPORTED)


def _corrupt(path: str, why: str) -> NpucError:
    return NpucError(E_READ, f"cannot read {path!r} as a torch.export archive: {why}",
                     "save it with torch.export.save(ep, path)", exit_code=EXIT_IO)


def check_pt2(path: str) -> None:
    """Raise NpucError unless torch.export.load(path) would load `path` without running its code."""
    try:
        with zipfile.ZipFile(path) as zf:
            _check_archive(path, zf)
    except NpucError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError,
            RuntimeError) as e:  # zipfile's own errors for a truncated or corrupt archive
        raise _corrupt(path, str(e) or type(e).__name__) from None


def _check_archive(path: str, zf: zipfile.ZipFile) -> None:
    infos = zf.infolist()
    if not infos:
        raise _corrupt(path, "the archive is empty")
    if len(infos) > MAX_ENTRIES:
        raise _corrupt(path, f"{len(infos)} entries (at most {MAX_ENTRIES})")
    # torch reads every record under the first entry's folder: one root for all, or
    # torch's fallback to its old format (which unpickles) could see other names.
    root = infos[0].filename.split("/", 1)[0]
    entries: dict[str, zipfile.ZipInfo] = {}
    total = 0
    for info in infos:
        head, _, rest = info.filename.partition("/")
        if head != root or not rest:
            raise _corrupt(path, f"entry {info.filename!r} is outside the archive's folder {root!r}")
        total += info.file_size
        if info.compress_type != zipfile.ZIP_STORED and info.file_size > MAX_RATIO * max(info.compress_size, 1):
            raise _corrupt(path, f"entry {info.filename!r} inflates {info.file_size} bytes from "
                                 f"{info.compress_size}")
        if not info.is_dir():
            entries[rest] = info
    if total > MAX_TOTAL_BYTES:
        raise _corrupt(path, f"the entries claim {total} bytes")

    def read(rest: str, limit: int) -> bytes:
        info = entries[rest]
        if info.file_size > limit:
            raise _corrupt(path, f"entry {info.filename!r} is {info.file_size} bytes (at most {limit})")
        with zf.open(info) as f:
            return f.read(limit + 1)[:limit]

    def load_json(rest: str) -> Any:
        try:
            return json.loads(read(rest, MAX_JSON_BYTES))
        except (ValueError, RecursionError):
            raise _corrupt(path, f"entry {entries[rest].filename!r} is not JSON") from None

    models = sorted(r[len("models/"):-len(".json")] for r in entries
                    if r.startswith("models/") and r.endswith(".json") and "/" not in r[len("models/"):])
    if not models:
        raise _corrupt(path, "no models/<name>.json (not a torch.export.save archive)")
    allowed = set(_METADATA) | {f"models/{m}.json" for m in models}
    for m in models:
        name = f"{root}/models/{m}.json"
        _check_program(name, load_json(f"models/{m}.json"))
        for folder, kind in (("data/weights/", "weights"), ("data/constants/", "constants")):
            cfg = f"{folder}{m}_{kind}_config.json"
            if cfg not in entries:
                raise _corrupt(path, f"no {root}/{cfg}")
            allowed.add(cfg)
            for payload in _check_payloads(f"{root}/{cfg}", load_json(cfg)):
                allowed.add(folder + payload)
        sample = f"data/sample_inputs/{m}.pt"
        if sample in entries:
            _check_weights_only(f"{root}/{sample}", read(sample, MAX_SAMPLE_INPUT_BYTES))
            allowed.add(sample)
    for rest in entries:
        if rest in allowed or rest.startswith("extra/"):  # extra files are read as text
            continue
        if rest.startswith("data/aotinductor/"):
            raise _refuse(f"{root}/{rest}", "is AOTInductor native code torch would load")
        raise _refuse(f"{root}/{rest}", "is not one npuc can check is free of pickle "
                                        "(a legacy or unknown payload torch may unpickle)")


def _check_payloads(entry: str, config: Any) -> Iterator[str]:
    """The raw-tensor files a weights or constants config names; refuse pickled ones."""
    table = config.get("config") if isinstance(config, dict) else None
    if not isinstance(table, dict):
        raise _refuse(entry, "is not a payload config npuc knows")
    for fqn, meta in table.items():
        if not isinstance(meta, dict):
            raise _refuse(entry, f"describes {fqn!r} in a form npuc does not know")
        name = meta.get("path_name")
        if meta.get("use_pickle") is not False:
            raise _refuse(entry, f"marks {fqn!r} use_pickle")
        if not isinstance(name, str) or not _PAYLOAD_NAME.fullmatch(name) or not name.startswith(_TENSOR_PREFIXES):
            raise _refuse(entry, f"stores {fqn!r} as {name!r}, a custom or opaque object torch unpickles")
        yield name


def _check_weights_only(entry: str, data: bytes) -> None:
    """torch loads sample inputs weights-only and, when that fails, with full pickle."""
    import torch

    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception:  # any refusal of the weights-only unpickler means torch would unpickle fully
        raise _refuse(entry, "does not load weights-only (torch would fall back to full pickle)") from None


def _walk(obj: Any) -> Iterator[dict[str, Any]]:
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            yield x
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def _check_program(entry: str, program: Any) -> None:
    if not isinstance(program, dict) or not isinstance(program.get("graph_module"), dict):
        raise _refuse(entry, "is not an exported program npuc knows")
    guards = program.get("guards_code") or []
    if not isinstance(guards, list):
        raise _refuse(entry, "has guards_code torch would exec")
    for g in guards:
        if not isinstance(g, str) or not _safe_expr(g, guard=True):
            raise _refuse(entry, f"has guards_code {str(g)[:60]!r} torch would exec")
    for node in _walk(program):
        expr = node.get("expr_str")
        if expr is not None and (not isinstance(expr, str) or not _safe_expr(expr, guard=False)):
            raise _refuse(entry, f"has a symbolic expression {str(expr)[:60]!r} torch would eval")
        target = node.get("target")
        if isinstance(target, str) and "inputs" in node and not _safe_target(target):
            raise _refuse(entry, f"calls {target[:80]!r}, which is not an operator")


# torch writes a symbol with its assumptions: Symbol('s77', positive=True, integer=True).
_SYMBOL_CALL = re.compile(r"Symbol\('([a-z]+\d+)'(?:\s*,\s*[a-z_]+=(?:True|False))*\)")


def _safe_expr(text: str, *, guard: bool) -> bool:
    if len(text) > 10_000:
        return False
    text = _SYMBOL_CALL.sub(lambda m: m.group(1), text)
    pos = 0
    names = _EXPR_NAMES | (_GUARD_NAMES if guard else set())
    while pos < len(text):
        m = _EXPR_TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            return text[pos:].strip() == ""
        ident, quoted, punct = m.group(2), m.group(3), m.group(4)
        if ident is not None and ident not in names and not _SYMBOL.fullmatch(ident):
            return False
        if (quoted is not None or punct in ("[", "]", ".")) and not guard:
            return False
        pos = m.end()
    return True


def _safe_target(target: str) -> bool:
    """Mirror torch's deserialize_operator, accepting only what resolves to an operator."""
    import torch

    parts = target.split(".")
    if parts[0] == "_operator":
        return len(parts) == 2 and parts[1] in _OPERATOR_FNS
    if parts[0] == "math":
        return len(parts) == 2 and parts[1] in _MATH_FNS
    if parts[0] != "torch":
        return False  # torch keeps it as a string: refused rather than trusted to fail later
    if len(parts) == 2:
        return parts[1].startswith("sym_") or parts[1] == "_sym_sqrt"
    if len(parts) not in (3, 4, 5) or parts[1] != "ops":
        return False
    ns = getattr(torch.ops, parts[2], None)
    if not isinstance(ns, (torch._ops._OpNamespace, torch._ops._HigherOrderNamespace)):
        return False
    if len(parts) == 3:
        return False
    op = getattr(ns, parts[3], None)
    if isinstance(op, torch._ops.HigherOrderOperator):
        return len(parts) == 4
    if not isinstance(op, torch._ops.OpOverloadPacket):
        return False
    return len(parts) == 4 or isinstance(getattr(op, parts[4], None), torch._ops.OpOverload)


def load_pt2(path: str, *, trust_pickle: bool = False) -> Any:
    """torch.export.load(path), after `check_pt2` unless the user trusts the file."""
    import torch

    if not trust_pickle:
        check_pt2(path)
    else:
        try:  # still a zip: torch would log a traceback for one that is not
            with zipfile.ZipFile(path) as zf:
                if not zf.infolist():
                    raise _corrupt(path, "the archive is empty")
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise _corrupt(path, str(e) or type(e).__name__) from None
    # torch logs a traceback at WARNING before its old-format fallback: the user gets our one line.
    quiet = logging.getLogger("torch.export")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return torch.export.load(path)
    except NpucError:
        raise
    except Exception as e:  # a corrupt archive is a user problem, not a crash
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _corrupt(path, first[:200]) from None
    finally:
        quiet.setLevel(level)

