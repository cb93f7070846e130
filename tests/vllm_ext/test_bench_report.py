"""``vllm_ext.bench.report``: ratios vs bf16-lora, LoRA overhead, target checks and the printed table."""

from __future__ import annotations

import random
import re

import pytest

pytest.importorskip("vllm")

from vllm_ext.bench import report  # noqa: E402


def _res(config, variant, toks, ok=True):
    return {"config": config, "variant": variant, "ok": ok, "startup_s": 60.0,
            "batches": {str(b): {"decode_tok_s": t} for b, t in toks.items()},
            "memory": {"weights_bytes": 5.5 * 2**30, "kv_cache_bytes": 50 * 2**30, "lora_buffers_bytes": 2**28}}


def test_summary_ratios_overhead_and_targets(rollout_args):
    results = [
        _res("bf16-lora", "default", {1: 100.0, 8: 800.0, 64: 6000.0}),
        _res("nvfp4", "default", {1: 280.0, 8: 2000.0, 64: 8000.0}),
        _res("nvfp4-lora", "default", {1: 260.0, 8: 1600.0, 64: 7200.0}),
        _res("nvfp4-lora", "dual-stream", {1: 270.0, 8: 1800.0, 64: 7000.0}),  # no bf16-lora@dual-stream: default base
        {"config": "nvfp4-lora-aqn", "variant": "default", "ok": False, "error": "AQN hook unavailable: ..."},
    ]
    args = rollout_args("--shape", "7B")
    summary = report.summarize(results, args)
    row = summary["rows"]["nvfp4-lora@default"]
    assert row["vs_bf16_lora"] == {"1": 2.6, "8": 2.0, "64": 1.2}
    assert row["lora_overhead"] == {"1": round(1 - 260 / 280, 3), "8": 0.2, "64": 0.1}
    assert summary["rows"]["nvfp4-lora@dual-stream"]["vs_bf16_lora"]["1"] == 2.7
    assert summary["rows"]["nvfp4-lora@dual-stream"]["baseline"] == "bf16-lora@default"
    checks = {(c["run"], c["what"]): c["pass"] for c in summary["checks"]}
    assert checks[("nvfp4-lora@default", "7B b1 vs bf16-lora")] is True
    assert checks[("nvfp4-lora@default", "7B b8 vs bf16-lora")] is False
    assert checks[("nvfp4-lora@default", "LoRA overhead b64")] is True
    table = report.format_table(results, summary, [1, 8, 64])
    assert re.search(r"nvfp4-lora-aqn@default +FAILED: AQN hook unavailable", table)
    assert "PASS nvfp4-lora@default 7B b1 vs bf16-lora: 2.6" in table and "5.50" in table


def test_target_verdicts_follow_the_spread_rule(rollout_args):
    """A target's verdict is "no verdict" where the larger relative spread of the two runs reaches the distance of
    the median result from the target (§4p's 7B run: LoRA overhead 9.0 % with 9.1 % spreads), else pass or fail."""
    def res(config, tok, spread):
        r = _res(config, "decode-gemv", {1: tok})
        r["batches"]["1"]["decode_spread"] = spread
        return r

    results = [res("nvfp4-lora", 277.83, 0.0914), res("nvfp4", 305.31, 0.0913), res("bf16-lora", 125.16, 0.0214)]
    summary = report.summarize(results, rollout_args("--shape", "7B"))
    checks = {c["what"]: c for c in summary["checks"]}
    over = checks["LoRA overhead b1"]
    assert over["got"] == round(1 - 277.83 / 305.31, 3) and over["pass"] is True  # the medians alone
    assert over["spread"] == 0.0914 and over["verdict"] == "no verdict"
    assert checks["7B b1 vs bf16-lora"]["verdict"] == "fail"  # 2.22 is 11 % below 2.5: beyond the 9.1 % spread
    table = report.format_table(results, summary, [1])
    assert "NO VERDICT nvfp4-lora@decode-gemv LoRA overhead b1: 0.09 (target <= 10%, spread 9.1%)" in table
    # tight repeats: the same medians decide
    tight = [res("nvfp4-lora", 277.83, 0.005), res("nvfp4", 305.31, 0.005), res("bf16-lora", 125.16, 0.005)]
    assert {c["what"]: c["verdict"] for c in report.summarize(tight, rollout_args("--shape", "7B"))["checks"]} == {
        "7B b1 vs bf16-lora": "fail", "LoRA overhead b1": "pass"}


