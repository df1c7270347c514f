"""Speculative decoding with a draft model's .om (apps/draft_model.py): the greedy output unchanged,
whether the draft agrees with the target always (itself) or rarely (another random model), its
cache caught up across steps, and the drafts its own greedy decode would give."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from compile_pool import CompilePool
from hf_models import save_checkpoint
from program_log import record_programs

from npuc.apps.draft_model import DraftModel
from npuc.apps.sampling import GREEDY, SamplingParams
from npuc.apps.scheduler import Scheduler
from npuc.apps.speculative import SpeculativeConfig
from npuc.errors import NpucError
from npuc.runtime.native_session import NativeSession, runtime_library

pytestmark = pytest.mark.skipif(runtime_library() is None, reason="no C compiler: the native runtime is not built")
K, MAX_SEQ = 4, 64
PROMPTS = [[5, 17, 3, 99, 42, 5, 17, 3, 99, 42, 5, 17], [1, 15, 27, 100, 42, 7, 64, 11, 80, 2]]
DRAFT = SpeculativeConfig(method="draft", min_gain=0.0)  # verify whenever there are drafts


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft")
    save_checkpoint("llama", str(root / "target"))
    save_checkpoint("qwen2", str(root / "other"), seed=5)  # the same 128-token vocabulary
    common: dict[str, Any] = dict(input_shape="input_ids:2,8", max_seq_len=MAX_SEQ)
    with CompilePool() as pool:
        oms = {"target": pool.compile(str(root / "target"), speculative_tokens=K, output=str(root / "t"), **common),
               "other": pool.compile(str(root / "other"), output=str(root / "o"), **common),
               # the same draft with a verify program: its catch-up feeds K + 1 tokens a step
               "other_verify": pool.compile(str(root / "other"), speculative_tokens=K, output=str(root / "ov"),
                                            **common),
               "one_slot": pool.compile(str(root / "other"), input_shape="input_ids:1,8", max_seq_len=MAX_SEQ,
                                        output=str(root / "o1"))}
        return {name: Path(om.result()) for name, om in oms.items()}


def _run(s: Any, config: SpeculativeConfig, draft: Any = None, n: int = 30,
         sampling: SamplingParams = GREEDY) -> tuple[list[list[int]], Any]:
    sched = Scheduler(s, speculative=config, draft=draft)
    ids = [sched.submit(p, n, True, sampling) for p in PROMPTS]
    while not sched.idle:
        sched.step()
    return [sched.requests[i].tokens for i in ids], sched.stats


@pytest.mark.parametrize("which", ["target", "other"])
def test_greedy_output_is_unchanged_by_a_draft_model(models: dict[str, Path], which: str) -> None:
    s = NativeSession(str(models["target"]))
    want, plain = _run(s, SpeculativeConfig(method="off"))
    got, stats = _run(s, DRAFT, NativeSession(str(models[which])))
    assert got == want
    assert stats.verify_steps > 0 and stats.drafted > 0
    if which == "target":  # drafting with itself: every draft is right, a step gives K + 1 tokens
        assert stats.accepted == stats.drafted and stats.steps < plain.steps / 2
    else:
        assert stats.accepted < stats.drafted


def test_seeded_sampling_is_unchanged_by_a_draft_model(models: dict[str, Path]) -> None:
    """The target's own seeded draws, drafts kept while they equal them: the tokens without
    speculation. The draft is the target itself (its greedy tokens), and the draws at a low
    temperature follow them often, not always."""
    cool = SamplingParams(temperature=0.03, top_k=8, seed=3)
    s = NativeSession(str(models["target"]))
    want, _ = _run(s, SpeculativeConfig(method="off"), sampling=cool)
    got, stats = _run(s, DRAFT, NativeSession(str(models["target"])), sampling=cool)
    assert got == want
    assert stats.verify_steps > 0 and 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("which", ["other", "other_verify"])
def test_drafts_are_the_draft_model_s_own_greedy_tokens(models: dict[str, Path], which: str) -> None:
    """Drafting in pieces (a sequence that grows by accepted tokens between proposals, the cache
    caught up each time) gives the tokens one greedy decode of the draft model gives; also
    after a long stretch without drafting, which a draft with a verify program catches up on
    K + 1 tokens a step."""
    want, _ = _run(NativeSession(str(models["other"])), SpeculativeConfig(method="off"), n=24)
    s = NativeSession(str(models[which]))
    programs = record_programs(s)
    d = DraftModel(s, 2, 128, MAX_SEQ)
    seqs = [list(p) for p in PROMPTS]
    for k, p in enumerate(PROMPTS):
        d.admit(k, p)
    while len(seqs[0]) < len(PROMPTS[0]) + 12:
        got = d.propose({k: (seqs[k], 3) for k in range(2)})
        for k in range(2):
            seqs[k] += got[k][:2]  # two of three accepted: the third is written over next time
    for k in range(2):  # 10 tokens decoded without the draft (speculation off a while)
        seqs[k] = [*PROMPTS[k], *want[k][:22]]
    del programs[:]
    got = d.propose({k: (seqs[k], 2) for k in range(2)})
    assert [g[:2] for g in got.values()] == [w[22:24] for w in want]
    # the cache holds 12 of the 22 tokens: 10 to catch up on, the last one's step drafting the
    # first token, one more step the second: a step each, or two of K + 1 = 5 and one
    assert programs == (["decode"] * 11 if which == "other" else ["verify"] * 2 + ["decode"])
    assert [s[len(p):len(p) + 12] for s, p in zip(seqs, PROMPTS, strict=True)] == [w[:12] for w in want]


def test_a_draft_that_does_not_fit_is_refused(models: dict[str, Path]) -> None:
    s = NativeSession(str(models["target"]))
    with pytest.raises(NpucError, match="slots") as e:
        Scheduler(s, speculative=DRAFT, draft=NativeSession(str(models["one_slot"])))
    assert e.value.code == "NPUC-E0163"
    with pytest.raises(NpucError) as e:
        Scheduler(s, speculative=DRAFT)
    assert e.value.code == "NPUC-E0163"


def test_generate_takes_a_draft(models: dict[str, Path]) -> None:
    import json

    from click.testing import CliRunner

    from npuc.cli.main import main

    args = ["generate", str(models["target"]), "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "20",
            "--ignore-eos"]
    plain = CliRunner().invoke(main, [*args, "--speculative", "off"])
    drafted = CliRunner().invoke(main, [*args, "--draft", str(models["target"]), "--stats"])
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    assert drafted.stdout.split() == plain.stdout.split()
    counts = json.loads(drafted.stderr.strip().splitlines()[-1])
    assert counts["accepted_tokens"] > 0  # (a draft as costly as the target is mostly not worth running)
    wrong = CliRunner().invoke(main, [*args, "--draft", str(models["target"]), "--speculative", "ngram"])
    assert wrong.exit_code == 2 and "NPUC-E0163" in wrong.output


def test_serve_takes_a_draft(models: dict[str, Path]) -> None:
    """`npuc serve --draft`: a completion's tokens are the greedy ones, and /metrics counts the
    drafts checked; --draft with another method is refused before the model loads."""
    import http.client
    import json
    import socket
    import subprocess
    import sys
    import time

    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from click.testing import CliRunner

    from npuc.cli.main import main

    wrong = CliRunner().invoke(main, ["serve", str(models["target"]), "--draft", "x.om", "--speculative", "off"])
    assert wrong.exit_code == 2 and "NPUC-E0163" in wrong.output
    want, _ = _run(NativeSession(str(models["target"])), SpeculativeConfig(method="off"), n=16)
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "npuc", "serve", str(models["target"]), "--port", str(port),
                             "--draft", str(models["target"])], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)

    def call(method: str, path: str, body: Any = None) -> tuple[int, str]:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read().decode()

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if call("GET", "/health")[0] == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-2000:]
                time.sleep(0.2)
        for p, w in zip(PROMPTS, want, strict=True):
            status, text = call("POST", "/v1/completions", {"prompt": p, "max_tokens": 16, "temperature": 0,
                                                            "ignore_eos": True})
            assert status == 200, text
            choice = json.loads(text)["choices"][0]
            assert choice["token_ids"] == w
        metrics = dict(line.split() for line in call("GET", "/metrics")[1].splitlines()
                       if line.startswith("npuc_draft_"))
        assert float(metrics["npuc_draft_tokens_total"]) > 0
        assert float(metrics["npuc_draft_accepted_tokens_total"]) == float(metrics["npuc_draft_tokens_total"])
    finally:
        proc.kill()
        proc.communicate()
