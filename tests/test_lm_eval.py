"""lm-evaluation-harness scores a multiple-choice task against `npuc serve`, as evaluation
teams use it: its `local-completions` model asks for each choice's loglikelihood with
`echo` and `logprobs` (max_tokens 1), the task written as a local file (no download).

The checkpoint is the trained byte-level Llama (tests/data/stdlib_llama), whose choices
are not random: each item is 40 bytes of held-out standard-library source, to be continued
by its next 8 bytes or by one of three 8-byte spans from elsewhere. The accuracy lm-eval
reports must equal the one HF transformers' own logits give on the same checkpoint, and
every per-choice loglikelihood must agree within 1e-4. docs/serving.md has the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_serve import Server

from npuc.compiler.driver import compile_model

pytest.importorskip("lm_eval")
pytest.importorskip("starlette")

DATA = Path(__file__).resolve().parent / "data" / "stdlib_llama"
ITEMS, CONTEXT, CONT = 24, 40, 8


def _items() -> list[dict[str, Any]]:
    text = (DATA / "heldout.bin").read_bytes()
    items: list[dict[str, Any]] = []
    at = 0
    while len(items) < ITEMS:
        window = text[at:at + CONTEXT + CONT]
        at += 997
        if not all(32 <= b < 127 or b == 10 for b in window):
            continue
        ctx, true = window[:CONTEXT].decode(), window[CONTEXT:].decode()
        others = []
        for j in range(1, 40):
            span = text[(at + 7919 * j) % (len(text) - CONT):][:CONT]
            if all(32 <= b < 127 for b in span) and span.decode() != true and span.decode() not in others:
                others.append(span.decode())
            if len(others) == 3:
                break
        label = len(items) % 4
        choices = others[:label] + [true] + others[label:]
        items.append({"context": ctx, "choices": choices, "label": label})
    return items


def _hf_loglikelihoods(items: list[dict[str, Any]]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DATA))
    model = AutoModelForCausalLM.from_pretrained(str(DATA), torch_dtype=torch.float32).eval()
    out = []
    for it in items:
        # lm-eval scores a context's trailing whitespace with the continuation (its _encode_pair)
        context = it["context"].rstrip()
        moved = it["context"][len(context):]
        ctx = tok(context)["input_ids"]
        row = []
        for c in it["choices"]:
            whole = tok(context + moved + c)["input_ids"]
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
            row.append(float(sum(lp[i - 1, whole[i]] for i in range(len(ctx), len(whole)))))
        out.append(row)
    return out


def test_lm_eval_scores_a_multiple_choice_task_as_hf_does(tmp_path: Path) -> None:
    items = _items()
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "items.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items))
    (tasks / "stdlib_mc.yaml").write_text(
        "task: stdlib_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        "target_delimiter: \"\"\nmetric_list:\n  - metric: acc\n")
    om = compile_model(str(DATA), input_shape="input_ids:1,64", max_seq_len=96, prefill_logits="all",
                       output=str(tmp_path / "stdlib"))
    server = Server(Path(om))
    try:
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
        args = (f"model=stdlib,base_url=http://127.0.0.1:{server.port}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={DATA},max_length=90,num_concurrent=1,max_retries=1")
        r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                            "--tasks", "stdlib_mc", "--include_path", str(tasks), "--output_path",
                            str(tmp_path / "out"), "--log_samples", "--batch_size", "1"],
                           capture_output=True, text=True, env=env, timeout=900)
    finally:
        server.close()
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_stdlib_mc_*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(samples) == ITEMS
    want = _hf_loglikelihoods(items)
    hf_acc = sum(max(range(4), key=lambda c: row[c]) == it["label"] for row, it in zip(want, items, strict=True)) / ITEMS
    got_acc = results["results"]["stdlib_mc"]["acc,none"]
    assert got_acc == pytest.approx(hf_acc, abs=1e-9)
    assert hf_acc > 0.5  # the trained model tells its source from other spans: the choices are not random
    for s in samples:
        lls = [float(resp[0][0]) for resp in s["resps"]]
        ref = want[s["doc_id"]]
        assert max(abs(a - b) for a, b in zip(lls, ref, strict=True)) < 1e-4, (s["doc_id"], lls, ref)