def test_targets_against_a_run_whose_gpu_slowed_get_no_verdict(rollout_args):
    """A run whose GPU slowed itself down (gpu_clocks' summary, e.g. §4x's H100 at 360-405 MHz with SW thermal
    slowdown): every target that compares it, as the run or as its baseline or its no-LoRA run, gets "no verdict (GPU
    slowed)" naming it, whatever the medians say; targets between runs on a healthy GPU keep theirs. The table lists
    each engine's clocks and flags the slowed one."""
    healthy = {"samples": 120, "busy": 100, "temp_c_max": 64, "sm_mhz_median": 1380.0, "sm_mhz_rated": 1980,
               "reasons": {"SW power cap": 1.0}, "slowdown_share": 0.0, "slowed": False}
    hot = {"samples": 120, "busy": 100, "temp_c_max": 87, "sm_mhz_median": 382.5, "sm_mhz_rated": 1980,
           "reasons": {"SW thermal slowdown": 1.0}, "slowdown_share": 1.0, "slowed": True}
    results = [_res("bf16-lora", "default", {1: 100.0, 8: 800.0}), _res("nvfp4", "default", {1: 280.0, 8: 2000.0}),
               _res("nvfp4-lora", "default", {1: 260.0, 8: 1600.0})]
    for r, c in zip(results, (healthy, hot, healthy)):
        r["gpu_clocks"] = c
    checks = {c["what"]: c for c in report.summarize(results, rollout_args("--shape", "7B"))["checks"]}
    assert checks["7B b1 vs bf16-lora"]["verdict"] == "pass" and "gpu_slowed" not in checks["7B b1 vs bf16-lora"]
    for what in ("LoRA overhead b1", "LoRA overhead b8"):  # against nvfp4@default, the slowed run
        assert checks[what]["verdict"] == "no verdict (GPU slowed)" and checks[what]["gpu_slowed"] == ["nvfp4@default"]
    results[0]["gpu_clocks"] = hot  # the BF16 baseline slowed too
    summary = report.summarize(results, rollout_args("--shape", "7B"))
    assert {c["verdict"] for c in summary["checks"]} == {"no verdict (GPU slowed)"}
    table = report.format_table(results, summary, [1, 8])
    assert "  nvfp4-lora@default: 1380 of 1980 MHz, 64 C; SW power cap 100%" in table
    assert ("  nvfp4@default: 382 of 1980 MHz, 87 C; SW thermal slowdown 100%  SLOWED: its timings are not this GPU "
            "kind's") in table
    assert "NO VERDICT (GPU SLOWED) nvfp4-lora@default 7B b1 vs bf16-lora: 2.6" in table


def test_ours_on_its_default_against_vllms_own_punica_lora(rollout_args):
    """The issue's table: ours as shipped (fused LoRA) vs BF16 on vLLM's punica LoRA, with no bf16-lora@default run."""
    results = [
        _res("nvfp4-lora", "default", {1: 212.0}),
        _res("stock-nvfp4-lora", "punica-lora", {1: 176.0}),
        _res("bf16-lora", "punica-lora", {1: 125.0}),
    ]
    summary = report.summarize(results, rollout_args("--shape", "7B"))
    assert summary["rows"]["nvfp4-lora@default"]["vs_bf16_lora"] == {"1": round(212 / 125, 3)}
    assert summary["rows"]["nvfp4-lora@default"]["baseline"] == "bf16-lora@punica-lora"
    assert summary["rows"]["stock-nvfp4-lora@punica-lora"]["vs_bf16_lora"] == {"1": round(176 / 125, 3)}
    table = report.format_table(results, summary, [1])
    assert "x against another variant of bf16-lora: nvfp4-lora@default vs bf16-lora@punica-lora" in table
    assert "stock-nvfp4-lora@punica-lora vs" not in table.split("x against")[1]


