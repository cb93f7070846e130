"""``qerl bench rollout``'s report: decode ratios vs bf16-lora, LoRA overhead, target checks, and the table."""

from __future__ import annotations

import argparse
from typing import Any

from qerl_plugin.gpu_clocks import reason_shares
from vllm_ext.bench.matrix import BASELINE, CONFIGS, MAX_LORA_OVERHEAD, QLORA_BASELINE, TARGETS

__all__ = ["format_table", "summarize"]

SLOWED_VERDICT = "no verdict (GPU slowed)"


def summarize(results: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """Ratios vs bf16-lora (same variant, else the default variant, else vLLM's own punica LoRA), LoRA overhead,
    target checks."""
    by = {(r["config"], r["variant"]): r for r in results if r.get("ok")}

    def baseline(config: str, vname: str) -> dict | None:  # same variant, else the default, else vLLM's punica LoRA
        return by.get((config, vname)) or by.get((config, "default")) or by.get((config, "punica-lora"))

    rows: dict[str, Any] = {}
    for (cname, vname), r in by.items():
        base, qlora = baseline(BASELINE, vname), baseline(QLORA_BASELINE, vname)
        row: dict[str, Any] = {"decode_tok_s": {}, "vs_bf16_lora": {}, "lora_overhead": {},
                               "baseline": f"{base['config']}@{base['variant']}" if base else None}
        if qlora and CONFIGS[cname].lora and cname != QLORA_BASELINE:
            row.update(vs_qlora={}, qlora_baseline=f"{qlora['config']}@{qlora['variant']}")
        no_lora = by.get((cname.replace("-lora-aqn", "").replace("-lora", ""), vname)) if CONFIGS[cname].lora else None
        if no_lora:
            row["no_lora"] = f"{no_lora['config']}@{no_lora['variant']}"
        row["spread"] = {"vs_bf16_lora": {}, "lora_overhead": {}}  # the larger relative spread of the two runs
        for b, m in r.get("batches", {}).items():
            tok = m.get("decode_tok_s")
            row["decode_tok_s"][b] = tok
            if base and tok and base["batches"].get(b, {}).get("decode_tok_s"):
                row["vs_bf16_lora"][b] = round(tok / base["batches"][b]["decode_tok_s"], 3)
                row["spread"]["vs_bf16_lora"][b] = _larger_spread(m, base["batches"][b])
            if "vs_qlora" in row and tok and qlora["batches"].get(b, {}).get("decode_tok_s"):
                row["vs_qlora"][b] = round(tok / qlora["batches"][b]["decode_tok_s"], 3)
            if no_lora and tok and no_lora["batches"].get(b, {}).get("decode_tok_s"):
                row["lora_overhead"][b] = round(1 - tok / no_lora["batches"][b]["decode_tok_s"], 3)
                row["spread"]["lora_overhead"][b] = _larger_spread(m, no_lora["batches"][b])
        rows[f"{cname}@{vname}"] = row
    checks = []
    shape = None if args.model else args.shape
    # runs whose GPU slowed itself down (qerl_plugin.gpu_clocks): a target that compares one of them gets no verdict
    slowed = {f"{r['config']}@{r['variant']}" for r in results
              if r.get("ok") and (r.get("gpu_clocks") or {}).get("slowed")}

    def check(key: str, what: str, target: str, got: float, ok: bool, spread, margin: float, other: str | None):
        c = {"run": key, "what": what, "target": target, "got": got, "pass": ok, "spread": spread,
             "verdict": _verdict(margin, spread)}
        hit = sorted({key, other} & slowed)
        if hit:
            c.update(verdict=SLOWED_VERDICT, gpu_slowed=hit)
        checks.append(c)

    for key, row in rows.items():
        cname = key.split("@")[0]
        if cname != "nvfp4-lora":
            continue
        for b, target in TARGETS.get(shape, {}).items():
            bk = str(b) if str(b) in row["vs_bf16_lora"] else b
            got = row["vs_bf16_lora"].get(bk)
            if got is not None:
                check(key, f"{shape} b{b} vs bf16-lora", f">= {target}", got, got >= target,
                      row["spread"]["vs_bf16_lora"].get(bk), got / target - 1.0, row["baseline"])
        for b, ov in row["lora_overhead"].items():
            check(key, f"LoRA overhead b{b}", f"<= {MAX_LORA_OVERHEAD:.0%}", ov, ov <= MAX_LORA_OVERHEAD,
                  row["spread"]["lora_overhead"].get(b), MAX_LORA_OVERHEAD - ov, row.get("no_lora"))
    return {"rows": rows, "checks": checks, "greedy": greedy_agreement(results)}


def _larger_spread(a: dict, b: dict) -> float | None:
    """The larger of two runs' relative spreads of their repeats ((max - min) / median), if both have one."""
    sa, sb = a.get("decode_spread"), b.get("decode_spread")
    return None if sa is None or sb is None else round(max(sa, sb), 4)


def _verdict(margin: float, spread: float | None) -> str:
    """docs/benchmarks.md's rule for a target: ``margin`` is how far the median result is on the good side of the
    target (relative; negative on the bad side), ``spread`` the larger relative spread of the runs compared. No
    verdict where the spread reaches the margin; without spreads (one repeat) the medians decide."""
    if spread is not None and abs(margin) <= spread:
        return "no verdict"
    return "pass" if margin >= 0 else "fail"


# the variant a config's greedy tokens are compared against: the first of these that the run has
GREEDY_REFERENCES = ("default", "decode-gemv-off")


def _greedy_pair(ref: dict, got: dict) -> dict[str, Any]:
    """One pass of ``got`` against one of ``ref``: per prompt the common token prefix; over those prefixes the
    largest |difference| of the chosen-token logprobs; and that of the first token alone (the prefill's, before any
    decode step) where both engines chose the same first token."""
    prefixes, diffs, first = [], [], []
    for ta, tb, la, lb in zip(ref["tokens"], got["tokens"], ref["chosen_logprobs"], got["chosen_logprobs"]):
        n = 0
        while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
            n += 1
        prefixes.append(n)
        diffs += [abs(a - b) for a, b in zip(la[:n], lb[:n])]
        first += [abs(la[0] - lb[0])] if n and la and lb else []
    length = max((len(t) for t in ref["tokens"]), default=0)
    return {"common_prefix": prefixes, "all_identical": all(p == length for p in prefixes),
            "max_abs_logprob_diff": round(max(diffs), 5) if diffs else None,
            "first_token_logprob_diff": round(max(first), 5) if first else None}


def _repeats_itself(g: dict) -> bool | None:
    """Whether an engine's second pass gave exactly its first's tokens and logprobs; None without a second pass
    (files from before §4an)."""
    if not g.get("repeat"):
        return None
    return g["tokens"] == g["repeat"]["tokens"] and g["chosen_logprobs"] == g["repeat"]["chosen_logprobs"]


def _greedy_verdict(pair: dict, ref_self: bool | None, got_self: bool | None) -> str:
    if pair["all_identical"]:
        return "same tokens"
    if ref_self is None or got_self is None:
        return "differs (no repeats: the engines' own variation is unknown)"
    if not (ref_self and got_self):
        return "differs, as an engine differs from itself: no verdict"
    return "differs while each engine repeats itself exactly"


def greedy_agreement(results: list[dict]) -> dict[str, Any]:
    """Each non-default variant's greedy fingerprint against the default variant of the same config (or, in a run
    without one, against ``decode-gemv-off``, the default before §4al, which steps name since), and each stock-*
    config's against ours (the name without ``stock-``) on the same variant.

    Per prompt: the length of the common token prefix; over those prefixes, the largest absolute difference of
    the chosen-token logprobs (nats). Identical arithmetic gives full prefixes and differences near 0; a different
    kernel order gives small differences and, on near-ties (random weights), an earlier divergence. Also, from
    fingerprints that have them (§4an on): the first token's logprob difference (nonzero: the prefills differ), whether
    each engine repeated its own pass exactly (``repeats_itself``), the same comparison of the prompts decoded one
    at a time (``alone``: one-row decode steps, where ``decode_gemv`` engines run their own kernel), and a verdict
    per mode: a divergence counts only where each engine repeats itself.
    """
    ok = {(r["config"], r["variant"]): r.get("greedy") for r in results if r.get("ok") and r.get("greedy")}
    reference = {c: next((v for v in GREEDY_REFERENCES if (c, v) in ok), None) for c, _ in ok}
    pairs = [((c, v), (c, reference[c])) for c, v in ok if reference[c] is not None and v != reference[c]]
    # vLLM's stock NVFP4A16 path against ours on the same variant: one checkpoint (--nvfp4-model), so the same weights
    pairs += [((c, v), (c.replace("stock-", "", 1), v)) for c, v in ok if c.startswith("stock-")]
    out: dict[str, Any] = {}
    for (cname, vname), (rname, rvar) in pairs:
        got, ref = ok[(cname, vname)], ok.get((rname, rvar))
        if ref is None:
            continue
        key = f"{cname}@{vname}" if rname == cname else f"{cname}@{vname} vs {rname}"
        entry = {"vs": f"{rname}@{rvar}", "tokens_per_prompt": max((len(t) for t in ref["tokens"]), default=0)}
        for mode, r, g in (("together", ref, got), ("alone", ref.get("alone"), got.get("alone"))):
            if not (r and g):
                continue
            pair = _greedy_pair(r, g)
            selves = {"reference": _repeats_itself(r), "variant": _repeats_itself(g)}
            pair.update(repeats_itself=selves, verdict=_greedy_verdict(pair, selves["reference"], selves["variant"]))
            if mode == "together":
                entry.update(pair)  # at the top, as before §4an
            else:
                entry["alone"] = pair
        out[key] = entry
    return out


def _greedy_line(key: str, g: dict) -> str:
    def mode(p: dict) -> str:
        text = (f"common prefix {p['common_prefix']} of {g['tokens_per_prompt']} tokens, max |chosen-token logprob "
                f"diff| {p['max_abs_logprob_diff']}")
        if p.get("first_token_logprob_diff") is not None:
            text += f" (first token {p['first_token_logprob_diff']})"
        selves = p.get("repeats_itself") or {}
        if selves.get("reference") is not None:
            text += (f"; repeats itself: reference {'yes' if selves['reference'] else 'no'}, "
                     f"variant {'yes' if selves['variant'] else 'no'}")
        return text + (f": {p['verdict']}" if p.get("verdict") else "")

    line = f"greedy vs {g['vs']}: {key} " + ("decoded together: " if g.get("alone") else "") + mode(g)
    if g.get("alone"):
        line += "; each prompt alone (one row per step): " + mode(g["alone"])
    return line


def host_cell(h: dict) -> str:
    """One timed run's host line: CPU ms per step, GC ms per step (collections per generation; longest pause)."""
    gc = h.get("gc") or {}
    counts = "/".join(str((gc.get(f"gen{g}") or {}).get("count", 0)) for g in range(3))
    longest = max((v.get("max_ms", 0.0) for v in gc.values()), default=0.0)
    return f"cpu {h['cpu_ms_per_step']:.3f}, gc {h['gc_ms_per_step']:.3f} ({counts}; max {longest:.1f} ms)"


def _gib(n: Any) -> str:
    return f"{n / 2**30:.2f}" if isinstance(n, (int, float)) and n else "-"


def format_table(results: list[dict], summary: dict, batches: list[int]) -> str:
    lines = []
    head = f"{'run':<34}" + "".join(f"{'b' + str(b) + ' tok/s':>12}{'x':>7}" for b in batches)
    head += f"{'weights':>9}{'lora':>7}{'kv':>8}{'start s':>8}"
    lines += ["", "decode tokens/s, median of the repeats (x = ratio vs bf16-lora of the same variant, else as noted "
              "below); memory in GiB", head, "-" * len(head)]
    for r in results:
        key = f"{r['config']}@{r['variant']}"
        if not r.get("ok"):
            lines.append(f"{key:<34} FAILED: {str(r.get('error'))[:150]}")
            continue
        row = summary["rows"].get(key, {})
        cells = ""
        for b in batches:
            tok = r["batches"].get(str(b), {}).get("decode_tok_s")
            ratio = row.get("vs_bf16_lora", {}).get(str(b))
            cells += f"{tok:>12.1f}" if tok else f"{'-':>12}"
            cells += f"{ratio:>7.2f}" if ratio else f"{'-':>7}"
        mem = r.get("memory", {})
        cells += f"{_gib(mem.get('weights_bytes')):>9}{_gib(mem.get('lora_buffers_bytes')):>7}"
        cells += f"{_gib(mem.get('kv_cache_bytes')):>8}{r.get('startup_s', 0):>8.0f}"
        lines.append(f"{key:<34}{cells}")
    other_base = [f"{k} vs {row['baseline']}" for k, row in summary["rows"].items()
                  if row.get("baseline") and row["baseline"].split("@")[1] != k.split("@")[1]]
    if other_base:
        lines += ["", "x against another variant of bf16-lora: " + "; ".join(other_base)]
    vs_qlora = [f"{k}: " + ", ".join(f"b{b} {v:.2f}x" for b, v in row["vs_qlora"].items())
                for k, row in summary["rows"].items() if row.get("vs_qlora")]
    if vs_qlora:
        qbase = next(row["qlora_baseline"] for row in summary["rows"].values() if row.get("vs_qlora"))
        lines += ["", f"x against QLoRA's NF4 base ({qbase}; the paper's 1.5x / 1.7x / 2.2x are of this kind): "
                  + "; ".join(vs_qlora)]
    overheads = [f"{k}: " + ", ".join(f"b{b} {v:.0%}" for b, v in row["lora_overhead"].items())
                 for k, row in summary["rows"].items() if row["lora_overhead"]]
    if overheads:
        lines += ["", "LoRA overhead (1 - tok/s with LoRA / without): " + "; ".join(overheads)]
    lines += [_greedy_line(key, g) for key, g in summary.get("greedy", {}).items()]
    spreads = [f"{r['config']}@{r['variant']} b{b} {m['decode_spread']:.1%}" for r in results if r.get("ok")
               for b, m in r.get("batches", {}).items() if m.get("decode_spread") is not None]
    if spreads:
        lines += ["", "spread of the repeats ((max - min) / median decode tok/s): " + "; ".join(spreads)]
    hosts = [(r, b, m["host"]) for r in results if r.get("ok") for b, m in r.get("batches", {}).items()
             if m.get("host")]
    if hosts:
        lines += ["", "the host during each timed run (vllm_ext.bench.child.HostClock), per decode step: process "
                  "CPU ms; Python GC ms (collections: gen0/gen1/gen2; longest pause)"]
        for r, b, runs in hosts:
            cells = "; ".join(host_cell(h) for h in runs)
            lines.append(f"  {r['config']}@{r['variant']} b{b}: {cells}")
    clocks = [(r, r["gpu_clocks"]) for r in results if (r.get("gpu_clocks") or {}).get("busy")]
    if clocks:
        lines += ["", "GPU while each engine ran, busy samples (qerl_plugin.gpu_clocks): median SM clock of the rated, "
                  "peak temperature, clock-event reasons"]
        for r, c in clocks:
            flag = "  SLOWED: its timings are not this GPU kind's" if c.get("slowed") else ""
            lines.append(f"  {r['config']}@{r['variant']}: {c['sm_mhz_median']:.0f} of {c['sm_mhz_rated']} MHz, "
                         f"{c['temp_c_max']} C; {reason_shares(c)}{flag}")
    profiled = [(r, b, p) for r in results for b, p in r.get("profile", {}).items()]
    if profiled:
        lines += ["", "profiled decode step, GPU clock, median per step in ms (vllm_ext.bench.profile): step = graph "
                  "replay's busy time + GPU work outside it + GPU idle; categories inside the replay, 'outside:' for "
                  "eager work"]
        for r, b, p in profiled:
            key = f"{r['config']}@{r['variant']} b{b}"
            if "error" in p:
                lines.append(f"  {key}: {p['error']}")
                continue
            cats = ", ".join(f"{c} {v:.3f}" for c, v in sorted(p["by_category_ms"].items(), key=lambda kv: -kv[1]) if v)
            lines.append(f"  {key}: step {p['period_ms']:.3f} = replay {p['replay_busy_ms']:.3f} (span "
                         f"{p['replay_span_ms']:.3f}, {p['replay_kernels']} kernels) + outside {p['outside_busy_ms']:.3f} "
                         f"+ idle {p['idle_ms']:.3f}; {cats}")
            if p.get("host"):
                lines.append(f"    host clock: {host_cell(p['host'])}")
            if p.get("top_host"):  # what the host did meanwhile (the idle is the GPU waiting for it)
                host = ", ".join(f"{h['name'][:60]} {h['us_per_step']:.0f} us x{h['calls_per_step']:g}"
                                 for h in p["top_host"][:5])
                lines.append(f"    host per step: {host}")
            sampled = p.get("host_sampled") or {}
            if sampled.get("clock"):
                lines.append(f"    the same tokens sampled without the profiler: {host_cell(sampled['clock'])}")
            threads = sorted(sampled.get("threads", {}).items(), key=lambda kv: kv[0] != "MainThread")
            for name, t in threads[:2]:  # the main thread (vLLM's in-process engine runs there) and one more
                leaf = ", ".join(f"{w} {share:.0%}" for w, share in t["leaf"][:6])
                lines.append(f"    {name} ({t['samples']} samples), innermost frames: {leaf}")
    if summary["checks"]:
        lines += ["", "targets (no verdict where the larger spread of the two runs reaches the distance to the target):"]
        for c in summary["checks"]:
            verdict = c.get("verdict") or ("pass" if c["pass"] else "fail")
            spread = "" if c.get("spread") is None else f", spread {c['spread']:.1%}"
            lines.append(f"  {verdict.upper()} {c['run']} {c['what']}: {c['got']} (target {c['target']}{spread})")
    return "\n".join(lines)
