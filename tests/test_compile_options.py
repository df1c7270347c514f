"""`npuc compile`'s pipeline options: --dump-ir-after/--dump-dir, --time-passes, --debug, --fusion-report."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from torch import nn

import npuc
from npuc.cli.main import main
from npuc.compiler import instrument
from npuc.compiler.driver import compile_model
from npuc.errors import InternalError, NpucError
from npuc.ir import Graph, parse_graph, print_graph, verify
from npuc.passes.dce import DeadCodeElimination
from npuc.passes.manager import Pass, PassResult
from npuc.passes.pipeline import default_pipeline
from npuc.passes.swiglu_fusion import SwiGLUFusion

PASSES = [p.name for p in default_pipeline()]
ALL_DUMPS = ["00-input.ir"] + [f"{i:02d}-{name}.ir" for i, name in enumerate(PASSES, start=1)]


class TinyBlock(nn.Module):
    """An RMSNorm and a gated MLP: enough for the rmsnorm and swiglu rules to fire."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(8))
        self.gate = nn.Linear(8, 16, bias=False)
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def tiny() -> TinyBlock:
    torch.manual_seed(0)
    return TinyBlock().eval()


@pytest.fixture(scope="module")
def tiny_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pt2") / "tiny.pt2"
    torch.export.save(torch.export.export(tiny(), (torch.zeros(2, 8),)), str(path))
    return path


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, ["compile", *args])


def compile_tiny(tmp_path: Path, **options: Any) -> str:
    return compile_model(tiny(), input_shape="x:2,8", output=str(tmp_path / "m"), **options)


# -- --dump-ir-after / --dump-dir ---------------------------------------------------------

def test_dump_ir_after_all_writes_every_stage_and_each_parses_back(tmp_path: Path) -> None:
    om = compile_tiny(tmp_path, dump_ir_after="all", dump_dir=tmp_path / "ir")
    assert sorted(p.name for p in (tmp_path / "ir").iterdir()) == ALL_DUMPS
    for name in ALL_DUMPS:
        text = (tmp_path / "ir" / name).read_text()
        g = parse_graph(text)
        verify(g)
        assert print_graph(g) == text, name
    first, last = (tmp_path / "ir" / ALL_DUMPS[0]).read_text(), (tmp_path / "ir" / ALL_DUMPS[-1]).read_text()
    assert "silu(" in first and "swiglu(" not in first
    assert re.search(r"= swiglu\(", last) and re.search(r"= rms_norm\[", last) and "silu(" not in last
    # The last dump is the program that was lowered: one op per node.
    ops = [ln.split("=", 1)[1].split("(")[0].split("[")[0].strip() for ln in last.splitlines() if " = " in ln]
    assert ops == [op.op for op in npuc.load(om, executor="torch").program.ops]


def test_dump_ir_after_names_selects_passes_by_name(tiny_pt2: Path, tmp_path: Path) -> None:
    r = cli(str(tiny_pt2), "--input_shape", "x:2,8", "--output", str(tmp_path / "m"),
            "--dump_ir_after", "swiglu-fusion, dce", "--dump_dir", str(tmp_path / "ir"))
    assert r.exit_code == 0, r.output
    dce = [f"{i:02d}-dce.ir" for i, name in enumerate(PASSES, start=1) if name == "dce"]
    swiglu = f"{PASSES.index('swiglu-fusion') + 1:02d}-swiglu-fusion.ir"
    assert len(dce) > 1  # a pass that runs twice is dumped twice
    assert sorted(p.name for p in (tmp_path / "ir").iterdir()) == sorted(["00-input.ir", swiglu, *dce])
    text = (tmp_path / "ir" / swiglu).read_text()
    verify(parse_graph(text))
    assert "swiglu(" in text and "silu(" not in text


def test_dump_ir_after_accepts_a_list_of_names(tmp_path: Path) -> None:
    compile_tiny(tmp_path, dump_ir_after=["constant-folding"], dump_dir=str(tmp_path / "ir"))
    assert sorted(p.name for p in (tmp_path / "ir").iterdir()) == [
        d for d in ALL_DUMPS if d == "00-input.ir" or d.endswith("-constant-folding.ir")]


