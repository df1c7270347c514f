"""ExecuTorch's memory planner on the same torch.export program npuc compiles.

Run in an environment that has executorch (its requirements clash with npuc's dev
set, so the harness uses a separate venv that sees this machine's torch):

    python bench/et_plan.py HF_DIR SEQ   ->  {"arena_bytes": ..., "algorithm": "greedy", ...}

The program is the model's forward for `input_ids` [1, SEQ] without a cache (npuc's
prefill program without the KV-cache writes), lowered to the edge dialect and planned
by `to_executorch()`'s default memory planning pass.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")


def main(ckpt: str, seq: int) -> dict[str, object]:
    import torch
    import transformers
    from executorch.exir import to_edge

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()

    class Logits(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=input_ids, use_cache=False).logits

    ids = torch.zeros(1, seq, dtype=torch.long)
    with torch.no_grad():
        ep = torch.export.export(Logits(model), (ids,), strict=False)
    prog = to_edge(ep).to_executorch()
    plan = prog.executorch_program.execution_plan[0]
    sizes = list(plan.non_const_buffer_sizes)
    from importlib.metadata import version

    return {"arena_bytes": int(sum(sizes)), "buffers": sizes, "algorithm": "executorch default (greedy)",
            "executorch": version("executorch")}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
