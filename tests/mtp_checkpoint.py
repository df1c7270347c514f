"""Tiny random-init checkpoints that keep a multi-token-prediction (MTP) layer, laid out as
DeepSeek-V3's are (`model.layers.<L>.*`, L = num_hidden_layers), and that layer computed in
torch from transformers' own modules (the reference compiler/mtp.py is compared with)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EXTRA = ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")


def save_mtp_checkpoint(arch: str, path: str, seed: int = 0) -> None:
    """hf_models.make_config(arch) saved with one more decoder layer, stored as the MTP layer's:
    config.json keeps num_hidden_layers (and says num_nextn_predict_layers 1), the safetensors
    gain the layer's enorm, hnorm, eh_proj and shared_head."""
    import safetensors.torch as st
    import torch
    import transformers as tf
    from hf_models import make_config

    config = make_config(arch)
    layers = config.num_hidden_layers
    config.num_hidden_layers = layers + 1
    if isinstance(getattr(config, "layer_types", None), list):  # one entry a layer (Qwen2's)
        config.layer_types = [*config.layer_types, config.layer_types[-1]]
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    h, v = config.hidden_size, config.vocab_size
    gen = torch.Generator().manual_seed(seed + 1)
    extra = {f"model.layers.{layers}.{name}.weight": t for name, t in (
        ("enorm", 1 + 0.1 * torch.randn(h, generator=gen)), ("hnorm", 1 + 0.1 * torch.randn(h, generator=gen)),
        ("eh_proj", torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5),
        ("shared_head.norm", 1 + 0.1 * torch.randn(h, generator=gen)),
        ("shared_head.head", torch.randn(v, h, generator=gen) / h ** 0.5))}
    st.save_file(extra, str(Path(path) / "model-mtp.safetensors"))
    weights = Path(path) / "model.safetensors"
    index = {"metadata": {}, "weight_map": {**{k: weights.name for k in st.load_file(str(weights))},
                                            **{k: "model-mtp.safetensors" for k in extra}}}
    (Path(path) / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"] = layers, 1
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    (Path(path) / "config.json").write_text(json.dumps(cfg))


class ReferenceMTP:
    """The checkpoint's main model and its MTP layer, in transformers."""

    def __init__(self, path: str) -> None:
        import safetensors.torch as st
        import transformers as tf

        self.model = tf.AutoModelForCausalLM.from_pretrained(path).eval()
        self.layers = layers = self.model.config.num_hidden_layers
        self.full = tf.AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=layers + 1).eval()
        self.w = {k.split(f"model.layers.{layers}.")[1]: t
                  for k, t in st.load_file(str(Path(path) / "model-mtp.safetensors")).items()}

    def hidden(self, ids: Any) -> Any:
        """The main model's last hidden state (after its final norm) at every position."""
        return self.model.model(input_ids=ids).last_hidden_state

    def mtp(self, ids: Any, positions: Any, hidden: Any) -> tuple[Any, Any]:
        """(logits, hidden) of the MTP layer over rows (token ids, positions, hidden states),
        causal over the rows given (positions 0..s-1 of one sequence)."""
        import torch

        m, w = self.full.model, self.w
        eps = self.model.config.rms_norm_eps

        def norm(x: Any, weight: Any) -> Any:
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

        e = m.embed_tokens(ids) * (positions != 0).unsqueeze(-1)
        x = torch.cat([norm(e, w["enorm.weight"]), norm(hidden, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
        out = m.layers[self.layers](x, attention_mask=None, position_ids=positions,
                                    position_embeddings=m.rotary_emb(x, positions))
        x = out[0] if isinstance(out, tuple) else out
        return norm(x, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T, x
