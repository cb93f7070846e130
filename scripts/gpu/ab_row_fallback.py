#!/usr/bin/env python3
"""Two versions of the hfma2 row kernel's fallback in one run (docs/benchmarks.md §4be call 2, §4bf item 3): the row
op with ``QERL_ROW_DECODE=hfma2`` from this tree and from a second copy of ``vllm_ext``, with the op without the guard
(``hfma2-unguarded``) and the FP8 row kernel, timed in one process and interleaved, on the weights every sweep here
streams from HBM (check_gemv.streamed_weight), per linear and per 7B and 32B step. The copy's ``nvfp4_gemv.py`` is
``--other FILE`` as it is, or (``--fallback-from FILE``) this tree's with only ``_row_fallback`` taken from FILE, so
that nothing else differs. ``--labels`` names this tree's version and the other's (default ``tree,other``); the
verdicts read ``<tree>_vs_<other>``. §4bf item 3, the one-loop fallback of ``6a7d782`` against this tree's nested
loops (make the file where git is, carry it to the GPU machine):

    git show 6a7d782:vllm_ext/nvfp4_gemv.py > flat_gemv.py
    PYTHONPATH=. python3 scripts/gpu/ab_row_fallback.py --fallback-from flat_gemv.py --labels nested,flat --reps 15

(``flat`` faster shows as ``nested_vs_flat: slower``.) §4be call 2 ran this script as of ``3aae4ca``, whose tree had
the one loop, with ``--old`` the file of ``2096e51``; its keys were ``flat`` and ``nested``. The copy is imported as the
package ``vx_old`` (its imports and its torch ops' namespace renamed, so both register), from a folder removed at
the end. Without an ``x`` beyond float16 no fallback runs, so the three hfma2 outputs must be the same bits; exit 1
otherwise. "faster" where the medians differ by more than both spreads.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts" / "gpu"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from check_gemv import (  # noqa: E402
    LINEARS, add_linear_args, decode_env, fp8_decode_device, jsonl_recorder, step_lines, streamed_weight,
    timed_interleaved, verdict)

FALLBACK = re.compile(r"    @triton\.jit\n    def _row_fallback\(.*?(?=\n    @triton\.jit\n)", re.S)


def with_fallback_from(source: str) -> str:
    """This tree's nvfp4_gemv.py with its ``_row_fallback`` (decorator to the next ``@triton.jit``) replaced by the
    one in ``source`` (the text of another nvfp4_gemv.py). A ValueError where either has no such function."""
    ours = (ROOT / "vllm_ext" / "nvfp4_gemv.py").read_text()
    theirs = FALLBACK.search(source)
    if theirs is None or FALLBACK.search(ours) is None:
        raise ValueError("no _row_fallback (from '@triton.jit' to the next) in one of the two nvfp4_gemv.py files")
    return FALLBACK.sub(lambda _: theirs.group(0), ours, count=1)


def labels(text: str) -> tuple[str, str]:
    """``--labels``: two distinct names, neither a column of its own (unguarded, fp8). A ValueError otherwise."""
    names = tuple(text.split(","))
    if len(names) != 2 or len(set(names)) != 2 or set(names) & {"unguarded", "fp8"} or not all(names):
        raise ValueError(f"--labels {text!r}: two distinct names, e.g. nested,flat (not unguarded or fp8)")
    return names


def old_package(old_gemv: Path, into: Path) -> str:
    """A copy of ``vllm_ext`` as ``vx_old`` under ``into``, with ``old_gemv`` as its nvfp4_gemv.py; its name (put on
    ``sys.path``)."""
    dest = into / "vx_old"
    shutil.copytree(ROOT / "vllm_ext", dest, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(old_gemv, dest / "nvfp4_gemv.py")
    for f in dest.rglob("*.py"):
        text = re.sub(r"\bvllm_ext\b", "vx_old", f.read_text())
        f.write_text(text.replace('"qerl::', '"qerl_old::'))
    sys.path.insert(0, str(into))
    return "vx_old"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--other", type=Path, help="the nvfp4_gemv.py to compare this tree's with, as it is")
    src.add_argument("--fallback-from", type=Path, help="this tree's nvfp4_gemv.py with this file's _row_fallback")
    p.add_argument("--labels", default="tree,other", help="names of this tree's version and the other's")
    add_linear_args(p, "7B,32B")
    args = p.parse_args(argv)
    try:
        tree, other = labels(args.labels)
        other_text = (with_fallback_from(args.fallback_from.read_text()) if args.fallback_from
                      else args.other.read_text())
    except (OSError, ValueError) as e:
        print(f"ab_row_fallback: {e}", file=sys.stderr)
        return 2
    dev = fp8_decode_device("ab_row_fallback")
    if dev is None:
        return 1
    work = Path(tempfile.mkdtemp())
    try:
        other_file = work / "other_gemv.py"
        other_file.write_text(other_text)
        other_row = importlib.import_module(old_package(other_file, work / "pkg") + ".nvfp4_gemv").nvfp4_gemv_row
        return _run(args, dev, tree, other, other_row)
    finally:
        if str(work / "pkg") in sys.path:
            sys.path.remove(str(work / "pkg"))
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, dev, tree: str, other: str, other_row) -> int:  # noqa: ANN001
    """The timing itself (see the module docstring), once the other version is imported as ``other_row``."""
    import torch

    from vllm_ext.bench.kernels import capture_graph
    from vllm_ext.nvfp4_gemv import nvfp4_gemv_row

    bf16 = torch.bfloat16
    keys = (tree, other, "unguarded", "fp8")
    modes = {tree: "hfma2", other: "hfma2", "unguarded": "hfma2-unguarded", "fp8": "fp8"}
    record = jsonl_recorder(args.out, "ab_row_fallback.jsonl")
    record({"what": "setup", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "other": str(args.other or args.fallback_from), "fallback_only": bool(args.fallback_from),
            "labels": [tree, other], "shapes": args.shapes})
    finals, unequal = [], 0
    for shape in args.shapes.split(","):
        for lname in args.linears.split(","):
            k, n = LINEARS[shape][lname]
            _, q, raw_bytes, raws = streamed_weight(n, k, args.cold_mib, dev)
            x = torch.randn(1, k, device=dev, dtype=bf16)
            gs = q.global_scale.reshape(1).float()
            iters = max(args.iters, len(raws))
            graphs, outs = {}, {}
            for key in keys:
                fn = other_row if key == other else nvfp4_gemv_row
                with decode_env(modes[key]):  # read at each launch: the graph keeps the kernel it captured
                    outs[key] = fn(x, *raws[0], gs)
                    graphs[key] = (capture_graph([(lambda a=a, b=b, fn=fn: fn(x, a, b, gs)) for a, b in raws],
                                                 iters), iters)
            same = {key: bool(torch.equal(outs[tree], outs[key])) for key in (other, "unguarded")}
            unequal += sum(not v for v in same.values())
            res = timed_interleaved(graphs, args.reps)
            del graphs
            fin = {"what": "final", "shape": shape, "linear": lname, "n": n, "k": k, "nvfp4_bytes": raw_bytes,
                   f"same_bits_as_{tree}": same, **res, f"{tree}_vs_{other}": verdict(res[tree], res[other]),
                   f"unguarded_vs_{tree}": verdict(res["unguarded"], res[tree])}
            record(fin)
            finals.append(fin)
    cell = lambda r: f"{r['median_us']:>12.2f} ±{r['spread_us']:<6.2f}"  # noqa: E731
    lines = ["", f"hfma2 row op, {tree} against {other}: µs per call, median of {args.reps} (spread)",
             f"{'shape':<5} {'linear':<8}" + "".join(f"{key:>20}" for key in keys)
             + f"  {tree} vs {other}; unguarded vs {tree}"]
    for f in finals:
        lines.append(f"{f['shape']:<5} {f['linear']:<8}" + "".join(cell(f[key]) for key in keys)
                     + f"  {f[f'{tree}_vs_{other}']}; {f[f'unguarded_vs_{tree}']}")
    lines += step_lines(finals, args.shapes, args.linears, keys, record)
    lines.append(f"hfma2 outputs that differ from {tree}'s: {unequal}")
    print("\n".join(lines), flush=True)
    return 1 if unequal else 0


if __name__ == "__main__":
    sys.exit(main())
