#!/usr/bin/env python3
"""Convert a local GSM8K copy into verl RL parquet files (offline; no hub access needed).

    python scripts/data/prepare_gsm8k.py SRC OUT_DIR [--test-src FILE] [--test-fraction 0.1] [--seed 0]
                                         [--max-train N] [--max-test N] [--overwrite]

SRC is a folder holding train and test files (HF ``openai/gsm8k`` layout ``main/train-00000-of-00001.parquet``
and ``main/test-...``, or ``train.jsonl``/``test.jsonl``), or one parquet/jsonl file: then the test rows come
from --test-src or a --test-fraction hold-out. Columns ``question`` and ``answer`` (ending in ``#### N``).
Writes OUT_DIR/train.parquet and OUT_DIR/test.parquet in verl's row format (data_source "openai/gsm8k",
the prompt ends with verl's instruction 'Let's think step by step and output the final answer after "####".').
Library code: verl_ext/data.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    from verl_ext import data
except ImportError:  # running from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from verl_ext import data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="GSM8K folder (train and test files) or one .parquet/.jsonl file")
    parser.add_argument("out_dir", help="where train.parquet and test.parquet go")
    parser.add_argument("--test-src", default=None, help="test file, when SRC is a single train file")
    parser.add_argument("--test-fraction", type=float, default=0.1,
                        help="hold-out fraction when SRC is one file and --test-src is not given (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the hold-out draw (default 0)")
    parser.add_argument("--max-train", type=int, default=None, help="keep the first N train rows")
    parser.add_argument("--max-test", type=int, default=None, help="keep the first N test rows")
    parser.add_argument("--overwrite", action="store_true", help="replace existing train/test parquet files")
    args = parser.parse_args(argv)
    try:
        result = data.prepare_gsm8k(
            args.src, args.out_dir, test_src=args.test_src, test_fraction=args.test_fraction, seed=args.seed,
            max_train=args.max_train, max_test=args.max_test, overwrite=args.overwrite,
        )
    except (data.DataError, FileNotFoundError, FileExistsError) as exc:
        print(f"prepare_gsm8k: error: {exc}", file=sys.stderr)
        return 2
    print(f"train: {result['n_train']} rows -> {result['train']}   (from {result['sources']['train']})")
    print(f"test:  {result['n_test']} rows -> {result['test']}   (from {result['sources']['test']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
