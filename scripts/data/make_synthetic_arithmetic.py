#!/usr/bin/env python3
"""Write synthetic arithmetic word problems ("Tom has 3 apples...") as verl RL parquet files.

    python scripts/data/make_synthetic_arithmetic.py OUT_DIR [--n-train 2000] [--n-test 200] [--seed 0]
                                                     [--difficulty 2] [--overwrite]

Exact integer answers; the same arguments give the same files on any machine (no network, no downloads).
Difficulty 1: one add/subtract step; 2: two steps with groups and doubling; 3: three or four steps, also
equal sharing. Rows: data_source "qerl/synthetic_arithmetic", GSM8K-style instruction (answer after
"####"), ground truth the integer answer; score them with verl_ext.reward.compute_score.
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
    parser.add_argument("out_dir", help="where train.parquet and test.parquet go")
    parser.add_argument("--n-train", type=int, default=2000, help="train problems (default 2000)")
    parser.add_argument("--n-test", type=int, default=200,
                        help="test problems, none repeating a train one (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--difficulty", default="2", help="1, 2, 3 or easy, medium, hard (default 2)")
    parser.add_argument("--instruction", default=data.GSM8K_INSTRUCTION,
                        help="text after each question (default: GSM8K's step-by-step instruction)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing train/test parquet files")
    args = parser.parse_args(argv)
    try:
        result = data.make_synthetic_arithmetic(
            args.out_dir, n_train=args.n_train, n_test=args.n_test, seed=args.seed,
            difficulty=args.difficulty, overwrite=args.overwrite,
            instruction=args.instruction,
        )
    except (data.DataError, FileExistsError) as exc:
        print(f"make_synthetic_arithmetic: error: {exc}", file=sys.stderr)
        return 2
    print(f"train: {result['n_train']} rows -> {result['train']}")
    print(f"test:  {result['n_test']} rows -> {result['test']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
