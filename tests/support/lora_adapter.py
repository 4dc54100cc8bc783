"""A LoRA adapter folder for a test model, written directly (PEFT's on-disk layout).

Why not train or use ``peft``: a test of how the server *routes* an adapter's name needs a
loadable adapter, not a useful one. ``lora_B`` is zero, so the adapter computes exactly the base
model; vLLM still registers and serves it under its own name.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_zero_lora(folder: Path, model_dir: str | Path, rank: int = 8) -> Path:
    """A rank-``rank`` adapter on every layer's ``q_proj`` and ``v_proj`` of ``model_dir``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv_out = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    tensors = {}
    generator = torch.Generator().manual_seed(0)
    for layer in range(config["num_hidden_layers"]):
        for proj, out in (("q_proj", hidden), ("v_proj", kv_out)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(out, rank)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False,
        "modules_to_save": None, "use_rslora": False, "use_dora": False}))
    return folder
