"""Speed at a glance: docs/speed.png from the raw GPU results committed under docs/gpu-runs (no GPU needed).

Five panels; each comparison is from one run on one machine (one H100, or two H100s of one host for the 2048 pair of
panel 2):

1. 7B decode tokens/s at batch 1 / 8 / 64 (docs/benchmarks.md §4v call 2, random weights): BF16 + LoRA on vLLM's
   punica, ours as shipped (overlap LoRA with the kernel v3), and NVFP4 without LoRA (what the adapter costs); each
   NVFP4 bar carries its ratio against BF16 + LoRA, and the issue's target is drawn as a tick on ours. (vLLM's stock
   NVFP4A16 + LoRA was measured in another run, §4j: 1.47 / 1.49 / 1.13× BF16 + LoRA.)
2. A 7B GRPO step in verl on the current default, seconds per phase (median of the steady-state steps; the bar's
   whisker is the step time's min-max), BF16 + LoRA on vLLM's punica and NVFP4 + LoRA, at 512- and 2048-token
   responses: each pair from one run on one machine, each with a verdict by the criteria fixed before it ran. The
   512 pair ran back to back on one H100 (§4ab); the 2048 pair at once, one arm per H100 of one host (§4aa).
3. Ratios against 16-bit LoRA: the paper's (read from its released figures, §7) next to ours, with the issue's targets.
4. Against QLoRA (§4l lease 1): 7B decode of ours and of BF16 + LoRA, each over NF4 + LoRA as vLLM serves it (the
   bitsandbytes loader, punica), with the paper's 7B rollout figures against QLoRA as reference lines.
5. The actor (§4u call 1): a 7B LoRA forward + backward at 16 384 tokens, tokens/s over BF16's (every layer
   recomputed) against the step's peak memory, as the last N layers keep their activations (N = 0-3 for NVFP4,
   0 and 2 for BF16); both orders of the run, and BF16's peak as the same-memory line.

    python scripts/plot_speed.py                 # writes docs/speed.png
    python scripts/plot_speed.py --out /tmp/s.png --json /tmp/s.json   # and the numbers drawn, as JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "gpu-runs"
DECODE_7B = RUNS / "2026-11-27" / "twentieth" / "call2" / "bench-v3" / "a" / "bench_rollout.json"
DECODE_32B = RUNS / "2026-11-25" / "eleventh" / "lease3" / "bench-gemv32" / "a" / "bench_rollout.json"
# Panel 2's pairs: response length -> (results file, BF16 run, NVFP4 run, the verdict that the criteria fixed before
# the run gave it)
PAIRS = {
    "512": (RUNS / "2026-11-28" / "twentysixth" / "calls11-13" / "verl_7b" / "results.jsonl",
            "bf16-r512p", "nvfp4-r512p", "NVFP4 faster; target 1.5×"),
    "2048": (RUNS / "2026-11-28" / "twentyfifth" / "calls09-10" / "verl_7b" / "results.jsonl",
             "bf16-r2048p", "nvfp4-r2048p", "NVFP4 faster; target 1.8×"),
}
DECODE_QLORA = RUNS / "2026-11-27" / "thirteenth" / "lease1" / "bench-qlora" / "a" / "bench_rollout.json"
ACTOR_7B = [RUNS / "2026-11-27" / "nineteenth" / "call1" / order / "check_actor_kernels.jsonl"
            for order in ("order1", "order2")]

# The paper's own figures against vanilla (16-bit) LoRA, from NVlabs/QeRL's README plots (assets/performance.png,
# assets/rank_speed.png): 7B rollout 2 092 vs 1 641 tokens/s, 7B end to end x1.2 vs x1, 32B rollout at rank 32
# 56.0 vs 33.3 tokens/s (docs/benchmarks.md §7).
PAPER_VS_LORA = {"7B rollout": 2092 / 1641, "7B end to end": 1.2, "32B rollout (r32)": 56.0 / 33.3}
# The same plot's 7B rollout against QLoRA: QeRL 2 092 and LoRA 1 641 vs QLoRA 1 362 tokens/s.
PAPER_VS_QLORA = {"QeRL": 2092 / 1362, "LoRA": 1641 / 1362}
# The targets (issue 12) for the same quantities; the 7B rollout has none as such (decode b1/b8/b64 do).
TARGETS = {"7B end to end": 1.8, "32B rollout (r32)": 3.0}
DECODE_TARGETS = {"1": 2.5, "8": 2.2, "64": 1.3}
ENGINES = (("bf16-lora@punica-lora", "BF16 + LoRA (vLLM punica)", "#9e9e9e"),
           ("nvfp4-lora@default", "ours: NVFP4 + LoRA (overlap, LoRA kernel v3)", "#c0392b"),
           ("nvfp4@default", "NVFP4 without LoRA (the adapter's cost)", "#f4a582"))
PHASES = (("gen_s", "rollout", "#c0392b"), ("update_actor_s", "actor update", "#2c7fb8"),
          ("update_weights_s", "adapter sync", "#7fcdbb"))


class SpeedDataError(ValueError):
    """A raw result file is missing or lacks what the figure needs; the message names the file."""


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise SpeedDataError(f"{path}: not found (the raw results are committed under docs/gpu-runs)") from None


def decode_rows(path: Path = DECODE_7B) -> dict[str, dict[str, float]]:
    """``{run: {batch: tokens/s}}`` of a ``qerl bench rollout`` JSON (median of its repeats)."""
    rows = json.loads(_read(path)).get("summary", {}).get("rows", {})
    if not rows:
        raise SpeedDataError(f"{path}: no summary rows")
    return {k: {b: float(t) for b, t in v["decode_tok_s"].items() if t} for k, v in rows.items()}


def step_phases(path: Path) -> dict[str, dict]:
    """Per run of a verl_7b_memory_step results.jsonl (``bf16-r2048f`` ...): step time median/min/max and the
    phases' medians over the steady-state steps (what the script itself recorded)."""
    out = {}
    for line in _read(path).splitlines():
        rec = json.loads(line)
        if rec.get("phase", "").startswith(("bf16-", "nvfp4-")) and rec.get("rc") == 0:
            spread = rec["step_s_spread"]
            out[rec["phase"]] = {
                "step": spread["median"], "step_min": spread["min"], "step_max": spread["max"],
                "gen_s": rec["gen_s_spread"]["median"], "update_actor_s": rec["update_actor_s_spread"]["median"],
                "update_weights_s": rec["update_weights_s"], "response": rec["settings"]["response"],
            }
    return out


