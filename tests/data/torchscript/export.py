"""How the files here were written (run once, not by the tests): torch.onnx.export with the
TorchScript exporter (dynamo=False) of the tiny checkpoints tests/hf_models.py builds, in a
venv with transformers 4.56 (under 5.x the TorchScript exporter fails on aten::diff):

    python export.py CHECKPOINT_DIR OUT.onnx OPSET
"""

from __future__ import annotations

import sys
import warnings

import torch
import transformers
from transformers import masking_utils

warnings.simplefilter("ignore")
# transformers' mask functions vmap, which the TorchScript exporter cannot trace
# (RuntimeError: unordered_map::at): use its vmap-free sdpa mask, as optimum patches it.
masking_utils.sdpa_mask = masking_utils.sdpa_mask_older_torch
masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = masking_utils.sdpa_mask_older_torch


class Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).logits


def main(ckpt: str, out: str, opset: int) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="sdpa").eval()
    ids = torch.arange(8)[None]
    dims = {0: "batch_size", 1: "sequence_length"}
    names = ["input_ids", "attention_mask", "position_ids"]
    torch.onnx.export(Logits(model), (ids, torch.ones_like(ids), ids.clone()), out, dynamo=False,
                      opset_version=opset, input_names=names, output_names=["logits"],
                      dynamic_axes={n: dims for n in [*names, "logits"]})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
