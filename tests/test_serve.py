"""`npuc serve` (apps/serve.py), run as users run it: a subprocess on a loopback port,
spoken to over HTTP. Every response's tokens are the ones `generate` gives that prompt
alone; bad requests get OpenAI-style 4xx errors and never reach the model; a full queue
is 429; a client that goes away frees its slot; SIGTERM drains and exits 0."""

from __future__ import annotations

import http.client
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from npuc.apps.scheduler import generate_many
from npuc.compiler.driver import compile_model
from npuc.runtime import Session

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

SLOTS, PREFILL, MAX_SEQ = 4, 8, 48
TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, om: Path, max_queue: int = 64) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "npuc", "serve", str(om), "--port", str(self.port),
                                      "--max-queue", str(max_queue)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"npuc serve did not start: {self.proc.communicate()[1][-2000:]}")

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)

    def get(self, path: str) -> tuple[int, str]:
        c = self.conn()
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()

    def post(self, path: str, body: Any) -> tuple[int, dict[str, Any], dict[str, str]]:
        c = self.conn()
        c.request("POST", path, body=body if isinstance(body, str | bytes) else json.dumps(body),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.getheaders()}

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[Any]:
        c = self.conn()
        c.request("POST", path, body=json.dumps({**body, "stream": True}), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: "):
                yield "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])

    def metric(self, name: str) -> float:
        text = self.get("/metrics")[1]
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")
                          or line.startswith(name + "{")))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture(scope="module")
def models(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """llama with a tokenizer and a chat template: (SLOTS slots, one slot)."""
    from test_generate import _save_tokenizer

    root = tmp_path_factory.mktemp("serve")
    ckpt = root / "ckpt"
    shutil.copytree(hf_checkpoints["llama"], ckpt)
    tok = _save_tokenizer(root / "tok")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(ckpt))
    many = compile_model(str(ckpt), input_shape=f"input_ids:{SLOTS},{PREFILL}", max_seq_len=MAX_SEQ,
                         output=str(root / "many"))
    one = compile_model(str(ckpt), input_shape=f"input_ids:1,{PREFILL}", max_seq_len=MAX_SEQ, output=str(root / "one"))
    return Path(many), Path(one)


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama big enough (32M parameters, 512 positions) that a request lasts seconds: what
    a disconnect or a SIGTERM must interrupt mid-way."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("serve_slow")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(root / "ckpt"))
    return Path(compile_model(str(root / "ckpt"), input_shape=f"input_ids:{SLOTS},{PREFILL}", max_seq_len=512,
                              output=str(root / "slow")))


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path]) -> Iterator[Server]:
    s = Server(models[0])
    yield s
    s.close()


def _alone(one: Path, prompts: list[list[int]], new: list[int]) -> list[list[int]]:
    sess = Session.load(str(one))
    return [generate_many(sess, [p], n, ignore_eos=True)[0] for p, n in zip(prompts, new, strict=True)]


