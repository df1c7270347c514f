"""The mixed step (--mixed_tokens C; passes/kv_cache.py KVCache.mixed, apps/scheduler.py): a
program of B + C rows, each of its own slot at its own position, runs one token of every
decoding slot beside an admitted prompt's next tokens. Requests admitted while others decode
get the tokens they get from a model without it, on both executors, over plain, sliding-window
and soft-capped attention and an int8 cache; a row's slot and position are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compile_pool import CompilePool
from hf_models import save_checkpoint
from model_matrix import tiny_config
from program_log import record_programs

from npuc.apps.scheduler import Scheduler
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.runtime import Session
from npuc.runtime.native_session import NativeSession, runtime_library

SLOTS, PREFILL, MAX_SEQ, C = 2, 8, 64, 3
# Longer and shorter than the prefill; more requests than slots, so that most are admitted
# while the other slot decodes (those go through the mixed steps)
PROMPTS = [[5, 17, 3, 99, 42, 7, 64, 11, 3, 4, 5, 6, 7], [1, 2, 3], [9] * 20, [100, 50, 25, 12, 6, 3], [7, 7]]
NEW = [10, 4, 8, 12, 3]
# (checkpoint, extra compile options): plain GQA attention; a sliding window with soft-capped
# scores (the generic attention kernel in libnpucrt); an int8 KV cache
CASES = {"llama": ("llama", {}), "gemma2": ("gemma2", {}), "llama_int8": ("llama", {"kv_cache_dtype": "int8"})}
EXECUTORS = [Session.load, *([NativeSession] if runtime_library() is not None else [])]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(with --mixed_tokens, without) per case."""
    import torch
    import transformers as tf

    root = tmp_path_factory.mktemp("mixed")
    save_checkpoint("llama", str(root / "llama"))
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(tiny_config("gemma2")).save_pretrained(str(root / "gemma2"))
    with CompilePool() as pool:
        oms = {}
        for name, (ckpt, extra) in CASES.items():
            common: dict[str, Any] = dict(input_shape=f"input_ids:{SLOTS},{PREFILL}", max_seq_len=MAX_SEQ, **extra)
            oms[name] = (pool.compile(str(root / ckpt), mixed_tokens=C, output=str(root / f"{name}-m"), **common),
                         pool.compile(str(root / ckpt), output=str(root / f"{name}-p"), **common))
        return {name: (Path(m.result()), Path(p.result())) for name, (m, p) in oms.items()}


def _serve(s: Any) -> tuple[list[list[int]], int]:
    """Each request's tokens, and the mixed steps run."""
    programs = record_programs(s)
    sched = Scheduler(s)
    ids = [sched.submit(p, n, ignore_eos=True) for p, n in zip(PROMPTS, NEW, strict=True)]
    while not sched.idle:
        sched.step()
    return [sched.requests[i].tokens for i in ids], programs.count("mixed")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("load", EXECUTORS, ids=lambda f: getattr(f, "__name__", str(f)))
def test_requests_admitted_beside_decoding_slots_get_their_tokens(models: dict[str, tuple[Path, Path]], case: str,
                                                                  load: Any) -> None:
    with_mixed, without = models[case]
    got, mixed_steps = _serve(load(str(with_mixed)))
    want, none = _serve(load(str(without)))
    assert got == want
    assert mixed_steps >= 4 and none == 0  # the admissions after the first went through mixed steps


