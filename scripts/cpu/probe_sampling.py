#!/usr/bin/env python3
"""How much GRPO signal a model's samples carry before training, per sampling temperature and length.

A summary of ``qerl eval`` runs; it samples and scores nothing itself. ``qerl eval --n N`` samples N responses
per prompt and scores each with the project's reward, writing one JSON line per prompt (every sample's score,
``correct``, ``num_tokens`` and ``truncated``) and the run's settings beside it (``X.summary.json``). For each
such file this prints one JSON line: the model ("nvfp4"/"bf16"), temperature, max_new_tokens, prompts, n,
``reward`` (mean sampled score), ``mixed_groups`` (prompts whose N samples hold both right and wrong answers:
the only ones with a non-zero GRPO advantage), ``cut_at_limit`` (fraction of samples cut at
--max-new-tokens), ``mean_length`` (mean sampled tokens, the end-of-sequence token included),
``right_within_<short>`` (fraction of samples that are right within --short tokens: what a shorter response
limit would keep), seed, ``eval_seconds`` (the whole ``qerl eval`` run) and ``source`` (the file).

The inputs of docs/learning/probe-sampling-2026-11-24b.jsonl (the SmolLM2 demo, examples/smollm2/prepare.py's
OUT at /tmp/qerl_smollm2; ``--quantization nvfp4`` puts the NVFP4 round trip of the Linear weights in place,
as the rollout sees them), one run per (temperature, max tokens):

    for m in 64 128; do for t in 1.0 0.7; do
      qerl eval /tmp/qerl_smollm2/bf16 --quantization nvfp4 --backend hf \\
        --data /tmp/qerl_smollm2/data/train.parquet --limit 48 --n 8 --temperature $t --max-new-tokens $m \\
        --seed 0 --out /tmp/qerl_probe/probe-t$t-m$m.jsonl --quiet
    done; done
    python scripts/cpu/probe_sampling.py /tmp/qerl_probe/probe-t*.jsonl --short 32

``qerl eval`` always decodes greedily too (its pass@1; not used here): about 20 s of a 48-prompt run at 64 tokens
on 2 CPU cores, where the whole run takes about 2 min (3.5 min at 128 tokens). Sampling is plain temperature
sampling (no top-k/top-p), as in the vLLM rollout; each run seeds its sampling with --seed, so a setting's
numbers do not depend on the other runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from qerl_plugin.evaluate import summary_path

HOW = "make one with `qerl eval MODEL --data FILE --n 8 --temperature T --max-new-tokens M --out X.jsonl` (see this script's --help)"


class ProbeError(Exception):
    """A bad input file; the message names the file and the fix."""


def _read_summary(path: Path) -> dict[str, Any]:
    spath = summary_path(path)
    if not spath.is_file():
        raise ProbeError(
            f"{path}: its summary {spath} is missing; qerl eval writes it beside --out and only it records the model, "
            "temperature and max tokens: keep the two files together, or run qerl eval again"
        )
    try:
        summary = json.loads(spath.read_text(encoding="utf-8"))
        config = summary["config"]
        [config[k] for k in ("n", "sample_temperature", "max_new_tokens", "quantization", "model_quantization")]
    except (ValueError, KeyError, TypeError) as exc:
        raise ProbeError(f"{spath}: not a qerl eval summary ({type(exc).__name__}: {exc}); run qerl eval again") from None
    return summary


def _read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ProbeError(f"{path}:{lineno}: not JSON ({exc}); give qerl eval's --out file") from None
            if not isinstance(row, dict) or "row" not in row or "greedy" not in row:
                raise ProbeError(f"{path}:{lineno}: not a qerl eval line (no 'row'/'greedy'); give qerl eval's --out file")
            rows.append(row)
    if not rows:
        raise ProbeError(f"{path}: empty; {HOW}")
    return rows


def _model_name(config: dict[str, Any]) -> str:
    if config["quantization"] == "nvfp4" or config["model_quantization"] == "nvfp4a16":
        return "nvfp4"
    return config["model_quantization"] or "bf16"


def summarize_file(path: Path, short: int) -> dict[str, Any]:
    """The probe's line for one ``qerl eval`` per-example JSONL (its summary beside it)."""
    if not path.is_file():
        raise ProbeError(f"{path}: no such file; {HOW}")
    summary = _read_summary(path)
    config = summary["config"]
    rows = _read_rows(path)
    n, temperature, max_new = config["n"], config["sample_temperature"], config["max_new_tokens"]
    if temperature is None or all("samples" not in r for r in rows):
        raise ProbeError(
            f"{path}: no sampled results (qerl eval ran greedy only, --n {n}); run it again with --n 8 "
            "--temperature T (a group of samples per prompt)"
        )
    if n < 2:
        raise ProbeError(
            f"{path}: one sample per prompt (--n {n}); a group of one has no GRPO advantage: run qerl eval again with --n 8"
        )
    # one run's lines: every row sampled with the summary's n, each row once, none longer than its limit
    mixed = []
    counts = sorted({len(r.get("samples") or []) for r in rows})
    if counts != [n]:
        mixed.append(f"rows with {counts} samples, the summary says --n {n}")
    seen = [r["row"] for r in rows]
    if len(set(seen)) != len(seen):
        mixed.append("the same data row more than once (files joined?)")
    if len(rows) != summary.get("num_examples", len(rows)):
        mixed.append(f"{len(rows)} lines, the summary counts {summary['num_examples']} examples")
    samples = [(i, s) for i, r in enumerate(rows) for s in r.get("samples") or []]
    if any(s["num_tokens"] > max_new for _, s in samples):
        mixed.append(f"samples longer than the summary's --max-new-tokens {max_new}")
    if mixed:
        raise ProbeError(
            f"{path}: mixed settings or not the run its summary {summary_path(path)} describes: {'; '.join(mixed)}; "
            "give each qerl eval run its own --out and summarize the files one by one"
        )

    def mean(values) -> float:
        values = list(values)
        return sum(values) / len(values)

    out: dict[str, Any] = {
        "model": _model_name(config),
        "temperature": temperature,
        "max_new_tokens": max_new,
        "prompts": len(rows),
        "n": n,
        "reward": round(mean(s["score"] for _, s in samples), 4),
        "mixed_groups": sum(1 for r in rows if len({bool(s["correct"]) for s in r["samples"]}) == 2),
        "cut_at_limit": round(mean(bool(s["truncated"]) for _, s in samples), 3),
        "mean_length": round(mean(s["num_tokens"] for _, s in samples), 1),
        f"right_within_{short}": round(mean(bool(s["correct"]) and s["num_tokens"] <= short for _, s in samples), 4),
        "seed": config.get("seed"),
        "eval_seconds": summary.get("elapsed_s"),
        "source": str(path),
    }
    if config.get("adapter"):
        out["adapter"] = config["adapter"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("evals", nargs="+", type=Path, metavar="EVAL.jsonl", help="qerl eval --out files (summaries beside them)")
    p.add_argument("--short", type=int, default=32, help="also count the samples right within this many tokens (default 32)")
    args = p.parse_args(argv)
    try:
        lines = [summarize_file(path, args.short) for path in args.evals]  # all checked before anything is printed
    except ProbeError as exc:
        print(f"probe_sampling: error: {exc}", file=sys.stderr)
        return 1
    for line in lines:
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
