"""The files beside a model that a `.om` carries: the generation metadata (end-of-sequence
ids) and the tokenizer, read from a Hugging Face folder, the folder an ONNX file is in, or
a GGUF file's metadata (compiler/driver.py stores them in the `metadata` and `tokenizer`
sections)."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from npuc.compiler.gguf_import import eos_token_ids, is_gguf, tokenizer_files


def is_onnx(model: Any) -> bool:
    return isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".onnx")


def generation_meta(model: Any, max_seq_len: int) -> tuple[dict[str, str], list[str]]:
    """Generation metadata (the end-of-sequence ids, from the checkpoint's generation
    config or config), and the files read for it."""
    meta = {"programs": "prefill,decode", "max_seq_len": str(max_seq_len)}
    read: list[str] = []
    if is_gguf(model):  # the metadata's tokenizer.ggml.eos_token_id
        ids = eos_token_ids(model)
        if ids:
            meta["eos_token_id"] = ",".join(str(i) for i in ids)
        return meta, [os.fspath(model)]
    folder = checkpoint_folder(model)
    if folder is not None:
        for fname in ("generation_config.json", "config.json"):
            path = os.path.join(folder, fname)
            try:
                with open(path) as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError):
                continue
            read.append(path)
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                meta["eos_token_id"] = ",".join(str(int(i)) for i in ids)
                break
    return meta, read


def checkpoint_folder(model: Any) -> str | None:
    """Where a model's generation config and tokenizer are: a Hugging Face folder, or the
    folder an ONNX file is in (optimum and onnxruntime-genai's builder write them beside it)."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    if os.path.isdir(model):
        return os.fspath(model)
    return os.path.dirname(os.path.abspath(model)) if is_onnx(model) else None


# What transformers' tokenizers are saved as; stored in the .om so `npuc generate --prompt` works.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def tokenizer_section(model: Any) -> tuple[dict[str, bytes], list[str]]:
    """The `tokenizer` section (the folder's tokenizer files), and the files read."""
    if is_gguf(model):  # built by transformers from the file's metadata
        made = {n: base64.b64encode(b).decode("ascii") for n, b in tokenizer_files(model).items()}
        return ({"tokenizer": json.dumps(made, sort_keys=True).encode()} if made else {}), [os.fspath(model)]
    folder = checkpoint_folder(model)
    if folder is None:
        return {}, []
    files, read = {}, []
    for fname in TOKENIZER_FILES:
        path = os.path.join(folder, fname)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[fname] = base64.b64encode(f.read()).decode("ascii")
            read.append(path)
    if "tokenizer.json" not in files and "tokenizer.model" not in files and "vocab.json" not in files:
        return {}, read
    return {"tokenizer": json.dumps(files, sort_keys=True).encode()}, read
