"""Build a tiny random Qwen2 checkpoint (bf16 by default, safetensors) whose weights hit NVFP4's edge cases.

Runs with torch + transformers only (either venv). Usage::

    python scripts/llmcompressor_equivalence/tiny_model.py DST [--seed 0] [--dtype float16] [--max-shard-size 100KB]

Shapes (defaults): hidden 128, intermediate 256, 4 heads / 2 KV heads (head_dim 32), 2 layers, vocab
512, untied lm_head; ``--hidden-size/--intermediate-size/--num-layers`` make a larger one. All input dimensions are multiples of 16. Planted cases (``EDGE_CASES`` lists them):

* ``layers.0.self_attn.k_proj``: one outlier (8.0), so the fused q/k/v global scale comes from k while
  q and v hold ordinary values;
* ``layers.0.self_attn.q_proj``: an all-zero group (FP8 scale 0 -> replaced by 0.125), a group whose
  FP8 scale is subnormal, a group whose scale underflows to 0 in FP8, a group of tiny negatives
  that round to E2M1 -0 (code 8), and negative zeros (-0.0 stays code 0);
* ``layers.0.self_attn.o_proj``: exact rounding ties. Its largest group is ``c * [6, +-0.25, +-0.75,
  ..., -6]`` with ``c = 2**-4``, so global scale ``448 / c``, FP8 scale 448 and step ``c`` are exact and
  every value lands on an E2M1 midpoint (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5); a second group does the
  same with step ``c / 2``;
* ``layers.0.mlp.up_proj`` carries the gate/up group's larger amax (shared global scale), chosen so that
  its FP8 scale computes to 451.5 in bf16 (clamped to 448) and the element saturates at E2M1 6;
* ``layers.1.mlp.down_proj`` is all zeros (global scale falls back to 1.0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

TIE_C = 2.0**-4
TIE_VALUES = (6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6)

EDGE_CASES = {
    "model.layers.0.self_attn.k_proj": "outlier 8.0 at [0, 5]: sets the shared q/k/v global scale",
    "model.layers.0.self_attn.q_proj": "zero group [1, 0:16]; subnormal FP8 scale [4, 16:32]; "
    "FP8 scale underflow [5, 32:48]; tiny negatives -> E2M1 -0 [6, 0:16]; -0.0 group [7, 0:16] and "
    "-0.0 entries [7, 16:32:3]",
    "model.layers.0.self_attn.o_proj": "exact E2M1 ties with step c [2, 16:32] and c/2 [3, 0:16], c=2^-4",
    "model.layers.0.mlp.up_proj": "amax 0.494140625 at [7, 7], larger than gate_proj's: shared gate/up "
    "scale; its FP8 scale computes to 451.5 (clamped to 448), the element saturates at E2M1 6",
    "model.layers.1.mlp.down_proj": "all zeros: global scale falls back to 1.0",
}


def tiny_config(hidden_size: int = 128, intermediate_size: int = 256, num_layers: int = 2):
    from transformers import Qwen2Config

    if hidden_size % 64 or intermediate_size % 16 or hidden_size < 128 or num_layers < 2:
        raise ValueError(
            f"hidden_size {hidden_size} must be a multiple of 64 and >= 128, intermediate_size "
            f"{intermediate_size} a multiple of 16, num_layers {num_layers} >= 2 (the planted cases need them)"
        )
    heads = hidden_size // 32
    return Qwen2Config(
        vocab_size=512,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        dtype="bfloat16",
    )


def _plant_edge_cases(weights: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Overwrite parts of the (float32) weights in place with the cases listed in EDGE_CASES."""
    k = weights["model.layers.0.self_attn.k_proj.weight"]
    k[0, 5] = 8.0

    q = weights["model.layers.0.self_attn.q_proj.weight"]
    q[1, 0:16] = 0.0
    # global scale 2688/8 = 336: amax 2e-4 -> FP8 scale 0.0112 (subnormal, < 2**-6)
    q[4, 16:32] = torch.linspace(-2e-4, 2e-4, 16)
    # amax 1e-5 -> scale 5.6e-4 < 2**-10: FP8 rounds it to 0, compressed-tensors substitutes 0.125
    q[5, 32:48] = torch.linspace(-1e-5, 1e-5, 16)
    # one ordinary value and 15 tiny negatives that quantize to -0
    q[6, 0:16] = -1e-4 * torch.rand(16, generator=gen)
    q[6, 0] = 0.05
    # negative zeros: a whole group (amax 0) and a few in an ordinary group; E2M1 keeps them +0 (code 0)
    q[7, 0:16] = -0.0
    q[7, 16:32:3] = -0.0

    o = weights["model.layers.0.self_attn.o_proj.weight"]
    o.clamp_(-0.3, 0.3)  # keep every other group below 6c = 0.375
    o[2, 16:32] = TIE_C * torch.tensor(TIE_VALUES)
    o[3, 0:16] = (TIE_C / 2) * torch.tensor(TIE_VALUES)

    up = weights["model.layers.0.mlp.up_proj.weight"]
    gate = weights["model.layers.0.mlp.gate_proj.weight"]
    gate.clamp_(-0.3, 0.3)
    # amax 0.494140625: 2688/amax rounds (bf16) to 5472 and amax/6 rounds up, so the FP8 scale computes
    # to 451.5 and is clamped to 448, and the element itself divides to 6.04 and saturates at E2M1 6
    up[7, 7] = 0.494140625

    weights["model.layers.1.mlp.down_proj.weight"].zero_()


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_tiny_model(
    dst: str | Path,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_shard_size: str | None = None,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
) -> Path:
    """Write the tiny checkpoint to ``dst`` (created; must not hold a checkpoint already).

    ``dtype`` is bfloat16 (default), float16 or float32; ``max_shard_size`` (e.g. "100KB") splits the
    safetensors into several files; the sizes make a larger model for a stress run.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    from transformers import Qwen2ForCausalLM

    dst = Path(dst)
    if (dst / "config.json").exists():
        raise FileExistsError(f"{dst} already holds a checkpoint; pass an empty or new directory")
    dst.mkdir(parents=True, exist_ok=True)

    config = tiny_config(hidden_size, intermediate_size, num_layers)
    config.dtype = dtype
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith(".bias"):
            w = 0.02 * torch.randn(p.shape, generator=gen)
        else:
            # heavier tails than a Gaussian, so group amaxes vary a lot
            w = 0.02 * torch.randn(p.shape, generator=gen) * (1 + torch.rand(p.shape, generator=gen) ** 4 * 4)
        weights[name] = w
    _plant_edge_cases(weights, gen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name].to(p.dtype))
    model = model.to(DTYPES[dtype])
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(dst, **kwargs)
    (dst / "edge_cases.json").write_text(json.dumps(EDGE_CASES, indent=2) + "\n")
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dst", help="output directory (new or empty)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--max-shard-size", default=None, help='split the safetensors, e.g. "100KB"')
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=2)
    args = parser.parse_args(argv)
    out = build_tiny_model(
        args.dst, args.seed, args.dtype, args.max_shard_size, args.hidden_size, args.intermediate_size, args.num_layers
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