def test_decode_stats_median_runs_and_spread():
    from vllm_ext.bench.child import decode_stats

    # batch 8, 101 new tokens: 100 decode tokens per sequence after the fastest 1-token run (0.1 s)
    s = decode_stats(8, 101, [0.12, 0.10, 0.11], [1.1, 0.9, 1.3])
    assert s["decode_runs_tok_s"] == [800.0, 1000.0, 666.67]
    assert s["decode_tok_s"] == 800.0  # the median, not the best
    assert s["decode_spread"] == round((1000 - 800 * 5 / 6) / 800, 4)
    assert s["prefill_s"] == 0.1 and s["e2e_tok_s"] == round(8 * 101 / 1.1, 2)


def test_greedy_agreement_against_the_default_variant():
    ref = {"tokens": [[1, 2, 3, 4], [5, 6, 7, 8]], "chosen_logprobs": [[-0.1, -0.2, -0.3, -0.4], [-1.0, -1.0, -1.0, -1.0]]}
    same = {"tokens": [[1, 2, 3, 4], [5, 6, 7, 8]], "chosen_logprobs": [[-0.1, -0.21, -0.3, -0.4], [-1.0, -1.0, -1.0, -1.0]]}
    diverged = {"tokens": [[1, 2, 9, 9], [5, 6, 7, 8]], "chosen_logprobs": [[-0.1, -0.2, -5.0, -5.0], [-1.0, -1.5, -1.0, -1.0]]}
    results = [
        {"config": "nvfp4-lora", "variant": "default", "ok": True, "greedy": ref},
        {"config": "nvfp4-lora", "variant": "dense-lora", "ok": True, "greedy": same},
        {"config": "bf16-lora", "variant": "default", "ok": True, "greedy": ref},
        {"config": "bf16-lora", "variant": "dense-lora", "ok": True, "greedy": diverged},
        {"config": "nvfp4", "variant": "dense-lora", "ok": True, "greedy": same},  # no default run: not compared
    ]
    g = report.greedy_agreement(results)
    assert set(g) == {"nvfp4-lora@dense-lora", "bf16-lora@dense-lora"}
    assert g["nvfp4-lora@dense-lora"]["all_identical"] and g["nvfp4-lora@dense-lora"]["max_abs_logprob_diff"] == 0.01
    d = g["bf16-lora@dense-lora"]
    assert d["common_prefix"] == [2, 4] and not d["all_identical"]
    assert d["max_abs_logprob_diff"] == 0.5  # only within the common prefixes


def test_greedy_agreement_without_a_default_run_is_against_decode_gemv_off():
    """A run that names decode_gemv off instead of the default (the session steps since §4al): the other variants of
    that config are compared against it; a config with neither is not compared."""
    ref = {"tokens": [[1, 2, 3]], "chosen_logprobs": [[-0.1, -0.2, -0.3]]}
    near = {"tokens": [[1, 2, 4]], "chosen_logprobs": [[-0.1, -0.25, -0.9]]}
    results = [
        {"config": "nvfp4-lora", "variant": "decode-gemv-off", "ok": True, "greedy": ref},
        {"config": "nvfp4-lora", "variant": "decode-gemv-shared", "ok": True, "greedy": near},
        {"config": "bf16-lora", "variant": "punica-lora", "ok": True, "greedy": ref},  # nothing to compare against
    ]
    g = report.greedy_agreement(results)
    assert list(g) == ["nvfp4-lora@decode-gemv-shared"]
    assert g["nvfp4-lora@decode-gemv-shared"]["vs"] == "nvfp4-lora@decode-gemv-off"
    assert g["nvfp4-lora@decode-gemv-shared"]["common_prefix"] == [2]


def test_greedy_agreement_of_stock_against_ours_on_the_same_variant():
    ref = {"tokens": [[1, 2, 3]], "chosen_logprobs": [[-0.1, -0.2, -0.3]]}
    near = {"tokens": [[1, 2, 4]], "chosen_logprobs": [[-0.1, -0.25, -0.9]]}
    results = [
        {"config": "nvfp4-lora", "variant": "punica-lora", "ok": True, "greedy": ref},
        {"config": "stock-nvfp4-lora", "variant": "punica-lora", "ok": True, "greedy": near},
        {"config": "stock-nvfp4", "variant": "punica-lora", "ok": True, "greedy": ref},  # no nvfp4 run: skipped
    ]
    g = report.greedy_agreement(results)
    assert list(g) == ["stock-nvfp4-lora@punica-lora vs nvfp4-lora"]
    s = g["stock-nvfp4-lora@punica-lora vs nvfp4-lora"]
    assert s["vs"] == "nvfp4-lora@punica-lora" and s["common_prefix"] == [2] and not s["all_identical"]
    assert s["max_abs_logprob_diff"] == 0.05


