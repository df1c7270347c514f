"""A bounded load test of `npuc serve` on loopback: time to first token (TTFT) and
inter-token latency (ITL), P50 and P99, at a steady request rate below saturation and at
saturation.

    python bench/serve_load.py OM [--requests 40] [--new 32] [--rate R] [--time-limit 300]

The server runs in its own process (`npuc serve OM --port P`); the client streams every
request (`/v1/completions`, `stream: true`) from its own thread and stamps each token as it
arrives. A warm-up runs first (SLOTS requests at once); steady: requests arrive at half its
completions per second, evenly spaced; saturation: all at once, whose completions per
second are the capacity reported. Each phase is bounded by the request count and a time
limit. Prompts are `prompt` random token ids.
First (--floor-rounds) the same model decodes alone in this process, every slot busy, no
server: its step P99/P50 is the host's own, the floor under the load's ITL P99/P50.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(q / 100 * (len(ys) - 1))))] if ys else float("nan")


class Client:
    def __init__(self, port: int) -> None:
        self.port = port

    def stream(self, prompt: list[int], new: int) -> tuple[float, list[float]]:
        """(seconds to the first token, the gaps between the later ones)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": new,
                                                              "ignore_eos": True, "stream": True}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"status {r.status}: {r.read()[:200]!r}")
        stamps = []
        for raw in r:
            line = raw.strip()
            if line.startswith(b"data: {"):
                stamps.extend([time.perf_counter()] * len(json.loads(line[6:])["choices"][0]["token_ids"]))
        c.close()
        return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def phase(client: Client, prompts: list[list[int]], new: int, interval: float, limit: float) -> dict[str, Any]:
    ttft: list[float] = []
    itl: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(p: list[int]) -> None:
        try:
            first, gaps = client.stream(p, new)
        except Exception as e:  # noqa: BLE001 - a failed request is a figure of the run
            with lock:
                errors.append(str(e))
            return
        with lock:
            ttft.append(first)
            itl.extend(gaps)

    threads = []
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        wait = start + i * interval - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        if time.perf_counter() - start > limit:
            break
        t = threading.Thread(target=one, args=(p,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(max(0.0, limit - (time.perf_counter() - start)))
    wall = time.perf_counter() - start
    return {"requests": len(threads), "completed": len(ttft), "errors": errors[:5], "wall_s": wall,
            "tok_per_s": (len(itl) + len(ttft)) / wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "itl_p99_over_p50": pct(itl, 99) / pct(itl, 50) if itl else float("nan"),
            "interval_s": interval}


def alone(om: Path, vocab: int, prompt_len: int, new: int, rounds: int) -> dict[str, Any]:
    """The host's own floor under the ITL target: the model's decode steps with every slot
    busy, timed in a loop in this process (the scheduler on the C executor, no server, no
    admissions beside them), each round SLOTS requests of the load's prompt and new lengths
    at once. Only steps that gave every slot a token (or C of them) count, the first 8 of a
    round left out."""
    import random

    from npuc.apps.scheduler import Scheduler
    from npuc.runtime.native_session import NativeSession

    session = NativeSession(str(om))
    try:
        sched = Scheduler(session)
        slots = sched.slots
        rng = random.Random(1)
        steps: list[float] = []
        for _ in range(rounds):
            for _ in range(slots):
                sched.submit([rng.randrange(3, vocab) for _ in range(prompt_len)], new, True)
            n = 0
            while not sched.idle:
                t0 = time.perf_counter()
                events = sched.step()
                t1 = time.perf_counter()
                if len({e.request for e in events if e.token is not None}) == slots:
                    n += 1
                    if n > 8:
                        steps.append(t1 - t0)
    finally:
        session.close()
    return {"steps": len(steps), "step_p50_ms": 1e3 * pct(steps, 50), "step_p99_ms": 1e3 * pct(steps, 99),
            "p99_over_p50": pct(steps, 99) / pct(steps, 50) if steps else float("nan")}


def run(om: Path, vocab: int, prompt_len: int, new: int, requests: int, limit: float,
        rate: float | None = None, floor_rounds: int = 0) -> dict[str, Any]:
    """The load test of om; with floor_rounds, first alone()'s floor over that many rounds."""
    import random

    floor = alone(om, vocab, prompt_len, new, floor_rounds) if floor_rounds else None
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "npuc", "serve", str(om), "--port", str(port),
                             "--max-queue", str(max(requests, 1))], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("npuc serve did not start") from None
                time.sleep(0.2)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/metrics")
        slots = int(next(float(line.split()[-1]) for line in c.getresponse().read().decode().splitlines()
                         if line.startswith("npuc_slots ")))
        from npuc.tools.om_tools import model_info

        programs = {p["name"]: p for p in model_info(str(om))["programs"]}
        tokens = int(programs["decode"]["inputs"][0]["shape"][1])
        mixed = int(programs["mixed"]["inputs"][0]["shape"][1]) - slots if "mixed" in programs else 0
        rng = random.Random(0)
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(requests)]
        client = Client(port)
        # a warm-up with every slot busy, whose completions per second set the steady rate (the
        # capacity reported is the saturation phase's, over every request)
        cap = phase(client, prompts[:slots], new, 0.0, limit)
        per_s = rate or cap["completed"] / cap["wall_s"]
        steady = phase(client, prompts, new, 1.0 / (0.5 * per_s) if not rate else 1.0 / rate, limit)
        saturated = phase(client, prompts, new, 0.0, limit)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return {"slots": slots, "prompt": prompt_len, "new": new, "capacity_req_per_s": per_s,
            "saturation_req_per_s": saturated["completed"] / saturated["wall_s"],
            "steady": steady, "saturation": saturated, "exit_code": proc.returncode, "decode_tokens": tokens,
            "mixed_tokens": mixed, "alone": floor}


