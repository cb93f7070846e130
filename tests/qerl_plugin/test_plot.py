"""``qerl plot``: panels per quantity present, runs overlaid or grouped by label, the real GPU-run metrics, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qerl_plugin.cli import main
from qerl_plugin.plot import QUANTITIES, PlotError, _smooth, plot_metrics, read_metrics

REAL = Path(__file__).resolve().parents[2] / "docs/gpu-runs/2026-11-22/verl_nvfp4/verl_grpo_tiny/nvfp4/metrics.jsonl"
REAL_BYPASS = REAL.parents[4] / "2026-11-24/demo_bypass/metrics.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VAL = "val-core/qerl/synthetic_arithmetic/acc/mean@1"


def _write_run(path: Path, steps: int = 6, offset: float = 0.0, sigma: bool = True, val_every: int = 3) -> Path:
    """verl file-logger lines: step 0 holds only validation, as verl's val_before_train logs it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "data": {VAL: 0.05 + offset}}]
    for s in range(1, steps + 1):
        data = {
            "critic/score/mean": 0.1 * s + offset,
            "actor/entropy": 1.5 - 0.01 * s,
            "rollout_corr/kl": 0.002,
            "timing_s/step": 5.0 + offset,
            "response_length/mean": 100.0,
        }
        if sigma:
            data["qerl/aqn_sigma"] = 1e-2 * 0.1 ** (s // 2)
        if s % val_every == 0:
            data[VAL] = 0.05 + 0.05 * s + offset
        lines.append({"step": s, "data": data})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes]


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def test_two_runs_one_panel_per_quantity(tmp_path):
    a = _write_run(tmp_path / "bf16" / "metrics.jsonl", sigma=False)
    b = _write_run(tmp_path / "nvfp4" / "metrics.jsonl", offset=0.02)
    out = tmp_path / "fig" / "curves.png"
    fig = plot_metrics([a, b], out)
    assert _is_png(out)
    # reward, val_acc, entropy, sigma, kl, step_time (no probs_diff in these files)
    assert len(fig.axes) == 6
    assert [t.split(" (")[0] for t in _titles(fig)] == [
        "train reward", "validation accuracy", "policy entropy", "AQN sigma", "rollout-vs-actor KL", "step time, s",
    ]  # fmt: skip
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["bf16", "nvfp4"]  # default label: the file's folder
    reward = fig.axes[0]
    assert len(reward.get_lines()) == 2
    assert list(reward.get_lines()[1].get_ydata()) == pytest.approx([0.1 * s + 0.02 for s in range(1, 7)])
    val = fig.axes[1].get_lines()[0]
    assert list(val.get_xdata()) == [0, 3, 6]  # step 0 (before training) and every 3 steps
    sigma = fig.axes[3]
    assert sigma.get_yscale() == "log" and len(sigma.get_lines()) == 1  # only nvfp4 logs sigma


def test_real_gpu_run(tmp_path):
    out = tmp_path / "real.png"
    fig = plot_metrics([REAL], out, smooth=3)
    assert _is_png(out)
    # that run logged no validation: reward, entropy, sigma, kl, probs_diff, step_time
    assert [t.split(" (")[0] for t in _titles(fig)] == [
        "train reward", "policy entropy", "AQN sigma", "rollout-vs-actor KL", "rollout-vs-actor prob. gap", "step time, s",
    ]  # fmt: skip
    run = read_metrics(REAL)
    assert run.label == "nvfp4" and len(run.values["critic/score/mean"]) == 20
    reward = fig.axes[0].get_lines()
    assert len(reward) == 2  # the raw curve, faint, and its moving average
    raw = [v for _, v in run.values["critic/score/mean"]]
    assert list(reward[1].get_ydata()) == pytest.approx(_smooth(raw, 3))
    assert list(fig.axes[2].get_lines()[0].get_ydata()) == [v for _, v in run.values["qerl/aqn_sigma"]]  # never smoothed


def test_repeated_labels_draw_mean_and_min_max_band(tmp_path):
    paths = [_write_run(tmp_path / f"s{i}" / "metrics.jsonl", offset=0.01 * i) for i in range(3)]
    paths.append(_write_run(tmp_path / "other" / "metrics.jsonl", offset=0.5))
    out = tmp_path / "seeds.png"
    fig = plot_metrics(paths, out, labels=["nvfp4", "nvfp4", "nvfp4", "bf16"], keys=["reward"])
    assert _is_png(out) and len(fig.axes) == 1
    ax = fig.axes[0]
    mean, single = ax.get_lines()
    assert list(mean.get_ydata()) == pytest.approx([0.1 * s + 0.01 for s in range(1, 7)])  # mean of offsets 0, .01, .02
    assert list(single.get_ydata()) == pytest.approx([0.1 * s + 0.5 for s in range(1, 7)])
    (band,) = ax.collections  # one band: the label with three runs
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(0.1) and max(ys) == pytest.approx(0.62)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["nvfp4 (mean, min-max of 3)", "bf16"]
    # --no-group draws each run
    fig = plot_metrics(paths, out, labels=["nvfp4", "nvfp4", "nvfp4", "bf16"], keys=["reward"], group=False)
    assert len(fig.axes[0].get_lines()) == 4 and not fig.axes[0].collections