def test_requests_admitted_together_are_prefilled(models: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """A burst (several requests admitted in one step) is prefilled even while a slot streams;
    a request admitted alone while a slot streams goes through the mixed steps. Three slots:
    one streams, two are free."""
    om = compile_model(str(models["llama"][0].parent / "llama"), input_shape=f"input_ids:3,{PREFILL}",
                       max_seq_len=MAX_SEQ, mixed_tokens=C, output=str(tmp_path / "m3"))
    for burst, want_prefills in ((True, 2), (False, 1)):
        s = Session.load(om)
        programs = record_programs(s)
        sched = Scheduler(s)
        first = sched.submit(PROMPTS[0], 12, ignore_eos=True)
        sched.step()
        sched.step()  # the first request streams
        del programs[:]
        later = [sched.submit(p, 4, ignore_eos=True) for p in (PROMPTS[3], PROMPTS[1])[: 1 + burst]]
        sched.step()
        assert programs == (["prefill"] * want_prefills + ["decode"] if burst else ["mixed"]), (burst, programs)
        while not sched.idle:
            sched.step()
        plain = Scheduler(Session.load(str(models["llama"][1])))
        ids = [plain.submit(sched.requests[r].prompt, len(sched.requests[r].tokens), ignore_eos=True)
               for r in (first, *later)]
        while not plain.idle:
            plain.step()
        assert [sched.requests[r].tokens for r in (first, *later)] == [plain.requests[i].tokens for i in ids]


def test_the_mixed_program_takes_a_slot_per_row(models: dict[str, tuple[Path, Path]]) -> None:
    """Its inputs, and the rows the pass rewrites: each attention over its row's slot."""
    s = Session.load(str(models["llama"][0]))
    inputs = {t.name: t.shape for t in s.programs["mixed"].inputs}
    assert inputs == {"input_ids": (1, SLOTS + C), "position": (1, SLOTS + C), "slot": (SLOTS + C,)}
    import json

    from npuc.tools.om_tools import dump_json

    m = json.loads(dump_json(str(models["llama"][0])))["modeldef"]
    names = {i: t["name"] for i, t in enumerate(m["tensors"])}
    prog = next(p for p in m["programs"] if p["name"] == "mixed")
    attn = [o for o in prog["ops"] if o["op"] == "cached_attention"]
    assert len(attn) == 2  # a layer each
    for o in attn:
        assert {"name": "slotted", "value": {"i": "1"}} in o["attrs"] and names[o["inputs"][-1]] == "slot"


@pytest.mark.parametrize("load", EXECUTORS, ids=lambda f: getattr(f, "__name__", str(f)))
def test_a_row_outside_the_slots_or_the_cache_is_refused(models: dict[str, tuple[Path, Path]], load: Any) -> None:
    s = load(str(models["llama"][0]))
    n = SLOTS + C
    ids, pos = np.full((1, n), 3, dtype=np.int64), np.arange(n, dtype=np.int64).reshape(1, n)
    for slot, p in ((np.array([0, 1, 1, 1, SLOTS]), pos), (np.array([0, 1, 1, 1, -1]), pos),
                    (np.zeros(n, dtype=np.int64), pos + MAX_SEQ - 2)):
        with pytest.raises(NpucError) as e:
            s.run({"input_ids": ids, "position": p, "slot": slot}, "mixed")
        assert e.value.code == "NPUC-E0108"


def test_flags_that_do_not_go_with_it_are_refused(tmp_path: Path) -> None:
    with pytest.raises(NpucError) as e:
        compile_model("x", input_shape="input_ids:2,8", mixed_tokens=3, output=str(tmp_path / "a"))
    assert e.value.code == "NPUC-E0124" and "--max_seq_len" in e.value.message
    with pytest.raises(NpucError) as e:
        compile_model("x", input_shape="input_ids:2,8", max_seq_len=64, mixed_tokens=0, output=str(tmp_path / "a"))
    assert e.value.code == "NPUC-E0124"
    save_checkpoint("deepseek_v3", str(tmp_path / "ds"))
    with pytest.raises(NpucError) as e:  # latent attention: not built
        compile_model(str(tmp_path / "ds"), input_shape="input_ids:2,8", max_seq_len=64, mixed_tokens=3,
                      output=str(tmp_path / "ds"))
    assert e.value.code == "NPUC-E0123" and "mixed step" in e.value.message
    assert not list(tmp_path.glob("*.om"))
