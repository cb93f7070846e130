#!/usr/bin/env python3
"""GPU: rollout decode throughput and memory, BF16 vs NVFP4, with LoRA and AQN (wraps `qerl bench rollout`).

Run from the repository root on the GPU machine, with vLLM and this project installed (/tmp/site):

    python3 scripts/gpu/bench_rollout.py --shape 7B                                  # 5 engines, ~10-15 min
    python3 scripts/gpu/bench_rollout.py --shape 7B --configs bf16-lora,nvfp4-lora   # 2 engines, ~5 min
    python3 scripts/gpu/bench_rollout.py --shape 7B --configs bf16-lora,nvfp4-lora \\
        --variants default,dual-stream,lora-tuned --batches 1,8                     # switches, one call

    python3 scripts/gpu/bench_rollout.py kernels --shape 7B    # per-layer kernels in CUDA graphs, ~1-2 min

Same options as `qerl bench rollout` / `qerl bench kernels` (see --help). Results go to $OUT (default ./.out): bench_rollout.json,
bench_rollout.jsonl, logs/; the table is printed last. Each engine is a child process running
`python -m vllm_ext.bench`, i.e. the *installed* vllm_ext: this script warns when the installed copy differs
from this checkout (reinstall with `python3 -m pip install -q --no-deps --no-build-isolation --no-index
--upgrade --target /tmp/site .`).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # the installed project (entry points) wins; the checkout is a fallback


def _stale_install_warning() -> None:
    import vllm_ext

    installed = Path(vllm_ext.__file__).resolve().parent
    checkout = ROOT / "vllm_ext"
    if installed == checkout.resolve() or not checkout.is_dir():
        return
    differ = []
    for f in sorted(checkout.rglob("*.py")):  # subpackages too (vllm_ext.bench)
        rel = f.relative_to(checkout)
        other = installed / rel
        if not other.exists() or hashlib.sha256(other.read_bytes()).digest() != hashlib.sha256(f.read_bytes()).digest():
            differ.append(str(rel))
    if differ:
        print(f"WARNING: installed vllm_ext ({installed}) differs from this checkout in {differ}; the engines use "
              "the installed copy. Reinstall the project first (see --help).", file=sys.stderr, flush=True)


def main() -> int:
    from vllm_ext import bench

    _stale_install_warning()
    parser = argparse.ArgumentParser(prog="bench_rollout.py", description=__doc__ + "\n" + bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(parser)
    argv = sys.argv[1:]
    if not argv or argv[0] not in ("rollout", "kernels"):
        argv = ["rollout", *argv]
    return bench.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
