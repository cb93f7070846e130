#!/usr/bin/env python3
"""Two `qerl eval` runs of one model against each other, on a real model: does an engine option change what it says?

    python3 scripts/gpu/compare_evals.py --reference off.jsonl --floor off2.jsonl --candidate shared.jsonl \
        [--candidate-log shared.log --path "on the row+lora path" [--path ...]] [--out compare.json]

``--reference`` and ``--floor`` are two runs of the same engine (their disagreement is the run-to-run floor: with
LoRA, vLLM's punica shrink and qerl's LoRA kernel sum float32 partials with atomics, docs/benchmarks.md §4an), and
``--candidate`` the engine under test. Per run: greedy accuracy; per pair: how many examples' greedy responses differ.

Verdict (the criteria of docs/benchmarks.md §4ao, fixed before the run):
- void where ``--candidate-log`` lacks a ``--path`` text (the candidate did not run the path it is meant to test);
- pass where the candidate's accuracy is within ``--max-acc-diff`` (0.05; compared as a count of examples, so 0.05 of
  200 is 10 and a float's rounding cannot move the line) of the reference's and the examples whose
  responses differ from the reference's number at most twice those that differ between reference and floor, plus
  ``--slack`` (4);
- fail otherwise.
Writes the comparison as JSON (``--out``) and prints it; exit 0 on pass, 1 on fail, 3 when void.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def load(path: Path) -> dict[int, dict[str, Any]]:
    """``qerl eval``'s per-example lines by row: the greedy record of each."""
    rows: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not rec.get("greedy"):
            raise SystemExit(f"{path}:{n}: no greedy result (row {rec.get('row')}): not a qerl eval output")
        rows[rec["row"]] = rec["greedy"]
    if not rows:
        raise SystemExit(f"{path}: no examples")
    return rows


def correct(rows: dict[int, dict[str, Any]]) -> int:
    return sum(bool(r["correct"]) for r in rows.values())


def differing(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> list[int]:
    """The rows whose greedy responses differ; the runs must cover the same rows."""
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))[:5]
        raise SystemExit(f"the runs cover different examples (e.g. rows {only}); run them with the same --data/--limit")
    return sorted(row for row in a if a[row]["response"] != b[row]["response"])


def compare(reference: dict, floor: dict, candidate: dict, *, max_acc_diff: float = 0.05, slack: int = 4,
            log_text: str | None = None, paths: list[str] | None = None) -> dict[str, Any]:
    base, cand = differing(reference, floor), differing(reference, candidate)
    runs = {"reference": reference, "floor": floor, "candidate": candidate}
    right = {k: correct(rows) for k, rows in runs.items()}
    acc = {k: right[k] / len(rows) for k, rows in runs.items()}
    out: dict[str, Any] = {
        "examples": len(reference),
        "accuracy": {k: round(v, 4) for k, v in acc.items()},
        "differ_reference_floor": len(base),
        "differ_reference_candidate": len(cand),
        "rows_differing": cand[:50],
        "allowed_differ": 2 * len(base) + slack,
        "max_acc_diff": max_acc_diff,
    }
    if paths:
        out["paths_seen"] = {p: bool(log_text) and p in log_text for p in paths}
        missing = [p for p, seen in out["paths_seen"].items() if not seen]
        if missing:
            out["verdict"] = "void"
            out["why"] = f"the candidate's log does not name {missing}: it did not run the path under test"
            return out
    acc_ok = abs(right["candidate"] - right["reference"]) <= round(max_acc_diff * len(reference), 9)
    differ_ok = len(cand) <= out["allowed_differ"]
    out["verdict"] = "pass" if acc_ok and differ_ok else "fail"
    out["why"] = (f"accuracy {acc['candidate']:.3f} against {acc['reference']:.3f} (at most {max_acc_diff} apart: "
                  f"{'yes' if acc_ok else 'no'}); {len(cand)} responses differ from the reference's, {len(base)} "
                  f"between the reference's two runs (at most {out['allowed_differ']}: {'yes' if differ_ok else 'no'})")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", type=Path, required=True, help="qerl eval's JSON lines of the reference engine")
    p.add_argument("--floor", type=Path, required=True, help="a second run of the reference engine")
    p.add_argument("--candidate", type=Path, required=True, help="the engine under test")
    p.add_argument("--candidate-log", type=Path, help="the candidate run's log (stderr), searched for --path")
    p.add_argument("--path", action="append", help="text the candidate's log must hold (e.g. 'on the row+lora path'); "
                   "repeat for several")
    p.add_argument("--max-acc-diff", type=float, default=0.05)
    p.add_argument("--slack", type=int, default=4)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if (args.path is None) != (args.candidate_log is None):
        p.error("--candidate-log and --path go together")
    log_text = args.candidate_log.read_text(errors="replace") if args.candidate_log else None
    out = compare(load(args.reference), load(args.floor), load(args.candidate), max_acc_diff=args.max_acc_diff,
                  slack=args.slack, log_text=log_text, paths=args.path)
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return {"pass": 0, "fail": 1, "void": 3}[out["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
