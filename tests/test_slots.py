"""Many sequences over static slots (passes/kv_cache.py `slots`, apps/scheduler.py):
`--input_shape input_ids:B,S --max_seq_len N` compiles a prefill that fills one slot and a
decode of one token of every slot, each at its own position. Every sequence's tokens and
logits are the ones it gets decoded alone, while others join and leave around it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compile_pool import CompilePool
from hf_models import GEN_ARCHS, GEN_MAX_SEQ, GEN_PREFILL

from npuc.apps.generate import steps
from npuc.apps.scheduler import Scheduler, generate_many
from npuc.compiler.driver import compile_model
from npuc.errors import NpucError
from npuc.runtime import Session
from npuc.tools.om_tools import model_info

SLOTS = 4
ARCHS = [*GEN_ARCHS, "deepseek_v3_moe"]
# Different lengths: shorter than the prefill, as long, and longer (the rest through decode).
PROMPTS = [[5, 17, 3, 99, 42, 7, 64, 11], [1, 2, 3], [9] * 12, [100, 50, 25, 12, 6, 3], [7, 7],
           list(range(20, 40)), [2, 3, 4, 5, 6]]
NEW = [12, 5, 9, 16, 3, 7, 10]  # so that sequences leave, and the queued join, mid-run


@pytest.fixture(scope="module")
def slot_models(hf_checkpoints: dict[str, Path], moe_checkpoint: Path, gen_models: dict[str, Path],
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(one slot, SLOTS slots) per architecture."""
    root = tmp_path_factory.mktemp("slots")
    ckpts = {**hf_checkpoints, "deepseek_v3_moe": moe_checkpoint}
    with CompilePool() as pool:
        oms = {}
        for arch in ARCHS:
            one = pool.compile(str(ckpts[arch]), input_shape=f"input_ids:1,{GEN_PREFILL}", max_seq_len=GEN_MAX_SEQ,
                               output=str(root / f"{arch}1")) if arch not in gen_models else None
            many = pool.compile(str(ckpts[arch]), input_shape=f"input_ids:{SLOTS},{GEN_PREFILL}",
                                max_seq_len=GEN_MAX_SEQ, output=str(root / arch))
            oms[arch] = (one, many)
        return {arch: (gen_models[arch] if one is None else Path(one.result()), Path(many.result()))
                for arch, (one, many) in oms.items()}


