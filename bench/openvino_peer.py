"""OpenVINO GenAI beside npuc's quantized decode: the same checkpoint exported by
optimum-intel with int8 and int4 weights, run by `openvino_genai.LLMPipeline` on the CPU
with the same thread count, prompt and greedy decoding.

Runs in the venv that bench/setup_openvino.sh makes; bench/run.py starts it as a child
and reads the JSON it prints:

    /tmp/ovvenv/bin/python bench/openvino_peer.py run --ckpt DIR --weight-format int4 --group-size 128 \
        --work DIR --prompt-ids '[1, 2, 3]' --new 64 --threads 2

The export is `optimum-cli export openvino --task text-generation-with-past` in a process
of its own (it runs torch); the process that times imports openvino_genai, openvino and
numpy only. Weight compression is NNCF's, data-free, as optimum-intel sets it up:

* int8: every matrix int8 per output channel, asymmetric (NNCF's INT8_ASYM, the default);
* int4: `--group-size 128 --ratio 1.0`: every matrix int4 in groups of 128 along K,
  asymmetric (optimum's default without `--sym`), except the embedding table and the LM
  head, which NNCF keeps in int8 (its backup precision; npuc keeps its LM head in int8 too).

Everything else is OpenVINO's CPU default: its attention backend, its KV-cache precision,
and its dynamic quantization of the activations to int8 in groups (the report prints the
two properties). Prefix caching is turned off, so that every timed prefill computes the
whole prompt. The checkpoint has no tokenizer; the pipeline takes token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FORMATS = ("int8", "int4")


def export(ckpt: Path, out: Path, fmt: str, group: int | None) -> Path:
    """`optimum-cli export openvino` of the checkpoint (once; `out` appears when it is complete)."""
    if (out / "openvino_model.xml").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    cli = Path(sys.executable).parent / "optimum-cli"
    cmd = (
        [
            str(cli),
            "export",
            "openvino",
            "--model",
            str(ckpt),
            "--task",
            "text-generation-with-past",
            "--weight-format",
            fmt,
        ]
        + (["--group-size", str(group), "--ratio", "1.0"] if group else [])
        + [str(tmp)]
    )
    r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode})")
    os.replace(tmp, out)
    return out


class Generator:
    """The exported model loaded once; `prefill()` runs the prompt to its first token, and
    `generate()` runs the prompt and then greedy-decodes: (the new tokens, seconds of each
    decode step, from the streamer's clock; the first token comes from prefill, untimed).
    bench/decode_ab.py runs one too."""

    def __init__(self, model_dir: Path, prompt: list[int], new: int, threads: int) -> None:
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        self.ov_genai, self.new = ov_genai, new
        self.ids = ov.Tensor(np.array([prompt], dtype=np.int64))
        sched = ov_genai.SchedulerConfig()
        sched.enable_prefix_caching = False
        self.pipe = ov_genai.LLMPipeline(
            str(model_dir), "CPU", {"INFERENCE_NUM_THREADS": threads, "scheduler_config": sched}
        )
        self.version = ov_genai.__version__
        self.last_prefill_s = 0.0
        core = ov.Core()
        self.cpu_defaults = {}
        for prop in ("KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE"):
            try:
                v = core.get_property("CPU", prop)
            except Exception:  # a property this release does not have
                v = "n/a"
            self.cpu_defaults[prop] = v.get_type_name() if hasattr(v, "get_type_name") else str(v)

    def _config(self, new: int) -> Any:
        cfg = self.ov_genai.GenerationConfig()
        cfg.max_new_tokens = new
        cfg.min_new_tokens = new
        cfg.ignore_eos = True
        cfg.do_sample = False
        return cfg

    def prefill(self) -> None:
        self.pipe.generate(self.ids, self._config(1))

    def generate(self) -> tuple[list[int], list[float]]:
        ov_genai = self.ov_genai

        class Clock(ov_genai.StreamerBase):  # type: ignore[misc,name-defined]
            def __init__(self) -> None:
                super().__init__()
                self.tokens: list[int] = []
                self.times: list[float] = []

            def write(self, token: Any) -> Any:
                self.times.append(time.perf_counter())
                self.tokens += [int(t) for t in token] if isinstance(token, list) else [int(token)]
                return ov_genai.StreamingStatus.RUNNING

            def end(self) -> None:
                pass

        clock = Clock()
        t0 = time.perf_counter()
        out = self.pipe.generate(self.ids, self._config(self.new), clock)
        self.last_prefill_s = clock.times[0] - t0  # the prompt to its first token
        tokens = [int(t) for t in out.tokens[0]]
        if tokens != clock.tokens or len(clock.times) != len(tokens):
            raise RuntimeError("OpenVINO's streamer saw other tokens than the result, or several at a time")
        return tokens, [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]


def run(model_dir: Path, prompt: list[int], new: int, threads: int, reps: int) -> dict[str, Any]:
    g = Generator(model_dir, prompt, new, threads)
    g.generate()  # warm-up: the first inference compiles and allocates
    prefill = []
    for _ in range(reps):
        t0 = time.perf_counter()
        g.prefill()
        prefill.append(time.perf_counter() - t0)
    tokens, steps = g.generate()
    return {
        "tokens": tokens,
        "steps": steps,
        "prefill": prefill,
        "version": g.version,
        "model": str(model_dir),
        "bytes": sum(f.stat().st_size for f in model_dir.glob("openvino_model.*")),
        "cpu_defaults": g.cpu_defaults,
        "torch_imported": "torch" in sys.modules,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="export (once), then time prefill and greedy decode")
    r.add_argument("--ckpt", required=True, help="the Hugging Face checkpoint folder")
    r.add_argument("--weight-format", choices=FORMATS, required=True)
    r.add_argument("--group-size", type=int, default=None, help="int4's group (default: optimum's)")
    r.add_argument("--work", required=True)
    r.add_argument("--prompt-ids", required=True)
    r.add_argument("--new", type=int, default=64)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    name = f"openvino_{a.weight_format}" + (f"_g{a.group_size}" if a.group_size else "")
    model_dir = export(Path(a.ckpt), Path(a.work) / name, a.weight_format, a.group_size)
    json.dump(run(model_dir, json.loads(a.prompt_ids), a.new, a.threads, a.reps), sys.stdout)


if __name__ == "__main__":
    main()
