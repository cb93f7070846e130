"""Quantize a checkpoint with llmcompressor's ``oneshot`` and the ``NVFP4A16`` preset (weight-only).

Runs inside the llmcompressor venv made by ``setup_venv.sh`` (llmcompressor 0.14.0.1, compressed-tensors
0.19.0, torch 2.13.0 CPU), never in qerl's own venv::

    VENV/bin/python scripts/llmcompressor_equivalence/run_llmcompressor.py SRC DST

The recipe is the one llmcompressor's examples use for NVFP4A16:
``QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"])``. NVFP4A16 only observes
weights, so llmcompressor picks its data-free pipeline and no dataset is passed. Everything runs
offline on CPU; the output is saved with ``save_compressed=True`` (``nvfp4-pack-quantized``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# offline: a tiny local checkpoint, no hub look-ups
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="bf16 Hugging Face checkpoint directory")
    parser.add_argument("dst", help="output directory (new or empty)")
    parser.add_argument("--scheme", default="NVFP4A16", help="compressed-tensors preset (default: NVFP4A16)")
    args = parser.parse_args(argv)

    src, dst = Path(args.src), Path(args.dst)
    if not (src / "config.json").is_file():
        print(f"error: {src} has no config.json; pass a Hugging Face checkpoint directory", file=sys.stderr)
        return 2
    if dst.exists() and any(dst.iterdir()):
        print(f"error: {dst} is not empty; pass a new or empty output directory", file=sys.stderr)
        return 2

    try:
        import llmcompressor
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except ImportError as exc:
        print(
            f"error: llmcompressor is not importable from {sys.executable} ({exc}); run this script with "
            "the python of the venv made by scripts/llmcompressor_equivalence/setup_venv.sh",
            file=sys.stderr,
        )
        return 2
    import compressed_tensors
    import torch
    import transformers

    t0 = time.perf_counter()
    recipe = QuantizationModifier(targets="Linear", scheme=args.scheme, ignore=["lm_head"])
    oneshot(model=str(src), recipe=recipe, output_dir=str(dst), save_compressed=True)
    elapsed = time.perf_counter() - t0

    versions = {
        "llmcompressor": llmcompressor.__version__,
        "compressed-tensors": compressed_tensors.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    (dst / "llmcompressor_versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    print(f"llmcompressor oneshot {args.scheme}: {src} -> {dst} in {elapsed:.1f} s ({versions})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
