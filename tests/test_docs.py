"""Docs that must agree with the code."""

from __future__ import annotations

import re
from pathlib import Path

from npuc.backend.om_schema import proto_text
from npuc.compiler.torch_frontend import CONVERTERS
from npuc.ir import all_ops

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ["ir", "compiler", "passes", "backend", "runtime", "apps", "tools", "cli"]


def test_error_table_matches_code() -> None:
    used = set()
    for d in CODE_DIRS:
        for f in (ROOT / d).rglob("*.py"):
            used |= set(re.findall(r"NPUC-E\d{4}", f.read_text()))
    # the C API's codes, as numbers in its header
    used |= {f"NPUC-E{int(n):04d}" for n in re.findall(r"^#define NPUC_E_\w+ (\d+)", (ROOT / "include/npucrt.h")
                                                        .read_text(), re.M)}
    table = set(re.findall(r"^\| (NPUC-E\d{4}) \|", (ROOT / "docs/errors.md").read_text(), re.M))
    assert used == table, {"undocumented": sorted(used - table), "unused": sorted(table - used)}


def test_ops_doc_is_current() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_ops", ROOT / "docs/gen_ops.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = (ROOT / "docs/ops.md").read_text()
    assert text == gen.render(), "regenerate with: python docs/gen_ops.py > docs/ops.md"
    assert all(f"`{n}`" in text for n in all_ops()) and all(f"`{t}`" in text for t in CONVERTERS)


def test_format_doc_has_current_schema() -> None:
    assert proto_text() in (ROOT / "docs/om-format.md").read_text()


def test_user_guide_lists_every_compile_flag() -> None:
    from npuc.cli.compile_cmd import compile_cmd

    guide = (ROOT / "docs/user-guide.md").read_text()
    table = guide[guide.index("| flag | meaning |"):guide.index("### Precheck")]
    missing = [p.opts[0] for p in compile_cmd.params
               if p.opts[0].startswith("--") and p.opts[0] not in table and p.name not in ("model_opt", "om", "json_out")]
    assert missing == [], f"docs/user-guide.md's flag table lacks {missing}"