def test_64_concurrent_requests_each_get_their_own_tokens(server: Server, models: tuple[Path, Path]) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(1, 20))] for _ in range(64)]
    new = [rng.randrange(1, 14) for _ in range(64)]
    want = _alone(models[1], prompts, new)

    def one(i: int) -> tuple[int, list[int], str | None]:
        body = {"prompt": prompts[i], "max_tokens": new[i], "ignore_eos": True, "temperature": 0}
        if i % 2:
            chunks = list(server.stream("/v1/completions", body))
            assert chunks[-1] == "[DONE]"
            ids = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
            return i, ids, chunks[-2]["choices"][0]["finish_reason"]
        status, out, _ = server.post("/v1/completions", body)
        assert status == 200, out
        return i, out["choices"][0]["token_ids"], out["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(64) as ex:
        results = list(ex.map(one, range(64)))
    assert sorted(i for i, _, _ in results) == list(range(64))
    for i, ids, reason in results:
        assert ids == want[i], i
        assert reason == "length"
    assert server.metric("npuc_active_slots") == 0 and server.metric("npuc_queue_depth") == 0


def _hf_tokenizer(om: Path, where: Path) -> Any:
    """transformers' tokenizer over the files stored in the .om: the reference for the server's
    own (apps/tokenizer.py, which runs without transformers)."""
    from transformers import AutoTokenizer

    from npuc.runtime.om_validate import check_tokenizer

    files = check_tokenizer(str(om), Session.load(str(om)).om.section("tokenizer").tobytes())
    for name, data in files.items():
        (where / name).write_bytes(data)
    return AutoTokenizer.from_pretrained(str(where), local_files_only=True)


def test_text_and_chat(server: Server, models: tuple[Path, Path], tmp_path: Path) -> None:
    tok = _hf_tokenizer(models[1], tmp_path)
    status, out, _ = server.post("/v1/completions", {"prompt": "w5 w9 w17", "max_tokens": 5, "ignore_eos": True})
    assert status == 200
    ids = tok("w5 w9 w17")["input_ids"]
    want = _alone(models[1], [ids], [5])[0]
    assert out["choices"][0]["token_ids"] == want and out["choices"][0]["text"] == tok.decode(want,
                                                                                                skip_special_tokens=True)
    messages = [{"role": "user", "content": "w7 w8"}]
    status, out, _ = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 4, "ignore_eos": True})
    assert status == 200, out
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    assert out["object"] == "chat.completion" and out["choices"][0]["token_ids"] == _alone(models[1], [chat_ids], [4])[0]
    assert out["choices"][0]["message"]["role"] == "assistant"
    chunks = list(server.stream("/v1/chat/completions", {"messages": messages, "max_tokens": 4, "ignore_eos": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"} and chunks[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks[1:-1]) == out["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 2], "max_tokens": 3, "best_of": 2}, "best_of"),
    ({"prompt": [1, 2], "logit_bias": {"999": 1.0}}, "logit_bias"),
    ({"prompt": [1, 2], "logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"prompt": [1, 2], "temperature": -0.7}, "temperature"),
    ({"prompt": [1, 2], "temperature": "hot"}, "temperature"),
    ({"prompt": [1, 2], "top_p": 1.5, "temperature": 1}, "top_p"),
    ({"prompt": [1, 2], "top_k": -3}, "top_k"),
    ({"prompt": [1, 2], "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": [1, 2], "seed": 1.5}, "seed"),
    ({"prompt": [1, 2], "logprobs": 21}, "logprobs"),
    ({"prompt": [1, 2], "stop": [1]}, "stop"),
    ({"prompt": [1, 2], "echo": "yes"}, "echo"),
    ({"prompt": [1, 128]}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": list(range(3, 3 + MAX_SEQ))}, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": "5"}, "max_tokens"),
    ({"prompt": [1, 2], "n": SLOTS + 1}, "n"),
    ({"prompt": [1, 2], "n": 0}, "n"),
    ({"prompt": []}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [[1], [2]]}, "prompt"),
    ('{"prompt": [1, 2', None),
    ("[1, 2]", None),
])
def test_bad_requests_get_a_json_4xx_and_serving_goes_on(body: Any, param: str | None, server: Server) -> None:
    before = server.metric("npuc_generated_tokens_total")
    status, out, _ = server.post("/v1/completions", body)
    assert status == 400 and out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == param
    assert server.metric("npuc_generated_tokens_total") == before  # it never reached the model
    status, out, _ = server.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "ignore_eos": True})
    assert status == 200 and len(out["choices"][0]["token_ids"]) == 2


def test_chat_errors(server: Server) -> None:
    status, out, _ = server.post("/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and out["error"]["param"] == "messages"


def test_a_client_that_disconnects_frees_its_slot(slow_model: Path) -> None:
    s = Server(slow_model)
    try:
        c = s.conn()
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": [3, 4, 5], "max_tokens": 400,
                                                              "ignore_eos": True, "stream": True}))
        r = c.getresponse()
        assert r.readline().startswith(b"data: ")
        assert s.metric("npuc_active_slots") == 1
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        deadline = time.monotonic() + 2
        while s.metric("npuc_active_slots") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.metric("npuc_active_slots") == 0
        assert s.metric('npuc_requests_total{outcome="cancelled"}') == 1
        assert s.metric("npuc_generated_tokens_total") < 400
    finally:
        s.close()


def test_a_full_queue_gives_429_with_retry_after(slow_model: Path) -> None:
    s = Server(slow_model, max_queue=1)
    try:
        def one(i: int) -> tuple[int, dict[str, str]]:
            status, _, headers = s.post("/v1/completions", {"prompt": [3 + i, 4], "max_tokens": 30, "ignore_eos": True})
            return status, headers

        with ThreadPoolExecutor(16) as ex:
            results = list(ex.map(one, range(16)))
        statuses = [st for st, _ in results]
        assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
        assert all(h.get("retry-after") == "1" for st, h in results if st == 429)
    finally:
        s.close()


def test_sigterm_mid_load_finishes_what_is_in_flight_and_exits_0(slow_model: Path) -> None:
    s = Server(slow_model)

    def one(i: int) -> tuple[str, list[int]]:
        try:
            chunks = list(s.stream("/v1/completions", {"prompt": [3 + i, 9, 4], "max_tokens": 25, "ignore_eos": True}))
        except (OSError, http.client.HTTPException, AssertionError):
            return "refused", []
        ids = [t for c in chunks if c != "[DONE]" for t in c["choices"][0]["token_ids"]]
        return ("complete" if chunks and chunks[-1] == "[DONE]" else "cut"), ids

    with ThreadPoolExecutor(8) as ex:
        futures = [ex.submit(one, i) for i in range(8)]
        deadline = time.monotonic() + 30
        while s.metric("npuc_generated_tokens_total") < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        s.proc.send_signal(signal.SIGTERM)
        results = [f.result() for f in futures]
    assert s.proc.wait(timeout=120) == 0
    started = [(how, ids) for how, ids in results if how != "refused"]
    assert started and all(how == "complete" and len(ids) == 25 for how, ids in started)