def test_unknown_pass_name_is_a_usage_error_listing_the_passes(tiny_pt2: Path, tmp_path: Path) -> None:
    r = cli(str(tiny_pt2), "--input_shape", "x:2,8", "--output", str(tmp_path / "m"),
            "--dump-ir-after=swiglu,dce,nope", "--dump-dir", str(tmp_path / "ir"))
    assert r.exit_code == 2, r.output
    assert "npuc: error NPUC-E0120: --dump-ir-after: no pass named 'swiglu' (closest: 'swiglu-fusion'), 'nope'" \
        in r.stderr
    assert f"passes: {', '.join(dict.fromkeys(PASSES))}" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "ir").exists() and not (tmp_path / "m.om").exists()


@pytest.mark.parametrize("options, code", [
    ({"dump_ir_after": "", "dump_dir": "ir"}, "NPUC-E0120"),
    ({"dump_ir_after": " , ", "dump_dir": "ir"}, "NPUC-E0120"),
    ({"dump_ir_after": "all"}, "NPUC-E0121"),
    ({"dump_dir": "ir"}, "NPUC-E0121"),
])
def test_bad_dump_options_fail_before_the_model_is_read(tmp_path: Path, options: dict[str, str], code: str
                                                        ) -> None:
    # The model does not exist: checking the options first means this is not E0401.
    with pytest.raises(NpucError) as info:
        compile_model(str(tmp_path / "missing"), input_shape="x:1", output=str(tmp_path / "m"), **options)
    assert info.value.code == code and info.value.exit_code == 2


def test_unwritable_dump_dir_and_report_are_io_errors(tiny_pt2: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    base = [str(tiny_pt2), "--input_shape", "x:2,8", "--output", str(tmp_path / "m")]
    for extra in (["--dump-ir-after=all", "--dump-dir", str(blocker)],
                  ["--dump-ir-after=all", "--dump-dir", str(blocker / "ir")],
                  ["--fusion-report", str(blocker / "report.json")]):
        r = cli(*base, *extra)
        assert r.exit_code == 4, (extra, r.output)
        assert "error NPUC-E0406" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "m.om").exists()


# -- --time-passes ------------------------------------------------------------------------

def test_time_passes_prints_a_table_to_stderr(tiny_pt2: Path, tmp_path: Path) -> None:
    r = cli(str(tiny_pt2), "--input_shape", "x:2,8", "--output", str(tmp_path / "m"), "--time-passes")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == f"wrote {tmp_path / 'm.om'}"
    lines = r.stderr.splitlines()
    start = lines.index("npuc: time per pass (wall clock)")
    rows = [ln.split() for ln in lines[start + 2:start + 2 + len(PASSES)]]
    assert [(int(row[0]), row[1]) for row in rows] == list(enumerate(PASSES, start=1))
    total = lines[start + 2 + len(PASSES)].split()
    assert total[0] == "total" and float(total[1]) == pytest.approx(sum(float(row[2]) for row in rows), abs=0.05)
    quiet = cli(str(tiny_pt2), "--input_shape", "x:2,8", "--output", str(tmp_path / "m"))
    assert quiet.exit_code == 0 and "time per pass" not in quiet.stderr