def actor_points(paths: list[Path] = ACTOR_7B) -> dict[str, dict]:
    """``{case: {"peak_GiB", "ratios": [one per run]}}`` of check_actor_kernels' model step: each case's tokens/s
    over the ``bf16`` case's of the same run."""
    out: dict[str, dict] = {}
    for path in paths:
        rows = [json.loads(line) for line in _read(path).splitlines()]
        rows = [r for r in rows if r.get("step") == "model" and "step_ms" in r]
        base = next((r["step_ms"] for r in rows if r["case"] == "bf16"), None)
        if base is None:
            raise SpeedDataError(f"{path}: no bf16 model row")
        for r in rows:
            point = out.setdefault(r["case"], {"peak_GiB": r["step_peak_GiB"], "keep": r.get("keep", 0), "ratios": []})
            point["ratios"].append(round(base / r["step_ms"], 3))
    return out


def figure_data() -> dict:
    """Every number the figure draws, read from the raw files."""
    decode = decode_rows(DECODE_7B)
    base = decode["bf16-lora@punica-lora"]
    ratios = {k: {b: round(t / base[b], 3) for b, t in v.items()} for k, v in decode.items()}
    pairs = {}
    for resp, (path, bf16, nvfp4, verdict) in PAIRS.items():
        steps = step_phases(path)
        if bf16 not in steps or nvfp4 not in steps:
            raise SpeedDataError(f"{path}: the {resp}-token pair ({bf16}, {nvfp4}) is not there")
        pairs[resp] = {"bf16": steps[bf16], "nvfp4": steps[nvfp4],
                       "ratio": round(steps[bf16]["step"] / steps[nvfp4]["step"], 3),
                       "rollout_ratio": round(steps[bf16]["gen_s"] / steps[nvfp4]["gen_s"], 3),
                       "verdict": verdict}
    d32 = decode_rows(DECODE_32B)
    ours32 = round(d32["nvfp4-lora@default"]["1"] / d32["bf16-lora@punica-lora"]["1"], 3)
    ours_vs_lora = {"7B rollout": pairs["2048"]["rollout_ratio"], "7B end to end": pairs["2048"]["ratio"],
                    "32B rollout (r32)": ours32}
    q = decode_rows(DECODE_QLORA)
    nf4 = q["nf4-lora@punica-lora"]
    vs_qlora = {k: {b: round(q[k][b] / nf4[b], 3) for b in nf4} for k in ("nvfp4-lora@default", "bf16-lora@punica-lora")}
    return {"decode_tok_s": decode, "decode_vs_bf16_lora": ratios, "grpo_step": pairs,
            "vs_lora": {"paper": {k: round(v, 3) for k, v in PAPER_VS_LORA.items()}, "ours": ours_vs_lora,
                        "targets": TARGETS},
            "vs_qlora": {"decode_tok_s": q, "ours": vs_qlora,
                         "paper_7b_rollout": {k: round(v, 3) for k, v in PAPER_VS_QLORA.items()}},
            "actor_7b_16k": actor_points(ACTOR_7B)}