def _fp(tokens, logprobs, repeat=None, alone=None):
    g = {"tokens": tokens, "chosen_logprobs": logprobs}
    if repeat is not None:
        g["repeat"] = {"tokens": repeat[0], "chosen_logprobs": repeat[1]}
    if alone is not None:
        g["alone"] = alone
    return g


def test_greedy_agreement_weighs_a_divergence_against_each_engines_own_repeat():
    """§4an: a divergence counts only where both engines repeat their own pass exactly; where one does not, the
    comparison gets no verdict; the first token's logprob difference (the prefill's) is reported apart; the prompts
    decoded alone are compared the same way."""
    t, lp = [[1, 2, 3]], [[-0.5, -0.6, -0.7]]
    off_alone = _fp(t, lp, repeat=(t, lp))
    noisy = _fp([[1, 5, 6]], [[-0.53, -0.9, -0.9]], repeat=([[1, 2, 3]], [[-0.5, -0.6, -0.7]]))
    steady = _fp([[1, 5, 6]], [[-0.53, -0.9, -0.9]], repeat=([[1, 5, 6]], [[-0.53, -0.9, -0.9]]),
                 alone=_fp(t, lp, repeat=(t, lp)))
    results = [
        {"config": "nvfp4-lora", "variant": "decode-gemv-off", "ok": True,
         "greedy": _fp(t, lp, repeat=(t, lp), alone=off_alone)},
        {"config": "nvfp4-lora", "variant": "decode-gemv-shared", "ok": True, "greedy": steady},
        {"config": "nvfp4", "variant": "decode-gemv-off", "ok": True, "greedy": _fp(t, lp, repeat=(t, lp))},
        {"config": "nvfp4", "variant": "decode-gemv-shared", "ok": True, "greedy": noisy},
    ]
    g = report.greedy_agreement(results)
    s = g["nvfp4-lora@decode-gemv-shared"]
    assert s["common_prefix"] == [1] and s["first_token_logprob_diff"] == 0.03
    assert s["repeats_itself"] == {"reference": True, "variant": True}
    assert s["verdict"] == "differs while each engine repeats itself exactly"
    assert s["alone"]["all_identical"] and s["alone"]["verdict"] == "same tokens"
    n = g["nvfp4@decode-gemv-shared"]
    assert n["repeats_itself"] == {"reference": True, "variant": False} and "alone" not in n
    assert n["verdict"] == "differs, as an engine differs from itself: no verdict"
    line = report._greedy_line("nvfp4-lora@decode-gemv-shared", s)
    assert "decoded together: common prefix [1] of 3 tokens" in line and "(first token 0.03)" in line
    assert "each prompt alone (one row per step): common prefix [3] of 3 tokens" in line
    assert line.endswith("repeats itself: reference yes, variant yes: same tokens")
    # a fingerprint from before §4an (one pass, no repeat): the divergence is reported, its cause unknown
    old = report.greedy_agreement([{**r, "greedy": {k: r["greedy"][k] for k in ("tokens", "chosen_logprobs")}}
                                   for r in results])
    verdict = old["nvfp4-lora@decode-gemv-shared"]["verdict"]
    assert verdict == "differs (no repeats: the engines' own variation is unknown)"
    assert "repeats itself" not in report._greedy_line("k", old["nvfp4-lora@decode-gemv-shared"])