def _flag(load: dict[str, Any]) -> str:
    """The compile flag that set the model's steps apart."""
    if load.get("mixed_tokens"):
        return f"--mixed_tokens {load['mixed_tokens']}"
    return f"--decode_tokens {load.get('decode_tokens', 1)}"


def _capacity(load: dict[str, Any]) -> float:
    """Completions per second at saturation (every request at once); a run from before that
    figure was kept: its warm-up's (SLOTS requests at once)."""
    return float(load.get("saturation_req_per_s") or load["capacity_req_per_s"])


def render(loads: list[dict[str, Any]] | dict[str, Any]) -> list[str]:
    """The section: one model per run, each at the steady load and at saturation."""
    loads = [loads] if isinstance(loads, dict) else loads
    first = loads[0]
    lines = ["", "## Serving under load", "",
             f"bench/serve_load.py: `npuc serve` ({first['slots']} slots) on loopback, every request streamed, "
             f"{first['prompt']} prompt tokens and {first['new']} new ones each. Steady: requests evenly spaced at "
             "half the completions per second of a warm-up with every slot busy; saturation: all at once. "
             "Capacity: the saturation phase's completions per second. "
             "The models are timed one after the other in the same run. With `--decode_tokens C` > 1 a decode "
             "step runs C tokens of each slot, and a request admitted while others decode feeds its prompt "
             "through those steps instead of a prefill. With `--mixed_tokens C` a request admitted while "
             "others stream feeds its prompt C tokens at a time through the mixed step, one row per decoding "
             "slot plus C prompt rows (apps/scheduler.py, docs/serving.md).", "",
             "| model | load | requests/s | completed | tokens/s | TTFT P50 (ms) | TTFT P99 (ms) "
             "| ITL P50 (ms) | ITL P99 (ms) | ITL P99/P50 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for load in loads:
        for name in ("steady", "saturation"):
            d = load[name]
            rate = f"{1 / d['interval_s']:.2f}" if d["interval_s"] else "all at once"
            lines.append(f"| `{_flag(load)}` | {name} | {rate} | {d['completed']}/{d['requests']} | "
                         f"{d['tok_per_s']:.1f} | {d['ttft_p50_ms']:.0f} | {d['ttft_p99_ms']:.0f} | "
                         f"{d['itl_p50_ms']:.1f} | {d['itl_p99_ms']:.1f} | {d['itl_p99_over_p50']:.2f} |")
    lines.append("")
    base = next((_capacity(load) for load in loads
                 if not load.get("mixed_tokens") and load.get("decode_tokens", 1) == 1), None)
    for load in loads:
        ratio = load["steady"]["itl_p99_over_p50"]
        cap = _capacity(load)
        versus = f" ({cap / base:.2f}x `--decode_tokens 1`'s)" if base and _flag(load) != "--decode_tokens 1" else ""
        floor = load.get("alone")
        host = (f" (the same model decoding alone, every slot busy, no server, just before: step P99/P50 "
                f"{floor['p99_over_p50']:.2f}x over {floor['steps']} steps, P50 {floor['step_p50_ms']:.1f} ms)"
                if floor and floor["steps"] else "")
        lines.append(f"- `{_flag(load)}`: capacity {cap:.2f} requests/s{versus}; ITL P99 at most 1.3x its P50 at "
                     f"the steady load: {ratio:.2f}x ({'met' if ratio <= 1.3 else 'missed'}){host}; exit code "
                     f"after SIGTERM: {load['exit_code']}.")
    if any(load["steady"]["itl_p99_over_p50"] > 1.3 for load in loads):
        lines += ["", "Where it is missed: without a mixed step, a newly admitted request's prefill runs between "
                      "two decode steps, so the requests already decoding wait for it; at the steady load that "
                      "gap is the P99. A decode step is bound by reading the weights, and so is a prefill of a "
                      "few tokens, so chunks run as steps of their own would not bound it either. "
                      "`--decode_tokens C` puts the prompt's rows into the decode step's products instead, at "
                      "the price of C rows per slot in every step; `--mixed_tokens C` adds only C rows, and "
                      "only to the steps that feed a prompt (docs/serving.md)."]
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("om")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=None, help="steady requests/s (default: half the capacity)")
    ap.add_argument("--time-limit", type=float, default=300)
    ap.add_argument("--floor-rounds", type=int, default=10, help="rounds of the model decoding alone first, the "
                    "host's own step P99/P50 (0: none)")
    args = ap.parse_args(argv)
    load = run(Path(args.om), args.vocab, args.prompt, args.new, args.requests, args.time_limit, args.rate,
               args.floor_rounds)
    print(json.dumps(load, indent=2))
    print("\n".join(render(load)), file=sys.stderr)
    sys.exit(0 if load["steady"]["completed"] and not load["steady"]["errors"] else 1)


if __name__ == "__main__":
    main()
