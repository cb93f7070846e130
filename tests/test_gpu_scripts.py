"""The GPU scripts' CPU-side logic: the entropy-sweep verdict, and that every `session.sh` step the docs name exists.

The scripts themselves run on the H100 (docs/benchmarks.md, docs/verl-h100.md); what is checked here is what
decides their verdicts and what a reader would type from the docs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"


def _import_script(name: str):
    """scripts/gpu/<name>.py as a module, imported without leaving its os.environ defaults (VLLM_* switches meant
    for its own GPU process) or scripts/gpu on sys.path behind for the rest of the test session."""
    env, path = dict(os.environ), list(sys.path)
    sys.path.insert(0, str(GPU))
    try:
        return importlib.import_module(name)
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path


@pytest.fixture(scope="module")
def check_aqn_vllm():
    return _import_script("check_aqn_vllm")


def _sweep(means_ses):
    return [{"sigma": s, "mean": m, "se": se, "top1_changed_frac": 0.0} for s, (m, se) in means_ses.items()]


def test_entropy_verdict_passes_a_rising_sweep_with_a_flat_step(check_aqn_vllm):
    # the float32 sweep measured on the H100 (second session)
    ok, detail = check_aqn_vllm.entropy_verdict(_sweep({
        0.0: (0.5708205636511734, 0.0), 1e-4: (0.5708208336212515, 2.99e-8),
        1e-3: (0.5708208934942253, 8.10e-8), 1e-2: (0.5708355626813281, 3.33e-7)}))
    assert ok
    assert [s["verdict"] for s in detail["steps"]] == ["up", "flat", "up"]
    assert detail["strictly_increasing_means"]


def test_entropy_verdict_fails_a_dip_beyond_two_se(check_aqn_vllm):
    # the bf16 sweep measured on the H100: 1e-4 sits 4 SE below sigma = 0
    ok, detail = check_aqn_vllm.entropy_verdict(_sweep({
        0.0: (0.570807, 0.0), 1e-4: (0.5707861, 4.7e-6), 1e-3: (0.5707840, 5.6e-6), 1e-2: (0.5708696, 1.2e-5)}))
    assert not ok
    assert detail["steps"][0]["verdict"] == "down"


def test_entropy_verdict_needs_the_largest_sigma_up(check_aqn_vllm):
    ok, _ = check_aqn_vllm.entropy_verdict(_sweep({0.0: (1.0, 0.0), 1e-2: (1.0 + 1e-9, 1e-6)}))
    assert not ok


def test_entropy_verdict_sorts_by_sigma(check_aqn_vllm):
    ok, detail = check_aqn_vllm.entropy_verdict(_sweep({1e-2: (2.0, 0.01), 0.0: (1.0, 0.0)}))
    assert ok and detail["steps"][0]["from"] == 0.0


def _session_steps() -> set[str]:
    text = (GPU / "session.sh").read_text()
    labels = re.findall(r"^\s+([a-z0-9_]+(?:\|[a-z0-9_]+)*)\)", text, flags=re.M)  # `a)` and `a|b)`
    return {name for label in labels for name in label.split("|")}


# steps the docs name as history, taken out of session.sh with what they ran: the float16-pair row decode's real-model
# checks (docs/benchmarks.md §4bi and §4bk; the mode was removed, §4bl)
REMOVED_STEPS = {"eval_hfma2", "eval_hfma2_4"}


@pytest.mark.parametrize("doc", ["docs/benchmarks.md", "docs/verl-h100.md", "docs/learning.md", "README.md"])
def test_every_session_step_named_in_the_docs_exists(doc):
    steps = _session_steps()
    assert not steps & REMOVED_STEPS
    assert {"install", "aqn", "entropy32", "bench32b", "verl_resume8a", "verl_resume8b"} <= steps
    text = (ROOT / doc).read_text()
    named = set()
    for line in re.findall(r"session\.sh ([a-z0-9_ ]+)", text):  # `bash scripts/gpu/session.sh a b`
        named.update(line.split())
    for group in re.findall(r"\b[Ss]teps? ((?:`[a-z0-9_]+`(?:,? and |, | then |\s*))+)", text):  # Step `a`, Steps `a`, `b`
        named.update(re.findall(r"`([a-z0-9_]+)`", group))
    missing = sorted(named - steps - REMOVED_STEPS)
    assert not missing, f"{doc} names session.sh steps that scripts/gpu/session.sh does not have: {missing}"


@pytest.fixture(scope="module")
def learning():
    return _import_script("learning")


_FAKE_RUN = """
import json, os, sys, time
path = os.environ["VERL_FILE_LOGGER_PATH"]
steps = int(sys.argv[1])
with open(path, "a") as fh:
    fh.write(json.dumps({"step": 0, "data": {"val-core/qerl/synthetic_arithmetic/acc/mean@1": 0.01}}) + "\\n")
    for s in range(1, steps + 1):
        data = {"critic/score/mean": s / 10, "timing_s/step": 40.0 if s == 1 else 2.0}
        if s % 2 == 0:
            data["val-core/qerl/synthetic_arithmetic/acc/mean@1"] = s / 20
        fh.write(json.dumps({"step": s, "data": data}) + "\\n")
        fh.flush()
        time.sleep(0.05)
print("done")
"""


def test_learning_runs_are_launched_watched_and_packed(learning, tmp_path, monkeypatch, capsys):
    """launch/wait/status/pack with a stand-in for verl that writes verl's file-logger lines."""
    import json
    import tarfile

    monkeypatch.setattr(learning, "command", lambda arm, seed, run_dir, overrides: [sys.executable, "-c", _FAKE_RUN, str(4 + seed)])
    work = tmp_path / "learn"
    assert learning.main(["launch", "--work", str(work), "--runs", "aqn:0,bf16:1", "--stagger", "0", "--host-gib-per-run", "0.01"]) == 0
    assert learning.main(["wait", "--work", str(work), "--timeout", "60", "--every", "0.2"]) == 0
    rows = {r["run"]: r for r in learning.status(argparse.Namespace(work=work, only=None))}
    assert set(rows) == {"aqn-s0", "bf16-s1"}
    a = rows["aqn-s0"]
    assert (a["alive"], a["failed"], a["step"], a["val_first"], a["val"], a["val_step"]) == (False, False, 4, 0.01, 0.2, 4)
    assert a["step_s_median"] == 2.0  # the first (compile) step is left out
    assert rows["bf16-s1"]["step"] == 5
    assert learning.main(["pack", "--work", str(work), "--out", str(tmp_path / "out"), "--name", "t"]) == 0
    with tarfile.open(tmp_path / "out" / "t.tar.gz") as tar:
        names = set(tar.getnames())
        summary = json.load(tar.extractfile("t/summary.json"))
    assert {"t/aqn-s0/metrics.jsonl", "t/bf16-s1/run.log", "t/bf16-s1/cmd.json"} <= names
    assert {r["run"] for r in summary} == {"aqn-s0", "bf16-s1"}
    # --after refuses to start anything behind a run that is not alive
    assert learning.main(["launch", "--work", str(work), "--runs", "nvfp4:0", "--after", "aqn-s0:10"]) == 1
    assert not (work / "nvfp4-s0").exists()


