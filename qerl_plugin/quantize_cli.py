"""``qerl quantize SRC DST``: write the NVFP4A16 checkpoint of a Hugging Face model.

SRC is a local model directory (config.json + *.safetensors) or a Hugging Face Hub id. DST becomes a
compressed-tensors ``nvfp4-pack-quantized`` checkpoint that vLLM loads as is: every decoder Linear in
NVFP4 (q/k/v and gate/up sharing a global scale), lm_head, embeddings, norms and biases unchanged.
SRC is never modified; DST appears only when the run succeeds.
"""

from __future__ import annotations

import argparse
import sys

from qerl_plugin.plan import SUPPORTED_ARCHITECTURES, format_plan, plan_quantization
from qerl_plugin.quantize import quantize_checkpoint
from qerl_plugin.shards import DEFAULT_MAX_SHARD_SIZE, human_size, parse_size

HELP = "quantize a Hugging Face checkpoint to NVFP4A16 (compressed-tensors, loads in vLLM)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="model directory (config.json + *.safetensors) or Hub id")
    parser.add_argument("dst", metavar="DST", nargs="?", help="output directory (not needed with --dry-run)")
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="MODULE",
        help="keep this module unquantized: an exact module name (model.layers.0.mlp.down_proj) or "
        "'re:<regex>' matched from the start, as in compressed-tensors' ignore lists; repeatable. "
        "lm_head is always kept; an ignored q/k/v or gate/up part keeps its whole fused group",
    )
    parser.add_argument("--dry-run", action="store_true", help="print what each tensor becomes and the sizes; write nothing")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DST (only once the new one is complete)")
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help=f"largest output file, e.g. 5GB, 500MB, 2GiB (default {DEFAULT_MAX_SHARD_SIZE}); peak memory is about this plus one source tensor and the codec's scratch (under 1 GB for 32B-class shapes)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="quantize an architecture not in the supported list ("
        + ", ".join(SUPPORTED_ARCHITECTURES)
        + "): every 2-D *_proj weight in the decoder layers; other 2-D layer weights are kept and ignored",
    )
    parser.add_argument("--device", default="cpu", help="where to quantize: cpu (default) or cuda; same bytes either way")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    limit = parse_size(args.max_shard_size)
    plan = plan_quantization(args.src, ignore=args.ignore, force=args.force)
    if args.dry_run:
        print(format_plan(plan, limit))
        print("dry run: nothing written")
        return 0
    if not args.dst:
        raise ValueError("DST is missing: give an output directory, or --dry-run to only print the plan")
    result = quantize_checkpoint(
        plan.src,
        args.dst,
        overwrite=args.overwrite,
        max_shard_size=limit,
        force=args.force,
        device=args.device,
        progress=not args.quiet,
        plan=plan,
    )
    ratio = result.dst_bytes / result.src_bytes if result.src_bytes else 0.0
    print(
        f"wrote {result.dst}: {result.num_quantized} Linear weights in NVFP4, "
        f"{human_size(result.src_bytes)} -> {human_size(result.dst_bytes)} ({ratio:.2f}x), "
        f"{len(result.files)} files",
        file=sys.stdout,
    )
    return 0
