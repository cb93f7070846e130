#!/usr/bin/env python3
"""The one-row NVFP4 kernels' main loops in SASS, counted per 4-byte word of weights, compiled for sm_90 on a machine
without a GPU (Triton's front end, LLVM, and the ptxas and nvdisasm its wheel bundles):

    python3 scripts/cpu/kernel_sass.py [--json] [--wgmma] [--fp8]

For each kernel and tile (``decode_gemv: "shared"``'s forms on §4ai's best 7B tiles, and the checkpoint-layout
row kernel on its shipped 7B tiles) it finds the loops (a branch back to an earlier label), takes the longest one as
the main loop, and reports its instructions per word (the loop's length over the words one thread reads per trip) and
the opcodes it uses most; loads per word count global loads (LDG) and asynchronous copies (LDGSTS, the pipelined
loop's). The pointers and N, K are declared divisible by 16, as Triton's launcher finds them in the engine (without
that it cannot prove 16-byte loads aligned, splits them and adds layout conversions). A static count: no latency, no
occupancy, no memory (docs/benchmarks.md §4ai used it to test §4ah's estimate that the shared kernel issues more
instructions per word than the row kernel).

``--fp8``: the one-row kernels with their decode through FP8 (``ASM`` 2, what sm_89 and later run since §4ba) instead
of the float16 bit moves. Each row also counts the integer and logic opcodes per word (LOP3, SHF, PRMT, LEA, IADD3,
SEL), which Nsight Compute put on the busiest pipeline (§4ba).

``--wgmma``: instead, vllm_ext.nvfp4_gluon's few-row wgmma GEMM at 8 rows, on the checkpoint's layout at the 7B q/k/v
tile the gluon+lora path runs and on Marlin's tensors (vllm_ext.nvfp4_gluon_marlin) at the tiles §4ay swept (docs/benchmarks.md §4ay).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARLIN_PTRS = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*i32", g_ptr="*fp32", y_ptr="*bf16", ws_ptr="*fp32",
                   cnt_ptr="*i32", b_ptr="*bf16")
ROW_PTRS = dict(MARLIN_PTRS, s_ptr="*fp8e4nv")
# what the engine's launches have divisible by 16: every buffer (fresh allocations) and N, K (7B and 32B shapes)
ALIGNED = (*MARLIN_PTRS, "N", "K")
# (name, HB, T, split-K, warps, asum): §4ai call set B's best tile of each form on the 7B gate/up and down, and the
# q/k/v's (form 0); forms 3 (added after those runs; §4aj's best tiles are these) and 4 (after §4aj's) on form 2's
SHARED_TILES = [("qkv form 0", 16, 8, 16, 2, 0), ("gate_up form 0", 16, 8, 8, 2, 0), ("gate_up form 1", 16, 8, 4, 4, 1),
                ("gate_up form 2", 16, 8, 8, 4, 2), ("down form 0", 16, 8, 16, 2, 0), ("down form 1", 8, 16, 16, 4, 1),
                ("down form 2", 8, 16, 16, 4, 2), ("gate_up form 3", 16, 8, 8, 4, 3), ("down form 3", 8, 16, 16, 4, 3),
                ("gate_up form 4", 16, 8, 8, 4, 4), ("down form 4", 8, 16, 16, 4, 4)]
# (name, BLOCK_N, split-K, warps, stages): vllm_ext.nvfp4_gemv.decode_tile's 7B tiles (block_k 512, x vectorized)
ROW_TILES = [("qkv", 4, 1, 4, 0), ("gate_up", 8, 1, 1, 3), ("down", 8, 4, 2, 0)]


def disassemble(cubin: bytes) -> str:
    """nvdisasm's text of a cubin (the nvdisasm in Triton's wheel)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def main_loop(text: str) -> list[str]:
    """The opcodes of the longest loop in ``text`` (nvdisasm output): from a label to the last branch back to it."""
    ops: list[tuple[str, str]] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        label = re.match(r"^\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        ins = re.match(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if ins:
            ops.append((ins.group(1), line))
    best: list[str] = []
    for i, (op, line) in enumerate(ops):
        target = re.search(r"`\(\.(L_x_\d+)\)", line)
        if op.startswith("BRA") and target and labels.get(target.group(1), i + 1) <= i:
            body = [o for o, _ in ops[labels[target.group(1)]:i + 1]]
            if len(body) > len(best):
                best = body
    return best


INT_LOGIC = ("LOP3", "SHF", "PRMT", "LEA", "IADD3", "SEL")  # the decode's integer and logic opcodes (§4ba)


def summary(name: str, body: list[str], words: float) -> dict:
    counts = collections.Counter(op.split(".")[0] for op in body)
    return {"kernel": name, "loop_instructions": len(body), "words_per_thread_per_trip": words,
            "per_word": round(len(body) / words, 1), "ffma_per_word": round(counts["FFMA"] / words, 2),
            "loads_per_word": round((counts["LDG"] + counts["LDGSTS"]) / words, 2), "bar_per_trip": counts["BAR"],
            "shared_memory_per_trip": sum(counts[op] for op in ("LDS", "STS", "LDSM", "STSM")),
            "hgmma_per_trip": counts["HGMMA"],
            "int_logic_per_word": round(sum(counts[op] for op in INT_LOGIC) / words, 2),
            "top": counts.most_common(8)}


def run(asm: int = 1) -> list[dict]:
    """The shared forms and the row kernel with decode ``asm`` (``vllm_ext.nvfp4_decode.decode_mode``: 1 the float16
    bit moves, the decode §4ai counted; 2 through FP8, §4ba)."""
    from vllm_ext import nvfp4_gemv, nvfp4_marlin_row
    from vllm_ext.triton_support import compile_sm90

    rows = []
    for name, hb, t, sk, warps, asum in SHARED_TILES:
        kernel = compile_sm90(nvfp4_marlin_row._marlin_row_kernel, MARLIN_PTRS,
                                dict(HB=hb, T=t, SPLIT_K=sk, ASM=asm, HAS_BIAS=False, STAGES=0, PDL=False,
                                     ASUM=asum), warps, ALIGNED)
        rows.append(summary(f"shared {name} (h{hb}t{t}s{sk}w{warps})", main_loop(disassemble(kernel.asm["cubin"])),
                            t * hb * 16 / (32 * warps)))
    for name, block_n, sk, warps, stages in ROW_TILES:
        kernel = compile_sm90(nvfp4_gemv._nvfp4_row_kernel, ROW_PTRS,
                                dict(BLOCK_N=block_n, BLOCK_K=512, SPLIT_K=sk, ASM=asm, XVEC=True, HAS_BIAS=False,
                                     STAGES=stages, PDL=False), warps, ALIGNED)
        rows.append(summary(f"row {name} (n{block_n}s{sk}w{warps}S{stages})",
                            main_loop(disassemble(kernel.asm["cubin"])), block_n * 64 / (32 * warps)))
    return rows


WGMMA_PTRS = dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*fp8e4nv", g_ptr="*fp32", y_ptr="*bf16", ws_ptr="*fp32",
                  cnt_ptr="*i32", hp_ptr="*fp32", idx_ptr="*i32", b0="*bf16", b1="*bf16", b2="*bf16", lscale="fp32",
                  bias_ptr="*bf16", z_ptr="*bf16")
