"""Model coverage (issue 16): every in-scope causal-LM family of the installed transformers,
built tiny, compiled from its HF folder and checked against HF eager (tests/model_matrix.py).

Each family's row must be the row docs/models.md holds for it, when the doc was generated
with this transformers version; the last test checks the whole doc (summary, scope) against
this run. `NPUC_WRITE_MODELS_DOC=1` (what `python docs/gen_models.py` sets) writes the doc
from this run instead.

The families selected in a session are checked ahead, in worker processes (NPUC_MATRIX_JOBS,
default 2: building and tracing a tiny model is single-threaded Python, so two workers on two
cores halve the matrix's time); each test waits for its own family's row.
"""

from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest
from model_matrix import MATCHED, Row, checked, documented, in_scope, render

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "models.md"
WRITE = os.environ.get("NPUC_WRITE_MODELS_DOC") == "1"
ROWS: dict[str, Row] = {}
ERR = 5  # the max-err column: last bits differ between machines' kernels; checked against TOL instead


def _version() -> str:
    import transformers

    return transformers.__version__


def _doc() -> tuple[str, dict[str, list[str]]]:
    return documented(DOC.read_text()) if DOC.exists() else ("", {})


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("matrix")


@pytest.fixture(scope="module")
def ahead(request: pytest.FixtureRequest, work: Path) -> Any:
    """Futures of the rows of every family this session selected, checked in worker processes."""
    selected = [item.callspec.params["family"] for item in request.session.items
                if item.originalname == "test_family_is_what_the_doc_says" and hasattr(item, "callspec")]
    jobs = int(os.environ.get("NPUC_MATRIX_JOBS", "2"))
    if jobs <= 1 or len(selected) <= 1:
        yield {}
        return
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield {f: pool.submit(checked, f, work) for f in selected}
    finally:
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("family", in_scope())
def test_family_is_what_the_doc_says(family: str, work: Path, ahead: dict[str, Future[Row]]) -> None:
    try:
        row = ahead[family].result() if family in ahead else checked(family, work)
    except BrokenProcessPool:  # a worker died (a crash in native code): this family again, here
        row = checked(family, work)
    ROWS[family] = row
    assert row.status != "crashed", f"npuc crashed instead of refusing: {row.reason}"
    if row.status in MATCHED:
        assert row.max_err is not None and row.max_err <= 1e-3
    if row.status == "ok":
        assert row.generate == "32/32" or row.generate.endswith("then a tie")
        # the C executor runs the family as the torch interpreter does, or refuses it at load
        assert row.native == "32/32" or row.native.startswith("refused:"), row.native
    version, rows = _doc()
    if WRITE or version != _version():
        return
    assert family in rows, f"{family} is not in docs/models.md: python docs/gen_models.py"
    assert _stable(rows[family]) == _stable(row.cells()), "regenerate: python docs/gen_models.py"


def _stable(cells: list[str]) -> list[str]:
    """A row's cells but those a machine's float rounding may move: the max error, and where
    greedy decoding meets a tie (either token is right) the step it does."""
    out = cells[:ERR] + cells[ERR + 1:]
    if cells[2] == "ok":
        out[ERR] = "ok"  # the generate cell: 32/32, or k/32 then a tie
    return out


def test_doc_is_this_run() -> None:
    if set(ROWS) != set(in_scope()):
        pytest.skip("not every family ran in this session")
    text = render(list(ROWS.values()), _version())
    if WRITE:
        DOC.write_text(text)
        return
    version, rows = _doc()
    if version != _version():
        pytest.skip(f"docs/models.md is for transformers {version}; this is {_version()}")

    def stable(t: str) -> list[object]:  # rows as above; every other line as it is
        return [_stable([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]) if line.startswith("| `") else line
                for line in t.splitlines()]

    assert stable(DOC.read_text()) == stable(text), "regenerate: python docs/gen_models.py"


def test_sparse_attention_past_its_top_k_is_refused(tmp_path: Path) -> None:
    """DeepSeek-V3.2's indexer keeps its top index_topk keys: up to that length it keeps them
    all (the mask is the causal one, and generation works); past it the mask comes from the
    tokens, and decode would attend keys it drops, so --max_seq_len beyond it is refused."""
    import torch
    import transformers as tf
    from model_matrix import tiny_config

    from npuc.compiler.driver import compile_model
    from npuc.errors import NpucError

    if "deepseek_v32" not in in_scope():
        pytest.skip("this transformers has no DeepSeek-V3.2")
    cfg = tiny_config("deepseek_v32")
    cfg.index_topk = 16
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path / "dsa"))
    compile_model(str(tmp_path / "dsa"), input_shape="input_ids:1,8", output=str(tmp_path / "ok"), max_seq_len=16)
    with pytest.raises(NpucError, match="computed from the tokens") as e:
        compile_model(str(tmp_path / "dsa"), input_shape="input_ids:1,8", output=str(tmp_path / "no"), max_seq_len=48)
    assert e.value.code == "NPUC-E0123" and not (tmp_path / "no.om").exists()


def test_llama4_nope_layers_decode_up_to_their_temperature_floor(tmp_path: Path) -> None:
    """Llama 4's NoPE layers scale their queries by a factor that leaves 1 at floor_scale - 1
    positions; decode is traced where it is 1, so a cache reaching that position is refused,
    and one below it decodes as HF does (the rope layers rope [batch, seq, heads, d])."""
    import torch
    import transformers as tf
    from hf_models import hf_greedy
    from model_matrix import tiny_config

    from npuc.apps.generate import generate
    from npuc.compiler.driver import compile_model
    from npuc.errors import NpucError
    from npuc.runtime import Session

    if "llama4_text" not in in_scope():
        pytest.skip("this transformers has no Llama 4")
    cfg = tiny_config("llama4_text")
    cfg.no_rope_layers, cfg.floor_scale, cfg.attn_scale = [1, 0], 40, 0.5
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(tmp_path / "l4"))
    with pytest.raises(NpucError, match="changes at position 39") as e:
        compile_model(str(tmp_path / "l4"), input_shape="input_ids:1,8", output=str(tmp_path / "no"), max_seq_len=40)
    assert e.value.code == "NPUC-E0123" and not (tmp_path / "no.om").exists()
    om = compile_model(str(tmp_path / "l4"), input_shape="input_ids:1,8", output=str(tmp_path / "ok"), max_seq_len=39)
    prompt = [5, 17, 3, 99, 42, 7]
    assert generate(Session.load(om), prompt, 30, ignore_eos=True) == hf_greedy(model, prompt, 30)
