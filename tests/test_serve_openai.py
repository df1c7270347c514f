"""`npuc serve` driven by the official `openai` Python package, as applications drive it:
sampling with a seed, stop strings, logprobs (and echo with logprobs, the loglikelihood
lm-eval scores with), completions and chat, streaming and not. The references are
npuc's own scheduler run in-process (the same sampled tokens) and HF transformers' logits
on the same checkpoint (the log-probabilities)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_serve import PREFILL, SLOTS, Server, _hf_tokenizer, models  # noqa: F401 - models: a fixture

from npuc.apps.sampling import SamplingParams
from npuc.apps.scheduler import Scheduler
from npuc.runtime.executor import open_session
from npuc.runtime.native_session import runtime_library

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytestmark = pytest.mark.skipif(runtime_library() is None, reason="sampling needs the native runtime")


@pytest.fixture(scope="module")
def ckpt_and_om(request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """test_serve's Llama with a tokenizer and a chat template: (its checkpoint, the SLOTS-slot .om)."""
    many = request.getfixturevalue("models")[0]
    return many.parent / "ckpt", many


@pytest.fixture(scope="module")
def client(ckpt_and_om: tuple[Path, Path]) -> Iterator[Any]:
    s = Server(ckpt_and_om[1])
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none", max_retries=0)
    s.close()


@pytest.fixture(scope="module")
def tok(ckpt_and_om: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _hf_tokenizer(ckpt_and_om[1], tmp_path_factory.mktemp("tok"))


PROMPT = "w5 w9 w17 w33"
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}


def _local(om: Path, prompt: list[int], new: int, params: SamplingParams) -> list[int]:
    sched = Scheduler(open_session(str(om)))
    rid = sched.submit(prompt, new, True, params)
    while not sched.idle:
        sched.step()
    return sched.requests[rid].tokens


def _text(chunks: Any, chat: bool) -> str:
    return "".join((c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks if c.choices)


def test_seeded_sampling_completions_and_chat(client: Any, ckpt_and_om: tuple[Path, Path], tok: Any) -> None:
    extra = {"ignore_eos": True, "top_k": 40}
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, extra_body=extra, **SAMPLED)
    ids = tok(PROMPT)["input_ids"]
    want = _local(ckpt_and_om[1], ids, 12, SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234))
    assert out.choices[0].model_extra["token_ids"] == want
    assert out.choices[0].text == tok.decode(want)
    streamed = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, extra_body=extra, stream=True,
                                         **SAMPLED)
    assert _text(streamed, chat=False) == out.choices[0].text
    greedy = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True})
    assert greedy.choices[0].text != out.choices[0].text  # sampled, not the default greedy answer
    other = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, extra_body=extra,
                                      **{**SAMPLED, "seed": 99})
    assert other.choices[0].text != out.choices[0].text

    messages = [{"role": "user", "content": "w7 w8"}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=10, extra_body=extra, **SAMPLED)
    again = client.chat.completions.create(model="m", messages=messages, max_tokens=10, extra_body=extra, stream=True,
                                           **SAMPLED)
    assert _text(again, chat=True) == chat.choices[0].message.content


def test_stop_strings_across_token_boundaries(client: Any) -> None:
    base = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    words = text.split(" ")
    assert len(words) >= 5
    cut = len(words[0]) + 1 + len(words[1]) - 1  # the last character of word 2, the space, and word 3's first
    stop = text[cut:cut + 3]
    want = text[:text.find(stop)]
    for chat in (False, True):
        for stream in (False, True):
            if chat:
                r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "w5 w9"}],
                                                   max_tokens=10, stop=[stop, "zzz"], stream=stream,
                                                   extra_body={"ignore_eos": True})
            else:
                r = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, stop=stop, stream=stream,
                                              extra_body={"ignore_eos": True})
            if stream:
                chunks = list(r)
                got = _text(chunks, chat)
                reason = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices
                              and c.choices[0].finish_reason)
            else:
                got = r.choices[0].message.content if chat else r.choices[0].text
                reason = r.choices[0].finish_reason
            if chat:  # another prompt: its own text, cut at its own first match (if any)
                assert stop not in got
                continue
            assert got == want and reason == "stop", (chat, stream, got, want)


def _hf_logprobs(ckpt: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


def test_logprobs_are_the_models_log_softmax(client: Any, ckpt_and_om: tuple[Path, Path], tok: Any) -> None:
    ids = tok(PROMPT)["input_ids"]
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, logprobs=3,
                                  extra_body={"ignore_eos": True}, **SAMPLED)
    gen = r.choices[0].model_extra["token_ids"]
    ref = _hf_logprobs(ckpt_and_om[0], ids + gen)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(gen) == 6
    for i, t in enumerate(gen):
        row = ref[len(ids) - 1 + i]
        assert abs(lp.token_logprobs[i] - row[t]) < 1e-4  # before temperature and top_p
        best = np.argsort(-row, kind="stable")[:3]
        assert list(lp.top_logprobs[i].values()) == pytest.approx([row[b] for b in best], abs=1e-4)
        assert list(lp.top_logprobs[i]) == [tok.decode([int(b)]) for b in best]

    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "w7 w8"}], max_tokens=5,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the most likely
    assert "".join(c.token for c in content).replace(" ", "") == chat.choices[0].message.content.replace(" ", "")

    streamed = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "w7 w8"}],
                                                   max_tokens=5, logprobs=True, top_logprobs=2, stream=True,
                                                   extra_body={"ignore_eos": True}))
    got = [c.choices[0].logprobs.content[0].logprob for c in streamed if c.choices and c.choices[0].logprobs]
    assert got == pytest.approx([c.logprob for c in content], abs=1e-6)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(client: Any, ckpt_and_om: tuple[Path, Path], tok: Any,
                                              max_tokens: int) -> None:
    """lm-eval's loglikelihood request: the prompt (longer than the prefill) echoed with
    each token's log-probability under the tokens before it."""
    text = "w5 w9 w17 w33 w40 w41 w7 w100 w12 w13 w99 w3"
    ids = tok(text)["input_ids"]
    assert len(ids) > PREFILL
    r = client.completions.create(model="m", prompt=ids, max_tokens=max_tokens, logprobs=1, echo=True, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + max_tokens
    ref = _hf_logprobs(ckpt_and_om[0], ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1][ids[i]]) < 1e-4, i
    total = sum(lp.token_logprobs[1:len(ids)])
    assert math.isfinite(total)
    assert r.choices[0].text.startswith(tok.decode(ids))


def test_n_choices_share_one_prompt(client: Any) -> None:
    """n = 2: choice i is what one request seeded S + i gets (one prefill, its slot copied)."""
    extra = {"ignore_eos": True}
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, n=2, extra_body=extra, **SAMPLED)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 16
    for i in range(2):
        one = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, extra_body=extra,
                                        **{**SAMPLED, "seed": SAMPLED["seed"] + i})
        assert r.choices[i].text == one.choices[0].text
    assert r.choices[0].text != r.choices[1].text
    messages = [{"role": "user", "content": "w7 w8"}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=6, n=2, extra_body=extra,
                                          **SAMPLED)
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=6, n=2, stream=True,
                                                 extra_body=extra, **SAMPLED))
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == chat.choices[i].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=4, n=SLOTS + 1)
    assert e.value.body["param"] == "n"