def test_files_sharing_a_folder_are_labelled_by_file_name(tmp_path):
    """verl's default file logger path is <root>/<project>/<experiment>.jsonl."""
    a = _write_run(tmp_path / "qerl" / "bf16_lr1e-5.jsonl")
    b = _write_run(tmp_path / "qerl" / "nvfp4_lr1e-5.jsonl")
    fig = plot_metrics([a, b], tmp_path / "p.png", keys=["reward"])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["bf16_lr1e-5", "nvfp4_lr1e-5"]
    assert len(fig.axes[0].get_lines()) == 2 and not fig.axes[0].collections  # not grouped


def test_keys_by_metric_name_and_wildcard(tmp_path):
    a = _write_run(tmp_path / "a" / "metrics.jsonl")
    fig = plot_metrics([a], tmp_path / "k.png", keys=["entropy", "response_length/*"])
    assert _titles(fig) == ["policy entropy (actor/entropy)", "response_length/mean"]
    with pytest.raises(PlotError, match=r"--keys 'nope/\*': no run has this metric"):
        plot_metrics([a], tmp_path / "k.png", keys=["nope/*"])


def test_cli(tmp_path, capsys):
    a = _write_run(tmp_path / "a" / "metrics.jsonl")
    b = _write_run(tmp_path / "b" / "metrics.jsonl")
    out = tmp_path / "cli.png"
    assert main(["plot", str(a), str(b), "-o", str(out), "--labels", "A", "B", "--smooth", "2", "--title", "t"]) == 0
    assert _is_png(out)
    assert f"wrote {out}: 6 panels" in capsys.readouterr().out
    assert main(["plot", str(a), "-o", str(out), "--labels", "A", "B"]) == 1
    assert "--labels: 2 labels for 1 files" in capsys.readouterr().err


def test_every_quantity_names_a_verl_metric():
    """The exact keys the plot reads are the ones verl 0.9.1 writes (its validation name format included)."""
    import importlib.util

    verl_dir = Path(importlib.util.find_spec("verl").origin).parent  # read, not imported (ray, engines)
    src = (verl_dir / "trainer/ppo/ray_trainer.py").read_text()
    src = src[src.index("def _val_metrics_update") :][:2000]
    assert 'f"{metric_sec}/{data_source}/{var_name}/{metric_name}"' in src and '"val-core"' in src
    val = next(q for q in QUANTITIES if q.name == "val_acc")
    assert val.series({"val-core/openai/gsm8k/acc/mean@1", "val-aux/openai/gsm8k/reward/mean@1"}) == {
        "openai/gsm8k": "val-core/openai/gsm8k/acc/mean@1"
    }
    real = set(read_metrics(REAL).values) | set(read_metrics(REAL_BYPASS).values)
    for q in QUANTITIES:
        if q.name != "val_acc":
            assert set(q.keys) <= real, q.name


def test_bypass_mode_run_draws_its_kl(tmp_path):
    """In verl's bypass mode the KL comes from the actor's update (actor/rollout_corr/kl): same panel."""
    fig = plot_metrics([REAL_BYPASS], tmp_path / "bypass.png")
    kl = next(ax for ax in fig.axes if ax.get_title().startswith("rollout-vs-actor KL"))
    ys = [y for line in kl.get_lines() for y in line.get_ydata()]
    run = read_metrics(REAL_BYPASS)
    raw = [v for _, v in run.values["actor/rollout_corr/kl"]]
    assert len(raw) == 50 and len(ys) >= 50
    assert min(raw) - 1e-12 <= min(ys) and max(ys) <= max(raw) + 1e-12  # drawn (smoothed or not) within the data
    assert not any(ax.get_title().startswith("policy entropy") for ax in fig.axes)  # bypass runs log none


# ----------------------------------------------------------------------------------------------------
# Bad input


def test_file_without_expected_keys_names_file_and_keys(tmp_path):
    bad = tmp_path / "other" / "metrics.jsonl"
    bad.parent.mkdir()
    bad.write_text(json.dumps({"step": 1, "data": {"loss": 1.0, "lr": 0.1}}) + "\n")
    with pytest.raises(PlotError) as e:
        plot_metrics([bad], tmp_path / "x.png")
    msg = str(e.value)
    assert str(bad) in msg and "['loss', 'lr']" in msg and "critic/score/mean" in msg and "actor/entropy" in msg
    assert not (tmp_path / "x.png").exists()
    # a chosen quantity without fixed keys (validation accuracy) names its key pattern
    with pytest.raises(PlotError, match=r"expects \['val-core/<data_source>/acc/mean@<n>'\]"):
        plot_metrics([bad], tmp_path / "x.png", keys=["val_acc"])


def test_empty_and_non_jsonl_files(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PlotError, match=r"empty\.jsonl: empty"):
        plot_metrics([empty], tmp_path / "x.png")
    text = tmp_path / "log.txt"
    text.write_text("step 1 reward 0.5\n")
    with pytest.raises(PlotError, match=r"log\.txt line 1: not JSON"):
        plot_metrics([text], tmp_path / "x.png")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"reward": 0.5}\n')
    with pytest.raises(PlotError, match=r'wrong\.jsonl line 1: expected \{"step": N'):
        plot_metrics([wrong], tmp_path / "x.png")
    assert main(["plot", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert "missing.jsonl: no such file" in err and len(err.strip().splitlines()) == 1


def test_bad_options(tmp_path):
    a = _write_run(tmp_path / "a" / "metrics.jsonl")
    with pytest.raises(PlotError, match="--smooth 0"):
        plot_metrics([a], tmp_path / "x.png", smooth=0)
    with pytest.raises(PlotError, match=r"-o .*x\.nope: .*use \.png"):
        plot_metrics([a], tmp_path / "x.nope")