# (name, BLOCK_K, warps, nrep, split-K, Marlin's layout): the checkpoint layout's 7B 8-row tile (TILES_7B), and the
# Marlin version's best tiles of §4ay's sweep (nrep 1 and 2) and its 16-byte-load tiles (nrep 4)
WGMMA_TILES = [("checkpoint", 256, 4, 1, 8, False), ("marlin", 256, 4, 1, 8, True), ("marlin", 128, 4, 2, 8, True),
               ("marlin", 256, 4, 4, 8, True), ("marlin", 128, 4, 4, 8, True)]


def run_wgmma() -> list[dict]:
    from vllm_ext import nvfp4_gluon, nvfp4_gluon_marlin
    from vllm_ext.triton_support import compile_sm90

    rows = []
    for name, block_k, warps, nrep, sk, marlin in WGMMA_TILES:
        consts = dict(BLOCK_M=8, BLOCK_K=block_k, WARPS=warps, NREP=nrep, SPLIT_K=sk, EVEN_N=True)
        if not marlin:  # the checkpoint layout's kernel, without an adapter
            consts.update(LORA=False, R=16, HP_M=16, KS_PAD=16, PDL=False, HAS_BIAS=False, ZEROS=False)
        ptrs = dict(WGMMA_PTRS, s_ptr="*u8") if marlin else WGMMA_PTRS
        fn = nvfp4_gluon_marlin._wgmma_marlin_kernel if marlin else nvfp4_gluon._wgmma_kernel
        kernel = compile_sm90(fn, ptrs, consts, warps,
                              ("x_ptr", "sxm", "w_ptr", "s_ptr", "y_ptr", "sym", "ws_ptr", "cnt_ptr", "K", "KB", "KS"),
                              gluon=True)
        words = 16 * warps * nrep * block_k / 8 / (32 * warps)  # 4-byte words of codes per thread per trip
        rows.append(summary(f"wgmma {name} (n{16 * warps * nrep}k{block_k}s{sk}w{warps})",
                            main_loop(disassemble(kernel.asm["cubin"])), words))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object per kernel instead of the table")
    p.add_argument("--wgmma", action="store_true", help="the few-row wgmma GEMM on both layouts instead (§4ay)")
    p.add_argument("--fp8", action="store_true", help="the one-row kernels with the decode through FP8 (§4ba)")
    args = p.parse_args(argv)
    rows = run_wgmma() if args.wgmma else run(2 if args.fp8 else 1)
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{r['kernel']:<36} {r['per_word']:>5.1f} instr/word  FFMA {r['ffma_per_word']:>4.2f}  "
                  f"loads {r['loads_per_word']:>4.2f}  BAR/trip {r['bar_per_trip']:>2}  "
                  f"LDS/STS/trip {r['shared_memory_per_trip']:>2}  int/logic {r['int_logic_per_word']:>5.2f}  "
                  + ", ".join(f"{op} {n}" for op, n in r["top"][:5]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
