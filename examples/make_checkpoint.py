"""Build a random-init Hugging Face checkpoint from a shipped config.json (nothing is downloaded).

    python examples/make_checkpoint.py examples/tiny-llama build/tiny-llama-hf
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main(config_dir: str, out_dir: str, seed: int = 0) -> None:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = transformers.AutoConfig.from_pretrained(config_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    n = sum(p.numel() for p in model.parameters())
    print(f"saved a random-init {config.architectures[0]} ({n:,} parameters) to {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