def test_learning_timing_reports_medians_and_checks_a_limit(learning, tmp_path, capsys):
    """`timing`: median / min / max of each phase over steps >= --first, the exit code against --max-median; checked
    against the real demo run whose numbers docs/learning.md quotes."""
    import json
    import shutil

    real = Path(__file__).resolve().parents[1] / "docs/gpu-runs/2026-11-24/demo_bypass"
    work = tmp_path / "w"
    (work / "demo").mkdir(parents=True)
    for f in ("cmd.json", "metrics.jsonl"):
        shutil.copy(real / f, work / "demo" / f)
    (work / "toy").mkdir()
    (work / "toy" / "cmd.json").write_text("{}")
    lines = [{"step": s, "data": {"timing_s/step": t, "timing_s/gen": t / 2}} for s, t in [(1, 90.0), (2, 5.0), (3, 7.0), (4, 6.0), (5, 4.0)]]
    (work / "toy" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))

    rows = {r["run"]: r for r in learning.timing_rows(work)}
    toy = rows["toy"]
    assert toy["steps"] == 4 and toy["timing_s/step"] == {"median": 5.5, "min": 4.0, "max": 7.0}  # step 1 left out
    assert toy["timing_s/gen"]["median"] == 2.75 and "timing_s/old_log_prob" not in toy
    assert learning.timing_rows(work, first=4, only=["toy"])[0]["timing_s/step"] == {"median": 5.0, "min": 4.0, "max": 6.0}
    import statistics

    recs = [json.loads(x) for x in (real / "metrics.jsonl").read_text().splitlines()]
    ref = [r["data"]["timing_s/step"] for r in recs if r["step"] >= 2 and "timing_s/step" in r["data"]]
    step = rows["demo"]["timing_s/step"]
    assert rows["demo"]["steps"] == len(ref) == 49
    assert step == {"median": round(statistics.median(ref), 3), "min": round(min(ref), 3), "max": round(max(ref), 3)}
    assert round(step["median"], 2) == 4.16  # the figure the docs quote

    out = tmp_path / "t.json"
    assert learning.main(["timing", "--work", str(work), "--max-median", "6", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == learning.timing_rows(work)
    assert learning.main(["timing", "--work", str(work), "--max-median", "5"]) == 3
    assert "median step over 5 s (or no steps): toy" in capsys.readouterr().out
    assert learning.main(["timing", "--work", str(tmp_path / "w"), "--only", "nothing"]) == 2


def test_learning_launch_refuses_more_runs_than_host_memory_holds(learning, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(learning, "command", lambda *a: pytest.fail("nothing may start"))
    monkeypatch.setattr(learning, "host_available_gib", lambda: 60.0)
    work = tmp_path / "learn"
    rc = learning.main(["launch", "--work", str(work), "--runs", "aqn:0,aqn:1,aqn:2,nvfp4:1", "--stagger", "0"])
    assert rc == 1
    out = capsys.readouterr().out
    assert "4 new runs need ~68 GiB" in out and "60 GiB is available" in out and "at most 3 now" in out
    assert not work.exists() or not any(work.iterdir())


def test_learning_stop_ends_the_running_runs(learning, tmp_path, monkeypatch):
    monkeypatch.setattr(learning, "command", lambda *a: [sys.executable, "-c", "import time; time.sleep(60)"])
    work = tmp_path / "learn"
    assert learning.main(["launch", "--work", str(work), "--runs", "aqn:0", "--stagger", "0", "--host-gib-per-run", "0.01"]) == 0
    assert learning._running(work / "aqn-s0")
    assert learning.main(["stop", "--work", str(work)]) == 0
    deadline = time.time() + 10
    while learning._running(work / "aqn-s0") and time.time() < deadline:
        time.sleep(0.1)
    assert not learning._running(work / "aqn-s0")


def test_learning_tag_puts_variants_of_one_arm_side_by_side(learning, tmp_path, monkeypatch, capsys):
    """--tag names the runs of one launch (aqn-s0-lr1e-3), so launches with different overrides share a folder."""
    seen, real_command = [], learning.command

    def fake(arm, seed, run_dir, overrides):
        seen.append((run_dir.name, overrides))
        return [sys.executable, "-c", "pass"]

    monkeypatch.setattr(learning, "command", fake)
    work = tmp_path / "learn"
    base = ["launch", "--work", str(work), "--runs", "aqn:0", "--stagger", "0", "--host-gib-per-run", "0.01"]
    assert learning.main(base) == 0
    assert learning.main(base + ["--tag", "lr1e-3", "--override", "actor_rollout_ref.actor.optim.lr=1e-3"]) == 0
    assert seen == [("aqn-s0", []), ("aqn-s0-lr1e-3", ["actor_rollout_ref.actor.optim.lr=1e-3"])]
    assert sorted(d.name for d in work.iterdir()) == ["aqn-s0", "aqn-s0-lr1e-3"]
    assert "trainer.experiment_name=aqn-s0-lr1e-3" in real_command("aqn", 0, work / "aqn-s0-lr1e-3", [])
    with pytest.raises(SystemExit, match="--tag"):
        learning.main(base + ["--tag", "lr 1e-3"])


def test_learning_arms_and_bad_runs(learning):
    assert learning.parse_runs("aqn:0, bf16:2") == [("aqn", 0), ("bf16", 2)]
    with pytest.raises(SystemExit, match="ARM:SEED"):
        learning.parse_runs("fp8:0")
    cmd = learning.command("bf16", 3, Path("/x/bf16-s3"), ["trainer.total_training_steps=5"])
    assert "actor_rollout_ref.rollout.quantization=null" in cmd and "data.seed=3" in cmd and cmd[-1] == "trainer.total_training_steps=5"
    assert "actor_rollout_ref.rollout.custom.qerl.aqn.enable=true" in learning.command("aqn", 0, Path("/x"), [])


@pytest.mark.parametrize("arm", ["bf16", "nvfp4", "aqn"])
def test_learning_lean_runs_pass_qerls_config_check(learning, arm):
    """Each arm with the side-by-side settings composes through verl's Hydra config and passes qerl's checks
    (the lean settings once capped Ray at 6 CPUs, fewer than verl's own actors reserve: every run waited)."""
    from verl_ext.config import compose, validate

    cmd = learning.command(arm, 1, Path("/tmp/qerl-test-run"), list(learning.LEAN))
    overrides = cmd[cmd.index("--config-name") + 2:]
    cfg = compose(learning.CONFIG, overrides)
    settings, _ = validate(cfg)
    assert settings.nvfp4 == (arm != "bf16") and settings.aqn_enabled == (arm == "aqn")
    assert cfg.data.seed == 1 and cfg.actor_rollout_ref.model.enable_gradient_checkpointing is True


def test_entropy_of_a_position_from_its_top_k(tmp_path):
    import math
    import types

    entropy_sigma = _import_script("entropy_sigma")  # sets VLLM_ENABLE_V1_MULTIPROCESSING for its own process
    lp = lambda p: types.SimpleNamespace(logprob=math.log(p))  # noqa: E731
    # all the mass in the top k: the exact entropy
    assert entropy_sigma.position_entropy({1: lp(0.5), 2: lp(0.5)}, vocab=100) == pytest.approx(math.log(2))
    # 0.2 left over, spread evenly over the 98 other tokens
    h = entropy_sigma.position_entropy({1: lp(0.5), 2: lp(0.3)}, vocab=100)
    want = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3)) - 0.2 * math.log(0.2 / 98)
    assert h == pytest.approx(want)


def test_learning_names_why_a_run_failed(learning, tmp_path, capsys):
    """The watch table's FAILED row comes with the root error line of the run's log (the first, not Hydra's re-raise)."""
    run = tmp_path / "learn" / "aqn-s2"
    run.mkdir(parents=True)
    (run / "cmd.json").write_text(json.dumps({"started": time.time()}))
    (run / "run.log").write_text(
        "(TaskRunnerV1 pid=1) 'truncation': 'error',\n"
        "(vLLMHttpServer pid=2) (Worker pid=3) ERROR 11-24 03:11:54 [multiproc_executor.py:1000] Traceback (most recent call last):\n"
        "(vLLMHttpServer pid=2) (Worker pid=3) ERROR 11-24 03:11:54 [multiproc_executor.py:1000] AssertionError: Memory usage increased after sleeping.\n"
        "(vLLMHttpServer pid=2) RuntimeError: Worker failed with error 'Memory usage increased after sleeping.'\n"
        "Error executing job with overrides: []\n"
    )
    rows = learning.status(argparse.Namespace(work=tmp_path / "learn", only=None))
    assert rows[0]["failed"]
    out = capsys.readouterr().out
    assert "aqn-s2 failed: AssertionError: Memory usage increased after sleeping. (run.log line 3)" in out
    assert learning.failure_reason("all fine\n") is None


@pytest.mark.parametrize("name", ["bf16", "nvfp4"])
@pytest.mark.parametrize("extra", [[], ["--bypass", "--response", "2048", "--ppo-micro", "1", "--steps", "5"],
                                   ["--bypass", "--max-token-len", "16384"]])
def test_7b_pair_runs_pass_qerls_config_check(name, extra):
    """The 7B step-time pair (scripts/gpu/verl_7b_memory_step.py): each run's overrides compose through verl's Hydra
    config and pass qerl's checks; with --bypass both runs skip the old-log-prob pass (verl's bypass mode) and both
    actors run verl's bypass_mode loss with the same rollout-correction block: qerl's normalisation sets it in the
    NVFP4 run, the script's overrides in the BF16 run (qerl off)."""
    from verl_ext.config import compose, validate

    v7 = _import_script("verl_7b_memory_step")
    args = v7.parser().parse_args(["bf16", *extra])
    cfg = compose(ROOT / "examples" / "tiny" / "config.yaml", v7.overrides_for(name, Path("/tmp/qerl-7b"), args))
    settings, _ = validate(cfg)
    assert settings.nvfp4 == (name == "nvfp4") and settings.aqn_enabled == (name == "nvfp4")
    assert cfg.data.max_response_length == args.response
    actor = cfg.actor_rollout_ref.actor
    assert (actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu if args.max_token_len else 0) == (
        bool(args.max_token_len), args.max_token_len)
    bypass = "--bypass" in extra
    assert cfg.algorithm.rollout_correction.bypass_mode is bypass
    assert (cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode") is bypass
    if bypass:
        block = cfg.actor_rollout_ref.actor.policy_loss.rollout_correction
        assert (block.rollout_is, block.rollout_is_threshold, block.bypass_mode, block.loss_type) == (
            "token", 2.0, True, "ppo_clip")
    if name == "bf16" and bypass:  # the first fifth-session pair: BF16 left on verl's vanilla loss
        args = v7.parser().parse_args(["bf16", *extra, "--bf16-vanilla-loss"])
        cfg = compose(ROOT / "examples" / "tiny" / "config.yaml", v7.overrides_for(name, Path("/tmp/qerl-7b"), args))
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"


def test_7b_pair_kept_layers_reach_each_runs_settings():
    """--nvfp4-keep / --bf16-keep: each run's composed config carries qerl's actor.no_recompute_layers (the NVFP4 run at
    the same peak memory as BF16, §4u) and passes qerl's checks; without them neither run has it."""
    from verl_ext.config import compose, validate

    v7 = _import_script("verl_7b_memory_step")
    args = v7.parser().parse_args(["bf16", "--max-token-len", "16384", "--nvfp4-keep", "2"])
    for name, expect in (("nvfp4", 2), ("bf16", 0)):
        cfg = compose(ROOT / "examples" / "tiny" / "config.yaml", v7.overrides_for(name, Path("/tmp/qerl-7b"), args))
        assert validate(cfg)[0].no_recompute_layers == expect
    args = v7.parser().parse_args(["bf16", "--bf16-keep", "1"])
    cfg = compose(ROOT / "examples" / "tiny" / "config.yaml", v7.overrides_for("bf16", Path("/tmp/qerl-7b"), args))
    settings = validate(cfg)[0]
    assert settings.no_recompute_layers == 1 and not settings.nvfp4 and settings.active


def test_7b_pair_verdict_and_bound_from_the_ninth_sessions_2048_pair():
    """The summary's pair line on §4i's 2048 records (docs/gpu-runs/2026-11-24/ninth/lease1): 1.174x, NVFP4 faster
    (4.6 s apart, spreads under 0.5 s), 1.8x not met, at most 2.44x with a free rollout, and 1.8x would need a
    rollout 4.1x faster than BF16's; a gap inside a spread gives no verdict, an unreachable target no ratio."""
    v7 = _import_script("verl_7b_memory_step")
    recs = v7.latest_records(ROOT / "docs/gpu-runs/2026-11-24/ninth/lease1/verl_7b/results.jsonl")
    v = v7.pair_verdict(recs["bf16-r2048f"], recs["nvfp4-r2048f"], v7.STEP_TARGETS[2048])
    assert (v["step_ratio"], v["rollout_ratio"], v["verdict"], v["met"]) == (1.174, 1.349, "nvfp4 faster", False)
    assert (v["ratio_with_free_rollout"], v["rollout_ratio_needed"]) == (2.44, 4.1)
    spread = lambda m, lo, hi: {"median": m, "min": lo, "max": hi}
    b = {"step_s_spread": spread(10.0, 9.0, 11.0), "gen_s_spread": spread(5.0, 5.0, 5.0)}
    n = {"step_s_spread": spread(9.5, 9.4, 9.6), "gen_s_spread": spread(4.0, 4.0, 4.0)}
    v = v7.pair_verdict(b, n, 3.0)
    assert v["verdict"] == "no verdict" and v["met"] is False and v["rollout_ratio_needed"] is None
    assert v7.pair_verdict(b, {}, 1.5) == {"problems": ["a run lacks timed steps"]}


def test_latest_records_keeps_each_phases_last_record(tmp_path):
    """results.jsonl grows by one line per phase run; a phase run again (same tag) is read as its last record, and a
    folder where nothing ran yet reads as no records."""
    v7 = _import_script("verl_7b_memory_step")
    path = tmp_path / "results.jsonl"
    assert v7.latest_records(path) == {}
    lines = [{"phase": "build", "model_gb": 14.19}, {"phase": "bf16-r512p", "rc": 1}, {"phase": "bf16-r512p", "rc": 0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert v7.latest_records(path) == {"build": lines[0], "bf16-r512p": lines[2]}


def test_7b_pair_verdict_from_the_twentysixth_sessions_512_pair():
    """§4ab's 512 pair, both arms back to back on one H100 (docs/gpu-runs/2026-11-28/twentysixth/calls11-13): 1.175x,
    NVFP4 faster (1.41 s apart, spreads 0.83 / 0.61 s), neither GPU slowed, 1.5x not met; it would need a rollout 2.63x
    faster than BF16's, and a free rollout would give 2.15x. Each arm's engine log names the path it asked for."""
    v7 = _import_script("verl_7b_memory_step")
    folder = ROOT / "docs/gpu-runs/2026-11-28/twentysixth/calls11-13/verl_7b"
    recs = v7.latest_records(folder / "results.jsonl")
    b, n = recs["bf16-r512p"], recs["nvfp4-r512p"]
    assert not b["gpu_clocks"]["slowed"] and not n["gpu_clocks"]["slowed"] and b["problems"] == n["problems"] == []
    v = v7.pair_verdict(b, n, v7.STEP_TARGETS[512])
    assert (v["step_ratio"], v["rollout_ratio"], v["verdict"], v["met"]) == (1.175, 1.376, "nvfp4 faster", False)
    assert (v["spreads_s"], v["difference_s"]) == ([0.825, 0.609], 1.41)
    assert (v["ratio_with_free_rollout"], v["rollout_ratio_needed"]) == (2.15, 2.63)
    assert "punica path (asked: punica" in (folder / "bf16-r512p" / "run.log").read_text()
    assert "on the overlap path" in (folder / "nvfp4-r512p" / "run.log").read_text()


def test_7b_pair_lora_path_reaches_vllms_command_line():
    """--bf16-lora / --nvfp4-lora: a run's composed config carries additional_config as JSON text; in the BF16 run
    (qerl off) verl turns it into vLLM's --additional-config argument as is, in the NVFP4 run qerl's rollout wrapper
    merges its own AQN key into it; qerl's option parser reads the LoRA path back either way. Without the flag a
    run carries none."""
    import json

    from verl.workers.rollout.vllm_rollout.utils import build_cli_args_from_config

    from qerl_plugin import options
    from verl_ext.config import compose
    from verl_ext.rollout import merged_additional_config

    v7 = _import_script("verl_7b_memory_step")
    args = v7.parser().parse_args(["bf16", "--bypass", "--bf16-lora", "punica", "--nvfp4-lora", "dense"])
    cfg = compose(ROOT / "examples" / "tiny" / "config.yaml", v7.overrides_for("bf16", Path("/tmp/qerl-7b"), args))
    engine = dict(cfg.actor_rollout_ref.rollout.engine_kwargs.vllm)
    cli = build_cli_args_from_config(engine)
    given = json.loads(cli[cli.index("--additional_config") + 1])
    assert given == {"qerl_lora": "punica"} and options.lora_mode(given) == "punica"
    cfg = compose(ROOT / "examples" / "tiny" / "config.yaml", v7.overrides_for("nvfp4", Path("/tmp/qerl-7b"), args))
    text = cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config
    merged = merged_additional_config(text, options.engine_config(aqn=True))
    assert options.lora_mode(merged) == "dense" and options.aqn_enabled(merged)
    for name in ("nvfp4", "bf16"):
        args = v7.parser().parse_args(["bf16", "--bypass"])
        cfg = compose(ROOT / "examples" / "tiny" / "config.yaml", v7.overrides_for(name, Path("/tmp/qerl-7b"), args))
        assert "additional_config" not in cfg.actor_rollout_ref.rollout.engine_kwargs.vllm


def test_7b_pair_nvfp4_backend_reaches_the_nvfp4_run_only():
    """--nvfp4-backend humming: the NVFP4 run's additional_config names the backend beside its LoRA path and qerl's AQN
    key (as qerl's option parser reads it back); the BF16 run carries none, and the record says which backend ran."""
    import json

    from qerl_plugin import options
    from verl_ext.config import compose
    from verl_ext.rollout import merged_additional_config

    v7 = _import_script("verl_7b_memory_step")
    args = v7.parser().parse_args(["nvfp4", "--bypass", "--nvfp4-backend", "humming", "--nvfp4-lora", "overlap"])
    cfg = compose(ROOT / "examples" / "tiny" / "config.yaml", v7.overrides_for("nvfp4", Path("/tmp/qerl-7b"), args))
    text = cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config
    merged = merged_additional_config(text, options.engine_config(aqn=True))
    assert json.loads(text) == {"qerl_lora": "overlap", "qerl_nvfp4": {"backend": "humming"}}
    assert options.nvfp4_options(merged) == {"backend": "humming"} and options.aqn_enabled(merged)
    cfg = compose(ROOT / "examples" / "tiny" / "config.yaml", v7.overrides_for("bf16", Path("/tmp/qerl-7b"), args))
    assert "additional_config" not in cfg.actor_rollout_ref.rollout.engine_kwargs.vllm
    with pytest.raises(SystemExit):  # emulation is for tests, not for a timed pair
        v7.parser().parse_args(["nvfp4", "--nvfp4-backend", "emulation"])


def test_7b_pair_record_keeps_the_lines_naming_the_engines_paths():
    """qerl_log_lines: the LoRA-path and nvfp4-backend lines of a run's log, each once, in order, without the prefix
    of the process that printed them."""
    v7 = _import_script("verl_7b_memory_step")
    text = "\n".join([
        "(WorkerDict pid=1) INFO step 1",
        "(vLLMHttpServer pid=7) WARNING 11-28 qerl.vllm.nvfp4: nvfp4: backend humming - vLLM's humming W4A16 kernels",
        "(vLLMHttpServer pid=7) WARNING qerl: LoRA linears on the overlap path (asked: overlap, max_loras=1)",
        "(vLLMHttpServer pid=7) WARNING qerl: LoRA linears on the overlap path (asked: overlap, max_loras=1)",
    ])
    assert v7.qerl_log_lines(text) == ["nvfp4: backend humming",
                                       "qerl: LoRA linears on the overlap path (asked: overlap, max_loras=1)"]
    assert v7.qerl_log_lines("nothing here") == []


# ---------------------------------------------------------------------------------------------------------
# the 32B shape: checkpoints written directly (scripts/gpu/random_checkpoint.py) and the runs' overrides

TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=320, tie_word_embeddings=False, max_position_embeddings=256, rope_theta=1_000_000.0,
                  rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def rc():
    return _import_script("random_checkpoint")


@pytest.fixture(scope="module")
def v7():
    return _import_script("verl_7b_memory_step")


def _tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(**TINY_SHAPE, architectures=["Qwen2ForCausalLM"], dtype="bfloat16")


def _bytes(t):
    import torch

    return t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_32b_shape_is_qwen25_32b(v7):
    s = v7.QWEN25_32B
    assert (s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"], s["num_attention_heads"],
            s["num_key_value_heads"], s["vocab_size"], s["tie_word_embeddings"]) == (5120, 64, 27648, 40, 8, 152064, False)
    assert v7.MODEL_SHAPES["7B"] is v7.QWEN25_7B


def test_direct_nvfp4_checkpoint_is_what_qerl_quantize_writes(rc, tmp_path):
    """The 32B build's NVFP4 writer, at a tiny size on the CPU: the same tensors (names, dtypes, bytes) and the same
    config.json as `qerl quantize` of the BF16 checkpoint holding the same random values; verl_ext sees an NVFP4
    checkpoint and loads it into a model built from its config with nothing left on the meta device."""
    import torch
    from accelerate import init_empty_weights
    from helpers import read_safetensors_dir
    from transformers import AutoConfig, AutoModelForCausalLM

    from qerl_plugin.quantize import quantize_checkpoint
    from verl_ext.nvfp4_checkpoint import load_nvfp4_checkpoint_into
    from verl_ext.nvfp4_replace import replace_linears_with_nvfp4
    from verl_ext.settings import checkpoint_quantization

    cfg = _tiny_config()
    quiet = lambda m: None  # noqa: E731
    rc.write_checkpoint(tmp_path / "bf16", cfg, "bf16", seed=3, device="cpu", log=quiet)
    info = rc.write_checkpoint(tmp_path / "nvfp4", cfg, "nvfp4", seed=3, device="cpu", max_shard_size=20_000, log=quiet)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "ref", progress=False, log=quiet)

    got, want = read_safetensors_dir(tmp_path / "nvfp4"), read_safetensors_dir(tmp_path / "ref")
    assert sorted(got) == sorted(want) and len(got) == 14 * 3 + 2 * (2 + 3) + 3  # 14 NVFP4 triples, norms, biases, ...
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(_bytes(got[k]), _bytes(want[k])), k
    assert got["model.layers.0.self_attn.q_proj.weight_global_scale"] == got["model.layers.0.self_attn.v_proj.weight_global_scale"]
    assert got["lm_head.weight"].dtype == torch.bfloat16 and got["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert (tmp_path / "nvfp4" / "config.json").read_text() == (tmp_path / "ref" / "config.json").read_text()
    assert json.loads((tmp_path / "nvfp4" / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]

    # shards and their index: every tensor in the file the index names, no shard past the limit (+ its header)
    index = json.loads((tmp_path / "nvfp4" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "nvfp4").glob("*.safetensors"))
    assert info["files"] == len(files) > 1 and set(index["weight_map"]) == set(got) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    from safetensors import safe_open

    for f in files:
        with safe_open(str(tmp_path / "nvfp4" / f), framework="pt") as fh:
            keys = set(fh.keys())
        assert keys == {k for k, v in index["weight_map"].items() if v == f}
        assert sum(got[k].numel() * got[k].element_size() for k in keys) <= 20_000 or len(keys) <= 3

    assert checkpoint_quantization(str(tmp_path / "nvfp4")) == "nvfp4"
    assert checkpoint_quantization(str(tmp_path / "bf16")) == "bf16"

    # the actor's build (verl_ext.actor.build_from_nvfp4_checkpoint): a meta model from the config, the bytes loaded
    hf = AutoConfig.from_pretrained(tmp_path / "nvfp4")
    del hf.quantization_config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    report = load_nvfp4_checkpoint_into(model, tmp_path / "nvfp4", device="cpu")
    assert len(report.replaced) == 14 and report.meta_left == []
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    # and it is the model the BF16 checkpoint gives once its projections are quantized as vLLM does
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    replace_linears_with_nvfp4(dense)
    ids = torch.randint(0, 259, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, dense(input_ids=ids).logits)


def _read_header(path):
    import struct

    raw = Path(path).read_bytes()[:8]
    (n,) = struct.unpack("<Q", raw)
    with open(path, "rb") as f:
        f.seek(8)
        text = f.read(n)
    return n, text


def test_zero_safetensors_file_follows_the_format(rc, tmp_path):
    """write_zero_safetensors: safetensors' layout (u64 LE header length, JSON header with dtype/shape/data_offsets,
    padded with spaces to 8 bytes, contiguous offsets to the end of the file), read back by safe_open as zeros."""
    import torch
    from safetensors import safe_open

    specs = [rc.TensorSpec("a.weight", (3, 5), "normal"), rc.TensorSpec("b", (7,), "normal"), rc.TensorSpec("c", (2, 2, 2), "ones")]
    path = tmp_path / "z.safetensors"
    n_data = rc.write_zero_safetensors(path, specs)
    assert n_data == 2 * (15 + 7 + 8)
    n, text = _read_header(path)
    assert (8 + n) % 8 == 0 and n % 8 == 0
    body = text.rstrip(b" ")  # the JSON object, then fewer than 8 spaces of padding
    assert body.endswith(b"}") and len(text) - len(body) < 8
    header = json.loads(body.decode("utf-8"))
    assert header.pop("__metadata__") == {"format": "pt"}
    offsets = sorted(tuple(h["data_offsets"]) for h in header.values())
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    assert path.stat().st_size == 8 + n + offsets[-1][1]
    assert {k: (h["dtype"], h["shape"]) for k, h in header.items()} == {
        "a.weight": ("BF16", [3, 5]), "b": ("BF16", [7]), "c": ("BF16", [2, 2, 2])}
    with safe_open(str(path), framework="pt") as fh:
        for s in specs:
            t = fh.get_tensor(s.name)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == s.shape and not t.any()


def _listing(folder):
    return sorted((p.relative_to(folder).as_posix(), p.read_bytes()) for p in folder.rglob("*") if p.is_file())


def test_random_checkpoint_cli_keeps_a_finished_folder(rc, tmp_path, capsys):
    """`random_checkpoint.py DST --if-missing` (session.sh ckpt7b) leaves a folder with a config.json alone."""
    (tmp_path / "config.json").write_text("{}")
    assert rc.main([str(tmp_path), "--shape", "7B", "--if-missing"]) == 0
    assert "already there, kept" in capsys.readouterr().out and [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_random_checkpoint_refuses_bad_input_and_keeps_what_was_there(rc, tmp_path, monkeypatch):
    """An unknown kind, too little disk, or a filesystem without holes: an error naming the cause, no partial folder
    left behind, and an existing checkpoint at the destination untouched."""
    cfg = _tiny_config()
    dst = tmp_path / "ckpt"
    rc.write_checkpoint(dst, cfg, "nvfp4", device="cpu", log=lambda m: None)
    before = _listing(dst)

    with pytest.raises(ValueError, match=r"kind 'fp8': choose from \('bf16', 'nvfp4', 'bf16_sparse'\)"):
        rc.write_checkpoint(dst, cfg, "fp8", device="cpu", log=lambda m: None)

    import shutil

    real_usage = shutil.disk_usage
    monkeypatch.setattr(rc.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=10_000))
    with pytest.raises(RuntimeError, match=r"0\.0 GB free, the bf16 checkpoint needs 0\.\d+ GB"):
        rc.write_checkpoint(dst, cfg, "bf16", device="cpu", log=lambda m: None)
    monkeypatch.setattr(rc.shutil, "disk_usage", real_usage)

    # every byte on disk: no holes (the check looks at zero shards over 1 MiB: a 16k vocabulary gives 2 MiB matrices)
    monkeypatch.setattr(rc, "allocated_bytes", lambda path: os.path.getsize(path))
    wide = _tiny_config()
    wide.vocab_size = 16384
    with pytest.raises(RuntimeError, match="does not keep holes"):
        rc.write_checkpoint(dst, wide, "bf16_sparse", device="cpu", log=lambda m: None)

    assert _listing(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .ckpt.partial


def test_sparse_bf16_checkpoint_loads_as_zeros_and_takes_no_disk(rc, tmp_path):
    """The 32B BF16 run's checkpoint at a tiny size: transformers loads it; the matrices are zeros, the norms ones, the
    biases zeros; the matrices' shards are holes (their allocated blocks far below their size)."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_ext.settings import checkpoint_quantization

    if not rc.sparse_files_supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} does not keep holes in files (no sparse files)")
    cfg = _tiny_config()
    dst = tmp_path / "sparse"
    rc.write_checkpoint(dst, cfg, "bf16_sparse", device="cpu", max_shard_size=100_000, log=lambda m: None)
    assert checkpoint_quantization(str(dst)) == "bf16"
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert len(files) >= 3 and files[0] == "model-00001-of-%05d.safetensors" % len(files)
    first = {k for k, f in index.items() if f == files[0]}
    assert first == {k for k in index if k.endswith(("norm.weight", ".bias"))}  # the small tensors, written for real
    for f in files[1:]:
        size, disk = (dst / f).stat().st_size, rc.allocated_bytes(dst / f)
        assert size > 30_000 and disk <= size // 4, (f, size, disk)

    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16)
    sd = model.state_dict()
    assert set(index) <= set(sd)
    for k, v in sd.items():
        if k not in index:
            continue
        if k.endswith("norm.weight"):
            assert torch.equal(v, torch.ones_like(v)), k
        else:
            assert v.dtype == torch.bfloat16 and not v.any(), k
    assert model.lm_head.weight.shape == (320, 64)


def test_32b_build_writes_both_checkpoints_once_and_the_runs_use_them(v7, tmp_path, monkeypatch):
    """The build phase of --shape 32B (at a tiny size, on the CPU): model_nvfp4/ (NVFP4), model_bf16_sparse/ (BF16) and
    the data; a second build keeps them. Each run's overrides compose through verl's Hydra config and pass qerl's
    checks: the nvfp4 run on the NVFP4 checkpoint, the bf16 run on the sparse one; --param-offload and
    --bf16-gpu-mem land where verl reads them."""
    from verl_ext.config import compose, validate
    from verl_ext.settings import checkpoint_quantization

    monkeypatch.setitem(v7.MODEL_SHAPES, "32B", TINY_SHAPE)
    out = tmp_path / "verl_32b"
    rec = v7.build(out, "32B")
    assert rec["shape"] == "32B" and "nvfp4_write_s" in rec and "bf16_sparse_write_s" in rec
    assert checkpoint_quantization(str(out / "model_nvfp4")) == "nvfp4"
    assert checkpoint_quantization(str(out / "model_bf16_sparse")) == "bf16"
    assert (out / "model_nvfp4" / "tokenizer.json").exists() and (out / "model_bf16_sparse" / "generation_config.json").exists()
    assert (out / "data" / "train.parquet").exists() and not (out / "model").exists()
    stamp = (out / "model_nvfp4" / "config.json").stat().st_mtime_ns
    again = v7.build(out, "32B")
    assert "nvfp4_write_s" not in again and (out / "model_nvfp4" / "config.json").stat().st_mtime_ns == stamp

    args = v7.parser().parse_args(["bf16", "--shape", "32B", "--bypass", "--param-offload", "--gpu-mem", "0.4",
                                   "--bf16-gpu-mem", "0.85"])
    for name, path, mem in (("nvfp4", out / "model_nvfp4", 0.4), ("bf16", out / "model_bf16_sparse", 0.85)):
        overrides = v7.overrides_for(name, out, args)
        cfg = compose(ROOT / "examples" / "tiny" / "config.yaml", overrides)
        settings, _ = validate(cfg)
        assert settings.nvfp4 == (name == "nvfp4") and settings.aqn_enabled == (name == "nvfp4")
        assert cfg.actor_rollout_ref.model.path == str(path)
        if name == "nvfp4":
            assert settings.model_quant == "nvfp4" and settings.nvfp4_checkpoint  # the actor is built from the 4-bit bytes
        fsdp = cfg.actor_rollout_ref.actor.fsdp_config
        assert fsdp.param_offload is True and fsdp.optimizer_offload is True
        assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == mem == v7.rollout_gpu_mem(name, args)
        assert cfg.actor_rollout_ref.model.lora_rank == 32 and cfg.data.max_prompt_length == 512

    # the "no model" check looks at the run's own folder
    (out / "model_bf16_sparse" / "config.json").rename(out / "model_bf16_sparse" / "config.off")
    assert v7.run("bf16", out, args) == {"problems": ["no model: run the build phase first"]}
    args7 = v7.parser().parse_args(["nvfp4"])
    assert v7.run("nvfp4", out, args7) == {"problems": ["no model: run the build phase first"]}  # 7B: out/model


def test_7b_runs_are_unchanged_by_the_32b_options(v7, monkeypatch):
    """Without the new options the 7B runs train on model/ with --gpu-mem and no offload; the default folder stays
    $OUT/verl_7b."""
    monkeypatch.setenv("OUT", "/tmp/o")
    args = v7.parser().parse_args([])
    assert (args.shape, args.out, args.bf16_gpu_mem, args.param_offload) == ("7B", None, None, False)
    assert v7.default_out("7B") == Path("/tmp/o/verl_7b") and v7.default_out("32B") == Path("/tmp/o/verl_32b")
    for name in ("bf16", "nvfp4"):
        ov = v7.overrides_for(name, Path("/x"), args)
        assert "actor_rollout_ref.model.path=/x/model" in ov and "actor_rollout_ref.rollout.gpu_memory_utilization=0.5" in ov
        assert not [o for o in ov if "offload" in o]
    args = v7.parser().parse_args(["--bf16-gpu-mem", "0.7"])
    assert "actor_rollout_ref.rollout.gpu_memory_utilization=0.7" in v7.overrides_for("bf16", Path("/x"), args)
    assert "actor_rollout_ref.rollout.gpu_memory_utilization=0.5" in v7.overrides_for("nvfp4", Path("/x"), args)


def test_v7_session_steps_take_the_shape():
    """session.sh: v7_pair_bg, v7_watch, v7_build (and v7_nvfp4/v7_bf16) pass --shape and use $work/verl_<shape>."""
    text = (GPU / "session.sh").read_text()
    assert 'v7_shape=${SHAPE:-7B}' in text and 'v7_dir="$work/verl_${v7_shape,,}"' in text
    steps = {name: m.group(2) for m in re.finditer(r"^    (v7_[\w|]+)\)(.*?);;", text, flags=re.M | re.S)
             for name in m.group(1).split("|")}
    assert set(steps) >= {"v7_pair_bg", "v7_pair_2gpu", "v7_watch", "v7_build", "v7_nvfp4", "v7_bf16"}
    assert 'v7_pair_opts="--shape $v7_shape --out $v7_dir ' in text  # every phase of a pair, in both pair steps
    for name in ("v7_pair_bg", "v7_pair_2gpu"):
        assert "'\"$v7_pair_opts\"'" in steps[name] and "d='\"$v7_dir\"';" in steps[name], name
    assert "d='\"$v7_dir\"';" in steps["v7_watch"]
    assert '--shape "$v7_shape" --out "$v7_dir"' in steps["v7_build"]
    for name in ("v7_nvfp4", "v7_bf16"):  # one case for both arms
        assert "d='\"$v7_dir\"';" in steps[name] and "--shape '\"$v7_shape\"' --out $d" in steps[name], name


def _session(tmp_path, *steps, rc=0, **env):
    """Runs scripts/gpu/session.sh STEPS with its work folder under tmp_path and checks that it exits with ``rc``;
    (seconds taken, status.txt, each step's stdout.log). The driver's own output (the step headers) is left in
    tmp_path / "session.out"."""
    work = tmp_path / "work"
    full = {**os.environ, "QERL_WORK": str(work), "OUT": str(tmp_path / "out"), **env}
    t0 = time.monotonic()
    with open(tmp_path / "session.out", "w") as driver_out:
        done = subprocess.run(["bash", str(GPU / "session.sh"), *steps], cwd=ROOT, env=full,
                              stdout=driver_out, stderr=subprocess.DEVNULL, timeout=120)
    assert done.returncode == rc, (tmp_path / "session.out").read_text()
    taken = time.monotonic() - t0
    logs = {p.parent.name: p.read_text() for p in work.glob("*/stdout.log")}
    return taken, (work / "status.txt").read_text(), logs


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
@pytest.mark.parametrize("step, env", [("v7_watch", {"RESP": "2048", "TAG": "-r2048p"}), ("bench_watch", {"TAG": "-s"})])
def test_watch_steps_return_at_once_when_the_run_is_not_on_this_machine(tmp_path, step, env):
    """A watch on a machine where nothing was started (the machine that started it went back; a fresh one has an
    empty /tmp) ends at once with rc 3 and says so, instead of waiting out its call (WATCH_S of 60 s here)."""
    taken, status, logs = _session(tmp_path, step, WATCH_S="60", **env)
    assert taken < 30
    assert f"{step} rc=3 " in status
    assert "nothing to watch: no run was started in" in logs[step] and "start it again" in logs[step]


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
@pytest.mark.parametrize("check_rc, passes", [(0, True), (4, False), (None, False)])
def test_gpuok_stops_the_session_unless_this_machines_gpucheck_passed(tmp_path, check_rc, passes):
    """gpuok, first in a call issued in a batch behind the gpucheck call: the later steps run only where this machine's
    last gpucheck passed. A stand-in for gpu_clocks.py exits 0 (passed) or 4 (a GPU slowed itself down); with no
    gpucheck at all (a fresh machine: the checked one went back) the session stops too, with rc 5, and says why."""
    fake = tmp_path / "clocks.sh"
    fake.write_text(f"#!/bin/bash\necho stand-in for gpu_clocks.py\nexit {check_rc or 0}\n")
    fake.chmod(0o755)
    if check_rc is not None:
        _, status, _ = _session(tmp_path, "gpucheck", PYTHON=str(fake))
        assert f"gpucheck rc={check_rc} " in status
    _, status, logs = _session(tmp_path, "gpuok", "v7_watch", rc=0 if passes else 5, WATCH_S="1")
    assert ("v7_watch rc=3 " in status) is passes  # the watch ran (nothing to watch here) only after a passed check
    if not passes:
        reason = f"gpucheck rc={check_rc} " if check_rc is not None else "none ran here"
        assert "gpuok rc=5: no passed gpucheck on this machine (" in status and reason in status
        assert "gpuok rc=5" in (tmp_path / "out" / "status.txt").read_text()  # packed: it reaches the device reply


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
def test_step_header_is_one_short_line(tmp_path):
    """Each step's header line names the step and its limit, then at most 160 characters of its command on one line
    (v7_watch's is a multi-line script of ~700): the device reply stays short (benchmarks §4z)."""
    _session(tmp_path, "v7_watch", WATCH_S="5")
    out = (tmp_path / "session.out").read_text()
    header = next(line for line in out.splitlines() if line.startswith("=== v7_watch (limit "))
    assert header.endswith(" ...") and len(header.split("s): ", 1)[1]) == 160 + len(" ...")
    assert header.split("s): ", 1)[1].startswith("bash -c t=-r512; d=" + str(tmp_path / "work" / "verl_7b"))


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
def test_v7_watch_reports_a_finished_pair(tmp_path):
    """With the pair's log and its DONE file there, v7_watch returns at once with the log's result lines and the
    pair's exit status."""
    d = tmp_path / "work" / "verl_7b"
    d.mkdir(parents=True)
    (d / "pair-r2048p.log").write_text('noise\n[verl_7b] {"phase": "bf16-r2048p", "rc": 0}\nmore noise\n')
    (d / "DONE-r2048p").write_text("0\n")
    taken, status, logs = _session(tmp_path, "v7_watch", RESP="2048", TAG="-r2048p", WATCH_S="60")
    assert taken < 30 and "v7_watch rc=0 " in status
    assert '[verl_7b] {"phase": "bf16-r2048p", "rc": 0}' in logs["v7_watch"] and "noise" not in logs["v7_watch"]
    assert logs["v7_watch"].rstrip().endswith("0")


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
def test_second_arm_of_a_pair_refuses_a_machine_without_the_first(tmp_path):
    """v7_nvfp4 with AFTER_ARM runs only where that arm finished (results.jsonl of this machine, rc 0) on a GPU that
    did not slow itself down; else rc 3 at once. PYTHON=echo stands in for the run, so the test sees the command the
    arm would run."""
    env = {"AFTER_ARM": "bf16-r2048p", "PYTHON": "echo", "V7_ARGS": "--tag=-r2048p --response 2048"}
    taken, status, logs = _session(tmp_path, "v7_nvfp4", **env)
    assert taken < 30 and "v7_nvfp4 rc=3 " in status and "did not finish on this machine" in logs["v7_nvfp4"]

    results = tmp_path / "work" / "verl_7b" / "results.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text('{"phase": "bf16-r2048p", "rc": 1, "settings": {}}\n')  # there, but failed
    _, status, _ = _session(tmp_path, "v7_nvfp4", **env)
    assert status.splitlines()[-1].startswith("v7_nvfp4 rc=3 ")

    results.write_text('{"phase": "build", "model_gb": 14.19}\n{"phase": "bf16-r2048p", "rc": 0, "settings": {}}\n')
    _, status, logs = _session(tmp_path, "v7_nvfp4", **env)
    assert status.splitlines()[-1].startswith("v7_nvfp4 rc=0 ")
    out = str(tmp_path / "work" / "verl_7b")
    assert logs["v7_nvfp4"].split() == ["scripts/gpu/verl_7b_memory_step.py", "nvfp4", "summary", "--shape", "7B",
                                        "--out", out, "--tag=-r2048p", "--response", "2048"]

    # finished, but on a GPU that slowed itself down (gpu_clocks' summary in its record): refused, saying why
    results.write_text('{"phase": "bf16-r2048p", "rc": 0, "settings": {}, "gpu_clocks": {"busy": 900, '
                       '"slowdown_share": 0.93, "slowed": true}, "problems": ["GPU slowed itself down"]}\n')
    _, status, logs = _session(tmp_path, "v7_nvfp4", **env)
    assert status.splitlines()[-1].startswith("v7_nvfp4 rc=3 ")
    assert "ran on a GPU that slowed itself down" in logs["v7_nvfp4"] and "take another machine" in logs["v7_nvfp4"]
    with results.open("a") as fh:  # run again on this machine, healthy this time: the latest record decides
        fh.write('{"phase": "bf16-r2048p", "rc": 0, "settings": {}, "gpu_clocks": {"busy": 900, "slowed": false}}\n')
    _, status, _ = _session(tmp_path, "v7_nvfp4", **env)
    assert status.splitlines()[-1].startswith("v7_nvfp4 rc=0 ")

    _, status, logs = _session(tmp_path, "v7_bf16", PYTHON="echo")  # without AFTER_ARM: no check
    assert status.splitlines()[-1].startswith("v7_bf16 rc=0 ") and logs["v7_bf16"].split()[1:3] == ["bf16", "summary"]


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
@pytest.mark.parametrize("swap, gpus", [("0", {"bf16": "0", "nvfp4": "1"}), ("1", {"bf16": "1", "nvfp4": "0"})])
def test_two_gpu_pair_pins_each_arm_to_its_own_gpu(tmp_path, swap, gpus):
    """v7_pair_2gpu: build, then both arms at once, each with CUDA_VISIBLE_DEVICES of its GPU in PCI order, every phase
    with the same options (no Ray dashboard: two clusters share the host), then the summary and DONE; v7_watch reads
    the arms' logs. A stand-in python prints its environment and arguments."""
    fake = tmp_path / "fakepy"
    fake.write_text('#!/bin/sh\necho "[verl_7b] GPU=$CUDA_VISIBLE_DEVICES ORDER=$CUDA_DEVICE_ORDER $*"\n')
    fake.chmod(0o755)
    env = {"PYTHON": str(fake), "SWAP": swap, "RESP": "2048", "STEPS": "4", "TAG": "-r2048q",
           "V7_ARGS": "--max-token-len 16384 --nvfp4-keep 2 --bf16-lora punica"}
    _, status, logs = _session(tmp_path, "v7_pair_2gpu", **env)
    assert "v7_pair_2gpu rc=0 " in status
    assert f"GPUs {gpus['bf16']} (bf16) and {gpus['nvfp4']} (nvfp4)" in logs["v7_pair_2gpu"]
    d = tmp_path / "work" / "verl_7b"
    for _ in range(100):  # the pair runs in the background (setsid)
        if (d / "DONE-r2048q").exists():
            break
        time.sleep(0.1)
    assert (d / "DONE-r2048q").read_text().strip() == "0"
    same = ("--shape 7B --out {} --bypass --steps 4 --response 2048 --tag=-r2048q --timeout 1500 --override "
            "+ray_kwargs.ray_init.include_dashboard=false --max-token-len 16384 --nvfp4-keep 2 --bf16-lora punica").format(d)
    for arm, gpu in gpus.items():
        line = (d / f"arm-{arm}-r2048q.log").read_text().strip()
        assert line == f"[verl_7b] GPU={gpu} ORDER=PCI_BUS_ID scripts/gpu/verl_7b_memory_step.py {arm} {same}"
    pair = (d / "pair-r2048q.log").read_text().splitlines()
    assert [x.split(" ORDER=")[0] for x in pair if "GPU=" in x] == ["[verl_7b] GPU="] * 2  # build, summary: every GPU
    assert pair[0].endswith(f"build {same}") and pair[-1].endswith(f"summary {same}")
    _, status, logs = _session(tmp_path, "v7_watch", RESP="2048", TAG="-r2048q", WATCH_S="60")
    assert status.splitlines()[-1].startswith("v7_watch rc=0 ")
    assert f"[pair] bf16 on GPU {gpus['bf16']}, nvfp4 on GPU {gpus['nvfp4']}" in logs["v7_watch"]
    assert f"GPU={gpus['nvfp4']} ORDER=PCI_BUS_ID scripts/gpu/verl_7b_memory_step.py nvfp4" in logs["v7_watch"]


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
@pytest.mark.parametrize("step, waits_on", [("v7_pair_2gpu", "AFTER"), ("v7_pair_bg", "AFTER"),
                                            ("v7_pair_2gpu", "AFTER_FILE"), ("v7_pair_bg", "AFTER_FILE")])
def test_a_queued_pair_starts_once_what_it_waits_for_exists(tmp_path, step, waits_on):
    """Both pair steps with AFTER=<tag> (that pair's DONE) or AFTER_FILE=<path>: the call returns at once saying what
    it waits for; nothing runs (not even the build) until that file exists, then the whole pair runs."""
    fake = tmp_path / "fakepy"
    fake.write_text('#!/bin/sh\necho "[verl_7b] GPU=$CUDA_VISIBLE_DEVICES $*"\n')
    fake.chmod(0o755)
    d = tmp_path / "work" / "verl_7b"
    gate = d / "DONE-r2048q" if waits_on == "AFTER" else tmp_path / "bench-p" / "DONE"
    env = {"PYTHON": str(fake), "RESP": "512", "STEPS": "4", "TAG": "-r512q",
           waits_on: "-r2048q" if waits_on == "AFTER" else str(gate)}
    _, status, logs = _session(tmp_path, step, **env)
    assert f"{step} rc=0 " in status
    said = "(after -r2048q)" if waits_on == "AFTER" else f"(once {gate} exists)"
    started = "pair on GPUs 0 (bf16) and 1 (nvfp4)" if step == "v7_pair_2gpu" else "runs"
    assert f"started the 7B -r512q {started} {said}" in logs[step]
    time.sleep(2)  # longer than its 5-s poll's first look
    assert not (d / "DONE-r512q").exists() and (d / "pair-r512q.log").read_text() == ""
    gate.parent.mkdir(parents=True, exist_ok=True)
    gate.write_text("0\n")
    for _ in range(150):
        if (d / "DONE-r512q").exists():
            break
        time.sleep(0.1)
    assert (d / "DONE-r512q").read_text().strip() == "0"
    pair = (d / "pair-r512q.log").read_text()
    assert "verl_7b_memory_step.py build " in pair and "summary " in pair
    if step == "v7_pair_2gpu":
        assert (d / "arm-nvfp4-r512q.log").read_text().startswith("[verl_7b] GPU=1 ")


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
@pytest.mark.parametrize("shape, folder", [("7B", "verl_7b"), ("32B", "verl_32b")])
def test_pair_on_one_gpu_runs_its_phases_with_the_pair_options(tmp_path, shape, folder):
    """v7_pair_bg: one invocation of every phase, in the shape's folder, with the same options v7_pair_2gpu gives each
    of its phases (there plus the dashboard switch), V7_ARGS last; DONE holds its exit status."""
    fake = tmp_path / "fakepy"
    fake.write_text('#!/bin/sh\necho "[verl_x] $*"\n')
    fake.chmod(0o755)
    env = {"PYTHON": str(fake), "SHAPE": shape, "RESP": "512", "STEPS": "4", "V7_ARGS": "--nvfp4-keep 2"}
    _, status, logs = _session(tmp_path, "v7_pair_bg", **env)
    assert "v7_pair_bg rc=0 " in status and f"started the {shape} -r512 runs" in logs["v7_pair_bg"]
    d = tmp_path / "work" / folder
    for _ in range(100):  # setsid: in the background
        if (d / "DONE-r512").exists():
            break
        time.sleep(0.1)
    assert (d / "DONE-r512").read_text().strip() == "0"
    assert (d / "pair-r512.log").read_text().strip() == (
        f"[verl_x] scripts/gpu/verl_7b_memory_step.py build bf16 nvfp4 summary --shape {shape} --out {d} --bypass "
        "--steps 4 --response 512 --tag=-r512 --timeout 1500 --nvfp4-keep 2")


def test_memory_is_sampled_on_the_runs_own_gpu(v7):
    """A run pinned to one GPU (CUDA_VISIBLE_DEVICES of one index) samples that GPU's memory.used; otherwise GPU 0's
    line of the all-GPU query, as before."""
    assert v7.visible_gpu({"CUDA_VISIBLE_DEVICES": "1"}) == 1
    for value in ("", "0,1", "GPU-5f1c2d3e", " "):
        assert v7.visible_gpu({"CUDA_VISIBLE_DEVICES": value}) is None
    assert v7.visible_gpu({}) is None
    from qerl_plugin import gpu_clocks

    assert v7.Sampler is gpu_clocks.Sampler and v7.visible_gpu is gpu_clocks.visible_gpu  # the arms sample through it


def test_clock_check_script_refuses_bad_input_and_a_machine_without_a_gpu(capsys):
    """scripts/gpu/gpu_clocks.py: --seconds must be positive (an argparse error naming it); without CUDA (here) it ends
    with rc 1 and says where to run it."""
    script = _import_script("gpu_clocks")
    with pytest.raises(SystemExit):
        script.main(["--seconds", "0"])
    assert "--seconds must be positive, got 0.0" in capsys.readouterr().err
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the no-GPU path cannot be shown")
    assert script.main(["--seconds", "1"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_pair_with_a_slowed_gpu_gets_no_verdict():
    """§4i's 2048 pair (NVFP4 faster, 1.174x) with a slowed GPU recorded in one arm, then in both: the ratios stay as
    measured, the verdict says why there is none, and a target is never met; a healthy record changes nothing."""
    v7 = _import_script("verl_7b_memory_step")
    recs = v7.latest_records(ROOT / "docs/gpu-runs/2026-11-24/ninth/lease1/verl_7b/results.jsonl")
    b, n = recs["bf16-r2048f"], recs["nvfp4-r2048f"]
    slowed, healthy = {"slowed": True, "slowdown_share": 0.4}, {"slowed": False, "slowdown_share": 0.0}
    v = v7.pair_verdict({**b, "gpu_clocks": healthy}, {**n, "gpu_clocks": healthy}, 1.1)
    assert (v["step_ratio"], v["verdict"], v["met"]) == (1.174, "nvfp4 faster", True)
    v = v7.pair_verdict({**b, "gpu_clocks": healthy}, {**n, "gpu_clocks": slowed}, 1.1)
    assert (v["step_ratio"], v["met"]) == (1.174, False)
    assert v["verdict"] == "no verdict: the GPU slowed itself down in the nvfp4 arm"
    v = v7.pair_verdict({**b, "gpu_clocks": slowed}, {**n, "gpu_clocks": slowed}, 1.1)
    assert v["verdict"] == "no verdict: the GPU slowed itself down in the bf16 and nvfp4 arms"


def test_swapped_cards_check_on_the_h200_pairs(tmp_path):
    """swap_check on §4y's four H200 pairs (docs/gpu-runs/2026-11-27/twentythird): 512 ratios 1.117x and 1.145x,
    2.5 % apart against the widest spread 16.0 % (NVFP4 in -r512s: 1.224 s over 7.638), 2048 ratios 1.115x and 1.119x,
    0.4 % apart against 3.0 %: both agree, as the section says. A BF16 arm 10 % slower on the swapped cards makes them
    disagree; the summary prints the check where --swap-of names a pair it has, and says what is missing otherwise."""
    v7 = _import_script("verl_7b_memory_step")
    src = ROOT / "docs/gpu-runs/2026-11-27/twentythird/all/verl_7b/results.jsonl"
    recs = v7.latest_records(src)
    arms = lambda tag: (recs[f"bf16{tag}"], recs[f"nvfp4{tag}"])
    c = v7.swap_check(arms("-r512p"), arms("-r512s"))
    assert (c["step_ratios"], c["apart"], c["widest_spread"]) == ([1.117, 1.145], 0.0253, 0.1603)
    assert c["verdict"] == "the card assignments agree"
    c = v7.swap_check(arms("-r2048p"), arms("-r2048s"))
    assert (c["step_ratios"], c["apart"], c["widest_spread"], c["verdict"]) == (
        [1.115, 1.119], 0.0039, 0.0305, "the card assignments agree")
    slow = json.loads(json.dumps(recs["bf16-r2048s"]))
    slow["step_s_spread"] = {k: v * 1.1 if k != "n" else v for k, v in slow["step_s_spread"].items()}
    c = v7.swap_check(arms("-r2048p"), (slow, recs["nvfp4-r2048s"]))
    assert c["step_ratios"] == [1.115, 1.231]
    assert c["verdict"].startswith("no verdict: the card assignments' ratios are 10.4% apart")
    assert v7.swap_check(arms("-r512p"), ({"phase": "bf16-x"}, recs["nvfp4-r512s"])) == {
        "problems": ["an arm lacks timed steps"]}
    (tmp_path / "results.jsonl").write_text(src.read_text())
    run = lambda *a: subprocess.run([sys.executable, str(GPU / "verl_7b_memory_step.py"), "summary", "--out",
                                     str(tmp_path), *a], capture_output=True, text=True, timeout=120)
    res = run("--tag=-r512s", "--response", "512", "--swap-of=-r512p")
    assert res.returncode == 0, res.stderr
    assert ('swap (-r512p / -r512s): {"step_ratios": [1.117, 1.145], "apart": 0.0253, "widest_spread": 0.1603, '
            '"verdict": "the card assignments agree"}') in res.stdout
    res = run("--tag=-r2048s", "--response", "2048", "--swap-of=-r2048x")
    assert "swap: no check, the runs of both -r2048x and -r2048s are needed in" in res.stdout


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
def test_gpucheck_step_runs_the_clock_check(tmp_path):
    """session.sh gpucheck runs gpu_clocks.py on every GPU for CLOCK_S seconds (a stand-in python echoes the
    command)."""
    _, status, logs = _session(tmp_path, "gpucheck", PYTHON="echo", CLOCK_S="7")
    assert "gpucheck rc=0 " in status
    assert logs["gpucheck"].split() == ["scripts/gpu/gpu_clocks.py", "--seconds", "7", "--gpu", "all"]


@pytest.mark.skipif(os.name != "posix", reason="a stand-in nvidia-smi is a shell script")
def test_clock_check_of_every_gpu_runs_one_process_per_card(tmp_path):
    """gpu_clocks.py --gpu all: one child per card nvidia-smi lists, its lines prefixed with its card, the worst rc
    returned. Here nvidia-smi is a stand-in listing two cards and there is no CUDA GPU, so each child ends with rc 1
    saying so."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the children would load it instead of reporting that there is none")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$1" = "--query-gpu=index" ] && printf "0\\n1\\n" && exit 0\nexit 9\n')
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/gpu_clocks.py"), "--gpu", "all", "--seconds", "1",
                          "--out", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    for i in (0, 1):
        assert f"[gpu {i}] gpu_clocks: needs a CUDA GPU (run it on the GPU machine)" in lines
        assert f"[gpu {i}] rc 1" in lines


def test_clock_check_names_a_bad_gpu_and_a_host_without_nvidia_smi(tmp_path, capsys, monkeypatch):
    """--gpu takes an index or 'all' (an argparse error naming the value otherwise); --gpu all without nvidia-smi on
    PATH ends with rc 1 and a line saying it needs nvidia-smi."""
    script = _import_script("gpu_clocks")
    with pytest.raises(SystemExit):
        script.main(["--gpu", "first"])
    assert "--gpu takes a GPU's index (0, 1, ...) or 'all', got 'first'" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path))
    assert script.main(["--gpu", "all", "--out", str(tmp_path)]) == 1
    assert "--gpu all needs nvidia-smi to list the GPUs" in capsys.readouterr().err


def test_override_reaches_both_runs_and_verls_config(v7):
    """--override: appended last to both runs' overrides; verl's config takes the dashboard switch the two-GPU pair
    passes."""
    from verl_ext.config import compose

    args = v7.parser().parse_args(["bf16", "--bypass", "--override", "+ray_kwargs.ray_init.include_dashboard=false"])
    for name in ("bf16", "nvfp4"):
        overrides = v7.overrides_for(name, Path("/tmp/qerl-7b"), args)
        assert overrides[-1] == "+ray_kwargs.ray_init.include_dashboard=false"
        cfg = compose(ROOT / "examples" / "tiny" / "config.yaml", overrides)
        assert cfg.ray_kwargs.ray_init.include_dashboard is False
    plain = v7.parser().parse_args(["bf16"])
    assert not any("ray_kwargs" in o for o in v7.overrides_for("bf16", Path("/tmp/qerl-7b"), plain))


def test_streamed_weight_is_the_sweeps_seeded_weight_with_its_copies():
    """check_gemv.streamed_weight, shared by check_gemv.py, sweep_row.py and sweep_mma.py: the N(0, 0.02) weight drawn
    after seed 0, its NVFP4 triple (the codec's own), its byte count, copies reading >= cold_mib MiB, and the generator
    left where the inline code those scripts had left it (their ``x`` is drawn next)."""
    import torch

    from qerl_plugin import nvfp4

    cg = _import_script("check_gemv")
    w, q, raw_bytes, raws = cg.streamed_weight(64, 256, 0.05, torch.device("cpu"))
    next_draw = torch.randn(3)
    torch.manual_seed(0)
    w_ref = (torch.randn(64, 256) * 0.02).to(torch.bfloat16)
    assert torch.equal(w, w_ref) and torch.equal(torch.randn(3), next_draw)
    ref = nvfp4.quantize(w_ref)
    assert torch.equal(q.packed, ref.packed) and torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    assert raw_bytes == 64 * 128 + 64 * 16 and len(raws) == cg.copies_for(raw_bytes, 0.05) == 6
    assert all(torch.equal(p, q.packed) and p.data_ptr() != q.packed.data_ptr() for p, _ in raws)  # copies, not views


def test_bf16_copies_stream_the_baseline_weight_like_the_nvfp4_one():
    """check_gemv.bf16_copies, the BF16 row of check_gemv.py, sweep_mma.py and sweep_humming.py: as many clones of
    the weight as copies_for asks for its bf16 bytes (2 per value), each a copy with its own storage."""
    import torch

    cg = _import_script("check_gemv")
    w = torch.randn(64, 256).to(torch.bfloat16)
    copies = cg.bf16_copies(w, 0.05)
    assert len(copies) == cg.copies_for(2 * 64 * 256, 0.05) == 2
    assert all(torch.equal(c, w) and c.data_ptr() != w.data_ptr() for c in copies)
    assert len(cg.bf16_copies(w, 0.0)) == 1  # at least one


def test_gemv_check_sweep_cold_copies_and_verdict():
    """check_gemv.py: the tiles it sweeps are ones the kernel accepts, its copy count makes one graph pass read past the
    H100's 50 MB L2, and its verdict needs the medians apart by more than both spreads."""
    cg = _import_script("check_gemv")
    tiles = cg.sweep_tiles()
    assert len({cg.tile_name(t) for t in tiles}) == len(tiles) == 20
    assert all(t["block_n"] in (16, 32, 64, 128) and 3584 % t["block_k"] == 0 and 18944 % t["block_k"] == 0
               for t in tiles)
    qkv = 4608 * 3584 // 2 + 4608 * 3584 // 16  # codes + FP8 scales of the 7B q/k/v projection, ~9.3 MB
    assert cg.copies_for(qkv, 256) == 29 and cg.copies_for(qkv, 256) * qkv >= 256 * 2**20
    assert cg.copies_for(10**12, 256) == 1 and cg.copies_for(1, 256) == 64  # at least one, at most the cap
    fast, slow = {"median_us": 10.0, "spread_us": 0.5}, {"median_us": 12.0, "spread_us": 1.0}
    assert cg.verdict(fast, slow) == "faster" and cg.verdict(slow, fast) == "slower"
    assert cg.verdict(fast, {"median_us": 11.0, "spread_us": 1.5}) == "equal"  # the spread exceeds the difference
    assert cg.summarize([3.0, 1.0, 2.0]) == {"median_us": 2.0, "spread_us": 2.0, "runs_us": [3.0, 1.0, 2.0]}
    # --shape 32B: every one-row tile of the xvec sweep divides the 32B input sizes (the kernel needs whole K tiles)
    assert cg.LAYERS == {"7B": 28, "32B": 64} and cg.LINEARS["32B"]["down"] == (27648, 5120)
    assert all(k % t["block_k"] == 0 for k, _ in cg.LINEARS["32B"].values() for t in cg.sweep_tiles(sweep="xvec"))


def test_sweep_row_tiles_and_their_names():
    """scripts/gpu/sweep_row.py: the grid it sweeps (block_k 512, the one-row kernel's flags) and the names its log
    gives each tile, the pipeline depth last (none for the unpipelined loop)."""
    sweep_row = _import_script("sweep_row")
    tiles = sweep_row.sweep_tiles([4, 8, 16], [1, 2, 4, 8], [1, 2, 4], [0, 2, 3, 4])
    assert len(tiles) == 144 and len({sweep_row.tile_name(t) for t in tiles}) == 144
    assert all(t["block_k"] == 512 and t["words"] and t["asm"] and t["xvec"] for t in tiles)
    assert sweep_row.tile_name(dict(block_n=8, block_k=512, split_k=1, num_warps=1, stages=3, words=True, asm=True,
                                    xvec=True)) == "n8k512s1w1WAXS3"
    assert sweep_row.tile_name(dict(block_n=4, block_k=512, split_k=1, num_warps=4, stages=0, words=True, asm=True,
                                    xvec=True)) == "n4k512s1w4WAX"


def test_jsonl_recorder_appends_one_line_per_record(tmp_path, capsys):
    check_gemv = _import_script("check_gemv")
    record = check_gemv.jsonl_recorder(str(tmp_path), "log.jsonl")
    record({"what": "a", "x": 1})
    record({"what": "b"}, echo=False)
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["what"] for line in lines] == ["a", "b"]
    assert capsys.readouterr().out.count('"what"') == 1


def test_check_row_lora_old_tiles_are_those_of_section_4m():
    """check_row_lora's `_s0` variants and sweep_row's baseline run §4m's tiles, unpipelined: what decode_tile
    returned before §4n (check_gemv.tile_4m, which both scripts import)."""
    check_row_lora = _import_script("check_row_lora")
    assert check_row_lora.tile_4m is _import_script("sweep_row").tile_4m
    assert check_row_lora.tile_4m(4608, 3584) == check_row_lora.tile_4m(3584, 3584) == dict(
        block_n=4, block_k=512, split_k=1, num_warps=4)
    assert check_row_lora.tile_4m(37888, 3584) == dict(block_n=8, block_k=512, split_k=1, num_warps=2)
    assert check_row_lora.tile_4m(3584, 18944) == dict(block_n=8, block_k=512, split_k=4, num_warps=2)
    assert check_row_lora.tile_4m(7168, 5120) == dict(block_n=4, block_k=512, split_k=1, num_warps=2)
    assert check_row_lora.tile_4m(5120, 27648) == dict(block_n=8, block_k=512, split_k=8, num_warps=2)


def test_sweep_tiles_keep_only_correct_reproducible_ones_fastest_first():
    """sweep_row.try_tiles (used by sweep_row.py and sweep_mma.py): a tile within the bf16 rounding of the float64
    product is timed, one beyond it or with other bits on the second call is refused and counted, one that raises is
    recorded with its error and not counted as refused; the timed tiles come back fastest first."""
    import torch

    try_tiles = _import_script("sweep_row").try_tiles
    exact = torch.tensor([[1.0, -2.0, 300.0]], dtype=torch.float64)
    calls = {"t0": 0}

    def call(t):
        if t["name"] == "raises":
            raise RuntimeError("out of resources")
        if t["name"] == "flaky":
            calls["t0"] += 1
            return exact.float() + calls["t0"] * 1e-3  # within the bound, other bits each time
        return exact.float() * (1.0 + t["err"])

    tiles = [dict(name=n, err=e, block_n=8, block_k=512, split_k=1, num_warps=w)
             for n, e, w in (("slow", 0.0, 1), ("fast", 2.0**-9, 2), ("wrong", 2.0**-6, 4), ("flaky", 0.0, 8),
                             ("raises", 0.0, 16))]
    rows = []
    swept, refused = try_tiles(tiles, call, exact, lambda t: {1: 9.0, 2: 4.0}[t["num_warps"]],
                               lambda r, echo=True: rows.append(r), {"linear": "o"})
    assert [t["name"] for _, t in swept] == ["fast", "slow"] and [us for us, _ in swept] == [4.0, 9.0]
    assert refused == 2
    assert [r["tile"] for r in rows] == ["n8k512s1w1", "n8k512s1w2", "n8k512s1w4", "n8k512s1w8", "n8k512s1w16"]
    assert all(r["linear"] == "o" and r["what"] == "tile" for r in rows)
    assert rows[2]["ok"] is False and rows[3]["repeat_identical"] is False
    assert rows[4]["error"] == "RuntimeError: out of resources" and "us" not in rows[4]


def test_sweep_mma_tiles_and_names():
    sweep_mma = _import_script("sweep_mma")
    tiles = sweep_mma.sweep_tiles([64, 128], [128, 256, 512], [1, 2, 4, 8], [0, 2, 3, 4], [4, 8])
    assert len(tiles) == 192 and len({sweep_mma.tile_name(t) for t in tiles}) == 192
    assert all(t["mma"] for t in tiles)
    assert sweep_mma.tile_name(dict(block_n=128, block_k=256, split_k=4, num_warps=4, stages=3, mma=True)) == \
        "n128k256s4w4MS3"


def test_sweep_mma_gluon_tiles_and_their_call():
    """--kernel gluon: 16 output features per warp (times nrep), split-K, prefetch; the tile names end in L (R when
    prefetched), and run_tile sends such a tile to vllm_ext.nvfp4_gluon (which refuses a CPU tensor, naming it)."""
    import pytest
    import torch

    sweep_mma = _import_script("sweep_mma")
    tiles = sweep_mma.gluon_tiles([64, 128, 256, 512], [1, 2, 4, 8])
    assert len(tiles) == 16 and all(t["gluon"] and t["block_n"] == 16 * t["num_warps"] for t in tiles)
    assert sweep_mma.tile_name(tiles[0]) == "n16k64s1w1L"
    more = sweep_mma.gluon_tiles([256], [1, 2], [1, 2], [1, 4], [0, 1], [0, 1], [0, 1])
    assert len(more) == 64 and len({sweep_mma.tile_name(t) for t in more}) == 64
    assert sweep_mma.tile_name(more[-1]) == "n64k256s4w2LRVB"  # 16 x 2 warps x nrep 2, split-K 4, prefetched, wide, bits
    hopper = sweep_mma.gluon_tiles([128], [4, 8], [1, 2], [1, 8], wgmma=True)
    assert len(hopper) == 8 and sweep_mma.tile_name(hopper[-1]) == "n256k128s8w8LH"
    from qerl_plugin import nvfp4

    q = nvfp4.quantize(torch.randn(32, 256).to(torch.bfloat16))
    with pytest.raises(ValueError, match="nvfp4_gluon_gemm: x on cpu"):
        _import_script("sweep_row").run_tile(torch.randn(2, 256).to(torch.bfloat16), q.packed, q.scale,
                                             q.global_scale, dict(tiles[0]))


def test_sweep_mma_marlin_tiles_go_to_the_marlin_version():
    """--kernel wgmma-marlin: the wgmma tiles with ``marlin`` set (names ending in HQ), which run_tile sends to
    nvfp4_gluon_marlin_gemm with Marlin's tensors (the call reaches its refusal of a CPU tensor, naming it)."""
    import pytest
    import torch

    from qerl_plugin import nvfp4
    from vllm_ext.bench.marlin_pack import marlin_pack

    sweep_mma = _import_script("sweep_mma")
    tiles = sweep_mma.gluon_tiles([128, 256], [4], [1, 2, 4], [2, 4, 8], wgmma=True, marlin=True)
    assert len(tiles) == 18 and all(t["marlin"] and t["wgmma"] for t in tiles)
    assert sweep_mma.tile_name(tiles[-1]) == "n256k256s8w4LHQ"
    q = nvfp4.quantize(torch.randn(64, 256).to(torch.bfloat16))
    with pytest.raises(ValueError, match="nvfp4_gluon_marlin_gemm: x on cpu"):
        _import_script("sweep_row").run_tile(torch.randn(2, 256).to(torch.bfloat16),
                                             *marlin_pack(q.packed, q.scale, q.global_scale), dict(tiles[0]))


def test_per_step_ms_sums_medians_and_spreads_over_linears_times_layers():
    """check_gemv.per_step_ms, used by check_gemv.py, sweep_row.py and sweep_mma.py: a decode step's ms is the sum of
    the four linears' µs per call times the layer count, for the medians and the spreads alike."""
    per_step_ms = _import_script("check_gemv").per_step_ms
    finals = [{"a": {"median_us": 10.0, "spread_us": 0.5}, "b": {"median_us": 20.0, "spread_us": 1.0}},
              {"a": {"median_us": 30.0, "spread_us": 0.25}, "b": {"median_us": 5.0, "spread_us": 0.0}}]
    step, spread = per_step_ms(finals, ("a", "b"), 28)
    assert step == {"a": 1.12, "b": 0.7} and spread == {"a": 0.021, "b": 0.028}


def _step_final(shape, linear, rows=None, **times):
    """A sweep's final record of one linear: each of ``times`` a (median, spread) in µs per call."""
    return {"what": "final", "shape": shape, "linear": linear, **({} if rows is None else {"rows": rows}),
            **{key: {"median_us": med, "spread_us": spr} for key, (med, spr) in times.items()}}


LINEARS4 = ("qkv", "o", "gate_up", "down")


def test_sweep_row_step_lines_record_and_describe_each_finished_shape():
    """sweep_row.decode_step_lines: a shape whose four linears all finished gets a per_step_ms row (best, shipped and
    §4m's tiles: the linears' µs summed, times 28 or 64 layers, in ms) and a line, in the order of --shapes; a shape
    with a linear missing gets neither."""
    sw = _import_script("sweep_row")
    finals = [_step_final("32B", lin, best=(10.0, 0.0), shipped=(20.0, 0.25), stages0=(25.0, 0.5)) for lin in LINEARS4]
    finals += [_step_final("7B", lin, best=(10.0 * i, 1.0 * i), shipped=(12.0 + 10 * (i - 1), 0.5),
                           stages0=(15.0 + 10 * (i - 1), 0.0)) for i, lin in enumerate(LINEARS4, 1)]
    recs = []
    lines = sw.decode_step_lines(finals, "7B,32B", "qkv,o,gate_up,down", recs.append)
    assert recs == [{"what": "per_step_ms", "shape": "7B", "median": {"best": 2.8, "shipped": 3.024, "stages0": 3.36},
                     "spread": {"best": 0.28, "shipped": 0.056, "stages0": 0.0}},
                    {"what": "per_step_ms", "shape": "32B", "median": {"best": 2.56, "shipped": 5.12, "stages0": 6.4},
                     "spread": {"best": 0.0, "shipped": 0.064, "stages0": 0.128}}]
    assert [list(r) for r in recs] == [["what", "shape", "median", "spread"]] * 2
    assert lines == ["per 7B decode step (x28): best tiles 2.800 ms (±0.280), shipped 3.024 (±0.056), §4m kernel "
                     "3.360 (±0.000)",
                     "per 32B decode step (x64): best tiles 2.560 ms (±0.000), shipped 5.120 (±0.064), §4m kernel "
                     "6.400 (±0.128)"]
    recs = []
    assert sw.decode_step_lines(finals[1:], "32B,7B", "qkv,o,gate_up,down", recs.append) == lines[:1]
    assert [r["shape"] for r in recs] == ["7B"]
    assert sw.decode_step_lines(finals, "7B", "qkv,o", recs.append) == [] and len(recs) == 1


def test_sweep_marlin_row_step_lines_over_the_keys_timed():
    """sweep_marlin_row.decode_step_lines, called by main with one shape's finals: a per_step_ms row over the keys
    timed (Marlin only with vLLM), the linears' µs summed times the layers in ms, and a line of them in that order;
    nothing for a shape with a linear missing."""
    sw = _import_script("sweep_marlin_row")
    sel = [_step_final("7B", lin, best=(10.0, 0.5), rule=(20.0, 0.0), checkpoint_row=(15.0, 1.0), marlin=(25.0, 2.0))
           for lin in LINEARS4]
    recs = []
    keys = ("best", "rule", "checkpoint_row")
    assert sw.decode_step_lines(sel, "7B", "qkv,o,gate_up,down", keys, recs.append) == [
        "per 7B decode step (x28): best 1.120 ms (±0.056), rule 2.240 ms (±0.000), checkpoint_row 1.680 ms (±0.112)"]
    assert recs == [{"what": "per_step_ms", "shape": "7B",
                     "median": {"best": 1.12, "rule": 2.24, "checkpoint_row": 1.68},
                     "spread": {"best": 0.056, "rule": 0.0, "checkpoint_row": 0.112}}]
    assert list(recs[0]) == ["what", "shape", "median", "spread"] and list(recs[0]["median"]) == list(keys)
    recs = []
    assert sw.decode_step_lines(sel, "7B", "qkv,o,gate_up,down", keys + ("marlin",), recs.append)[0].endswith(
        ", marlin 2.800 ms (±0.224)")
    assert recs[0]["median"]["marlin"] == 2.8 and recs[0]["spread"]["marlin"] == 0.224
    assert sw.decode_step_lines(sel[:3], "7B", "qkv,o,gate_up,down", keys, recs.append) == [] and len(recs) == 1


def test_sweep_humming_step_lines_per_shape_and_row_count():
    """sweep_humming.decode_step_lines: for each shape, then each row count, whose four linears all finished: a
    per_step_ms row (the linears' µs summed times the layers, in ms), humming's verdict against Marlin on the step and
    the count of its linears refused by the check, and a line; a (shape, rows) with a linear missing gets neither."""
    sh = _import_script("sweep_humming")
    r1 = [dict(_step_final("7B", lin, 1, humming=(5.0 * i, 0.5), marlin=(10.0 * i, 1.0), bf16=(20.0 * i, 2.0)),
               refused=lin == "gate_up") for i, lin in enumerate(LINEARS4, 1)]
    r8 = [dict(_step_final("7B", lin, 8, humming=(1.0, 0.0), marlin=(2.0, 0.0), bf16=(3.0, 0.0)), refused=False)
          for lin in LINEARS4[:3]]
    r64 = [dict(_step_final("7B", lin, 64, humming=(10.0, 1.0), marlin=(10.5, 1.0), bf16=(10.0, 0.0)), refused=False)
           for lin in LINEARS4]
    big = [dict(_step_final("32B", lin, 1, humming=(10.0, 0.0), marlin=(20.0, 0.0), bf16=(30.0, 0.0)), refused=False)
           for lin in LINEARS4]
    recs = []
    lines = sh.decode_step_lines(big + r64 + r8 + r1, "7B,32B", [1, 8, 64], "qkv,o,gate_up,down", recs.append)
    assert recs == [
        {"what": "per_step_ms", "shape": "7B", "rows": 1, "median": {"humming": 1.4, "marlin": 2.8, "bf16": 5.6},
         "spread": {"humming": 0.056, "marlin": 0.112, "bf16": 0.224}, "humming_vs_marlin": "faster",
         "refused_cases": 1},
        {"what": "per_step_ms", "shape": "7B", "rows": 64, "median": {"humming": 1.12, "marlin": 1.176, "bf16": 1.12},
         "spread": {"humming": 0.112, "marlin": 0.112, "bf16": 0.0}, "humming_vs_marlin": "equal", "refused_cases": 0},
        {"what": "per_step_ms", "shape": "32B", "rows": 1, "median": {"humming": 2.56, "marlin": 5.12, "bf16": 7.68},
         "spread": {"humming": 0.0, "marlin": 0.0, "bf16": 0.0}, "humming_vs_marlin": "faster", "refused_cases": 0}]
    assert all(list(r) == ["what", "shape", "rows", "median", "spread", "humming_vs_marlin", "refused_cases"]
               for r in recs)
    assert lines == [
        "per 7B decode step (x28), 1 rows: humming 1.400 ms (±0.056), marlin 2.800 ms (±0.112), bf16 5.600 ms "
        "(±0.224); humming vs Marlin: faster (1 of its linears refused by the check)",
        "per 7B decode step (x28), 64 rows: humming 1.120 ms (±0.112), marlin 1.176 ms (±0.112), bf16 1.120 ms "
        "(±0.000); humming vs Marlin: equal",
        "per 32B decode step (x64), 1 rows: humming 2.560 ms (±0.000), marlin 5.120 ms (±0.000), bf16 7.680 ms "
        "(±0.000); humming vs Marlin: faster"]


# ---------------------------------------------------------------------------------------------------------
# check_actor_kernels.py: the actor at the same peak memory (docs/benchmarks.md §4u)


def _model_row(case, keep, peak, runs):
    return {"step": "model", "case": case, "keep": keep, "step_peak_GiB": peak, "step_ms_all": runs,
            "step_ms": sorted(runs)[len(runs) // 2]}


def test_actor_same_memory_verdict_takes_the_most_kept_layers_within_bf16s_peak():
    ck = _import_script("check_actor_kernels")
    assert ck.parse_model_case("nvfp4+keep12") == ("nvfp4", 12) and ck.parse_model_case("bf16") == ("bf16", 0)
    for bad in ("nvfp4+keep", "nvfp4+keepx", "fp8", "nvfp4+kep2"):
        with pytest.raises(ValueError, match="optionally \\+keepN"):
            ck.parse_model_case(bad)
    bf16 = _model_row("bf16", 0, 45.7, [2400.0, 2405.0, 2410.0])
    rows = [bf16, _model_row("nvfp4", 0, 37.0, [2412.0, 2415.0, 2420.0]),
            _model_row("nvfp4+keep2", 2, 44.0, [2370.0, 2372.0, 2380.0]),
            _model_row("nvfp4+keep3", 3, 47.5, [2340.0, 2341.0, 2345.0]),  # over BF16's peak: not a same-memory case
            _model_row("bf16+keep2", 2, 52.0, [2360.0, 2361.0, 2362.0])]
    text = ck.same_memory_verdict(rows)
    assert text.startswith("same peak memory: nvfp4+keep2 (44.0 GiB) vs bf16 (45.7 GiB): tokens/s 1.014x")
    assert text.endswith("faster (ranges apart): PASS")
    rows[2] = _model_row("nvfp4+keep2", 2, 44.0, [2395.0, 2400.0, 2402.0])
    assert ck.same_memory_verdict(rows).endswith("ranges overlap: no verdict")
    assert ck.same_memory_verdict(rows[:2]).endswith("slower (ranges apart): FAIL")
    assert ck.same_memory_verdict([bf16, rows[3]]) == "same peak memory: no NVFP4 case within BF16's step peak"
    assert ck.same_memory_verdict(rows[1:]) is None


def test_lora_kernel_step_times_the_7b_linears_the_kernel_tests_use(monkeypatch, capsys):
    """scripts/gpu/lora_kernel_step.py (§4v) builds the four 7B LoRA linears of test_lora_fused's GPU tests, loads a
    baseline module from a file, and on a machine without CUDA says so instead of failing later."""
    import torch

    from tests.vllm_ext.test_lora_fused import SHAPES_7B

    step = _import_script("lora_kernel_step")
    groups, layers = step._groups("7B")
    assert groups == SHAPES_7B and layers == 28
    old = step._load(str(ROOT / "vllm_ext" / "lora_fused.py"), "lora_fused_baseline_test")
    assert old.MAX_TOKENS == 64 and callable(old.launch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert step.main(["--baseline", str(ROOT / "vllm_ext" / "lora_fused.py")]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_clock_poll_cost_summary_of_the_recorded_run():
    """clock_poll_cost.summarize on §4x call 16's 12 windows gives the summary that run printed (sampling every 1 s
    and every 0.2 s within the spreads of off: no verdict); a cost beyond both spreads is called, either way."""
    cost = _import_script("clock_poll_cost")
    rows = [json.loads(line) for line in (ROOT / "docs/gpu-runs/2026-11-27/twentysecond/call16-poll-cost/"
                                           "clock_poll_cost.jsonl").read_text().splitlines()]
    windows = [r for r in rows if r["step"] == "window"]
    assert len(windows) == 12
    recorded = next(r for r in rows if r["step"] == "summary")
    assert {"step": "summary", **cost.summarize(windows)} == recorded
    assert recorded["every 1 s"]["verdict"] == recorded["every 0.2 s"]["verdict"] == "no verdict"
    made = [{"setting": s, "ms_per_replay": ms} for s, ms in (("off", 5.0), ("off", 5.01), ("every 1 s", 5.1),
                                                               ("every 1 s", 5.11), ("every 0.2 s", 4.8))]
    s = cost.summarize(made)
    assert (s["every 1 s"]["verdict"], s["every 0.2 s"]["verdict"]) == ("slower", "faster")
    assert s["every 1 s"]["cost_vs_off"] == round(5.105 / 5.005 - 1, 4)


@pytest.mark.parametrize("argv", [["--window", "0"], ["--rounds", "0"]])
def test_clock_poll_cost_refuses_bad_input(argv, capsys):
    """A window of no time or no rounds: an argparse error naming both options and the values given."""
    cost = _import_script("clock_poll_cost")
    with pytest.raises(SystemExit):
        cost.main(argv)
    assert "--window must be positive and --rounds >= 1 (got" in capsys.readouterr().err


def _sweep_lines(per_step: dict[int, tuple[float, float, str]], refused: int = 0) -> str:
    """sweep_humming.jsonl's per-step records: rows -> (humming ms, Marlin ms, verdict)."""
    spread = {"humming": 0.01, "marlin": 0.01, "bf16": 0.01}
    return "".join(json.dumps({"what": "per_step_ms", "shape": "7B", "rows": r, "median": {"humming": h, "marlin": m,
                               "bf16": 9.0}, "spread": spread, "humming_vs_marlin": v,
                               "refused_cases": refused}) + "\n"
                   for r, (h, m, v) in per_step.items())


@pytest.mark.parametrize("per_step, passes", [
    ({1: (3.0, 2.0, "slower"), 8: (2.0, 2.36, "faster"), 64: (4.0, 3.89, "slower")}, True),
    ({8: (2.30, 2.36, "faster"), 64: (3.85, 3.89, "faster")}, False),  # faster, by less than 0.10 ms
    ({1: (1.0, 2.0, "faster"), 8: (2.5, 2.36, "slower")}, False),  # only at one row, which the gate does not count
    ({8: (2.0, 2.36, "equal")}, False),  # within the spreads
    ({}, False),
])
def test_humming_gate_needs_a_faster_step_at_8_or_64_rows(tmp_path, per_step, passes):
    sweep = _import_script("sweep_humming")
    path = tmp_path / "sweep_humming.jsonl"
    path.write_text(json.dumps({"what": "setup"}) + "\n" + _sweep_lines(per_step))
    passed, why = sweep.gate(path)
    assert passed is passes
    if passes:  # the same step timed with a linear that failed the correctness check (--time-refused) does not count
        path.write_text(_sweep_lines(per_step, refused=1))
        refused, why_refused = sweep.gate(path)
        assert not refused and "8 rows: humming 2.000 ms vs Marlin 2.360 (faster, +0.360 ms; 1 linears refused)" in \
            why_refused
    assert why.startswith("gate passed: " if passes else "gate not passed")
    if not per_step:
        assert "8 rows: not measured; 64 rows: not measured" in why


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
@pytest.mark.parametrize("passes", [True, False])
def test_humming_gate_step_stops_the_session_unless_the_sweep_passed(tmp_path, passes):
    """humming_gate between sweep_humming and bench_humming: the later steps run only after a passing sweep (a watch
    stands in for the engine run here: nothing to watch, rc 3); otherwise the session ends with rc 6 and says why."""
    folder = tmp_path / "work" / "sweep_humming"
    folder.mkdir(parents=True)
    (folder / "sweep_humming.jsonl").write_text(_sweep_lines({8: (2.0 if passes else 2.5, 2.36,
                                                                  "faster" if passes else "slower")}))
    _, status, _ = _session(tmp_path, "humming_gate", "bench_watch", rc=0 if passes else 6, WATCH_S="1", TAG="-humming")
    assert ("bench_watch rc=3 " in status) is passes
    assert ("humming_gate: gate passed: 8 rows: humming 2.000 ms" in status) is passes
    if not passes:
        assert "gate not passed" in status and "humming_gate rc=6: no engine run" in status
        assert "humming_gate rc=6" in (tmp_path / "out" / "status.txt").read_text()


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
@pytest.mark.parametrize("check_line, pair", [("lora_r32_humming rc=0 300s-total 300s", True),
                                              ("lora_r32_humming rc=1 300s-total 300s", False), (None, False)])
def test_humming_next_starts_the_pair_only_after_a_passing_check(tmp_path, check_line, pair):
    """humming_next (§4ae): after a passing lora_r32_humming the pair of TAG/V7_ARGS starts in the background; after a
    failing one, or none on this machine, the LoRA-overhead bench with both backends starts instead. A python3 shim
    on PATH stands in for the runs and records the command lines they got."""
    shim, calls = tmp_path / "bin", tmp_path / "calls.txt"
    shim.mkdir()
    (shim / "python3").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (shim / "python3").chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    if check_line:
        (work / "status.txt").write_text(check_line + "\n")
    _, status, _ = _session(tmp_path, "humming_next", PATH=f"{shim}:{os.environ['PATH']}", RESP="512", STEPS="4",
                            TAG="-r512h", V7_ARGS="--nvfp4-backend humming")
    deadline = time.monotonic() + 20
    while not calls.exists() and time.monotonic() < deadline:  # the runs start detached (setsid)
        time.sleep(0.2)
    called = calls.read_text()
    assert ("v7_pair_bg rc=0" in status) is pair and ("bench_bg rc=0" in status) is not pair
    if pair:
        assert "humming_next: §2's check passed on humming: the -r512h pair" in status
        assert "verl_7b_memory_step.py build bf16 nvfp4 summary" in called and "--response 512" in called
        assert "--tag=-r512h" in called and called.strip().endswith("--nvfp4-backend humming")
        assert (work / "verl_7b" / "pair-r512h.log").exists()
    else:
        assert "the LoRA-overhead bench" in status
        assert "bench_rollout.py --shape 7B" in called and "nvfp4@humming-backend" in called
        assert "nvfp4@default" in called and (work / "bench-hover" / "bg.log").exists()


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
def test_bench_shipped_runs_the_shipped_tiles_even_after_a_sweep(tmp_path):
    """bench_shipped (§4ak) times the tiles the package ships: no tiles file reaches the engines, neither one
    sweep_shared left on the machine nor one set in the environment. A python3 shim records the run."""
    shim, calls = tmp_path / "bin", tmp_path / "calls.txt"
    shim.mkdir()
    (shim / "python3").write_text(f'#!/bin/sh\necho "tiles=$QERL_MARLIN_ROW_TILES $*" >> {calls}\n')
    (shim / "python3").chmod(0o755)
    folder = tmp_path / "work" / "sweep_shared"
    folder.mkdir(parents=True)
    (folder / "marlin_row_tiles.json").write_text("{}")
    _, status, _ = _session(tmp_path, "bench_shipped", PATH=f"{shim}:{os.environ['PATH']}",
                            QERL_MARLIN_ROW_TILES=str(folder / "marlin_row_tiles.json"))
    assert "bench_bg rc=0" in status
    deadline = time.monotonic() + 20
    while not calls.exists() and time.monotonic() < deadline:  # the bench starts detached (setsid)
        time.sleep(0.2)
    called = calls.read_text()
    assert called.startswith("tiles= scripts/gpu/bench_rollout.py --shape 7B --configs nvfp4-lora"), called
    runs = "--runs nvfp4-lora@decode-gemv-off,nvfp4-lora@decode-gemv-shared,nvfp4-lora@decode-gemv --batches 1,8,64"
    assert runs in called


@pytest.mark.skipif(os.name != "posix", reason="session.sh is a bash script for the GPU machine (Linux)")
@pytest.mark.parametrize("best, bench", [(2.0, True), (2.27, False)])
def test_bench_shared_if_starts_the_engines_only_after_a_sweep_faster_than_marlin(tmp_path, best, bench):
    """bench_shared_if (§4ai): the sweep's record is judged by sweep_marlin_row.py --gate; only a 7B step faster than
    Marlin's starts the three-engine bench, with the sweep's tiles file; lora_r32_shared_if then waits for that
    bench's end before §2's check, and without a passed gate does nothing. A python3 shim records the other runs."""
    shim, calls = tmp_path / "bin", tmp_path / "calls.txt"
    shim.mkdir()
    (shim / "python3").write_text(f'#!/bin/sh\ncase "$*" in *--gate*) exec {sys.executable} "$@";; esac\n'
                                  f'echo "$QERL_MARLIN_ROW_TILES $*" >> {calls}\n')
    (shim / "python3").chmod(0o755)
    folder = tmp_path / "work" / "sweep_shared"
    folder.mkdir(parents=True)
    step = {"what": "per_step_ms", "shape": "7B", "median": {"best": best, "rule": 3.4, "checkpoint_row": 1.74,
                                                               "marlin": 2.285},
            "spread": {"best": 0.02, "rule": 0.01, "checkpoint_row": 0.01, "marlin": 0.02}}
    (folder / "sweep_marlin_row.jsonl").write_text(json.dumps(step) + "\n")
    env = dict(PATH=f"{shim}:{os.environ['PATH']}")
    _, status, _ = _session(tmp_path, "bench_shared_if", **env)
    assert (f"shared_gate rc={0 if bench else 3} " in status) and ("bench_bg rc=0" in status) is bench
    if not bench:
        _, status, _ = _session(tmp_path, "lora_r32_shared_if", **env)
        assert "lora_r32_shared_if skipped: no passed shared_gate" in status and not calls.exists()
        return
    deadline = time.monotonic() + 20
    while not calls.exists() and time.monotonic() < deadline:  # the bench starts detached (setsid)
        time.sleep(0.2)
    called = calls.read_text()
    assert called.startswith(f"{folder / 'marlin_row_tiles.json'} scripts/gpu/bench_rollout.py --shape 7B")
    assert "--runs nvfp4-lora@default,nvfp4-lora@decode-gemv-shared,nvfp4-lora@decode-gemv --batches 1,8,64" in called
    (tmp_path / "work" / "bench-shared3" / "DONE").write_text("0\n")  # the bench has ended
    _, status, _ = _session(tmp_path, "lora_r32_shared_if", **env)
    assert "shared_wait rc=0" in status and "lora_r32_shared rc=0" in status
    assert calls.read_text().splitlines()[-1].endswith("check_lora_correctness.py --skip-stock --ranks 32 "
                                                       "--greedy-one-by-one")


def test_humming_verdicts_from_the_twentyseventh_sessions_raw_results():
    """§4ac and §4ad, recomputed from the committed raw files: the kernel check refused all 12 humming cases (error
    above 2x Marlin's in 10, never the same bits twice); the refused mode was 1.31x Marlin per 7B step at 64 rows; in
    the engine the humming backend was faster than the default at b64 only (ranges apart), 1.482x BF16 + LoRA."""
    runs = ROOT / "docs" / "gpu-runs" / "2026-11-28" / "twentyseventh"
    sweep = _import_script("sweep_humming")
    checks = [json.loads(line) for line in (runs / "A-calls01-12" / "sweep_humming" / "sweep_humming.jsonl")
              .read_text().splitlines()]
    checks = [c for c in checks if c["what"] == "check"]
    assert len(checks) == 12 and not any(c["same_bits"] for c in checks)
    assert sum(c["rel_error"]["humming"] > 2 * c["rel_error"]["marlin"] for c in checks) == 10
    passed, why = sweep.gate(runs / "B-calls13-21" / "sweep_humming" / "sweep_humming.jsonl")
    assert not passed and "64 rows: humming 2.988 ms vs Marlin 3.929 (faster, +0.941 ms; 4 linears refused)" in why
    bench = json.loads((runs / "C-calls22-32" / "bench-humbe" / "a" / "bench_rollout.json").read_text())
    by = {(r["config"], r["variant"]): r["batches"] for r in bench["results"]}
    default, hum = by[("nvfp4-lora", "default")], by[("nvfp4-lora", "humming-backend")]
    bf16 = by[("bf16-lora", "punica-lora")]
    for b, verdict in (("1", "equal"), ("8", "equal"), ("64", "faster")):
        d, h = default[b]["decode_runs_tok_s"], hum[b]["decode_runs_tok_s"]
        diff = hum[b]["decode_tok_s"] - default[b]["decode_tok_s"]
        got = "faster" if diff > max(max(d) - min(d), max(h) - min(h)) else "equal"
        assert got == verdict, (b, diff)
    assert min(hum["64"]["decode_runs_tok_s"]) > max(default["64"]["decode_runs_tok_s"])  # ranges apart
    assert round(hum["64"]["decode_tok_s"] / bf16["64"]["decode_tok_s"], 3) == 1.482
    greedy = bench["summary"]["greedy"]
    assert greedy["nvfp4-lora@humming-backend"]["max_abs_logprob_diff"] == 1e-05
    assert greedy["nvfp4-lora@punica-lora"]["max_abs_logprob_diff"] == 0.0  # the floor: 2 x 0 = 0, so the rule fails


def test_lora_check_finds_the_backend_line_of_an_engine_log(tmp_path):
    """check_lora_correctness --backend: an engine passes the backend row only where its log has qerl's first-use
    line for that backend; the environment variable it sets is the one vllm_ext reads."""
    from vllm_ext.nvfp4_backends import BACKEND_ENV

    check = _import_script("check_lora_correctness")
    assert check.BACKEND_ENV == BACKEND_ENV
    log = tmp_path / "ct.log"
    log.write_text("INFO loading\nWARNING 11-28 [nvfp4_backends.py:60] nvfp4: backend humming - vLLM's humming\n")
    assert check.backend_logged(log, "humming").startswith("WARNING 11-28")
    log.write_text("INFO loading\nINFO Using Marlin\n")
    assert check.backend_logged(log, "humming") is None
    assert check.backend_logged(tmp_path / "missing.log", "humming") is None


def test_humming_verdicts_from_the_twentyeighth_sessions_raw_results():
    """§4ae, recomputed from the committed raw files: §2's check fails on humming's split-K mode (teacher-forced max
    above the tolerance on both load paths, whose tensors were byte-identical), passes on Marlin and on humming's
    batch-invariant mode on the same machine; the LoRA overhead and the ratios of the same-run bench."""
    runs = ROOT / "docs" / "gpu-runs" / "2026-11-28" / "twentyeighth"

    def rows(folder):  # noqa: ANN001, ANN202
        return {r["step"]: r for r in json.loads((folder / "check_lora_correctness.json").read_text())["rows"]}

    def teacher_forced(check):  # noqa: ANN001, ANN202
        tf = {p: check[f"{p} r32 teacher-forced"] for p in ("bf16", "ct")}
        return {p: (round(r["max"], 4), round(r["mean"], 4)) for p, r in tf.items()}

    split_k = rows(runs / "call09" / "lora_r32_humming")
    assert [s for s, r in split_k.items() if not r["ok"]] == ["bf16 r32 teacher-forced", "ct r32 teacher-forced"]
    tol = split_k["ct r32 teacher-forced"]
    assert (round(tol["tol_max"], 4), round(tol["tol_mean"], 4)) == (0.5279, 0.0829)
    assert teacher_forced(split_k) == {"bf16": (0.6726, 0.075), "ct": (0.5434, 0.0923)}
    assert split_k["marlin bytes bf16 == ct"]["ok"] and split_k["engine:ct backend humming"]["ok"]
    marlin, invariant = rows(runs / "calls01-14" / "lora_r32"), rows(runs / "calls01-14" / "lora_r32_humming")
    assert all(r["ok"] for r in marlin.values()) and len(marlin) == 11
    assert all(r["ok"] for r in invariant.values()) and len(invariant) == 13
    assert teacher_forced(marlin) == {"bf16": (0.3533, 0.0639), "ct": (0.3533, 0.0639)}
    assert teacher_forced(invariant) == {"bf16": (0.2986, 0.064), "ct": (0.2986, 0.0661)}

    bench = json.loads((runs / "calls01-14" / "bench-hover" / "a" / "bench_rollout.json").read_text())
    med = {(r["config"], r["variant"]): {b: v["decode_tok_s"] for b, v in r["batches"].items()}
           for r in bench["results"]}
    runs_of = {(r["config"], r["variant"]): {b: v["decode_runs_tok_s"] for b, v in r["batches"].items()}
               for r in bench["results"]}
    overhead = {v: [round(100 * (1 - med[("nvfp4-lora", v)][b] / med[("nvfp4", v)][b]), 1) for b in ("1", "8", "64")]
                for v in ("default", "humming-backend")}
    assert overhead == {"default": [14.0, 14.4, 10.0], "humming-backend": [17.4, 12.4, 14.6]}
    bf16 = med[("bf16-lora", "punica-lora")]
    assert [round(med[("nvfp4-lora", "default")][b] / bf16[b], 3) for b in ("1", "8", "64")] == [1.85, 1.772, 1.3]
    assert round(med[("nvfp4-lora", "humming-backend")]["64"] / bf16["64"], 3) == 1.453
    default, hum = runs_of[("nvfp4-lora", "default")], runs_of[("nvfp4-lora", "humming-backend")]
    apart = {b: min(hum[b]) > max(default[b]) for b in ("1", "8", "64")}  # humming faster with the ranges apart
    assert apart == {"1": False, "8": True, "64": True}


def test_timed_interleaved_replays_each_graph_per_repeat_in_turn():
    """The sweeps' shared timing: every repeat replays each graph once, in the order given, with its own call count;
    the summary is each key's median and max - min over the repeats."""
    check_gemv = _import_script("check_gemv")
    seen, clock = [], iter([5.0, 1.0, 7.0, 2.0, 6.0, 3.0])

    def replay(graph, iters):  # noqa: ANN001, ANN202
        seen.append((graph, iters))
        return next(clock)

    res = check_gemv.timed_interleaved({"a": ("ga", 64), "b": ("gb", 9)}, 3, replay=replay)
    assert seen == [("ga", 64), ("gb", 9)] * 3
    assert res["a"] == {"median_us": 6.0, "spread_us": 2.0, "runs_us": [5.0, 7.0, 6.0]}
    assert res["b"] == {"median_us": 2.0, "spread_us": 2.0, "runs_us": [1.0, 2.0, 3.0]}


def test_decode_gemv_small_verdicts_from_the_twentyninth_sessions_raw_results():
    """§4af, recomputed from the committed raw files (H200): small against off with LoRA is faster at b1 and slower at
    b8 with the ranges apart (so off stays the default), equal at b64; the copies' memory; all's b1 gain; and in the
    b8 diagnostic the same GPU work per step with the difference in the GPU's idle time."""
    runs = ROOT / "docs" / "gpu-runs" / "2026-11-28" / "twentyninth"
    bench = json.loads((runs / "calls01-11" / "bench-small" / "a" / "bench_rollout.json").read_text())
    res = {f"{r['config']}@{r['variant']}": r for r in bench["results"]}
    assert all(r["ok"] and r["memory"]["device"] == "NVIDIA H200" for r in res.values()) and len(res) == 5

    def runs_of(key, b):  # noqa: ANN001, ANN202
        return res[key]["batches"][b]["decode_runs_tok_s"]

    def med(key, b):  # noqa: ANN001, ANN202
        return res[key]["batches"][b]["decode_tok_s"]

    off, small, every = "nvfp4-lora@default", "nvfp4-lora@decode-gemv-small", "nvfp4-lora@decode-gemv"

    def verdict(b):  # noqa: ANN001, ANN202  the spread rule: the medians' difference against both runs' spreads
        diff, spread = med(small, b) - med(off, b), max(max(runs_of(k, b)) - min(runs_of(k, b)) for k in (small, off))
        return "equal" if abs(diff) <= spread else ("faster" if diff > 0 else "slower")

    assert {b: verdict(b) for b in ("1", "8", "64")} == {"1": "faster", "8": "slower", "64": "equal"}
    assert max(runs_of(small, "8")) < min(runs_of(off, "8"))  # b8: every repeat below off's range
    assert [round(100 * (med(small, b) / med(off, b) - 1), 1) for b in ("1", "8", "64")] == [5.8, -16.1, -0.6]
    assert round(100 * (med(every, "1") / med(off, "1") - 1), 1) == 23.2
    assert round(med(every, "1") / med("bf16-lora@punica-lora", "1"), 3) == 1.988
    gib = {k: (r["memory"]["weights_bytes"] - res[off]["memory"]["weights_bytes"]) / 2**30 for k, r in res.items()}
    assert round(gib[small], 2) == 0.43 and round(gib[every], 2) == 3.42
    kv = (res[off]["memory"]["kv_cache_bytes"] - res[small]["memory"]["kv_cache_bytes"]) / 2**30
    assert abs(kv - 0.43) <= 0.1  # the plan's expectation for the KV cache the copies take

    diag = json.loads((runs / "calls12-21" / "bench-smallp" / "a" / "bench_rollout.json").read_text())
    prof = {f"{r['config']}@{r['variant']}": r["profile"]["8"] for r in diag["results"]}
    assert {k: p["replay_kernels"] for k, p in prof.items()} == {off: 533, small: 533, every: 533}
    busy = [p["replay_busy_ms"] for p in prof.values()]
    assert max(busy) - min(busy) < 0.01  # the same GPU work per b8 step
    assert {k: round(p["idle_ms"], 2) for k, p in prof.items()} == {off: 0.23, small: 1.28, every: 0.96}


def test_sweep_marlin_row_grids_and_the_tiles_each_linear_takes():
    """sweep_marlin_row.py: the first grid (72 tiles of at most one chunk per program), the wide one (270) and the
    chunks one (36, whole chunks); a tile fits a linear only where its loop step divides K, every split-K program has
    a step, its programs tile N and the grid stays below 32 768 programs. Its tile names are what §4ah quotes."""
    sweep = _import_script("sweep_marlin_row")
    first, wide, chunks = (sweep.sweep_tiles(grid=g) for g in ("first", "wide", "chunks"))
    assert (len(first), len(wide), len(chunks)) == (72, 270, 36)
    assert {t["hb"] for t in chunks} == {8, 16, 32} and all(t["stages"] == 0 for t in wide + chunks)
    assert sweep.fits(dict(hb=16, t=8, split_k=16, num_warps=2, stages=0), 4608, 3584)  # call set B's best q/k/v
    assert not sweep.fits(dict(hb=32, t=32, split_k=8, num_warps=2, stages=0), 4608, 3584)  # 7 steps < split-K 8
    assert not sweep.fits(dict(hb=32, t=8, split_k=1, num_warps=2, stages=0), 3584 + 64, 3584)  # N not 256-aligned
    assert not sweep.fits(dict(hb=1, t=8, split_k=16, num_warps=1, stages=0), 37888, 3584)  # 75 776 programs
    assert sweep.tile_name(dict(hb=16, t=8, split_k=16, num_warps=2, stages=0)) == "h16t8s16w2"
    assert sweep.tile_name(dict(hb=2, t=32, split_k=4, num_warps=1, stages=3)) == "h2t32s4w1S3"
    assert [t["asum"] for t in sweep.sweep_tiles(grid="asum")] == [1] * 36
    assert sweep.tile_name(sweep.sweep_tiles(grid="asum")[0]) == "h8t8s4w2A"
    forms = sweep.sweep_tiles(grid="forms")  # the chunks grid in each of the kernel's three forms
    assert len(forms) == 108 and [t["asum"] for t in forms] == [0] * 36 + [1] * 36 + [2] * 36
    assert forms[72:] == sweep.sweep_tiles(grid="asum2") and sweep.tile_name(forms[72]) == "h8t8s4w2A2"
    assert [t["asum"] for t in sweep.sweep_tiles(grid="forms3")] == [1] * 36 + [2] * 36 + [3] * 36
    assert sweep.tile_name(sweep.sweep_tiles(grid="asum3")[0]) == "h8t8s4w2A3"
    assert [t["asum"] for t in sweep.sweep_tiles(grid="forms4")] == [3] * 36 + [4] * 36
    assert sweep.tile_name(sweep.sweep_tiles(grid="asum4")[0]) == "h8t8s4w2A4"


def test_sweep_marlin_row_gate_runs_the_engines_only_for_a_step_faster_than_marlin(tmp_path):
    """--gate (session.sh bench_shared_if, §4ai): exit 0 only where the best tiles' 7B step beats Marlin's by more
    than both spreads; a sweep cut before its per-step line is a 'no' that says why."""
    sweep = _import_script("sweep_marlin_row")

    def record(best, spread):
        path = tmp_path / f"{best}-{spread}.jsonl"
        step = {"what": "per_step_ms", "shape": "7B", "median": {"best": best, "rule": 3.4, "checkpoint_row": 1.74,
                                                                   "marlin": 2.285},
                "spread": {"best": spread, "rule": 0.01, "checkpoint_row": 0.01, "marlin": 0.02}}
        path.write_text(json.dumps({"what": "setup"}) + "\n" + json.dumps(step) + "\n")
        return str(path)

    assert sweep.gate(record(2.0, 0.02))[0] and sweep.main(["--gate", record(2.0, 0.02)]) == 0
    assert not sweep.gate(record(2.27, 0.02))[0]  # 0.015 ms faster, within the spreads
    assert sweep.main(["--gate", record(2.7, 0.02)]) == 3
    cut = tmp_path / "cut.jsonl"
    cut.write_text(json.dumps({"what": "setup"}) + "\n")
    ok, line = sweep.gate(cut)
    assert not ok and "no 7B decode step recorded" in line


def _verdict_tok_s(a: dict, b: dict, batch: str) -> str:
    """'faster' / 'slower' for engine ``a`` against ``b`` at ``batch`` where the medians differ by more than both
    spreads of the repeats (tok/s), else 'equal' (the criteria of §4ak)."""
    ra, rb = a[batch]["decode_runs_tok_s"], b[batch]["decode_runs_tok_s"]
    diff = a[batch]["decode_tok_s"] - b[batch]["decode_tok_s"]
    if abs(diff) <= max(max(ra) - min(ra), max(rb) - min(rb)):
        return "equal"
    return "faster" if diff > 0 else "slower"


def test_shared_kernel_verdicts_from_the_thirty_third_sessions_raw_results():
    """§4aj, recomputed from the committed raw files: form 3 the fastest form per 7B and 32B step; §4aj's tiles (the
    SWEPT_TILES that §4al replaced, below) were exactly the best tiles that beat marlin_row_tile's rule by more than
    both spreads; in the engine shared beat off at b1 and was equal at b8 and b64, with the same greedy tokens; §2's
    one-prompt check failed on shared and on the default engine with the same numbers, and passed with four prompts on
    shared."""
    from vllm_ext.nvfp4_marlin_row import TILE_KEYS

    SWEPT_TILES = {(4608, 3584): (16, 8, 16, 4, 0, 3), (3584, 18944): (8, 16, 16, 4, 0, 3),  # as §4aj shipped them
                   (7168, 5120): (8, 8, 16, 2, 0, 3), (5120, 5120): (8, 8, 16, 2, 0, 3),
                   (55296, 5120): (16, 8, 16, 2, 0, 3), (5120, 27648): (16, 16, 16, 4, 0, 1)}

    runs = ROOT / "docs" / "gpu-runs" / "2026-11-28" / "thirty-third"
    sweep, gemv = _import_script("sweep_marlin_row"), _import_script("check_gemv")
    names = {sweep.tile_name(t): t for t in sweep.sweep_tiles(grid="forms3")}
    for folder, per_step, shape in (("sweep_shared", 28, "7B"), ("sweep_shared32", 64, "32B")):
        rows = [json.loads(line) for line in (runs / "calls01-15" / folder / "sweep_marlin_row.jsonl").open()]
        tiles = [r for r in rows if r["what"] == "tile"]
        assert tiles and all(r["ok"] for r in tiles)
        steps = {}
        for form in (1, 2, 3):
            best = {}
            for r in tiles:
                if names[r["tile"]]["asum"] == form:
                    best[r["linear"]] = min(best.get(r["linear"], 1e9), r["us"])
            steps[form] = round(sum(best.values()) * per_step / 1000, 3)
        assert min(steps, key=steps.get) == 3, (shape, steps)
        for r in (r for r in rows if r["what"] == "final"):
            faster = gemv.verdict(r["best"], r["rule"]) == "faster"
            tile = names[r["tile"]]
            assert ((r["n"], r["k"]) in SWEPT_TILES) is faster, (shape, r["linear"])
            if faster:
                assert SWEPT_TILES[(r["n"], r["k"])] == tuple(tile[k] for k in (*TILE_KEYS, "asum"))
    assert steps == {1: 7.816, 2: 7.93, 3: 7.758}  # the 32B step, ms (7B: 2.026, 2.017, 1.951)

    bench = json.loads((runs / "calls01-15" / "bench-shared3" / "a" / "bench_rollout.json").read_text())
    by = {r["variant"]: r["batches"] for r in bench["results"]}
    off, shared = by["default"], by["decode-gemv-shared"]
    for b, want in (("1", "faster"), ("8", "equal"), ("64", "equal")):
        assert _verdict_tok_s(shared, off, b) == want, b
    assert round(100 * (shared["1"]["decode_tok_s"] / off["1"]["decode_tok_s"] - 1), 1) == 16.6
    assert all(g["all_identical"] for g in bench["summary"]["greedy"].values())

    def teacher_forced(path):  # noqa: ANN001, ANN202
        rows = [json.loads(line) for line in path.open()]
        return {r["step"]: (r["ok"], round(r["max"], 4), round(r["tol_max"], 4)) for r in rows
                if r["step"].endswith("teacher-forced")}

    one = teacher_forced(runs / "calls01-15" / "lora_r32_shared" / "check_lora_correctness.jsonl")
    default_one = teacher_forced(runs / "calls16-24" / "lora_r32_1p" / "check_lora_correctness.jsonl")
    assert one["bf16 r32 teacher-forced"] == default_one["bf16 r32 teacher-forced"] == (False, 0.3418, 0.3319)
    four = json.loads((runs / "calls16-24" / "lora_r32_shared4" / "check_lora_correctness.json").read_text())
    assert len(four["rows"]) == 11 and all(r["ok"] for r in four["rows"])


def test_shared_default_and_form_4_tiles_from_the_thirty_fifth_sessions_raw_results():
    """§4al, recomputed from the committed raw files by §4ak's criteria: §2's check passed 11/11 with shared (four
    prompts, one at a time); on the shipped tiles shared was faster than off at b1 and equal at b8 and b64, with the
    same greedy tokens (so shared is the default on Hopper); SWEPT_TILES holds the sweep's best tile exactly where it
    beat the tile shipped before (the sweep's rule row) by more than both spreads, and that tile elsewhere."""
    from qerl_plugin import options
    from vllm_ext.nvfp4_marlin_row import SWEPT_TILES, TILE_KEYS

    runs = ROOT / "docs" / "gpu-runs" / "2026-11-28" / "thirty-fifth" / "work"
    check = json.loads((runs / "lora_r32_shared" / "check_lora_correctness.json").read_text())
    assert len(check["rows"]) == 11 and all(r["ok"] for r in check["rows"])

    bench = json.loads((runs / "bench-shipped" / "a" / "bench_rollout.json").read_text())
    by = {r["variant"]: r["batches"] for r in bench["results"]}
    off, shared, full = by["default"], by["decode-gemv-shared"], by["decode-gemv"]
    assert [_verdict_tok_s(shared, off, b) for b in ("1", "8", "64")] == ["faster", "equal", "equal"]
    assert round(100 * (shared["1"]["decode_tok_s"] / off["1"]["decode_tok_s"] - 1), 1) == 12.3
    assert _verdict_tok_s(full, off, "1") == "faster"
    assert all(g["all_identical"] for g in bench["summary"]["greedy"].values())
    assert options.decode_gemv_default(90) == "shared" and options.decode_gemv_default(80) == "off"

    sweep, gemv = _import_script("sweep_marlin_row"), _import_script("check_gemv")
    names = {sweep.tile_name(t): t for t in sweep.sweep_tiles(grid="forms4")}
    rows = [json.loads(line) for line in (runs / "sweep_shared" / "sweep_marlin_row.jsonl").open()]
    assert all(r["ok"] for r in rows if r["what"] == "tile")
    finals = [r for r in rows if r["what"] == "final"]
    assert len(finals) == 8
    resweep = {(37888, 3584), (55296, 5120)}  # §4ba swept these again with the FP8 decode (its own raw-file test)
    for r in finals:
        best = names[r["tile"]]
        best = tuple(best[k] for k in (*TILE_KEYS, "asum"))
        if (r["n"], r["k"]) in resweep:
            assert gemv.verdict(r["best"], r["rule"]) == "faster"
        elif gemv.verdict(r["best"], r["rule"]) == "faster":
            assert SWEPT_TILES[(r["n"], r["k"])] == best, (r["shape"], r["linear"])
        else:
            assert r["rule_tile"] == sweep.tile_name(dict(zip((*TILE_KEYS, "asum"), SWEPT_TILES[(r["n"], r["k"])])))
    assert sum(gemv.verdict(r["best"], r["rule"]) == "faster" for r in finals) == 7


def test_shared_default_holds_on_the_thirty_sixth_sessions_raw_results():
    """§4an, recomputed from the committed raw files by its criteria (§4am's): the GPU tests of the row and row+lora
    kernels passed; on ckpt7b's checkpoint shared was faster than off at b1 and equal at b8 and b64, with LoRA and
    without, and faster at 32B b1, so the default stays shared; the LoRA overhead of shared, the ratios against BF16 +
    punica, and the greedy divergence of the LoRA engines, which starts in the prefill (the same kernels in both)."""
    from vllm_ext.bench import report

    runs = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "thirty-sixth" / "work"
    assert "17 passed" in (runs / "marlin_row_test" / "stdout.log").read_text()
    table = json.loads((runs / "bench-tshared" / "a" / "bench_rollout.json").read_text())
    by = {(r["config"], r["variant"]): r["batches"] for r in table["results"]}
    assert all(r["inherited_env"] == {"QERL_MARLIN_ROW_TILES": ""} for r in table["results"])  # the shipped tiles
    for config, gain in (("nvfp4-lora", 17.2), ("nvfp4", 11.5)):
        shared, off = by[(config, "decode-gemv-shared")], by[(config, "decode-gemv-off")]
        assert [_verdict_tok_s(shared, off, b) for b in ("1", "8", "64")] == ["faster", "equal", "equal"], config
        assert round(100 * (shared["1"]["decode_tok_s"] / off["1"]["decode_tok_s"] - 1), 1) == gain
    rows = table["summary"]["rows"]
    assert rows["nvfp4-lora@decode-gemv-shared"]["vs_bf16_lora"] == {"1": 1.932, "8": 1.551, "64": 1.124}
    assert rows["stock-nvfp4-lora@punica-lora"]["vs_bf16_lora"] == {"1": 1.244, "8": 1.262, "64": 0.951}
    overhead = {b: round(v, 3) for b, v in rows["nvfp4-lora@decode-gemv-shared"]["lora_overhead"].items()}
    assert overhead == {"1": 0.081, "8": 0.13, "64": 0.08}
    checks = {(c["run"], c["what"]): c["verdict"] for c in table["summary"]["checks"]}
    assert checks[("nvfp4-lora@decode-gemv-shared", "LoRA overhead b1")] == "no verdict"  # 8.1 %, spread 4.1 %

    big = json.loads((runs / "bench-32b" / "a" / "bench_rollout.json").read_text())
    by32 = {r["variant"]: r["batches"] for r in big["results"]}
    assert _verdict_tok_s(by32["decode-gemv-shared"], by32["decode-gemv-off"], "1") == "faster"
    assert [c["got"] for c in big["summary"]["checks"]] == [1.906, 2.182]

    # the greedy check: the engines without LoRA gave the same tokens and logprobs; those with LoRA differ from the
    # first token on, which comes from the prefill: 256 tokens, Marlin and punica in both engines
    greedy = report.greedy_agreement(table["results"])
    assert greedy["nvfp4@decode-gemv-shared"]["all_identical"]
    assert greedy["nvfp4@decode-gemv-shared"]["max_abs_logprob_diff"] == 0.0
    lora = greedy["nvfp4-lora@decode-gemv-shared"]
    assert lora["common_prefix"] == [12, 11, 1, 9] and lora["first_token_logprob_diff"] == 0.0937
    assert lora["verdict"] == "differs (no repeats: the engines' own variation is unknown)"


def test_vllms_lora_shrink_splits_k_with_atomic_adds_for_the_bench_prefill():
    """§4an's likely cause of the LoRA engines' differing prefills, in the installed vLLM (what this shows: the split
    and the atomic add, not that the sums vary between runs): its punica shrink splits the input features (split_k 8
    for the bench's 256-token prefill, 64 for fewer than 128 tokens) and sums the parts with float32 atomic adds,
    whose order can vary from launch to launch; only vLLM's batch-invariant mode sets 1."""
    pytest.importorskip("vllm")
    import inspect

    from vllm.lora.ops.triton_ops import kernel_utils, utils

    shrink = utils.get_lora_op_configs("shrink", max_loras=1, batch=256, hidden_size=3584, rank=32, num_slices=3)
    assert shrink["split_k"] == (1 if utils.is_batch_invariant else 8)
    assert "tl.atomic_add(c_ptr, accumulator" in inspect.getsource(kernel_utils)


def _eval_check_call(name: str) -> list[str]:
    """The arguments that session.sh's step ``name`` (eval_shared, eval_gluon) hands its ``eval_check`` function:
    ``[step, seqs, ref, cand, cand_env, *paths]``."""
    import shlex

    text = (GPU / "session.sh").read_text()
    start = text.index(f"    {name})")
    step = text[start:text.index(";;", start)]
    call = step[step.index("eval_check "):].replace("\\\n", " ")
    return shlex.split(call)[1:]


def _run_eval_check(name: str, tmp_path: Path, done: tuple[str, ...] = ()) -> list[list[str]]:
    """session.sh's step ``name`` run with ``step`` stubbed to run its command and a fake ``python3`` that records
    each call: ``[QERL_NVFP4_DECODE_GEMV, QERL_FEW_ROW_LORA, *argv]`` per call, in order. ``done``: runs whose summary
    is already there (finished in an earlier call)."""
    import shlex
    import subprocess

    text = (GPU / "session.sh").read_text()
    fn = text[text.index("eval_check() {"):text.index("\n}\n", text.index("eval_check() {")) + 3]
    bin_dir, record = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3").write_text('#!/bin/sh\nprintf "%s\\0" "${QERL_NVFP4_DECODE_GEMV-}" "${QERL_FEW_ROW_LORA-}" '
                                     f'"$@" >> {record}\necho >> {record}\n')
    (bin_dir / "python3").chmod(0o755)
    for m in done:
        (tmp_path / "work" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "work" / name / f"{m}.summary.json").write_text("{}")
    call = " ".join(shlex.quote(a) for a in _eval_check_call(name))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("FRESH", None)
    subprocess.run(["bash", "-c", f'work={tmp_path}/work\nstep() {{ shift 2; "$@"; }}\n{fn}eval_check {call}'],
                   capture_output=True, text=True, env=env, check=True)
    return [line.split("\0") for line in record.read_text().split("\0\n") if line]  # each arg ends in NUL, a call in LF


def test_eval_shared_runs_qerls_method_and_checks_its_log_for_it(tmp_path):
    """§4ap: the real-model check runs SmolLM2's NVFP4A16 checkpoint with --quantization nvfp4 (vLLM's stock
    compressed-tensors path has no decode_gemv), off twice and then shared, one sequence at a time, and is void unless
    the candidate's log names that method in the words ``qerl eval`` logs (vllm_ext.evaluate.kernels_line); a run
    finished in an earlier call is not run again. Run with a fake ``python3`` that records its calls."""
    from types import SimpleNamespace

    from vllm_ext.evaluate import kernels_line

    calls = _run_eval_check("eval_shared", tmp_path)
    evals, compare = calls[:3], calls[3]
    d = f"{tmp_path}/work/eval_shared"
    for (gemv, few, *argv), m in zip(evals, ("off", "off2", "shared")):
        assert (gemv, few) == (m.rstrip("2"), "")
        assert argv[:3] == ["-m", "qerl_plugin.cli", "eval"] and "--quantization" in argv
        assert argv[argv.index("--quantization") + 1] == "nvfp4" and argv[argv.index("--max-num-seqs") + 1] == "1"
        assert argv[argv.index("--out") + 1] == f"{d}/{m}.jsonl"
    paths = _eval_shared_paths()
    assert paths == ["qerl's nvfp4 method on the NVFP4A16", "on the row+lora path",
                     "3072 x 576 weights run on qerl's row kernel"]
    assert compare[2:] == ["scripts/gpu/compare_evals.py", "--reference", f"{d}/off.jsonl", "--floor",
                           f"{d}/off2.jsonl", "--candidate", f"{d}/shared.jsonl", "--candidate-log", f"{d}/shared.log",
                           *[w for p in paths for w in ("--path", p)], "--out", f"{d}/compare.json"]
    line = kernels_line(SimpleNamespace(quantization="nvfp4a16"), {"quantization": "nvfp4"})
    assert paths[0] in line and paths[0] not in kernels_line(SimpleNamespace(quantization="nvfp4a16"), {})
    again = _run_eval_check("eval_shared", tmp_path / "again", done=("off", "off2"))
    assert len(again) == 2 and again[0][0] == "shared"  # only the run not finished before, then the comparison


def test_eval_gluon_runs_the_path_in_batches_and_checks_its_log_for_it(tmp_path):
    """§4aw's real-model check of the gluon+lora path: qerl's method, eight sequences at a time (so decode steps of 2
    to 8 tokens), the default twice, then the candidate with decode_gemv's copy and the switch, void unless its log
    names the method and the path in the words the code logs (vllm_ext.evaluate.kernels_line, lora_dense_wrapper's
    path line). Run with a fake ``python3`` that records its calls."""
    from qerl_plugin import options

    calls = _run_eval_check("eval_gluon", tmp_path)
    assert options.FEW_ROW_LORA_MAX_TOKENS == 8
    assert [c[:2] for c in calls[:3]] == [["shared", ""], ["shared", ""], ["all", "1"]]
    for (_, _, *argv), m in zip(calls[:3], ("shared", "shared2", "gluon")):
        assert argv[argv.index("--quantization") + 1] == "nvfp4" and argv[argv.index("--max-num-seqs") + 1] == "8"
        assert argv[argv.index("--out") + 1] == f"{tmp_path}/work/eval_gluon/{m}.jsonl"
    assert _eval_check_call("eval_gluon")[4] == f"QERL_NVFP4_DECODE_GEMV=all {options.FEW_ROW_LORA_ENV}=1"
    paths = _eval_shared_paths("eval_gluon")
    assert paths == ["qerl's nvfp4 method on the NVFP4A16", "on the gluon+lora path"]
    assert calls[3][calls[3].index("--candidate") + 1].endswith("eval_gluon/gluon.jsonl")
    assert [calls[3][i + 1] for i, w in enumerate(calls[3]) if w == "--path"] == paths
    wrapper = (ROOT / "vllm_ext" / "lora_dense_wrapper.py").read_text()
    assert 'GLUON_PATH = "gluon+lora"' in wrapper and '"qerl: LoRA call with %d tokens on the %s path%s"' in wrapper


def test_thirty_seventh_sessions_raw_results():
    """§4ap, recomputed from the committed raw files: the real-model check was void (all three runs on vLLM's stock
    compressed-tensors path, so decode_gemv changed nothing: the same 200 responses, 0.780 each); the GPU tests passed;
    in the 7B table shared beat off at b1 and equalled it at b8 and b64, with LoRA and without; in the greedy check
    every engine with LoRA, vLLM's stock ones included, differs from its own repeat, and none without LoRA does."""
    from vllm_ext.bench import report

    runs = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "thirty-seventh" / "work"
    assert "19 passed" in (runs / "marlin_row_test" / "stdout.log").read_text()
    ev, ce = runs / "eval_shared", _import_script("compare_evals")
    got = ce.compare(ce.load(ev / "off.jsonl"), ce.load(ev / "off2.jsonl"), ce.load(ev / "shared.jsonl"),
                     log_text=(ev / "shared.log").read_text(), paths=["on the row+lora path"])
    assert got["verdict"] == "void" and got["differ_reference_floor"] == got["differ_reference_candidate"] == 0
    assert set(got["accuracy"].values()) == {0.78}
    assert json.loads((ev / "compare.json").read_text())["verdict"] == "void"
    for name in ("off", "off2", "shared"):
        log = (ev / f"{name}.log").read_text()
        assert "quantization=compressed-tensors" in log and "Using MarlinNvFp4LinearKernel" in log
        assert "quantization=nvfp4" not in log and "decode_gemv" not in log

    table = json.loads((runs / "bench-tshared" / "a" / "bench_rollout.json").read_text())
    by = {(r["config"], r["variant"]): r for r in table["results"]}
    assert all(r["inherited_env"] == {"QERL_MARLIN_ROW_TILES": ""} for r in by.values())
    for config, gain in (("nvfp4-lora", 21.5), ("nvfp4", 12.4)):
        shared, off = by[(config, "decode-gemv-shared")]["batches"], by[(config, "decode-gemv-off")]["batches"]
        assert [_verdict_tok_s(shared, off, b) for b in ("1", "8", "64")] == ["faster", "equal", "equal"], config
        assert round(100 * (shared["1"]["decode_tok_s"] / off["1"]["decode_tok_s"] - 1), 1) == gain
    rows = table["summary"]["rows"]
    assert rows["nvfp4-lora@decode-gemv-shared"]["vs_bf16_lora"] == {"1": 1.981, "8": 1.588, "64": 1.135}
    assert rows["stock-nvfp4-lora@punica-lora"]["vs_bf16_lora"] == {"1": 1.277, "8": 1.304, "64": 0.964}
    assert rows["nvfp4-lora@decode-gemv-shared"]["lora_overhead"] == {"1": 0.079, "8": 0.132, "64": 0.079}

    for (config, variant), result in by.items():
        for mode, g in (("together", result["greedy"]), ("alone", result["greedy"]["alone"])):
            assert report._repeats_itself(g) is ("lora" not in config), (config, variant, mode)
    greedy = report.greedy_agreement(table["results"])
    plain = greedy["nvfp4@decode-gemv-shared"]
    assert plain["all_identical"] and plain["alone"]["first_token_logprob_diff"] == 0.0
    assert plain["alone"]["verdict"] == "differs while each engine repeats itself exactly"
    assert plain["alone"]["common_prefix"] == [7, 3, 11, 1]


def test_thirty_eighth_sessions_raw_results():
    """§4aq, recomputed from the committed raw files: the real-model check of decode_gemv "shared" ran qerl's method
    (every run's log says so, and shared's names the row kernel on SmolLM2's gate/up and down) and passes §4ao's rule:
    0.780 each, 2 of 200 responses differ from off's, none between off's two runs; off's responses are the stock
    path's of §4ap."""
    runs = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "thirty-eighth" / "work"
    assert "19 passed" in (runs / "marlin_row_test" / "stdout.log").read_text()
    ev, ce = runs / "eval_shared", _import_script("compare_evals")
    paths = _eval_shared_paths()
    off, off2, shared = (ce.load(ev / f"{m}.jsonl") for m in ("off", "off2", "shared"))
    got = ce.compare(off, off2, shared, log_text=(ev / "shared.log").read_text(), paths=paths)
    assert got["verdict"] == "pass" and got["differ_reference_floor"] == 0 and got["differ_reference_candidate"] == 2
    assert got["rows_differing"] == [112, 128] and set(got["accuracy"].values()) == {0.78}
    assert json.loads((ev / "compare.json").read_text())["verdict"] == "pass"
    for name in ("off", "off2", "shared"):
        log = (ev / f"{name}.log").read_text()
        assert "'quantization': 'nvfp4'" in log and paths[0] in log
        assert ("qerl's row kernel" in log) is (name == "shared")
    shared_log = (ev / "shared.log").read_text()
    for n, k, where in ((3072, 576, "run on qerl's row kernel"), (576, 1536, "run on qerl's row kernel"),
                        (960, 576, "stay on Marlin"), (576, 576, "stay on Marlin")):
        assert f"one-row calls of {n} x {k} weights {where}" in shared_log
    answers = {m: [rows[i]["pred"] for i in (112, 128)] for m, rows in (("off", off), ("shared", shared))}
    assert answers == {"off": ["21", "6"], "shared": ["20", "7"]}
    stock = ce.load(ROOT / "docs" / "gpu-runs" / "2026-11-29" / "thirty-seventh" / "work" / "eval_shared" / "off.jsonl")
    assert ce.differing(stock, off) == [] and ce.differing(stock, shared) == [112, 128]


def _ncu_metrics(log: Path) -> list[dict[str, str]]:
    """Each profiled launch's metric values in an Nsight Compute text report (``Metric Name  Unit  Value`` rows)."""
    import re

    launches: list[dict[str, str]] = []
    for line in log.read_text().splitlines():
        if ", Context " in line and ", Device " in line:  # a launch's header line
            launches.append({"header": line.strip()})
        elif launches:
            got = re.match(r"\s{4}(\S.*?)\s{2,}(?:\S+\s{2,})?([\d.,]+)\s*$", line)
            if got:
                launches[-1].setdefault(got.group(1).strip(), got.group(2))
    return launches


def test_ncu_launch_step_profiles_marlin_and_the_lora_kernel_at_the_rows_asked():
    """session.sh's ncu_launch_step (marlin_smem at 8 rows, ncu_launch at ROWS, default 64), run with ``step`` stubbed
    to print its arguments: one step of the given name and limit, whose command profiles both kernels in the kernel
    bench at that row count."""
    import subprocess

    text = (GPU / "session.sh").read_text()
    fn = text[text.index("ncu_launch_step() {"):text.index("\n}\n", text.index("ncu_launch_step() {")) + 3]
    assert "ncu_launch_step ncu_marlin_smem 8 ;;" in text and 'ncu_launch_step ncu_launch "${ROWS:-64}" ;;' in text
    out = subprocess.run(["bash", "-c", 'step() { printf "%s\\0" "$@"; }\n' + fn + "ncu_launch_step ncu_launch 64"],
                         capture_output=True, text=True, check=True).stdout.split("\0")
    name, limit, cmd = out[0], out[1], out[-2]
    assert (name, limit, out[2:4]) == ("ncu_launch", "240", ["bash", "-c"])
    assert "for k in Marlin _fused_lora_kernel" in cmd and "--batches 64 --iters 2" in cmd
    assert "--section LaunchStats --section Occupancy" in cmd and "--launch-count 8" in cmd


def _assert_one_block_per_sm_with_all_its_shared_memory(m: dict[str, str]) -> None:
    """A Marlin launch in an ncu report (:func:`_ncu_metrics`): a grid of the SM count (132, an H200), each block taking
    the SM's whole shared-memory configuration (dynamic + driver), so one block per SM by shared memory."""
    assert "void Marlin<" in m["header"] and int(m["Grid Size"]) == int(m["# SMs"]) == 132
    used = float(m["Dynamic Shared Memory Per Block"]) + float(m["Driver Shared Memory Per Block"])
    assert abs(used - float(m["Shared Memory Configuration Size"])) < 0.01 and m["Block Limit Shared Mem"] == "1"


def test_thirty_eighth_sessions_marlin_shared_memory():
    """§4ar, recomputed from the committed raw files: Marlin's FP4 GEMM at 8 rows launches one block per SM with the
    SM's whole shared-memory configuration (so Nsight Compute limits it to one block per SM), while the LoRA kernel's
    blocks need shared memory of their own; and the kernel bench's share of the LoRA kernel that overlap hides."""
    runs = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "thirty-eighth-b" / "work"
    marlin = _ncu_metrics(runs / "ncu_marlin_smem" / "ncu_Marlin.log")
    lora = _ncu_metrics(runs / "ncu_marlin_smem" / "ncu__fused_lora_kernel.log")
    assert len(marlin) == len(lora) == 8
    for m in marlin:
        _assert_one_block_per_sm_with_all_its_shared_memory(m)
    for k in lora:
        assert "_fused_lora_kernel (50, 1, 1)x(128, 1, 1)" in k["header"]
        assert float(k["Dynamic Shared Memory Per Block"]) == 24.58 and float(k["Driver Shared Memory Per Block"]) > 0

    step = json.loads((runs / "kernels_h200" / "bench_kernels.json").read_text())["per_step_ms"]
    hidden = {m: round(100 * (v["serial_fused"] - v["overlap_fused"]) / v["lora_fused"], 1) for m, v in step.items()}
    assert hidden == {"1": 17.2, "8": 11.6, "64": 31.6}
    assert round(step["8"]["overlap_fused"] - step["8"]["marlin"], 3) == 0.555
    table = json.loads((ROOT / "docs" / "gpu-runs" / "2026-11-29" / "thirty-seventh" / "work" / "bench-tshared" / "a" /
                        "bench_rollout.json").read_text())
    by = {(r["config"], r["variant"]): r["batches"]["8"]["decode_tok_s"] for r in table["results"]}
    per_step_ms = 1000 * (8 / by[("nvfp4-lora", "decode-gemv-shared")] - 8 / by[("nvfp4", "decode-gemv-shared")])
    assert round(per_step_ms, 3) == 0.536


def test_thirty_eighth_sessions_launch_orders():
    """§4as, recomputed from the committed raw files: over three kernel-bench runs, the LoRA kernel as a dependent
    launch after Marlin (serial_pdl) and enqueued before it (overlap_first) are each slower than overlap_fused at 8
    and at 64 rows by the plan's rule (each run of the case above overlap's slowest), so neither reaches the gate."""
    import statistics

    runs = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "thirty-eighth-c" / "work"
    assert "16 passed" in (runs / "lora_order_test" / "stdout.log").read_text()
    steps = [json.loads((runs / f"lora_order_{i}" / "bench_kernels.json").read_text())["per_step_ms"]
             for i in (1, 2, 3)]
    for m in ("8", "64"):
        overlap = [s[m]["overlap_fused"] for s in steps]
        for case in ("serial_pdl", "overlap_first"):
            assert min(s[m][case] for s in steps) > max(overlap), (m, case)
    med = {c: statistics.median(s["8"][c] for s in steps) for c in ("overlap_fused", "serial_pdl", "overlap_first")}
    assert med == {"overlap_fused": 2.733, "serial_pdl": 2.819, "overlap_first": 2.841}


def test_thirty_eighth_sessions_marlin_launch_at_64_rows():
    """§4at, recomputed from the committed raw files: at 64 rows Marlin's q/k/v GEMM launches as at 8 rows (grid = the
    SM count, the SM's whole shared memory per block, one block per SM), so the plan's verdict is "not explained by
    the launch shape"."""
    runs = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "thirty-eighth-d" / "work" / "ncu_launch"
    marlin, lora = _ncu_metrics(runs / "ncu_Marlin.log"), _ncu_metrics(runs / "ncu__fused_lora_kernel.log")
    assert len(marlin) == len(lora) == 8
    for m in marlin:
        _assert_one_block_per_sm_with_all_its_shared_memory(m)
        assert "128, 4, 4, 8" in m["header"] and m["Block Size"] == "128"
    assert all(float(k["Dynamic Shared Memory Per Block"]) == 49.15 for k in lora)


def test_thirty_ninth_sessions_gluon_lora_kernel_gate():
    """§4au, recomputed from the committed raw files: the first machine's GPU tests failed six checks (rank 16, and
    two 64-token cases under the 2-ulp check); the second's passed 42/42, and in each of its three kernel-bench runs
    the LoRA in the Gluon GEMM's epilogue is at least 0.2 ms per 7B step below Marlin with the LoRA kernel beside it
    at 8 rows (the gate), with spreads far below the difference; at 16 and 64 rows it is slower."""
    import statistics

    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "thirty-ninth"
    first = (root / "first" / "work" / "gluon_lora_test" / "stdout.log").read_text()
    assert "6 failed, 36 passed" in first and first.count("FAILED tests/vllm_ext/test_nvfp4_gluon_lora.py") == 6
    assert "42 passed" in (root / "second" / "work" / "gluon_lora_test" / "stdout.log").read_text()
    steps = [json.loads((root / "second" / "work" / f"kernels_gluon_{i}" / "bench_kernels.json").read_text())
             ["per_step_ms"] for i in (1, 2, 3)]
    diffs = [round(s["8"]["overlap_fused"] - s["8"]["gluon_lora"], 3) for s in steps]
    assert diffs == [0.253, 0.253, 0.257]
    med = {c: statistics.median(s["8"][c] for s in steps) for c in ("marlin", "overlap_fused", "gluon", "gluon_lora")}
    assert med == {"marlin": 2.183, "overlap_fused": 2.737, "gluon": 2.121, "gluon_lora": 2.484}
    assert med["overlap_fused"] - med["gluon_lora"] >= 0.2
    for c in ("overlap_fused", "gluon_lora"):
        assert max(s["8"][c] for s in steps) - min(s["8"][c] for s in steps) < min(diffs)
    for m in ("16", "64"):
        assert all(s[m]["gluon_lora"] > s[m]["overlap_fused"] for s in steps)


def test_thirty_ninth_sessions_gluon_lora_engine_run():
    """§4av, recomputed from the committed raw files: with the gluon+lora path 7B b8 decode is faster than the
    default beyond both spreads (every repeat above every repeat), the logs name the path at 8 tokens (bench) and at
    2, 4 and 8 (the check), §2's check passed 11/11, the two bias tests that failed under a one-rounding bound
    passed under the corrected one, and the final kernel code passed its 54 GPU tests."""
    run = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "thirty-ninth" / "third"
    res = {f"{r['config']}@{r['variant']}": r["batches"]["8"] for r in
           json.loads((run / "work" / "bench-gluon" / "a" / "bench_rollout.json").read_text())["results"]}
    gluon, default = res["nvfp4-lora@gluon-lora"], res["nvfp4-lora@default"]
    assert min(gluon["decode_runs_tok_s"]) > max(default["decode_runs_tok_s"])
    assert (gluon["decode_tok_s"], default["decode_tok_s"]) == (2047.81, 1997.49)
    assert round(gluon["decode_tok_s"] / default["decode_tok_s"] - 1, 3) == 0.025
    bf16, bare = res["bf16-lora@punica-lora"]["decode_tok_s"], res["nvfp4@default"]["decode_tok_s"]
    assert (round(gluon["decode_tok_s"] / bf16, 3), round(default["decode_tok_s"] / bf16, 3)) == (1.609, 1.569)
    assert (round(1 - gluon["decode_tok_s"] / bare, 3), round(1 - default["decode_tok_s"] / bare, 3)) == (0.108, 0.13)
    bench_logs = "".join(p.read_text() for p in (run / "work" / "bench-gluon" / "a" / "logs").glob("*.log"))
    assert "LoRA call with 8 tokens on the gluon+lora path" in bench_logs
    assert "stays off the gluon+lora" not in bench_logs
    check = run / "work" / "lora_r32_gluon"
    check_logs = "".join(p.read_text() for p in (check / "check_lora_correctness").glob("*.log"))
    for tokens in (2, 4, 8):
        assert f"LoRA call with {tokens} tokens on the gluon+lora path" in check_logs
    assert "ALL PASSED (11/11)" in (check / "stdout.log").read_text()
    tests = (run / "work" / "gluon_lora_test" / "stdout.log").read_text()
    assert "2 failed, 42 passed" in tests and tests.count("FAILED") == 2 and "test_gpu_bias_and_the_split" in tests
    assert "2 passed" in (run / "call32_bias_test.log").read_text()
    final = (run.parent / "fourth" / "final_gpu_tests.log").read_text()  # the kernel code after the review's refactor
    assert "54 passed" in final and "failed" not in final


def test_fortieth_sessions_raw_results():
    """§4ax, recomputed from the committed raw files: the GPU tests passed 44/44; at 7B b8 the gluon+lora path is faster
    than its exact control (decode_gemv all without the switch) beyond both spreads, and only its log names the path;
    the real-model check passes §4ao's rule with the path on down_proj only; and at 16 and 32 rows the wgmma GEMM's
    best tiles are slower than Marlin per 7B step beyond the larger spread (the 16/32-row item closed). The two calls
    sent before the machine was ready failed as lease.txt says."""
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "fortieth"
    runs = root / "work"
    assert "44 passed, 85 deselected" in (runs / "gluon_lora_test" / "stdout.log").read_text()

    bench = runs / "bench-gluonctl" / "a"
    res = {f"{r['config']}@{r['variant']}": r["batches"]["8"]
           for r in json.loads((bench / "bench_rollout.json").read_text())["results"]}
    gluon, ctl = res["nvfp4-lora@gluon-lora"], res["nvfp4-lora@decode-gemv"]
    spreads = [max(r["decode_runs_tok_s"]) - min(r["decode_runs_tok_s"]) for r in (gluon, ctl)]
    assert gluon["decode_tok_s"] - ctl["decode_tok_s"] > max(spreads)
    assert min(gluon["decode_runs_tok_s"]) > max(ctl["decode_runs_tok_s"])
    assert round(100 * (gluon["decode_tok_s"] / ctl["decode_tok_s"] - 1), 1) == 2.2
    bf16, bare = res["bf16-lora@punica-lora"]["decode_tok_s"], res["nvfp4@default"]["decode_tok_s"]
    got = {k: (round(res[k]["decode_tok_s"] / bf16, 3), round(1 - res[k]["decode_tok_s"] / bare, 3))
           for k in ("nvfp4-lora@default", "nvfp4-lora@decode-gemv", "nvfp4-lora@gluon-lora")}
    assert got == {"nvfp4-lora@default": (1.601, 0.125), "nvfp4-lora@decode-gemv": (1.592, 0.13),
                   "nvfp4-lora@gluon-lora": (1.627, 0.111)}
    logs = bench / "logs"
    assert "LoRA call with 8 tokens on the gluon+lora path" in (logs / "nvfp4-lora--gluon-lora.log").read_text()
    assert "gluon+lora" not in (logs / "nvfp4-lora--decode-gemv.log").read_text()

    ev, ce = runs / "eval_gluon", _import_script("compare_evals")
    ref, floor, cand = (ce.load(ev / f"{m}.jsonl") for m in ("shared", "shared2", "gluon"))
    log = (ev / "gluon.log").read_text()
    verdict = ce.compare(ref, floor, cand, log_text=log, paths=_eval_shared_paths("eval_gluon"))
    assert verdict["verdict"] == "pass" and verdict["accuracy"] == {"reference": 0.78, "floor": 0.78, "candidate": 0.77}
    assert (verdict["differ_reference_floor"], verdict["rows_differing"]) == (0, [17, 84, 112])
    assert json.loads((ev / "compare.json").read_text())["verdict"] == "pass"
    for tokens in (2, 4, 8):
        assert f"LoRA call with {tokens} tokens on the gluon+lora path" in log
    assert "one-row calls of 3072 x 576 weights stay on Marlin" in log  # gate/up's 1-token steps: not as in shared
    assert "qkv_proj stays off the gluon+lora path (the layer has no copy" in log

    sweep = [json.loads(line) for line in (runs / "sweep_wgmma" / "sweep_wgmma.jsonl").read_text().splitlines()]
    step = {r["rows"]: r for r in sweep if r["what"] == "per_step_ms"}
    for rows, (mma, marlin) in {16: (2.539, 2.477), 32: (3.062, 2.765)}.items():
        med, spread = step[rows]["median"], step[rows]["spread"]
        assert (med["mma"], med["marlin"]) == (mma, marlin)
        assert med["mma"] - med["marlin"] > max(spread["mma"], spread["marlin"]), rows
    assert "tiles refused (error beyond the bf16 rounding, or not the same bits twice): 0" in (
        runs / "sweep_wgmma" / "stdout.log").read_text()

    calls = root / "calls"
    assert "checksum did NOT match" in (calls / "call12_smol.log").read_text()
    assert (calls / "call13_bench_bg.log").read_text().count("No module named 'vllm'") >= 5


def test_fortieth_sessions_marlin_layout_sweep():
    """§4ay, recomputed from the committed raw files: every one of the 72 swept tile runs of the wgmma GEMM on Marlin's
    tensors was correct (within the bound, the same bits twice), its 18 GPU tests passed, and per 7B step at 8 rows its
    best tiles are slower than the checkpoint layout at tile_for's tiles beyond the larger spread, on every linear; the
    exploratory second sweep likewise."""
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "fortieth-b"
    assert "18 passed" in (root / "call1" / "gpu_tests.log").read_text()
    for call, (mma, ckpt), tiles in (("call1", (2.681, 2.243), 72), ("call2", (2.713, 2.238), 48)):
        recs = [json.loads(line) for line in (root / call / "sweep_wgmma-marlin.jsonl").read_text().splitlines()]
        swept = [r for r in recs if r["what"] == "tile"]
        assert len(swept) == tiles and all(r["ok"] for r in swept), call
        finals = [r for r in recs if r["what"] == "final"]
        assert len(finals) == 4 and all(r["mma_vs_ckpt"] == "slower" and r["tile"].endswith("HQ") for r in finals)
        step = next(r for r in recs if r["what"] == "per_step_ms")
        assert (step["median"]["mma"], step["median"]["ckpt"]) == (mma, ckpt)
        assert step["median"]["mma"] - step["median"]["ckpt"] > max(step["spread"]["mma"], step["spread"]["ckpt"])
        if call == "call1":
            assert round(100 * (step["median"]["mma"] / step["median"]["ckpt"] - 1), 1) == 19.5


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_forty_first_session_marlin_layout_and_tma():
    """§4ba calls 1 and 2, from the committed raw files: the Marlin-layout GEMM's leaner loop is correct (18 tests, 72
    tile runs) but 0.251 ms per 7B step above the checkpoint layout at 8 rows, beyond the 0.1 allowed (closed); the TMA
    row kernel is correct (6 tests, 1 296 tile runs) and slower than the shipped row kernel on every linear."""
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "forty-first"
    assert re.search(r"\b18 passed", (root / "call1" / "gpu_tests.log").read_text())
    recs = _jsonl(root / "call1" / "sweep_wgmma-marlin.jsonl")
    assert sum(1 for r in recs if r["what"] == "tile" and r["ok"]) == 72
    step = next(r for r in recs if r["what"] == "per_step_ms")
    assert (step["median"]["mma"], step["median"]["ckpt"]) == (2.533, 2.282)
    assert step["median"]["mma"] - step["median"]["ckpt"] > 0.1 + max(step["spread"].values())
    assert re.search(r"\b6 passed", (root / "call2" / "gpu_tests.log").read_text())
    recs = _jsonl(root / "call2" / "sweep_row_tma.jsonl")
    tiles = [r for r in recs if r["what"] == "tile"]
    assert len(tiles) == 1296 and all(r["ok"] for r in tiles)
    assert all(r["best_vs_shipped"] == "slower" for r in recs if r["what"] == "final")
    steps = {r["shape"]: r["median"] for r in recs if r["what"] == "per_step_ms"}
    assert (steps["7B"]["best"], steps["7B"]["shipped"], steps["32B"]["best"], steps["32B"]["shipped"]) == (
        1.885, 1.751, 7.673, 7.177)


def test_forty_first_session_what_limits_the_row_kernel():
    """§4ba calls 3-7: the probe (loads alone 26 % under the whole loop per 7B step; its full mode within float32
    sums of the exact product), Nsight Compute (gate/up issuing in 77 % of cycles, the ALU busiest; the Gluon kernel
    in 53-54 %), the Gluon register kernel slower at one row, and the decode through FP8 10.1 % faster in the probe,
    correct."""
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "forty-first"
    recs = _jsonl(root / "call3" / "probe_row_limit.jsonl")
    step = next(r for r in recs if r["what"] == "per_step_ms" and r["shape"] == "7B")["median"]
    assert (step["full"], step["loads"], step["words"]) == (1.791, 1.319, 1.091)
    assert round(100 * (1 - step["loads"] / step["full"]), 1) == 26.4
    assert all(r["full_ok"] for r in recs if r["what"] == "final")
    ncu = (root / "call4" / "ncu.txt").read_text()
    busy = [float(v) for v in re.findall(r"Issue Slots Busy\s+%\s+([\d.]+)", ncu)]
    assert busy == [54.26, 41.97, 76.68, 58.96]  # q/k/v, o, gate/up, down
    recs = _jsonl(root / "call5" / "sweep_gluon.jsonl")
    assert not any(r["what"] == "tile" and not r["ok"] for r in recs)
    step = next(r for r in recs if r["what"] == "per_step_ms")
    assert (step["median"]["mma"], step["median"]["row"]) == (1.98, 1.76)
    assert all(r["mma_vs_row"] == "slower" for r in recs if r["what"] == "final")
    ncu = (root / "call6" / "ncu.txt").read_text()
    kernels = re.findall(r"^  (_\w+_kernel) ", ncu, flags=re.M)
    busy = [float(v) for v in re.findall(r"Issue Slots Busy\s+%\s+([\d.]+)", ncu)]
    alu = [float(v) for v in re.findall(r"ALU is the highest-utilized pipeline \(([\d.]+)%\)", ncu)]
    assert kernels == ["_nvfp4_row_kernel"] * 2 + ["_gluon_kernel"] * 2
    assert busy == [77.08, 76.56, 52.85, 53.93] and all(66 <= a <= 69 for a in alu)
    recs = _jsonl(root / "call7" / "probe_row_limit.jsonl")
    step = next(r for r in recs if r["what"] == "per_step_ms" and r["shape"] == "7B")
    assert (step["median"]["fp8"], step["median"]["full"]) == (1.615, 1.797)
    assert step["median"]["full"] - step["median"]["fp8"] > max(step["spread"]["fp8"], step["spread"]["full"])
    assert 1 - step["median"]["fp8"] / step["median"]["full"] >= 0.05
    assert all(r["full_ok"] for r in recs if r["what"] == "final")


def test_forty_first_session_fp8_decode_in_the_kernels_and_engines():
    """§4ba calls 8, 10 and the engines: the same bits with either decode in every kernel, and the verdicts per step
    (row faster at 7B and 32B, shared equal at 7B and faster at 32B); the two gate/up tiles SWEPT_TILES took, faster
    than the tiles before beyond both spreads; the 7B b1 engines level (the spread rule), with the f16 variant's
    environment recorded, and the BF16 row on qerl's overlap LoRA."""
    from vllm_ext.nvfp4_marlin_row import SWEPT_TILES

    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "forty-first"
    log = (root / "call8" / "gpu_tests.log").read_text()
    assert re.search(r"\b18 passed", log) and re.search(r"\b15 passed", log)
    recs = _jsonl(root / "call8" / "bench_decode.jsonl")
    finals = [r for r in recs if r["what"] == "final"]
    assert len(finals) == 8 and all(all(r["same_bits"].values()) for r in finals)
    steps = {r["shape"]: r for r in recs if r["what"] == "per_step_ms"}
    assert [_step_verdict(steps[s], f"{k}_fp8", f"{k}_f16") for s in ("7B", "32B") for k in ("row", "shared")] == [
        "faster", "equal", "faster", "faster"]
    assert (steps["7B"]["median"]["row_fp8"], steps["7B"]["median"]["row_f16"]) == (1.631, 1.724)
    recs = _jsonl(root / "call10" / "sweep_marlin_row.jsonl")
    assert not any(r["what"] == "tile" and not r.get("ok") for r in recs)
    taken = {(r["n"], r["k"]): r for r in recs if r["what"] == "final" and r["best_vs_rule"] == "faster"}
    assert set(taken) == {(37888, 3584), (55296, 5120)}
    tiles = json.loads((root / "call10" / "marlin_row_tiles.json").read_text())
    for (n, k), r in taken.items():
        t = tiles[f"{n},{k}"]
        assert SWEPT_TILES[(n, k)] == (t["hb"], t["t"], t["split_k"], t["num_warps"], t["stages"], t["asum"])
    bench = json.loads((root / "engines" / "bench-dec" / "a" / "bench_rollout.json").read_text())
    res = {f"{r['config']}@{r['variant']}": r for r in bench["results"]}
    new, old = (res[f"nvfp4-lora@{v}"]["batches"] for v in ("default", "row-decode-f16"))
    assert (new["1"]["decode_tok_s"], old["1"]["decode_tok_s"]) == (302.21, 303.11)
    assert _verdict_tok_s(new, old, "1") == "equal"  # level
    assert res["nvfp4-lora@row-decode-f16"]["env"]["QERL_ROW_DECODE"] == "f16"
    assert "QERL_ROW_DECODE" not in res["nvfp4-lora@default"]["env"]
    log = (root / "engines" / "bench-dec" / "a" / "logs" / "bf16-lora--default.log").read_text()
    assert "LoRA linears on the overlap path" in log  # not punica: the 1.46x is not the issue's ratio


def _step_verdict(step: dict, a: str, b: str) -> str:
    """The spread rule on a per_step_ms record: ``a`` against ``b``."""
    med, spr = step["median"], step["spread"]
    diff = med[b] - med[a]
    return "equal" if abs(diff) <= max(spr[a], spr[b]) + 1e-9 else ("faster" if diff > 0 else "slower")


def test_forty_second_session_hfma2_kernel():
    """§4bc calls 1-5, from the committed raw files: call 1 (no tile refused; the best hfma2 tiles faster per 7B step
    by >= 5 % beyond both spreads, the tiles decode_tile held for hfma2 until the mode was removed); call 2 (5 tests
    failed: no claim); calls 3 and 5 (every test passed, no output worse than the bfloat16 weight's, row_hfma2 faster
    than row_fp8 at 7B and 32B); call 4 (the shared path failed its bound on 7B down: taken out); call 5 (the
    fallback's cost: unguarded faster)."""
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "forty-second"
    recs = _jsonl(root / "call1" / "sweep_row_hfma2.jsonl")
    tiles = [r for r in recs if r["what"] == "tile"]
    assert len(tiles) == 768 and all(r["ok"] and r["max_err"] <= r["ref_err"] for r in tiles)
    step = next(r for r in recs if r["what"] == "per_step_ms" and r["shape"] == "7B")
    assert (step["median"]["best"], step["median"]["shipped"]) == (1.466, 1.661)
    assert _step_verdict(step, "best", "shipped") == "faster" and step["median"]["best"] <= 0.95 * 1.661
    # decode_tile(n, k, hfma2=True) until the mode was removed (§4bl; ad45c71 has it): (block_n, split_k, warps, stages)
    hfma2_tiles = {"7B": {"qkv": (4, 1, 1, 4), "o": (4, 1, 1, 4), "gate_up": (32, 1, 2, 3), "down": (8, 4, 2, 3)},
                   "32B": {"qkv": (16, 1, 1, 3), "o": (4, 1, 1, 4), "gate_up": (32, 1, 2, 3), "down": (8, 4, 1, 3)}}
    finals = [r for r in recs if r["what"] == "final"]
    assert len(finals) == 8
    for r in finals:
        bn, sk, w, st = hfma2_tiles[r["shape"]][r["linear"]]
        assert r["best_tile"] == f"n{bn}k512s{sk}w{w}WAX2S{st}", (r["shape"], r["linear"])
    assert re.search(r"5 failed, 35 passed", (root / "call2" / "gpu_tests.log").read_text())
    for call in ("call3", "call5"):
        assert re.search(r"\b40 passed", (root / call / "gpu_tests.log").read_text())
        assert re.search(r"\b15 passed", (root / call / "gpu_tests_row.log").read_text())
        recs = _jsonl(root / call / "bench_decode.jsonl")
        finals = [r for r in recs if r["what"] == "final"]
        assert len(finals) == 8 and all(all(r["same_bits"].values()) for r in finals)
        assert all(r["max_err"]["hfma2" if call == "call3" else "row_hfma2"] <= r["max_err"]["bf16_weight"]
                   for r in finals)
        steps = {r["shape"]: r for r in recs if r["what"] == "per_step_ms"}
        assert [_step_verdict(steps[s], "row_hfma2", "row_fp8") for s in ("7B", "32B")] == ["faster", "faster"]
    assert (steps["7B"]["median"]["row_hfma2"], steps["7B"]["median"]["row_fp8"]) == (1.523, 1.641)
    assert _step_verdict(steps["7B"], "row_hfma2-unguarded", "row_hfma2") == "faster"
    assert steps["7B"]["median"]["row_hfma2-unguarded"] == 1.454  # 4.5 % under row_hfma2's 1.523
    log = (root / "call4" / "gpu_tests.log").read_text()
    assert re.search(r"1 failed, 45 passed", log)
    assert "test_gpu_shared_op_is_no_worse_than_the_bfloat16_weight[3584-18944]" in log
    assert "(0.033123650755943146, 0.029376349244056854)" in log


def test_forty_second_session_hfma2_engines():
    """§4bc's engines (7B b1, H200): the hfma2 engine decoded with QERL_ROW_DECODE=hfma2 in its environment and
    decode_gemv all; level with decode-gemv by the spread rule, faster than the default; BF16 on punica."""
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "forty-second" / "engines" / "bench-h2"
    bench = json.loads((root / "a" / "bench_rollout.json").read_text())
    res = {f"{r['config']}@{r['variant']}": r for r in bench["results"]}
    h2, gemv, default, bf16 = (res[k]["batches"] for k in ("nvfp4-lora@decode-gemv+row-hfma2",
                                                             "nvfp4-lora@decode-gemv", "nvfp4-lora@default",
                                                             "bf16-lora@punica-lora"))
    assert [r["1"]["decode_tok_s"] for r in (h2, gemv, default, bf16)] == [331.61, 316.27, 307.19, 152.3]
    assert _verdict_tok_s(h2, gemv, "1") == "equal"  # level
    assert _verdict_tok_s(h2, default, "1") == "faster"
    assert round(h2["1"]["decode_tok_s"] / bf16["1"]["decode_tok_s"], 3) == 2.177
    assert res["nvfp4-lora@decode-gemv+row-hfma2"]["env"]["QERL_ROW_DECODE"] == "hfma2"
    log = (root / "a" / "logs" / "nvfp4-lora--decode-gemv_row-hfma2.log").read_text()
    assert "decode_gemv all: one-row calls of 37888 x 3584 weights run on qerl's row kernel" in log
    assert "LoRA call with 1 tokens on the row+lora path" in log
    log = (root / "a" / "logs" / "bf16-lora--punica-lora.log").read_text()
    assert "overlap path" not in log


def test_decode_env_sets_and_restores_the_mode(monkeypatch):
    """check_gemv.decode_env (bench_decode): QERL_ROW_DECODE is the mode inside the block and as it was after it,
    whether it was unset or set, and after an exception too."""
    decode_env = _import_script("check_gemv").decode_env
    monkeypatch.delenv("QERL_ROW_DECODE", raising=False)
    with decode_env("f16"):
        assert os.environ["QERL_ROW_DECODE"] == "f16"
    assert "QERL_ROW_DECODE" not in os.environ
    monkeypatch.setenv("QERL_ROW_DECODE", "f16")
    with pytest.raises(RuntimeError, match="inside"), decode_env("fp8"):
        assert os.environ["QERL_ROW_DECODE"] == "fp8"
        raise RuntimeError("inside")
    assert os.environ["QERL_ROW_DECODE"] == "f16"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the message of a machine without a CUDA GPU")
def test_decode_timings_refuse_a_machine_without_a_gpu(capsys, monkeypatch):
    """bench_decode.py, through check_gemv.fp8_decode_device: exit 1 and a message naming the script on a machine
    without a CUDA GPU, QERL_ROW_DECODE left as it was."""
    monkeypatch.setenv("QERL_ROW_DECODE", "f16")
    assert _import_script("check_gemv").fp8_decode_device("x") is None
    assert _import_script("bench_decode").main(["--out", "/nonexistent"]) == 1
    assert "bench_decode: needs a CUDA GPU" in capsys.readouterr().err
    assert os.environ["QERL_ROW_DECODE"] == "f16"


def _assert_gpu_tests_passed(root: Path, logs: dict[str, int]) -> None:
    """Each pytest log under ``root`` (relative path -> tests passed) ends with that many passed, some deselected,
    exit status 0 (a line ``rc=0`` from the device command) and no failure or error."""
    for log, passed in logs.items():
        text = (root / log).read_text()
        assert re.search(rf"^{passed} passed, \d+ deselected", text, re.M), log
        assert re.search(r"^rc=0\b", text, re.M) and not re.search(r"\b(failed|error)", text), log


def test_forty_third_session_guard_and_two_chains():
    """§4be, from the committed raw files. Call 1: every GPU test passed, no output worse than the bfloat16 weight's
    or unequal where it should be equal; the one-loop guard's gap 2.37 % per 7B step (above the 2.25 % asked: fail);
    shared with two chains slower than FP8 (fail). Call 2: the one-loop fallback level with the nested one per 7B step
    (so the nested loops came back), faster per 32B step. The final tree's GPU tests passed."""
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "forty-third"
    _assert_gpu_tests_passed(root, {"call1/gpu_tests.log": 48, "call1/gpu_tests_row.log": 15,
                                    "final-tests/final_gpu_tests.log": 42, "final-tests-2/final_gpu_tests.log": 42})
    recs = _jsonl(root / "call1" / "bench_decode.jsonl")
    finals = [r for r in recs if r["what"] == "final"]
    assert len(finals) == 8 and all(all(r["same_bits"].values()) for r in finals)
    assert all(r["max_err"][k] <= r["max_err"]["bf16_weight"] for r in finals for k in ("row_hfma2", "shared_hfma2"))
    steps = {r["shape"]: r for r in recs if r["what"] == "per_step_ms"}
    med = steps["7B"]["median"]
    assert (med["row_hfma2"], med["row_hfma2-unguarded"]) == (1.479, 1.444)
    assert round(100 * (med["row_hfma2"] - med["row_hfma2-unguarded"]) / med["row_hfma2"], 2) == 2.37 > 2.25
    assert [_step_verdict(steps[s], "row_hfma2", "row_fp8") for s in ("7B", "32B")] == ["faster", "faster"]
    assert _step_verdict(steps["7B"], "shared_hfma2", "shared_fp8") == "slower"
    assert (med["shared_hfma2"], med["shared_fp8"]) == (2.002, 1.802)
    recs = _jsonl(root / "call2" / "ab_row_fallback.jsonl")
    assert all(all(r["same_bits_as_flat"].values()) for r in recs if r["what"] == "final")
    steps = {r["shape"]: r for r in recs if r["what"] == "per_step_ms"}
    assert (steps["7B"]["median"]["flat"], steps["7B"]["median"]["nested"]) == (1.493, 1.529)
    assert [_step_verdict(steps[s], "flat", "nested") for s in ("7B", "32B")] == ["equal", "faster"]


def test_forty_third_session_32b_engines():
    """§4be's 32B engines at batch 1 (H200, random weights, LoRA r32): hfma2 (decode_gemv all) faster than the
    default (shared) by the spread rule, 2.309x and 2.197x BF16 + punica; in call 3's run hfma2 faster than the FP8
    row kernel with the same copy, by 0.9 %. Call 4's diagnostic: the row op alone gains far more from hfma2 than the
    row+lora path that the engine runs."""
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "forty-third"

    def engines(sub: str) -> dict:
        bench = json.loads((root / sub / "a" / "bench_rollout.json").read_text())
        return {f"{r['config']}@{r['variant']}": r for r in bench["results"]}

    res = engines("engines-32b/bench-32bh")
    h2, default, bf16 = (res[k]["batches"] for k in ("nvfp4-lora@decode-gemv+row-hfma2", "nvfp4-lora@default",
                                                       "bf16-lora@punica-lora"))
    assert [r["1"]["decode_tok_s"] for r in (h2, default, bf16)] == [103.34, 98.34, 44.76]
    assert _verdict_tok_s(h2, default, "1") == "faster"
    assert [round(r["1"]["decode_tok_s"] / bf16["1"]["decode_tok_s"], 3) for r in (h2, default)] == [2.309, 2.197]
    assert res["nvfp4-lora@decode-gemv+row-hfma2"]["env"]["QERL_ROW_DECODE"] == "hfma2"
    log = (root / "engines-32b" / "bench-32bh" / "a" / "logs" / "nvfp4-lora--decode-gemv_row-hfma2.log").read_text()
    assert "decode_gemv all: one-row calls of 55296 x 5120 weights run on qerl's row kernel" in log
    assert "LoRA call with 1 tokens on the row+lora path" in log
    g_h2, g_def = (res[k]["greedy"] for k in ("nvfp4-lora@decode-gemv+row-hfma2", "nvfp4-lora@default"))
    assert g_h2["tokens"] == g_def["tokens"] and [len(t) for t in g_h2["tokens"]] == [32] * 4
    assert g_h2["chosen_logprobs"] == g_def["chosen_logprobs"]
    res = engines("call3-32b/bench-32bg")
    h2, gemv = (res[k]["batches"] for k in ("nvfp4-lora@decode-gemv+row-hfma2", "nvfp4-lora@decode-gemv"))
    assert [r["1"]["decode_tok_s"] for r in (h2, gemv)] == [103.31, 102.41]
    assert _verdict_tok_s(h2, gemv, "1") == "faster"
    assert round(100 * (103.31 / 102.41 - 1), 1) == 0.9
    assert len({res[k]["memory"]["weights_bytes"] for k in res}) == 1  # the same copy in both
    steps = {m: json.loads((root / "call4-diag" / m / "check_row_lora.json").read_text())["steps"]
             for m in ("fp8", "hfma2")}
    row = [steps[m]["row"]["median_ms"] for m in ("fp8", "hfma2")]
    lora = [steps[m]["row_lora_pdl"]["median_ms"] for m in ("fp8", "hfma2")]
    assert (row, lora) == ([6.5643, 5.9762], [7.4961, 7.3623])
    assert row[0] - row[1] > 4 * (lora[0] - lora[1])



def test_forty_fourth_session_fallback_and_row_lora_sweep():
    """§4bg calls 1-2, from the committed raw files: every GPU test passed; the one-loop fallback level with the nested
    one per 7B step (closed), faster per 32B step; the row+lora sweep refused no hfma2 tile, every tile's largest error
    the FP8 path's, the FP8 path itself outside the first bound on 32B q/k/v only (inside the widened one); the gate
    passed at both shapes (recomputed here by its rule, §4bf item 2); row_tile's hfma2 tiles, until the mode was
    removed, were the best tiles where they beat the tiles then shipped, and those tiles elsewhere."""
    # nvfp4_gemv_lora.row_tile(n, k, slices=..., hfma2=True) until the mode was removed (§4bl; ad45c71 has it):
    # (block_n, split_k, warps, stages), block_k 512
    hfma2_lora_tiles = {"7B": {"qkv": (4, 1, 1, 4), "o": (4, 1, 1, 4), "gate_up": (16, 1, 2, 3), "down": (16, 4, 1, 3)},
                        "32B": {"qkv": (4, 1, 1, 4), "o": (4, 1, 1, 4), "gate_up": (32, 1, 2, 3),
                                "down": (16, 4, 1, 3)}}
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "forty-fourth"
    _assert_gpu_tests_passed(root, {"call1/gpu_tests.log": 30, "call3-tests/gpu_tests.log": 31,
                                    "final-tests/final_gpu_tests.log": 56, "logcheck/gpu_tests.log": 21})
    assert (root / "logcheck" / "log.txt").read_text().count("qerl: QERL_ROW_DECODE=hfma2 on cuda:0") == 1
    recs = _jsonl(root / "call1" / "ab_row_fallback.jsonl")
    assert recs[0]["labels"] == ["nested", "flat"] and recs[0]["fallback_only"]
    assert all(all(r["same_bits_as_nested"].values()) for r in recs if r["what"] == "final")
    steps = {r["shape"]: r for r in recs if r["what"] == "per_step_ms"}
    assert (steps["7B"]["median"]["nested"], steps["7B"]["median"]["flat"]) == (1.523, 1.489)
    assert [_step_verdict(steps[s], "nested", "flat") for s in ("7B", "32B")] == ["equal", "slower"]
    per_linear = [r["nested_vs_flat"] for r in recs if r["what"] == "final"]
    assert (per_linear.count("slower"), per_linear.count("equal")) == (5, 3)
    first, second = _jsonl(root / "call1" / "sweep_row_lora.jsonl"), _jsonl(root / "call2" / "sweep_row_lora.jsonl")
    refused = [(r["shape"], r["linear"]) for r in first if r.get("mode") == "fp8_shipped" and not r["ok"]]
    assert refused == [("32B", "qkv")]
    fp8 = {(r["shape"], r["linear"]): r for r in first + second if r.get("mode") == "fp8_shipped"}  # call 2's at 32B
    assert all(r["ok"] for r in fp8.values()) and fp8[("32B", "qkv")]["max_err"] == 0.03249255103151949
    first_bound = next(r["ref_err"] for r in first
                       if r["what"] == "linear" and (r["shape"], r["linear"]) == ("32B", "qkv"))
    assert round(first_bound, 4) == 0.0303  # every 32B q/k/v tile (call 2) passed only under the widened bound
    qkv = [r for r in second if r.get("linear") == "qkv" and "max_err" in r]
    assert len(qkv) == 97 and all(first_bound < r["max_err"] <= r["ref_err"] for r in qkv)
    for recs, shape in ((first, "7B"), (second, "32B")):
        mine = [r for r in recs if r.get("shape") == shape]
        tiles = [r for r in mine if r.get("mode") == "hfma2" and r["what"] == "tile"]
        assert len(tiles) == 4 * 96 and all(r["ok"] for r in tiles)
        assert all(r["max_err"] == fp8[(shape, r["linear"])]["max_err"] for r in tiles)  # the check ranks nothing
        step = next(r for r in mine if r["what"] == "per_step_ms")
        # §4bf item 2's gate: best at least 5 % under fp8 per step, by more than both spreads
        fp8_ms, best_ms = step["median"]["fp8"], step["median"]["best"]
        saved, margin = fp8_ms - best_ms, max(step["spread"]["fp8"], step["spread"]["best"])
        got = {"saved_ms": round(saved, 4), "saved_fraction": round(saved / fp8_ms, 4),
               "beyond_spreads": saved > margin, "pass": saved >= 0.05 * fp8_ms and saved > margin}
        assert got["pass"] and got == {k: v for k, v in next(r for r in mine if r["what"] == "gate").items()
                                       if k in got}
        assert round(got["saved_fraction"], 3) == {"7B": 0.125, "32B": 0.132}[shape]
        for fin in (r for r in mine if r["what"] == "final"):
            lin = next(r for r in mine if r["what"] == "linear" and r["linear"] == fin["linear"])
            want = fin["best_tile"] if fin["best_vs_hfma2"] == "faster" else lin["shipped"]["hfma2"]
            bn, sk, w, st = hfma2_lora_tiles[shape][fin["linear"]]
            assert {k: v for k, v in want.items() if v or k != "stages"} == {
                "block_n": bn, "block_k": 512, "split_k": sk, "num_warps": w, "stages": st}, fin["linear"]
        assert sum(f["best_vs_hfma2"] == "faster" for f in mine if f["what"] == "final") == 2


def test_forty_fourth_session_engines():
    """§4bg's engines at batch 1 (H200, random weights, LoRA r32, one run per shape): hfma2 with the new row+lora tiles
    faster than FP8 (both decode_gemv all, the same copy) at 32B (planned) and 7B (added), 2.508x and 2.234x BF16 +
    punica; the same greedy tokens; the hfma2 engine ran the row+lora path at one token."""
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "forty-fourth"
    want = {"32b": ([109.83, 100.1, 43.79], [2.508, 2.286]), "7b": ([340.82, 303.02, 152.53], [2.234, 1.987])}
    for shape, (tok_s, ratios) in want.items():
        bench = json.loads((root / f"engines-{shape}" / f"bench-{shape}i" / "a" / "bench_rollout.json").read_text())
        res = {f"{r['config']}@{r['variant']}": r for r in bench["results"]}
        keys = ("nvfp4-lora@decode-gemv+row-hfma2", "nvfp4-lora@decode-gemv", "bf16-lora@punica-lora")
        h2, fp8, bf16 = (res[k]["batches"] for k in keys)
        assert [r["1"]["decode_tok_s"] for r in (h2, fp8, bf16)] == tok_s
        assert _verdict_tok_s(h2, fp8, "1") == "faster"
        assert [round(r["1"]["decode_tok_s"] / bf16["1"]["decode_tok_s"], 3) for r in (h2, fp8)] == ratios
        assert res[keys[0]]["env"]["QERL_ROW_DECODE"] == "hfma2" and "QERL_ROW_DECODE" not in res[keys[1]]["env"]
        assert res[keys[0]]["memory"]["weights_bytes"] == res[keys[1]]["memory"]["weights_bytes"]
        assert res[keys[0]]["greedy"]["tokens"] == res[keys[1]]["greedy"]["tokens"]
        log = (root / f"engines-{shape}" / f"bench-{shape}i" / "a" / "logs" / "nvfp4-lora--decode-gemv_row-hfma2.log")
        assert "LoRA call with 1 tokens on the row+lora path" in log.read_text()

def _eval_shared_paths(name: str = "eval_shared") -> list[str]:
    """The ``--path`` texts that session.sh's eval_shared step (or ``name``) hands compare_evals.py through
    ``eval_check``."""
    return _eval_check_call(name)[5:]


def _eval_lines(path: Path, answers: list[tuple[str, bool]]) -> Path:
    """``qerl eval``'s per-example lines (its own record functions) for responses ``answers`` (text, correct)."""
    from qerl_plugin.evaluate import _record
    from qerl_plugin.evaluate_inputs import Example
    from qerl_plugin.evaluate_metrics import Completion, Scored

    lines = []
    for row, (text, ok) in enumerate(answers):
        ex = Example(row=row, data_source="arith", messages=[{"role": "user", "content": f"q{row}"}], ground_truth="1")
        scored = Scored(Completion(text=text, num_tokens=3, truncated=False), score=float(ok), correct=ok, pred=text)
        lines.append(json.dumps(_record(ex, scored, None)))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_compare_evals_judges_a_candidate_against_the_run_to_run_floor(tmp_path, capsys):
    """§4ao's real-model check: pass within 0.05 accuracy and at most 2x the floor's differing responses + 4; fail
    beyond either; void where the candidate's log does not name the path under test; exit codes 0 / 1 / 3."""
    ce = _import_script("compare_evals")
    ref = [(f"#### {i}", i % 5 != 0) for i in range(100)]  # accuracy 0.8
    floor = [("other", ok) if i in (3, 7) else (t, ok) for i, (t, ok) in enumerate(ref)]  # 2 differ
    close = [("else", ok) if i < 8 else (t, ok) for i, (t, ok) in enumerate(ref)]  # 8 differ <= 2*2+4, same accuracy
    many = [("else", ok) if i < 9 else (t, ok) for i, (t, ok) in enumerate(ref)]  # 9 differ
    worse = [(t, False) if i < 6 and ok else (t, ok) for i, (t, ok) in enumerate(ref)]  # accuracy 0.76, 0 differ
    edge = [(t, False) if i < 7 and ok else (t, ok) for i, (t, ok) in enumerate(ref)]  # 0.75: exactly 0.05 below
    files = {name: _eval_lines(tmp_path / f"{name}.jsonl", rows)
             for name, rows in (("ref", ref), ("floor", floor), ("close", close), ("many", many), ("worse", worse),
                                ("edge", edge))}
    got = ce.compare(ce.load(files["ref"]), ce.load(files["floor"]), ce.load(files["close"]))
    assert got["verdict"] == "pass" and got["differ_reference_floor"] == 2 and got["allowed_differ"] == 8
    assert got["accuracy"] == {"reference": 0.8, "floor": 0.8, "candidate": 0.8}
    assert ce.compare(ce.load(files["ref"]), ce.load(files["floor"]), ce.load(files["many"]))["verdict"] == "fail"
    strict = ce.compare(ce.load(files["ref"]), ce.load(files["floor"]), ce.load(files["worse"]), max_acc_diff=0.03)
    assert strict["verdict"] == "fail" and "accuracy 0.760 against 0.800" in strict["why"]
    # 0.80 - 0.75 is 0.0500000000000000044 in floats: the line is drawn on counts, 5 of 100 allowed
    assert ce.compare(ce.load(files["ref"]), ce.load(files["floor"]), ce.load(files["edge"]))["verdict"] == "pass"
    log = tmp_path / "close.log"
    log.write_text("WARNING:qerl.vllm.lora_dense:qerl: LoRA call with 1 tokens on the overlap path\n")
    argv = ["--reference", str(files["ref"]), "--floor", str(files["floor"]), "--candidate", str(files["close"])]
    assert ce.main([*argv, "--candidate-log", str(log), "--path", "on the row+lora path"]) == 3
    assert '"verdict": "void"' in capsys.readouterr().out
    log.write_text("WARNING:qerl.vllm.lora_dense:qerl: LoRA call with 1 tokens on the row+lora path\n")
    out = tmp_path / "compare.json"
    both = ["--path", "on the row+lora path", "--path", "3072 x 576 weights run on qerl's row kernel"]
    assert ce.main([*argv, "--candidate-log", str(log), *both]) == 3  # the second family's layer: not in the log
    log.write_text(log.read_text() + "nvfp4: decode_gemv shared: one-row calls of 3072 x 576 weights run on qerl's "
                   "row kernel\n")
    assert ce.main([*argv, "--candidate-log", str(log), *both, "--out", str(out)]) == 0
    assert all(json.loads(out.read_text())["paths_seen"].values())
    assert ce.main(["--reference", str(files["ref"]), "--floor", str(files["floor"]), "--candidate",
                    str(files["many"])]) == 1
    short = _eval_lines(tmp_path / "short.jsonl", ref[:50])
    with pytest.raises(SystemExit, match="cover different examples"):
        ce.compare(ce.load(files["ref"]), ce.load(files["floor"]), ce.load(short))


def test_the_smollm2_shapes_gpu_tests_passed_in_the_thirty_sixth_sessions_second_call_set():
    """§4an call set B: the GPU tests of the row and row+lora kernels, with SmolLM2's gate/up (Marlin's second unpadded
    family) and down among them: 19 passed where §4an's run of the same files had 17 (the quiet log names no test;
    session.sh marlin_row_test now passes -rA)."""
    runs = ROOT / "docs" / "gpu-runs" / "2026-11-29"
    log = (runs / "thirty-sixth-b" / "marlin_row_test" / "stdout.log").read_text()
    assert "19 passed" in log and "failed" not in log
    assert "17 passed" in (runs / "thirty-sixth" / "work" / "marlin_row_test" / "stdout.log").read_text()


@pytest.mark.parametrize("name", ["bench_gluon_lora", "bench_gluon_ctl"])
def test_gluon_bench_steps_name_configs_and_variants_that_exist(name):
    """§4av's and §4aw's engine benches: their BENCH_ARGS parse with bench_rollout's own parser, every config and
    variant exists, and every ``--runs`` entry is one of the config × variant pairs asked for."""
    import shlex

    from vllm_ext.bench import CONFIGS, VARIANTS, add_arguments

    text = (GPU / "session.sh").read_text()
    start = text.index(f"    {name})")
    step = text[start:text.index(";;", start)]
    bench_args = step[step.index('BENCH_ARGS="') + len('BENCH_ARGS="'):]
    bench_args = bench_args[:bench_args.index('"')].replace("\\\n", "")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["rollout", *shlex.split(bench_args)])  # bench_rollout.py's default subcommand
    assert set(args.configs) <= set(CONFIGS) and set(args.variants) <= set(VARIANTS)
    assert args.batches == [8] and args.repeats == 3
    for run in args.runs:
        config, variant = run.split("@")
        assert config in args.configs and variant in args.variants, run


def test_forty_fifth_session_hfma2_on_a_real_model():
    """§4bi, from the committed raw files. Item 1: the three SmolLM2 runs recomputed with compare_evals (not void: the
    hfma2 log names the method, the row+lora path and the mode; the FP8 logs lack the mode's warning): the same
    accuracy, a floor of 0, 6 responses differing where 4 are allowed, so fail. Item 2: 273 GPU tests passed, none
    failed; the skip lines are the two-GPU test (planned) and the humming tests (not planned: item 2 did not pass by
    its criterion, §4bi). The refactor's smoke run exited 0 twice. The diagnostic's reading
    recomputed from its per-layer maxima: beyond on layer 26 only, no input beyond float16."""
    ce = _import_script("compare_evals")
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "forty-fifth"
    ev = root / "machine1" / "eval_hfma2"
    runs = {m: ce.load(ev / f"{m}.jsonl") for m in ("all", "all2", "hfma2")}
    # the --path texts of session.sh's eval_hfma2 step (removed with the mode, §4bl; ad45c71 has it)
    paths = ["qerl's nvfp4 method on the NVFP4A16", "on the row+lora path", "QERL_ROW_DECODE=hfma2 on cuda:0"]
    out = ce.compare(runs["all"], runs["all2"], runs["hfma2"], log_text=(ev / "hfma2.log").read_text(), paths=paths)
    assert out["verdict"] == "fail" and out["accuracy"] == {"reference": 0.775, "floor": 0.775, "candidate": 0.775}
    assert (out["differ_reference_floor"], out["differ_reference_candidate"], out["allowed_differ"]) == (0, 6, 4)
    assert out["rows_differing"] == [84, 140, 142, 176, 186, 199]
    assert json.loads((ev / "compare.json").read_text()) == out
    for m in ("all", "all2"):
        log = (ev / f"{m}.log").read_text()
        assert paths[2] not in log and paths[1] in log and paths[0] in log
    tests = (root / "machine1" / "gputests" / "stdout.log").read_text()
    assert re.search(r"^273 passed, 5 skipped, 1310 deselected", tests, re.M) and not re.search(r"\bfailed\b", tests)
    skips = re.findall(r"^SKIPPED \[(\d+)\] \S+: (.*)$", tests, re.M)
    assert sorted((int(n), why.split(" (")[0]) for n, why in skips) == [
        (1, "humming-kernels"), (1, "needs 2 CUDA GPUs"), (3, "humming-kernels")]
    assert "gputests rc=0" in (root / "machine1" / "status.txt").read_text()
    assert (root / "machine1" / "smoke-refactor" / "rc.txt").read_text().split() == ["sweep_row", "rc=0",
                                                                                   "sweep_marlin_row", "rc=0"]
    recs = _jsonl(root / "machine2" / "diag" / "real_row_error.jsonl")
    layers = [r for r in recs if r["what"] == "layer"]
    assert [r["layer"] for r in layers] == list(range(30)) and all(r["rows"] == 16010 for r in layers)
    beyond = [r["layer"] for r in layers if r["max_err"]["hfma2"] > r["max_err"]["bound"]]
    assert beyond == [26] and [r["layer"] for r in layers if not r["within"]] == beyond
    assert recs[-1]["line"] == "beyond: hfma2's largest error exceeds the bfloat16-weight bound on layers [26] of 30"
    assert all(r["max_err"]["fp8"] <= r["max_err"]["bound"] for r in layers)
    assert sum(r["rows_hfma2_beyond_row_bound"] for r in layers) == 17460
    assert sum(r["rows_fp8_beyond_row_bound"] for r in layers) == 5
    assert sum(r["rows_x_beyond_float16"] for r in layers) == 0 and max(r["max_abs_x"] for r in layers) == 3056.0
    assert sum(r["max_err"]["hfma2"] == r["max_err"]["fp8"] for r in layers) == 17


def test_forty_fifth_session_hfma2_4():
    """§4bk, from the committed raw files: the GPU tests passed (53); the run's hfma2 rows equal §4bi's (not void);
    hfma2-4 beyond the bound on layer 26 and over its row bound on 10 721 rows, more than the 1 746 allowed (a tenth
    of hfma2's 17 460): the precision criterion fails on both counts."""
    root = ROOT / "docs" / "gpu-runs" / "2026-11-29" / "forty-fifth"
    tests = (root / "machine3" / "gpu_tests.log").read_text()
    assert re.search(r"^53 passed, \d+ deselected", tests, re.M) and re.search(r"^rc=0$", tests, re.M)
    assert not re.search(r"\b(failed|error)", tests)
    recs = _jsonl(root / "machine3" / "real_row_error.jsonl")
    by_mode = {m: [r for r in recs if r["what"] == "layer" and r["mode"] == m] for m in ("hfma2", "hfma2-4")}
    old = [r for r in _jsonl(root / "machine2" / "diag" / "real_row_error.jsonl") if r["what"] == "layer"]
    assert [{k: v for k, v in r.items() if k != "mode"} for r in by_mode["hfma2"]] == old
    h4 = by_mode["hfma2-4"]
    assert [r["layer"] for r in h4] == list(range(30))
    assert [r["layer"] for r in h4 if r["max_err"]["hfma2-4"] > r["max_err"]["bound"]] == [26]
    assert round(h4[26]["max_err"]["hfma2-4"], 4) == 0.2584 and round(h4[26]["max_err"]["bound"], 4) == 0.2498
    allowed = sum(r["rows_hfma2_beyond_row_bound"] for r in old) // 10
    assert allowed == 1746 and sum(r["rows_hfma2-4_beyond_row_bound"] for r in h4) == 10721 > allowed
    readings = {r["mode"]: r["line"] for r in recs if r["what"] == "reading"}
    assert readings["hfma2-4"].startswith("beyond: ") and "[26] of 30" in readings["hfma2-4"]
