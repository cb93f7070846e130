"""Benchmark rollouts in vLLM: decode tokens/s and memory of BF16 / NVFP4, with and without LoRA and AQN.

    qerl bench rollout --shape 7B                                  # the five configs, batch 1/8/64
    qerl bench rollout --shape 7B --configs bf16-lora,nvfp4-lora   # fit a short GPU slot
    qerl bench rollout --shape 7B --configs bf16-lora,nvfp4-lora --variants default,dual-stream,lora-tuned
    qerl bench rollout --model /path/to/bf16-checkpoint --batches 1,8

Each (config, variant) runs in its own Python process with its own vLLM engine (CUDA graphs + torch.compile,
never eager), so GPU memory is freed between them and a hung engine is killed after --timeout. Named
shapes are Qwen2.5 configs with random weights (load_format=dummy); NVFP4 configs quantize them while
loading (``--quantization nvfp4``). LoRA configs serve a random PEFT adapter (rank --lora-rank on
q/k/v/o/gate/up/down, non-zero B) written once to --work; every request uses it.

Per batch size: prompts of --prompt-len random tokens, --new-tokens generated with ignore_eos. Decode
tokens/s = batch * (new_tokens - 1) / (t(new_tokens) - t(1 token)), i.e. prefill removed (the fastest
1-token run); the median of --repeats runs, each run's rate and the spread kept. Engines of one config under
different variants (e.g. dense-lora) are checked against its default variant on greedy tokens and their
chosen-token logprobs (--greedy-check: the prompts decoded together and each alone, each twice, so that the report
can tell an engine's own run-to-run variation from a difference between engines). Written to --out (default $OUT or
./.out): bench_rollout.json (all runs, ratios vs bf16-lora of the same variant, LoRA overhead, target checks),
bench_rollout.jsonl (one line per engine as it finishes) and logs/<config>--<variant>.log. The table is printed last.
"""

from __future__ import annotations

import argparse
import sys

from vllm_ext.bench import kernels, runner
from vllm_ext.bench.kernels import KERNELS_DOC
from vllm_ext.bench.matrix import CONFIGS, DEFAULT_CONFIGS, VARIANTS
from vllm_ext.bench.shapes import SHAPES

__all__ = ["CONFIGS", "HELP", "SHAPES", "VARIANTS", "add_arguments", "run"]

HELP = "benchmark NVFP4 + LoRA rollouts in vLLM"


def _csv(kind):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return [kind(x) for x in items]

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``rollout`` and ``kernels`` subcommands and their options."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    p = sub.add_parser("rollout", help="decode tokens/s and memory per config (one vLLM engine each)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", default="7B", choices=sorted(SHAPES, key=lambda s: float(s[:-1])),
                     help="Qwen2.5 shape with random weights (default 7B)")
    src.add_argument("--model", help="a BF16 Hugging Face checkpoint directory (real weights)")
    p.add_argument("--nvfp4-model", help="NVFP4A16 checkpoint (`qerl quantize` output) for the nvfp4/stock configs "
                   "instead of quantizing while loading; needed for the stock-* and humming-* configs (with random weights, "
                   "scripts/gpu/random_checkpoint.py writes one of a shape)")
    p.add_argument("--bf16-model", help="a BF16 checkpoint of the same shape for the nf4 configs (QLoRA's base), which "
                   "vLLM's bitsandbytes loader quantizes while loading and so cannot take dummy weights (with random "
                   "weights, scripts/gpu/random_checkpoint.py's bf16 kind writes one); --model serves when given")
    p.add_argument("--configs", type=_csv(str), default=_csv(str)(DEFAULT_CONFIGS),
                   help=f"comma list from {list(CONFIGS)} (default {DEFAULT_CONFIGS})")
    p.add_argument("--variants", type=_csv(str), default=["default"],
                   help="comma list of engine switch presets, '+' combines presets: "
                   + "; ".join(f"{k}: {v.help}" for k, v in VARIANTS.items()))
    p.add_argument("--runs", type=_csv(str), default=None, metavar="CONFIG@VARIANT,...",
                   help="run only these pairs of --configs x --variants, e.g. ours on its default next to vLLM's own "
                   "punica LoRA for the others: nvfp4-lora@default,bf16-lora@punica-lora (default: every pair)")
    p.add_argument("--batches", type=_csv(int), default=[1, 8, 64], help="batch sizes (default 1,8,64)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per batch size (default 3); the median is reported with every run and the spread")
    p.add_argument("--greedy-check", type=int, default=4, metavar="N",
                   help="greedy tokens and chosen-token logprobs of N fixed prompts per engine, compared across the "
                   "variants of one config in the report, decoded together and each alone, twice each (0: off)")
    p.add_argument("--lora-rank", type=int, default=32, help="adapter rank (max_lora_rank follows it)")
    p.add_argument("--profile-tokens", type=int, default=0, metavar="N",
                   help="after the timings, decode N tokens per batch size under torch.profiler: per-step GPU time "
                   "by kernel family, idle time, top kernels (vllm_ext.bench.profile); chrome traces in logs/ (0: off)")
    p.add_argument("--aqn-sigma", type=float, default=1e-2, help="AQN noise sigma for *-aqn configs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--capture-sizes", choices=["batches", "vllm"], default="batches",
                   help="CUDA-graph capture sizes: exactly --batches (fast start) or vLLM's default list")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per engine before it is killed")
    p.add_argument("--clock-interval", type=float, default=1.0, metavar="S",
                   help="seconds between nvidia-smi samples of the GPU's clocks, temperature and clock-event reasons "
                        "while each engine runs (default 1; 0: off). A run whose GPU slowed itself down (heat, power "
                        "brake) is flagged and its targets get no verdict")
    p.add_argument("--mp", action="store_true", help="use vLLM's engine subprocess (default: in-process engine, "
                   "VLLM_ENABLE_V1_MULTIPROCESSING=0, which avoids a LoRA start-up hang)")
    p.add_argument("--out", default=None, help="output folder for results and logs (default $OUT or ./.out)")
    p.add_argument("--work", default=None, help="folder for the generated model configs and LoRA adapter "
                   "(hundreds of MB for large shapes; default <tmp>/qerl-bench, reused across runs)")
    p.add_argument("--dry-run", action="store_true", help="write model config/adapter, print the plan, run nothing")

    k = sub.add_parser("kernels", help="per-layer decode kernels in CUDA graphs: BF16 GEMM, Marlin FP4, LoRA (vLLM "
                       "punica vs a dense alternative), base+LoRA serial vs overlapped on two streams",
                       description=KERNELS_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    k.add_argument("--shape", default="7B", choices=sorted(SHAPES, key=lambda s: float(s[:-1])))
    k.add_argument("--batches", type=_csv(int), default=[1, 8, 64])
    k.add_argument("--lora-rank", type=int, default=32)
    k.add_argument("--iters", type=int, default=50, help="kernel calls captured per CUDA graph")
    k.add_argument("--out", default=None, help="output folder (default $OUT or ./.out)")


def run(args: argparse.Namespace) -> int:
    """Run the chosen subcommand; its exit status."""
    command = getattr(args, "bench_command", None)
    if command == "rollout":
        return runner.rollout(args)
    if command == "kernels":
        return kernels.run(args)
    print("usage: qerl bench {rollout,kernels} [options]  (see qerl bench rollout --help)", file=sys.stderr)
    return 2