def _paired_bars(ax, series: list[tuple[list[float], str, str]]) -> None:  # noqa: ANN001
    """Two bars per group side by side (``series``: values per group, color, legend label), each labelled "N.NN×"."""
    for i, (vals, color, label) in enumerate(series):
        xs = [j + (i - 0.5) * 0.36 for j in range(len(vals))]
        ax.bar(xs, vals, 0.36, color=color, label=label)
        for x, v in zip(xs, vals):
            ax.annotate(f"{v:.2f}×", (x, v), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                        textcoords="offset points")


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(27, 5.2), gridspec_kw={"width_ratios": [1.25, 1.0, 1.0, 1.0, 1.0]})
    # 1. decode tokens/s, log scale (b1 ~ 100s, b64 ~ 1000s)
    ax = axes[0]
    batches = ["1", "8", "64"]
    width = 0.26
    for i, (key, label, color) in enumerate(ENGINES):
        vals = [data["decode_tok_s"][key][b] for b in batches]
        xs = [j + (i - 1) * width for j in range(len(batches))]
        ax.bar(xs, vals, width, label=label, color=color)
        base = data["decode_tok_s"]["bf16-lora@punica-lora"]
        for x, b, v in zip(xs, batches, vals):
            if key == "bf16-lora@punica-lora":
                continue
            top = v
            if key == "nvfp4-lora@default":  # the target's tick, and the ratio above whichever is higher
                goal = DECODE_TARGETS[b] * base[b]
                ax.plot([x - width / 2, x + width / 2], [goal, goal], color="black", lw=1.5, ls="--")
                top = max(v, goal)
            ax.annotate(f"{data['decode_vs_bf16_lora'][key][b]:.2f}×", (x, top), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.plot([], [], color="black", lw=1.5, ls="--", label="issue's target (× BF16 + LoRA)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s (log scale)")
    ax.set_title("Qwen2.5-7B shape, decode, r32 adapter\n(H100, one run, 2026-11-27, §4v)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    # 2. GRPO step phases
    ax = axes[1]
    labels, xs = [], []
    for j, resp in enumerate(("512", "2048")):
        pair = data["grpo_step"][resp]
        for i, run in enumerate(("bf16", "nvfp4")):
            rec = pair[run]
            x = j * 2.6 + i
            bottom = 0.0
            for key, name, color in PHASES:
                ax.bar(x, rec[key], 0.8, bottom=bottom, color=color, label=name if (j, i) == (0, 0) else None)
                bottom += rec[key]
            ax.bar(x, rec["step"] - bottom, 0.8, bottom=bottom, color="#dddddd",
                   label="other (log-prob, reward, ...)" if (j, i) == (0, 0) else None)
            ax.errorbar(x, rec["step"], yerr=[[rec["step"] - rec["step_min"]], [rec["step_max"] - rec["step"]]],
                        color="black", capsize=3, lw=1)
            labels.append(f"{'BF16' if run == 'bf16' else 'NVFP4'}\n{resp} tok")
            xs.append(x)
        ax.annotate(f"{pair['ratio']:.2f}× step\n{pair['rollout_ratio']:.2f}× rollout\n({pair['verdict']})",
                    (j * 2.6 + 0.5, max(pair["bf16"]["step_max"], pair["nvfp4"]["step_max"])), ha="center",
                    va="bottom", fontsize=8,
                    xytext=(0, 4), textcoords="offset points")
    ax.set_xticks(xs, labels, fontsize=8)
    top = max(pair[run]["step_max"] for pair in data["grpo_step"].values() for run in ("bf16", "nvfp4"))
    ax.set_ylim(0, top * 1.3)  # room for the ratios and verdicts above the bars
    ax.set_ylabel("seconds per GRPO step (median of 3 steady steps)")
    ax.set_title("verl GRPO step, 7B shape, LoRA r32, random weights\n(512: one H100, arms back to back, §4ab; "
                 "2048: two H100s at once, §4aa)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    # 3. against 16-bit LoRA: paper vs ours vs target
    ax = axes[2]
    names = list(PAPER_VS_LORA)
    _paired_bars(ax, [([data["vs_lora"][who][n] for n in names], color, label)
                      for who, color, label in (("paper", "#7f7f7f", "paper (its own setup)"),
                                                ("ours", "#c0392b", "ours (one run each)"))])
    for j, n in enumerate(names):
        if n in TARGETS:
            ax.plot([j - 0.4, j + 0.4], [TARGETS[n]] * 2, color="black", ls="--", lw=1.5)
    ax.plot([], [], color="black", ls="--", lw=1.5, label="issue's target")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xticks(range(len(names)), ["7B rollout\n(ours: verl, 2048)", "7B end to end\n(ours: 2048)",
                                      "32B rollout, r32\n(ours: decode b1)"], fontsize=8)
    ax.set_ylabel("× 16-bit LoRA")
    ax.set_title("Against 16-bit LoRA: the paper's figures and ours\n(not a same-machine comparison; §7)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    # 4. against QLoRA (NF4 + LoRA in vLLM), one run: ours and BF16 + LoRA over it, the paper's 7B lines for reference
    ax = axes[3]
    vq = data["vs_qlora"]
    _paired_bars(ax, [([vq["ours"][key][b] for b in batches], color, label)
                      for key, label, color in (("bf16-lora@punica-lora", "BF16 + LoRA", "#9e9e9e"),
                                                ("nvfp4-lora@default", "ours: NVFP4 + LoRA", "#c0392b"))])
    for who, ls in (("QeRL", "--"), ("LoRA", ":")):
        ax.axhline(vq["paper_7b_rollout"][who], color="black", ls=ls, lw=1.2,
                   label=f"paper, 7B rollout: {who} / QLoRA {vq['paper_7b_rollout'][who]:.2f}×")
    ax.axhline(1.0, color="black", lw=0.6)
    top = max(v for row in vq["ours"].values() for v in row.values())
    ax.set_ylim(0, top * 1.45)  # room for the legend above the bars
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s ÷ NF4 + LoRA (QLoRA's base)")
    ax.set_title("Against QLoRA: NF4 + LoRA in vLLM (bitsandbytes), 7B decode\n(one H100 run, random weights; §4l)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    # 5. the actor: tokens/s over BF16's against peak memory, as layers keep their activations
    ax = axes[4]
    pts = data["actor_7b_16k"]
    for kind, color, label in (("nvfp4", "#c0392b", "NVFP4 + LoRA"), ("bf16", "#9e9e9e", "BF16 + LoRA")):
        cases = sorted((c for c in pts if c.partition("+keep")[0] == kind), key=lambda c: pts[c]["keep"])
        xs = [pts[c]["peak_GiB"] for c in cases]
        ax.plot(xs, [sum(pts[c]["ratios"]) / len(pts[c]["ratios"]) for c in cases], color=color, lw=1.2, label=label)
        for c in cases:
            for i, r in enumerate(pts[c]["ratios"]):
                ax.plot(pts[c]["peak_GiB"], r, marker="os"[i % 2], color=color, ms=5, ls="none")
            ax.annotate(f"N={pts[c]['keep']}", (pts[c]["peak_GiB"], max(pts[c]["ratios"])), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.axvline(pts["bf16"]["peak_GiB"], color="black", ls="--", lw=1.2, label="BF16's peak (same-memory line)")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.plot([], [], marker="o", color="black", ls="none", ms=5, label="order 1 (circle) / order 2 (square)")
    ax.set_xlabel("step peak memory, GiB (torch max allocated)")
    ax.set_ylabel("tokens/s ÷ BF16 + LoRA (every layer recomputed)")
    ax.set_title("Actor forward + backward, 7B shape, 16 384 tokens:\nthe last N layers keep their activations "
                 "(H100, §4u)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "speed.png", help="PNG to write (default docs/speed.png)")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers drawn here")
    args = p.parse_args(argv)
    try:
        data = figure_data()
    except SpeedDataError as exc:
        print(f"plot_speed: {exc}", file=sys.stderr)
        return 2
    plot(data, args.out)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