def _alone(om: Path, prompt: list[int], new: int) -> list[tuple[int, torch.Tensor]]:
    return list(steps(Session.load(str(om)), prompt, new, ignore_eos=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_each_slot_decodes_as_it_would_alone(arch: str, slot_models: dict[str, tuple[Path, Path]]) -> None:
    """Seven sequences of different lengths over four slots: each token and its logits
    (within 1e-4) equal that sequence decoded alone by the one-slot model, as sequences
    finish and queued ones take their slots mid-run."""
    one, many = slot_models[arch]
    sched = Scheduler(Session.load(str(many)), keep_logits=True)
    ids = [sched.submit(p, n, ignore_eos=True) for p, n in zip(PROMPTS, NEW, strict=True)]
    got: dict[int, list[tuple[int, torch.Tensor]]] = {i: [] for i in ids}
    joined_mid_run = False
    while not sched.idle:
        before = sched.queued
        for e in sched.step():
            assert e.token is not None and e.logits is not None
            got[e.request].append((e.token, e.logits))
        joined_mid_run |= 0 < sched.queued < before
    assert joined_mid_run
    for i, prompt, new in zip(ids, PROMPTS, NEW, strict=True):
        want = _alone(one, prompt, new)
        assert [t for t, _ in got[i]] == [t for t, _ in want]
        err = max(float((a - b).abs().max()) for (_, a), (_, b) in zip(got[i], want, strict=True))
        assert err < 1e-4, f"sequence {i}: logits differ from its decoding alone by {err}"
        assert sched.requests[i].finish_reason == "length"


def test_cancel_frees_the_slot_and_leaves_the_others(slot_models: dict[str, tuple[Path, Path]]) -> None:
    one, many = slot_models["llama"]
    sched = Scheduler(Session.load(str(many)))
    ids = [sched.submit(p, 10, ignore_eos=True) for p in PROMPTS[:5]]
    sched.step()
    sched.step()
    assert sched.active == SLOTS and sched.queued == 1
    assert sched.cancel(ids[1]) and not sched.cancel(ids[1])
    assert sched.active == SLOTS - 1
    sched.step()  # the queued sequence takes the freed slot
    assert sched.active == SLOTS and sched.queued == 0
    while not sched.idle:
        sched.step()
    assert sched.requests[ids[1]].finish_reason == "cancelled"
    for i in (0, 2, 3, 4):
        assert sched.requests[ids[i]].tokens == [t for t, _ in _alone(one, PROMPTS[i], 10)]


def test_generate_many_on_one_slot_runs_them_in_turn(slot_models: dict[str, tuple[Path, Path]]) -> None:
    one, many = slot_models["qwen2"]
    want = generate_many(Session.load(str(many)), PROMPTS, 6, ignore_eos=True)
    assert generate_many(Session.load(str(one)), PROMPTS, 6, ignore_eos=True) == want
    assert want == [[t for t, _ in _alone(one, p, 6)] for p in PROMPTS]


def test_programs_and_info(slot_models: dict[str, tuple[Path, Path]]) -> None:
    one, many = slot_models["llama"]
    s = Session.load(str(many))
    assert [(t.name, t.shape) for t in s.programs["prefill"].inputs] == \
        [("input_ids", (1, GEN_PREFILL)), ("slot", (1,)), ("last_token", (1,))]
    assert [(t.name, t.shape) for t in s.programs["decode"].inputs] == [("input_ids", (SLOTS, 1)), ("position", (SLOTS,))]
    a, b = model_info(str(one)), model_info(str(many))
    assert (a["kv_slots"], b["kv_slots"]) == (1, SLOTS)
    assert a["kv_cache_bytes_per_token"] == b["kv_cache_bytes_per_token"]
    assert b["kv_cache_bytes_per_slot"] == a["state_bytes"] and b["state_bytes"] == SLOTS * a["state_bytes"]
    text = subprocess.run([sys.executable, "-m", "npuc", "info", str(many)], capture_output=True, text=True).stdout
    assert f"KV cache: {SLOTS} slots of {a['state_bytes']:,} B" in text


def test_decode_over_every_slot_allocates_nothing(slot_models: dict[str, tuple[Path, Path]]) -> None:
    from npuc.tools.alloc_profile import profile_run

    for arch in ("llama", "deepseek_v3"):
        sess = Session.load(str(slot_models[arch][1]))
        step = {"input_ids": torch.tensor([[5], [6], [7], [8]]), "position": torch.tensor([3, 9, 0, 20])}
        for _ in range(2):
            sess.run(step, "decode")
        r = profile_run(sess, step, "decode", copy_outputs=False)
        assert (r.count, r.bytes) == (0, 0), (arch, r.ops, sess.launchers.kinds)


@pytest.mark.parametrize("feeds, msg", [
    ({"slot": [SLOTS]}, f"outside the model's {SLOTS} slots"),
    ({"slot": [-1]}, f"outside the model's {SLOTS} slots"),
])
def test_a_slot_outside_the_cache_is_a_user_error(feeds: dict, msg: str,
                                                  slot_models: dict[str, tuple[Path, Path]]) -> None:
    sess = Session.load(str(slot_models["llama"][1]))
    with pytest.raises(NpucError) as e:
        sess.run({"input_ids": torch.zeros(1, GEN_PREFILL, dtype=torch.int64), "last_token": torch.tensor([0]),
                  **{k: torch.tensor(v) for k, v in feeds.items()}}, "prefill")
    assert e.value.code == "NPUC-E0108" and msg in e.value.message


def test_each_slots_position_is_checked(slot_models: dict[str, tuple[Path, Path]]) -> None:
    sess = Session.load(str(slot_models["llama"][1]))
    with pytest.raises(NpucError) as e:
        sess.run({"input_ids": torch.zeros(SLOTS, 1, dtype=torch.int64),
                  "position": torch.tensor([0, 1, GEN_MAX_SEQ, 2])}, "decode")
    assert e.value.code == "NPUC-E0108" and "outside the" in e.value.message


def test_cli_generate_several_prompts(slot_models: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    one, many = slot_models["mistral"]
    want = [[t for t, _ in _alone(one, p, 6)] for p in PROMPTS[:5]]
    args = [x for p in PROMPTS[:5] for x in ("--prompt-ids", ",".join(map(str, p)))]
    r = subprocess.run([sys.executable, "-m", "npuc", "generate", str(many), *args, "--max-new-tokens", "6",
                        "--ignore-eos"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert [json.loads(line) for line in r.stdout.splitlines()] == \
        [{"index": i, "token_ids": w} for i, w in enumerate(want)]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join([json.dumps(PROMPTS[0]), json.dumps({"prompt_ids": PROMPTS[1]})]) + "\n")
    r = subprocess.run([sys.executable, "-m", "npuc", "generate", str(many), "--prompts", str(f), "--max-new-tokens",
                        "6", "--ignore-eos"], capture_output=True, text=True)
    assert [json.loads(line)["token_ids"] for line in r.stdout.splitlines()] == want[:2]
    f.write_text('{"prompt_ids": [1, -2]}\n')
    r = subprocess.run([sys.executable, "-m", "npuc", "generate", str(many), "--prompts", str(f)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "NPUC-E0125" in r.stderr and ":1:" in r.stderr and "Traceback" not in r.stderr


def test_learned_positions_per_slot(tmp_path: Path) -> None:
    """GPT-2's learned position table: decode gathers each slot's own row."""
    import transformers

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                         n_positions=64)).save_pretrained(str(tmp_path / "gpt2"))
    one = compile_model(str(tmp_path / "gpt2"), input_shape="input_ids:1,8", max_seq_len=48, output=str(tmp_path / "a"))
    many = compile_model(str(tmp_path / "gpt2"), input_shape="input_ids:3,8", max_seq_len=48,
                         output=str(tmp_path / "b"))
    prompts = [[5, 6, 7], [1] * 11, [9, 8, 7, 6, 5, 4, 3, 2], [4, 4]]
    want = [[t for t, _ in _alone(Path(one), p, 10)] for p in prompts]
    assert generate_many(Session.load(many), prompts, 10, ignore_eos=True) == want


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_several_tokens_a_step_feed_prompts_beside_the_decoding_slots(
        arch: str, hf_checkpoints: dict[str, Path], slot_models: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """--decode_tokens 4: a decode step runs 4 tokens of each slot. Requests admitted while
    others decode skip the prefill (their prompt goes through the decode steps, 4 tokens at a
    time); every token and logit is still the sequence's alone, and the step allocates nothing."""
    from npuc.tools.alloc_profile import profile_run

    om = compile_model(str(hf_checkpoints[arch]), input_shape=f"input_ids:{SLOTS},{GEN_PREFILL}",
                       max_seq_len=GEN_MAX_SEQ, decode_tokens=4, output=str(tmp_path / "c4"))
    sess = Session.load(om)
    assert [t.shape for t in sess.programs["decode"].inputs] == [(SLOTS, 4), (SLOTS, 4)]
    prefills = []
    run = sess.run

    def counting(inputs, program=None, copy_outputs=True):  # type: ignore[no-untyped-def]
        prefills.append(program == "prefill")
        return run(inputs, program, copy_outputs)

    sess.run = counting  # type: ignore[method-assign]
    sched = Scheduler(sess, keep_logits=True)
    ids = [sched.submit(p, n, ignore_eos=True) for p, n in zip(PROMPTS, NEW, strict=True)]
    got: dict[int, list[tuple[int, torch.Tensor]]] = {i: [] for i in ids}
    while not sched.idle:
        for e in sched.step():
            got[e.request].append((e.token, e.logits))
    assert 0 < sum(prefills) < len(PROMPTS)  # the first admissions prefill; later ones feed through decode
    for i, prompt, new in zip(ids, PROMPTS, NEW, strict=True):
        want = _alone(slot_models[arch][0], prompt, new)
        assert [t for t, _ in got[i]] == [t for t, _ in want]
        err = max(float((a - b).abs().max()) for (_, a), (_, b) in zip(got[i], want, strict=True))
        assert err < 1e-4, f"sequence {i}: logits differ from its decoding alone by {err}"
    sess.run = run  # type: ignore[method-assign]
    step = {"input_ids": torch.ones(SLOTS, 4, dtype=torch.int64), "position": torch.arange(16).reshape(SLOTS, 4)}
    sess.run(step, "decode")
    r = profile_run(sess, step, "decode", copy_outputs=False)
    assert (r.count, r.bytes) == (0, 0), (r.ops, sess.launchers.kinds)


@pytest.mark.parametrize("value, max_seq, msg", [(0, GEN_MAX_SEQ, "not an integer from 1 to 64"),
                                                 (2, None, "needs --max_seq_len")])
def test_decode_tokens_errors(value: int, max_seq: int | None, msg: str, hf_checkpoints: dict[str, Path],
                              tmp_path: Path) -> None:
    with pytest.raises(NpucError) as e:
        compile_model(str(hf_checkpoints["llama"]), input_shape="input_ids:1,8", max_seq_len=max_seq,
                      decode_tokens=value, output=str(tmp_path / "m"))
    assert e.value.code == "NPUC-E0124" and msg in e.value.message and not list(tmp_path.iterdir())
