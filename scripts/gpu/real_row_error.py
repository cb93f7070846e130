#!/usr/bin/env python3
"""The hfma2 row decode's error on a real model's inputs (docs/benchmarks.md §4bi, the diagnostic after item 1): the
one-row kernel's sums with ``QERL_ROW_DECODE=hfma2`` and with the FP8 decode (``fp8``, exact products summed in
float32) on the ``down_proj`` inputs of SmolLM2-135M-Instruct, the one linear the real-model check ran hfma2 on,
against the float64 product with the exact NVFP4 weight. Every kernel sweep here bounds hfma2's error by that of the
product with the weight dequantized to bfloat16 and the result rounded to bfloat16, vLLM's Marlin arithmetic
(``check_gemv.bf16_weight_error``); it was met on random data (§4bc, §4bg). This script asks the same of real inputs.

    PYTHONPATH=. python3 scripts/gpu/real_row_error.py --model /tmp/qerl_smollm2/bf16 \
        --adapter docs/learning/smollm2-nvfp4-lora-aqn --data /tmp/qerl_smollm2/data/test.parquet \
        --responses all.jsonl [--limit 200] [--rows 84,140,...]

The inputs: the BF16 model with each decoder linear's weight replaced by its NVFP4 round trip (the weights the engine
holds) and the PEFT adapter, teacher-forced through each example's chat prompt and the response of ``--responses``
(a ``qerl eval`` output; default: the prompt alone); a hook takes every token's input to each layer's ``down_proj``
base weight. Per layer, each row runs through the row kernel at the row+lora kernel's tile
(``nvfp4_gemv_lora.row_tile``; with the adapter's B zero that kernel gives these bits, tests/vllm_ext/test_nvfp4_hfma2)
in both modes. Per row the error is the largest absolute difference from the float64 product over the outputs.

Reading fixed before the run (§4bi): per layer, **within** where hfma2's largest error over all rows is at most the
bfloat16-weight product's largest error over all rows (the sweeps' bound), else **beyond**. Also reported: the rows
where hfma2's error exceeds that row's bound, RMS errors, rows with an input beyond float16 (the guard's fallback), and
the examples named by ``--rows`` (the real-model check's differing responses). Writes $OUT/real_row_error.jsonl and
prints a table; exit 0 when it ran (the reading is printed, not an exit code), 2 on bad input. ``--modes`` takes
several candidates, each on its own rows of the JSONL (``mode``) and its own reading line; §4bi's file, written before
``--modes``, has no ``mode`` key (its rows are hfma2's). §4bk ran ``--modes hfma2,hfma2-4`` with a mode of ``bcb5759``
(4 products per float16 lane) that failed there and was taken out again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "scripts" / "gpu"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from check_gemv import decode_env, fp8_decode_device, jsonl_recorder  # noqa: E402

FLOAT16_MAX = 65504.0


def row_errors(y, exact):  # noqa: ANN001, ANN201
    """Per row of ``y`` ``[R, N]`` (any float dtype): the largest absolute difference from ``exact`` (float64)."""
    return (y.double() - exact).abs().amax(dim=-1)


def layer_summary(err_fp8, err_cand, err_bound, exact, x, cand: str = "hfma2") -> dict[str, Any]:  # noqa: ANN001
    """One layer's reading from per-row errors ``[R]`` (FP8 decode, the candidate mode ``cand``, the bfloat16-weight
    bound), the float64 product ``exact`` ``[R, N]`` and the inputs ``x`` ``[R, K]``: the largest errors, the rows
    beyond their own bound, the RMS over rows of each row's largest error, the largest output and input, and the rows
    with an input beyond float16. Keys name the candidate (``max_err[cand]``, ``rows_<cand>_beyond_row_bound``)."""
    errs = (("fp8", err_fp8), (cand, err_cand), ("bound", err_bound))
    worst = {k: float(v.max()) for k, v in errs}
    return {
        "mode": cand,
        "rows": int(exact.shape[0]),
        "max_err": worst,
        "within": worst[cand] <= worst["bound"],
        "fp8_within": worst["fp8"] <= worst["bound"],
        f"rows_{cand}_beyond_row_bound": int((err_cand > err_bound).sum()),
        "rows_fp8_beyond_row_bound": int((err_fp8 > err_bound).sum()),
        "rms_row_err": {k: float(v.double().pow(2).mean().sqrt()) for k, v in errs},
        "max_abs_out": float(exact.abs().max()),
        "max_abs_x": float(x.abs().max()),
        "rows_x_beyond_float16": int((x.abs().amax(dim=-1) > FLOAT16_MAX).sum()),
    }


def reading(layers: list[dict[str, Any]], cand: str = "hfma2") -> str:
    """The line fixed before the run: every layer within the bound, or which are beyond (for the mode ``cand``)."""
    beyond = [d["layer"] for d in layers if not d["within"]]
    if not beyond:
        return f"within: {cand}'s largest error is within the bfloat16-weight bound on all {len(layers)} layers"
    return f"beyond: {cand}'s largest error exceeds the bfloat16-weight bound on layers {beyond} of {len(layers)}"


def examples(data: str, responses: str | None, limit: int) -> list[tuple[int, list[dict[str, str]], str]]:
    """``(row, chat prompt, response)`` for the first ``limit`` examples of ``data`` (a parquet with a ``prompt``
    column of chat messages), the response from ``responses`` (``qerl eval``'s JSONL, its greedy response) or ''."""
    import pandas as pd

    frame = pd.read_parquet(data)
    if "prompt" not in frame.columns:
        raise SystemExit(f"{data}: no 'prompt' column (expected the parquet of examples/smollm2/prepare.py)")
    said: dict[int, str] = {}
    if responses:
        for line in Path(responses).read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                said[rec["row"]] = rec["greedy"]["response"]
    out = []
    for row in range(min(limit, len(frame))):
        prompt = [dict(m) for m in frame.iloc[row]["prompt"]]
        out.append((row, prompt, said.get(row, "")))
    return out


def capture(model_dir: str, adapter: str | None, items: list,  # noqa: ANN001
            device) -> tuple[dict[int, Any], list[int], dict]:
    """Every token's ``down_proj`` input per layer (``{layer: [R, K] bfloat16}``), each row's example, and each layer's
    NVFP4 weight (``qerl_plugin.nvfp4.quantize`` of the BF16 weight, as ``qerl quantize`` writes it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_plugin import nvfp4

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    weights = {}
    for i, layer in enumerate(model.model.layers):
        for name, lin in [*layer.self_attn.named_children(), *layer.mlp.named_children()]:
            if isinstance(lin, torch.nn.Linear):
                q = nvfp4.quantize(lin.weight.data)
                if name == "down_proj":
                    weights[i] = q
                lin.weight.data.copy_(nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.bfloat16))
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).to(device).eval()
    taken: dict[int, list] = {i: [] for i in weights}
    hooks = []
    for i, layer in enumerate(model.base_model.model.model.layers if adapter else model.model.layers):
        down = layer.mlp.down_proj
        base = getattr(down, "base_layer", down)
        hooks.append(base.register_forward_pre_hook(lambda _m, args, i=i: taken[i].append(args[0].reshape(
            -1, args[0].shape[-1]).detach().clone())))
    owner: list[int] = []
    with torch.no_grad():
        for row, prompt, response in items:
            text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False) + response
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
            model(input_ids=ids)
            owner += [row] * ids.shape[-1]
    for h in hooks:
        h.remove()
    return {i: torch.cat(v) for i, v in taken.items()}, owner, weights


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the BF16 SmolLM2 folder (examples/smollm2/prepare.py's bf16)")
    p.add_argument("--adapter", default=None, help="a PEFT adapter folder applied on top (default: none)")
    p.add_argument("--data", required=True, help="the test parquet (prepare.py's data/test.parquet)")
    p.add_argument("--responses", default=None, help="qerl eval JSONL whose greedy responses are teacher-forced")
    p.add_argument("--limit", type=int, default=200, help="examples (default 200)")
    p.add_argument("--rows", default="", help="examples to report on their own, e.g. 84,140 (default none)")
    p.add_argument("--modes", default="hfma2", help="candidate QERL_ROW_DECODE modes, each against fp8 and the bound "
                   "(default hfma2)")
    p.add_argument("--out", default=None, help="folder for real_row_error.jsonl (default $OUT, else ./.out)")
    args = p.parse_args(argv)
    for name in ("model", "data", "responses", "adapter"):
        value = getattr(args, name)
        if value and not Path(value).exists():
            print(f"real_row_error.py: --{name} {value}: not found", file=sys.stderr)
            return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("hfma2", "f16")]
    if bad or not modes:
        print(f"real_row_error.py: --modes {args.modes!r}: choose from hfma2, f16", file=sys.stderr)
        return 2
    import torch

    from qerl_plugin import nvfp4
    from vllm_ext.nvfp4_gemv import nvfp4_small_gemm
    from vllm_ext.nvfp4_gemv_lora import row_tile

    dev = fp8_decode_device("real_row_error.py")
    if dev is None:
        return 2
    record = jsonl_recorder(args.out, "real_row_error.jsonl")
    items = examples(args.data, args.responses, args.limit)
    xs, owner, weights = capture(args.model, args.adapter, items, dev)
    named = [int(r) for r in args.rows.split(",") if r.strip()]
    owner_t = torch.tensor(owner, device=dev)
    layers: dict[str, list] = {m: [] for m in modes}
    print(f"{len(items)} examples, {len(owner)} rows per layer; errors: largest |y - exact| over a row's outputs")
    print("layer  mode       N x K       max err fp8  mode       bound   rows mode>row bound   max|x|   reading")
    for i, x in xs.items():
        q = weights[i]
        n, k = q.packed.shape[0], x.shape[-1]
        exact = x.double() @ nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.float32).double().t()
        w16 = nvfp4.dequantize(q.packed, q.scale, q.global_scale, dtype=torch.bfloat16).double()
        err = {"bound": row_errors((x.double() @ w16.t()).to(torch.bfloat16), exact)}
        for mode in ("fp8", *modes):
            with decode_env(mode):
                tile = row_tile(n, k, hfma2=mode.startswith("hfma2"))
                if tile is None:
                    print(f"real_row_error.py: layer {i}: K={k} has no row tile (not a multiple of 128)",
                          file=sys.stderr)
                    return 2
                y = torch.cat([nvfp4_small_gemm(x[r:r + 1], q.packed, q.scale, q.global_scale, words=True, xvec=True,
                                                **tile) for r in range(x.shape[0])])
            err[mode] = row_errors(y, exact)
        for mode in modes:
            d = {"what": "layer", "layer": i, "n": n, "k": k,
                 **layer_summary(err["fp8"], err[mode], err["bound"], exact, x, mode)}
            for r in named:
                sel = owner_t == r
                if sel.any():
                    d.setdefault("named", {})[str(r)] = {m: float(err[m][sel].max()) for m in ("fp8", mode, "bound")}
            record(d, echo=False)
            layers[mode].append(d)
            e = d["max_err"]
            print(f"{i:>5}  {mode:<9} {n} x {k:<6} {e['fp8']:>9.3g} {e[mode]:>9.3g} {e['bound']:>9.3g} "
                  f"{d[f'rows_{mode}_beyond_row_bound']:>8} of {d['rows']:<6} {d['max_abs_x']:>8.3g}   "
                  f"{'within' if d['within'] else 'BEYOND'}")
    for mode in modes:
        line = reading(layers[mode], mode)
        record({"what": "reading", "mode": mode, "line": line, "examples": len(items), "rows": len(owner)}, echo=False)
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