def test_time_passes_says_when_the_verifier_is_included(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    compile_tiny(tmp_path, time_passes=True, debug=True)
    err = capsys.readouterr().err
    assert "time per pass" in err and "includes the verifier" in err


# -- --debug ------------------------------------------------------------------------------

def test_debug_verifies_after_every_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import npuc.passes.manager as manager

    calls: list[int] = []
    real = manager.verify
    monkeypatch.setattr(manager, "verify", lambda g: calls.append(len(g.nodes)) or real(g))
    compile_tiny(tmp_path)
    assert calls == []
    compile_tiny(tmp_path, debug=True)
    assert len(calls) == 1 + len(PASSES)  # the frontend's graph, then after each pass


class BreaksUses(Pass):
    name = "breaks-uses"

    def call(self, g: Graph) -> PassResult:
        g.inputs[0].uses.clear()
        return PassResult(g, True)


def test_debug_names_the_pass_that_broke_the_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import npuc.compiler.driver as driver

    monkeypatch.setattr(driver, "default_pipeline", lambda *args, **kwargs: [DeadCodeElimination(), BreaksUses()])
    with pytest.raises(InternalError, match=r"^pass 'breaks-uses' failed \(after dce\): "):
        compile_tiny(tmp_path, debug=True)


# -- --fusion-report ----------------------------------------------------------------------

def test_fusion_report_lists_rules_provenance_and_op_counts(hf_checkpoints: dict[str, Path], tmp_path: Path
                                                             ) -> None:
    om = compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,16", output=str(tmp_path / "m"),
                       fusion_report=tmp_path / "r" / "fusion.json", dump_ir_after="all", dump_dir=tmp_path / "ir")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["fusion.json"]  # no temp file left behind
    report = json.loads((tmp_path / "r" / "fusion.json").read_text())
    assert report["format"] == "npuc-fusion-report/1"

    by_pass = {(e["index"], e["pass"]): e for e in report["passes"]}
    swiglu = by_pass[(PASSES.index("swiglu-fusion") + 1, "swiglu-fusion")]["rules"]["swiglu"]
    assert swiglu["matched"] == swiglu["applied"] == 2 and swiglu["refused"] == {}
    never = [(p["pass"], rule, stats) for p in report["passes"] for rule, stats in p.get("rules", {}).items()
             if not stats["applied"]]
    assert never and all(stats["why_not"] for _, _, stats in never)

    fused = [f for f in report["fusions"] if f["rule"] == "swiglu"]
    assert len(fused) == 2 and all(f["pass"] == "swiglu-fusion" for f in fused)
    assert all(len(f["created"]) == 1 and any(n.startswith("silu") for n in f["replaced"]) for f in fused)

    # Every fused op of the final program, traced back to nodes of the frontend's graph.
    frontend = set(re.findall(r"^  %(\S+) :", (tmp_path / "ir" / "00-input.ir").read_text(), re.M))
    ops = {op.name: op.op for op in npuc.load(om, executor="torch").program.ops}
    kinds = {v["op"] for v in report["fused_ops"].values()}
    assert {"swiglu", "rms_norm", "rope_lut"} <= kinds
    for name, v in report["fused_ops"].items():
        assert ops[name] == v["op"] and v["replaced"] and set(v["replaced"]) <= frontend, (name, v)
    norm = next(v for v in report["fused_ops"].values() if v["op"] == "rms_norm")
    assert norm["rules"] == ["rmsnorm", "rmsnorm-weight"]  # a fusion of a fusion keeps the whole history
    assert any(n.startswith("rsqrt") for n in norm["replaced"])

    assert report["op_counts"] == dict(sorted(Counter(ops.values()).items()))
    assert report["nodes"] == len(ops)


def test_fusion_report_is_deterministic_and_has_no_paths(tmp_path: Path, tiny_pt2: Path) -> None:
    texts = []
    for i in range(2):
        r = cli(str(tiny_pt2), "--input_shape", "x:2,8", "--output", str(tmp_path / f"m{i}"),
                "--fusion_report", str(tmp_path / f"d{i}" / "f.json"))
        assert r.exit_code == 0, r.output
        texts.append((tmp_path / f"d{i}" / "f.json").read_text())
    assert texts[0] == texts[1]
    assert str(tmp_path) not in texts[0] and str(tiny_pt2) not in texts[0]
    report = json.loads(texts[0])
    assert json.dumps(report, indent=2, sort_keys=True) + "\n" == texts[0]
    assert report["op_counts"]["swiglu"] == 1 and report["op_counts"]["rms_norm"] == 1


def test_fusion_report_keeps_each_run_of_a_pass(tmp_path: Path) -> None:
    g = parse_graph("""graph main(%g : f32[4], %u : f32[4], %v : f32[4]) {
  %s : f32[4] = silu(%g)
  %y : f32[4] = mul(%s, %u)
  %t : f32[4] = silu(%y)
  %z : f32[4] = mul(%t, %v)
  return %z
}
""")
    run = instrument.run_pipeline(g, [SwiGLUFusion(), DeadCodeElimination(), SwiGLUFusion()], verify_each=True)
    report = instrument.fusion_report(run)
    assert [(e["index"], e["pass"]) for e in report["passes"]] == [(1, "swiglu-fusion"), (3, "swiglu-fusion")]
    assert [e["rules"]["swiglu"]["applied"] for e in report["passes"]] == [2, 0]
    assert [(f["index"], f["created"], f["replaced"]) for f in report["fusions"]] == [
        (1, ["y"], ["y", "s"]), (1, ["z"], ["z", "t"])]
    assert report["fused_ops"] == {"y": {"op": "swiglu", "replaced": ["y", "s"], "rules": ["swiglu"]},
                                   "z": {"op": "swiglu", "replaced": ["z", "t"], "rules": ["swiglu"]}}
    assert report["op_counts"] == {"swiglu": 2}
    table = instrument.format_timings(run)
    assert [ln.split()[1] for ln in table.splitlines()[2:5]] == ["swiglu-fusion", "dce", "swiglu-fusion"]
    assert "includes the verifier" in table
