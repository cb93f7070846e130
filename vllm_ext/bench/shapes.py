"""The models the benchmarks run: Qwen2.5 shapes with random weights, written as a config.json-only folder
(vLLM's ``load_format=dummy`` fills the weights), and a random PEFT LoRA adapter for them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["LORA_TARGETS", "SHAPES", "model_dims", "shape_config", "write_adapter", "write_shape"]

# Qwen2.5 base/instruct configs as published
_QWEN25_COMMON = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_act="silu",
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=True,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=28,
    bos_token_id=151643,
    eos_token_id=151645,
    torch_dtype="bfloat16",
)
SHAPES: dict[str, dict[str, Any]] = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def shape_config(shape: str) -> dict[str, Any]:
    """The full Hugging Face config of a named shape."""
    return {**_QWEN25_COMMON, **SHAPES[shape]}



def write_shape(shape: str, root: Path) -> Path:
    """A model folder with only config.json (weights come from load_format=dummy)."""
    path = root / f"qwen2.5-{shape.lower()}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(shape_config(shape), indent=1))
    return path


def model_dims(model_dir: Path) -> dict[str, int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return dict(
        hidden=cfg["hidden_size"],
        inter=cfg["intermediate_size"],
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab=cfg["vocab_size"],
    )


def write_adapter(model_dir: Path, rank: int, path: Path, seed: int = 0) -> Path:
    """A random PEFT LoRA adapter on all 7 projections (non-zero B), as PEFT saves it."""
    import torch
    from safetensors.torch import save_file

    d = model_dims(model_dir)
    marker = path / ".complete"
    if marker.exists() and json.loads(marker.read_text()) == {"dims": d, "rank": rank, "seed": seed}:
        return path
    path.mkdir(parents=True, exist_ok=True)
    q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    io = {"q_proj": (d["hidden"], q), "k_proj": (d["hidden"], kv), "v_proj": (d["hidden"], kv),
          "o_proj": (q, d["hidden"]), "gate_proj": (d["hidden"], d["inter"]),
          "up_proj": (d["hidden"], d["inter"]), "down_proj": (d["inter"], d["hidden"])}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(d["layers"]):
        for name, (fan_in, fan_out) in io.items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            a = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)
            b = torch.randn(fan_out, rank, generator=gen) * 1e-2
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": LORA_TARGETS, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": str(model_dir),
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1))
    marker.write_text(json.dumps({"dims": d, "rank": rank, "seed": seed}))
    return path

