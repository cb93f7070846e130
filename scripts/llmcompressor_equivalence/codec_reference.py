"""Quantize a bf16 checkpoint with ``qerl_plugin.nvfp4`` directly (no CLI), as llmcompressor's NVFP4A16 would.

Stand-in for ``qerl quantize`` while that command is missing, and a cross-check of the codec alone::

    python scripts/llmcompressor_equivalence/codec_reference.py SRC DST

Quantizes every 2-D ``*_proj.weight`` of the decoder layers (the modules llmcompressor's
``targets="Linear", ignore=["lm_head"]`` picks in a Llama/Qwen2-style model); q/k/v share one global
scale and gate/up share one (llmcompressor's ``FUSED_LAYER_NAMES``). Every other tensor is copied as it is.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qerl_plugin import nvfp4

FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
LINEAR_RE = re.compile(r"^(?P<parent>.*\.layers\.\d+\.(?:self_attn|mlp))\.(?P<leaf>\w+_proj)\.weight$")


def nvfp4a16_quantization_config() -> dict:
    """The ``quantization_config`` block, built with the installed compressed-tensors' NVFP4A16 preset."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme

    scheme: QuantizationScheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    scheme.format = "nvfp4-pack-quantized"
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="nvfp4-pack-quantized",
        quantization_status="compressed",
        ignore=["lm_head"],
    )
    out = config.model_dump(mode="json")
    out["version"] = compressed_tensors.__version__
    return out


def quantize_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    targets: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = LINEAR_RE.match(name)
        if m and t.dim() == 2:
            targets.setdefault(m["parent"], {})[m["leaf"]] = t
        else:
            out[name] = t
    for parent, leaves in targets.items():
        done = set()
        for group in FUSED_GROUPS:
            if all(g in leaves for g in group):
                names = [f"{parent}.{g}" for g in group]
                for prefix, q in zip(names, nvfp4.quantize_fused([leaves[g] for g in group], names)):
                    out.update(q.tensors(prefix))
                done.update(group)
        for leaf, w in leaves.items():
            if leaf not in done:
                out.update(nvfp4.quantize(w, name=f"{parent}.{leaf}").tensors(f"{parent}.{leaf}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args(argv)
    src, dst = Path(args.src), Path(args.dst)
    if dst.exists() and any(dst.iterdir()):
        parser.error(f"{dst} is not empty; pass a new or empty output directory")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        parser.error(f"{src} holds no *.safetensors files")
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    save_file(quantize_state_dict(tensors), dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = nvfp4a16_quantization_config()
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