def test_greedy_fingerprint_decodes_the_prompts_together_and_alone_twice_each():
    """The child's four passes (§4an), on a stand-in for vLLM's LLM (no model runs on this machine): the same 64-token
    prompts as before §4an, one generate call with all of them twice, then one call per prompt twice; outputs kept
    in prompt order per pass."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_ext.bench.child import greedy_fingerprint

    class Engine:
        def __init__(self):
            self.calls = []

        def generate(self, prompts, params, lora_request=None, use_tqdm=True):
            self.calls.append((len(prompts), params.max_tokens, params.temperature, lora_request))
            outs = []
            for p in prompts:
                ids = [p["prompt_token_ids"][0] + i for i in range(params.max_tokens)]
                lps = [{t: SimpleNamespace(logprob=-0.1 * len(self.calls))} for t in ids]
                outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=lps)]))
            return outs

    llm = Engine()
    spec = {"greedy_prompts": 3, "greedy_tokens": 5, "dims": {"vocab": 1000}}
    g = greedy_fingerprint(llm, spec, "adapter", SamplingParams)
    assert llm.calls == [(3, 5, 0.0, "adapter")] * 2 + [(1, 5, 0.0, "adapter")] * 6
    firsts = [t[0] for t in g["tokens"]]
    assert g["alone"]["tokens"] == g["repeat"]["tokens"] == g["tokens"] and len(set(firsts)) == 3
    rng = random.Random(1234)  # the prompts of every bench run so far
    assert firsts == [[rng.randrange(100, 900) for _ in range(64)][0] for _ in range(3)]
    assert g["chosen_logprobs"][0][0] == -0.1 and g["repeat"]["chosen_logprobs"][0][0] == -0.2
    assert [lp[0][0] for lp in (g["alone"]["chosen_logprobs"], g["alone"]["repeat"]["chosen_logprobs"])] == [-0.3, -0.6]


def test_profiled_steps_are_printed():
    from test_bench_profile import _trace

    from vllm_ext.bench import profile

    res = _res("nvfp4-lora", "default", {1: 200.0})
    res["profile"] = {"1": profile.summarize_trace(_trace()), "8": {"error": "the trace has no GPU kernels: ..."}}
    clock = {"gc": {}, "gc_ms_per_step": 0.0, "wall_s": 0.5, "cpu_s": 0.4, "cpu_ms_per_step": 4.0}
    res["profile"]["1"]["host_sampled"] = {"clock": clock, "threads": {  # as sampled: every thread equally often
        "other": {"samples": 900, "leaf": [["a/b.py:wait", 1.0]]}, "third": {"samples": 900, "leaf": []},
        "MainThread": {"samples": 900, "leaf": [["core/sched.py:schedule", 0.25], ["x/y.py:f", 0.125]]}}}
    table = report.format_table([res], {"rows": {}, "checks": []}, [1])
    assert "    the same tokens sampled without the profiler: cpu 4.000, gc 0.000 (0/0/0; max 0.0 ms)" in table
    assert "    MainThread (900 samples), innermost frames: core/sched.py:schedule 25%, x/y.py:f 12%" in table
    assert "    other (900 samples), innermost frames: a/b.py:wait 100%" in table and "third (" not in table
    assert table.index("MainThread (900") < table.index("other (900")  # the main thread first
    assert ("nvfp4-lora@default b1: step 1.000 = replay 0.270 (span 0.270, 4 kernels) + outside 0.305 + idle 0.425; "
            "outside:gemm 0.300, marlin 0.200, lora 0.050, attention 0.020, outside:copy 0.005") in table
    assert "    host per step: cudaGraphLaunch 8 us x1, cudaLaunchKernel 4 us x1" in table
    assert "nvfp4-lora@default b8: the trace has no GPU kernels" in table


def test_ratios_against_qloras_nf4_base_where_the_run_has_one(rollout_args):
    """The paper's headline multipliers are against QLoRA: with an nf4-lora run (vLLM's punica, as QLoRA serving
    gets it), each LoRA row also carries its ratio against that run, named, and the table prints them."""
    results = [
        _res("nvfp4-lora", "default", {1: 212.0, 8: 1600.0}),
        _res("nf4-lora", "punica-lora", {1: 100.0, 8: 1000.0}),
        _res("bf16-lora", "punica-lora", {1: 125.0, 8: 1000.0}),
        _res("nvfp4", "default", {1: 260.0, 8: 2000.0}),
    ]
    summary = report.summarize(results, rollout_args("--shape", "7B"))
    ours = summary["rows"]["nvfp4-lora@default"]
    assert ours["vs_qlora"] == {"1": 2.12, "8": 1.6} and ours["qlora_baseline"] == "nf4-lora@punica-lora"
    assert summary["rows"]["bf16-lora@punica-lora"]["vs_qlora"] == {"1": 1.25, "8": 1.0}
    assert "vs_qlora" not in summary["rows"]["nf4-lora@punica-lora"]  # not against itself
    assert "vs_qlora" not in summary["rows"]["nvfp4@default"]  # no LoRA: not a QLoRA comparison
    table = report.format_table(results, summary, [1, 8])
    assert "x against QLoRA's NF4 base (nf4-lora@punica-lora" in table
    assert "nvfp4-lora@default: b1 2.12x, b8 1.60x" in table
    # without an nf4 run, nothing about QLoRA
    summary = report.summarize(results[:1] + results[2:], rollout_args("--shape", "7B"))
    assert all("vs_qlora" not in row for row in summary["rows"].values())
    assert "QLoRA" not in report.format_table(results[:1] + results[2:], summary, [1, 8])


def test_host_clock_counts_real_collections_and_cpu_time():
    import gc
    import time

    from vllm_ext.bench import report
    from vllm_ext.bench.child import HostClock

    host = HostClock()
    try:
        host.reset()
        start, cpu = time.perf_counter(), time.process_time()
        gc.collect(0)
        gc.collect(2)
        busy_until = time.process_time() + 0.05  # 50 ms of CPU on this thread
        while time.process_time() < busy_until:
            pass
        h = host.summary(time.perf_counter() - start, time.process_time() - cpu, 10)
    finally:
        host.close()
    assert gc.callbacks.count(host._callback) == 0  # closed: nothing left hooked into the interpreter
    assert h["gc"]["gen0"]["count"] >= 1 and h["gc"]["gen2"]["count"] >= 1
    assert h["gc_ms_per_step"] > 0 and h["gc"]["gen2"]["max_ms"] <= h["gc"]["gen2"]["total_ms"]
    assert h["cpu_ms_per_step"] >= 5.0 and h["cpu_s"] <= h["wall_s"] + 0.01
    cell = report.host_cell(h)
    assert cell.startswith(f"cpu {h['cpu_ms_per_step']:.3f}, gc ") and "; max " in cell


def test_host_lines_in_the_table(rollout_args):
    from vllm_ext.bench import report

    h = {"gc": {"gen0": {"count": 3, "total_ms": 0.3, "max_ms": 0.2}, "gen2": {"count": 1, "total_ms": 9.0,
                                                                             "max_ms": 9.0}},
         "gc_ms_per_step": 0.0363, "wall_s": 1.0, "cpu_s": 0.9, "cpu_ms_per_step": 3.63}
    results = [{"config": "nvfp4-lora", "variant": "default", "ok": True,
                "batches": {"8": {"decode_tok_s": 1900.0, "decode_spread": 0.01, "host": [h, h]}}}]
    table = report.format_table(results, report.summarize(results, rollout_args("--shape", "7B")), [8])
    line = next(ln for ln in table.splitlines() if ln.startswith("  nvfp4-lora@default b8: cpu"))
    assert line.count("cpu 3.630, gc 0.036 (3/0/1; max 9.0 ms)") == 2


def test_stack_sampler_finds_the_busy_function_of_another_thread():
    import threading
    import time

    from vllm_ext.bench.child import StackSampler

    done = threading.Event()

    def spin_here():
        while not done.is_set():
            sum(range(200))

    worker = threading.Thread(target=spin_here, name="busy-worker")
    worker.start()
    try:
        with StackSampler(interval_s=0.001) as sampler:
            time.sleep(0.3)
    finally:
        done.set()
        worker.join()
    threads = sampler.summary()["threads"]
    busy = threads["busy-worker"]
    assert busy["samples"] >= 20
    top, share = busy["leaf"][0]
    assert top.endswith("test_bench_report.py:spin_here") and share > 0.5
    assert any(w.endswith(":spin_here") for w, _ in busy["inclusive"])
    assert "qerl-stack-sampler" not in threads  # it does not sample itself
