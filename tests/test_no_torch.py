"""The runtime commands where torch cannot be imported: `npuc run`, `generate` (token ids
and text through the stored tokenizer), `serve`, `info`, `validate` and `dump` run on the
C executor with torch, transformers, onnx, safetensors, networkx, `npuc.compiler`,
`npuc.passes` and `npuc.ir` blocked from import, and give what the torch interpreter gives."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_e2e_hf import RUNNER

from npuc.compiler.driver import compile_model
from npuc.runtime.native_session import runtime_library

pytestmark = pytest.mark.skipif(runtime_library() is None, reason="no C compiler: the native runtime is not built")

BLOCKED = ["torch", "transformers", "onnx", "onnxruntime", "safetensors", "networkx", "npuc.compiler", "npuc.passes",
           "npuc.ir"]
# The same runner as test_e2e_hf's (an import blocker, then the CLI), with torch blocked too.


def _argv(argv: list[str]) -> list[str]:
    return [sys.executable, "-c", RUNNER.format(blocked=BLOCKED, argv=argv)]


def without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_argv(list(argv)), capture_output=True, text=True, timeout=300)


def with_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NPUC_EXECUTOR": "torch"}
    return subprocess.run([sys.executable, "-m", "npuc", *argv], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def model(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama with a stored tokenizer and a chat template, compiled with --max_seq_len."""
    from test_generate import _save_tokenizer

    root = tmp_path_factory.mktemp("notorch")
    ckpt = root / "ckpt"
    shutil.copytree(hf_checkpoints["llama"], ckpt)
    tok = _save_tokenizer(root / "tok")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant"
    tok.save_pretrained(str(ckpt))
    return Path(compile_model(str(ckpt), input_shape="input_ids:1,8", max_seq_len=48, output=str(root / "m")))


def test_generate_and_run(model: Path, tmp_path: Path) -> None:
    for args in (["--prompt-ids", "5,17,3,99", "--max-new-tokens", "12", "--ignore-eos"],
                 ["--prompt", "w5 w17 w3", "--max-new-tokens", "8", "--ignore-eos"],
                 ["--prompt-ids", "1,2,3", "--prompt-ids", "9,9", "--max-new-tokens", "5"]):
        got, want = without_torch("generate", str(model), *args), with_torch("generate", str(model), *args)
        assert got.returncode == 0, got.stderr
        assert want.returncode == 0, want.stderr
        assert got.stdout == want.stdout and got.stdout.strip()
    np.save(tmp_path / "ids.npy", np.arange(8, dtype=np.int64).reshape(1, 8) + 3)
    np.save(tmp_path / "last.npy", np.array([7], dtype=np.int64))
    args = ["run", str(model), "--input", f"input_ids={tmp_path / 'ids.npy'}", "--input",
            f"last_token={tmp_path / 'last.npy'}"]
    got = without_torch(*args, "--output-dir", str(tmp_path / "c"))
    want = with_torch(*args, "--output-dir", str(tmp_path / "t"))
    assert got.returncode == 0 and want.returncode == 0, got.stderr + want.stderr
    a, b = np.load(tmp_path / "c/logits.npy"), np.load(tmp_path / "t/logits.npy")
    assert a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-5


def test_inspection_tools(model: Path, tmp_path: Path) -> None:
    for cmd in (["info"], ["info", "--json"], ["dump", "--summary"], ["dump"]):
        got, want = without_torch(*cmd, str(model)), with_torch(*cmd, str(model))
        assert got.returncode == 0, got.stderr
        assert got.stdout == want.stdout, cmd
    got = without_torch("validate", str(model))
    assert got.returncode == 0 and got.stdout.startswith("ok:") and "native runtime" in got.stdout, got.stderr
    bad = tmp_path / "bad.om"
    data = bytearray(model.read_bytes())
    data[-5] ^= 0xFF  # a weight byte: the weights section's checksum
    bad.write_bytes(bytes(data))
    got, want = without_torch("validate", str(bad)), with_torch("validate", str(bad))
    assert got.returncode == want.returncode == 4
    assert got.stderr.splitlines()[0] == want.stderr.splitlines()[0]


def test_serve(model: Path) -> None:
    pytest.importorskip("starlette")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen(_argv(["serve", str(model), "--port", str(port)]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError(proc.communicate(timeout=10)[1][-2000:]) from None
                time.sleep(0.2)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 4, "ignore_eos": True}
        c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        out = json.loads(r.read())
        assert r.status == 200, out
        want = with_torch("generate", str(model), "--prompt-ids",
                          ",".join(map(str, _chat_ids(model))), "--max-new-tokens", "4", "--ignore-eos")
        assert out["choices"][0]["token_ids"] == [int(t) for t in want.stdout.split()]
    finally:
        proc.kill()
        proc.communicate()


def _chat_ids(model: Path) -> list[int]:
    """The chat prompt's ids as transformers' tokenizer makes them from the stored files."""
    import tempfile

    from transformers import AutoTokenizer

    from npuc.backend.om_format import OmFile
    from npuc.runtime.om_validate import check_tokenizer

    with OmFile.open(model) as om:
        files = check_tokenizer(str(model), bytes(om.section("tokenizer")))
    with tempfile.TemporaryDirectory() as d:
        for name, data in files.items():
            Path(d, name).write_bytes(data)
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        ids = tok.apply_chat_template([{"role": "user", "content": "w7 w8"}], add_generation_prompt=True,
                                      tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
