"""GPU check of sampling (issue 32): greedy, seeded sampling (alone and in slot 3 beside three
other requests), logprobs and n > 1 through the torch interpreter on CUDA (`--device cuda`),
against the same on the CPU. A check to run by hand where a GPU is (docs/serving.md has the
last run's figures), not a test: CI has no GPU.

    python3 bench/gpu_sampling_check.py          # prints JSON; also $OUT/result.json where OUT is set
"""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

try:
    import npuc  # noqa: F401
except ImportError:  # a checkout, not installed: the repository root is the package
    link = Path(tempfile.mkdtemp()) / "npuc"
    link.symlink_to(Path(__file__).resolve().parent.parent)
    sys.path.insert(0, str(link.parent))
import torch  # noqa: E402
import transformers  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("no GPU: torch.cuda.is_available() is False")
res: dict[str, object] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
torch.manual_seed(0)
work = tempfile.mkdtemp()
cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
transformers.LlamaForCausalLM(cfg).save_pretrained(os.path.join(work, "ck"))
from npuc.apps.sampling import SamplingParams  # noqa: E402
from npuc.apps.scheduler import Scheduler  # noqa: E402
from npuc.compiler.driver import compile_model  # noqa: E402
from npuc.runtime.executor import open_session  # noqa: E402
from npuc.runtime.native_session import runtime_library  # noqa: E402

om = compile_model(os.path.join(work, "ck"), input_shape="input_ids:4,16", max_seq_len=64, output=os.path.join(work, "m"))
res["native_library"] = runtime_library() is not None
P = [5, 9, 33, 7, 2, 81]
S = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=2024)
def run(device: str, reqs: list, lp: int = -1, n: int = 1) -> tuple[list, list]:
    sch = Scheduler(open_session(om, device=device))
    ids = []
    for p, q in reqs:
        ids += sch.submit_many(p, n, 20, True, q, lp)
    ev: dict[int, list] = {}
    while not sch.idle:
        for e in sch.step():
            ev.setdefault(e.request, []).append(e)
    return [[e.token for e in ev[i]] for i in ids], [[e.logprobs for e in ev[i]] for i in ids]
others = [([3, 4, 5], SamplingParams(temperature=1.0, seed=1)), ([8] * 9, SamplingParams()), ([11, 12], SamplingParams(temperature=0.5))]
t = time.time()
g_cuda, _ = run("cuda", [(P, SamplingParams())])
g_cpu, _ = run("cpu", [(P, SamplingParams())])
res["greedy_cuda_equals_cpu"] = g_cuda == g_cpu
alone, lpa = run("cuda", [(P, S)], lp=3)
slot3, _ = run("cuda", others + [(P, S)])
res["sampled_alone_equals_slot3"] = alone[0] == slot3[-1]
cpu_s, lpc = run("cpu", [(P, S)], lp=3)
res["sampled_cuda_equals_cpu"] = alone[0] == cpu_s[0]
res["logprob_max_diff_cuda_cpu"] = (max(abs(a[0] - b[0]) for a, b in zip(lpa[0], lpc[0], strict=True))
                                    if alone[0] == cpu_s[0] else None)
two, _ = run("cuda", [(P, S)], n=2)
res["n2_choice0_equals_alone"] = two[0] == alone[0]
res["n2_choices_differ"] = two[0] != two[1]
res["seconds"] = round(time.time() - t, 1)
print(json.dumps(res, indent=1))
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "result.json").write_text(json.dumps(res, indent=1))
