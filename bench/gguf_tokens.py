"""GGUF import: npuc's greedy tokens against HF eager on the file's own dequantized weights
and against llama.cpp on the same file, for a tiny random-init Llama and Qwen2 written in
each tensor type npuc reads (the writers and K-quant encoders of tests/gguf_models.py).

    python bench/gguf_tokens.py --llamacpp-python /tmp/lcpvenv/bin/python [--new 16]

Prints a Markdown table (docs/gguf.md keeps the last one). HF and npuc compute in f32
(`--precision_mode force_fp32`: an all-F16 or all-BF16 file otherwise compiles to a 16-bit
model) and must agree token for token (tests/test_gguf_import.py asserts it); llama.cpp quantizes the
activations of its quantized products to int8 (Q8_K for the K-quants) and is reported, not
asserted: on a random model, a near-tie between two logits can go either way.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
PROMPT = [5, 17, 3, 99, 42, 7, 64, 11]


def leading(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def hf_tokens(model: object, prompt: list[int], new: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)  # type: ignore[attr-defined]
    return out[0, len(prompt):].tolist()


def main() -> None:
    import gguf_models as gm
    import llamacpp

    from npuc.apps.generate import generate
    from npuc.compiler.driver import compile_model
    from npuc.runtime.executor import open_session

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llamacpp-python", required=True)
    ap.add_argument("--new", type=int, default=16)
    args = ap.parse_args()
    rows = ["| model | type | npuc = HF eager (leading tokens) | npuc vs llama.cpp (leading tokens) | "
            "tokens equal to llama.cpp's |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen2"):
            model = gm.hf_model(arch)
            tok = gm.bpe_tokenizer(model.config.vocab_size)
            for t in TYPES:
                path = Path(tmp) / f"{arch}-{t}.gguf"
                types = {n: t for n, p in model.state_dict().items() if p.dim() == 2}
                weights = gm.write_gguf(path, model, types, tokenizer=tok)
                ref = hf_tokens(gm.reference(model, weights), PROMPT, args.new)
                om = compile_model(str(path), input_shape=f"input_ids:1,{len(PROMPT)}",
                                   max_seq_len=len(PROMPT) + args.new, output=str(Path(tmp) / f"{arch}-{t}"),
                                   soc_version="cpu", precision_mode="force_fp32")
                got = generate(open_session(om, quiet=True), PROMPT, args.new, ignore_eos=True)
                lc = llamacpp.greedy_tokens(args.llamacpp_python, path, PROMPT, args.new)
                same = sum(a == b for a, b in zip(got, lc, strict=False))
                rows.append(f"| {arch} | {t} | {leading(got, ref)}/{args.new} | {leading(got, lc)}/{args.new} "
                            f"| {same}/{args.new} |")
                print(rows[-1], file=sys.stderr)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
