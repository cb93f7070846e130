"""``qerl plot METRICS.jsonl... -o FILE.png``: training curves from verl's file logger, several runs overlaid.

verl's ``trainer.logger=[file]`` writes one line per step, ``{"step": N, "data": {metric: value}}``
(``VERL_FILE_LOGGER_PATH``, or ``<root>/<project>/<experiment>.jsonl``). One panel per quantity present:

=============  ==================================================================================
reward         ``critic/score/mean`` (the reward of the step's rollouts)
val_acc        ``val-core/<data_source>/acc/mean@<n>`` (validation accuracy; step 0 is before training)
entropy        ``actor/entropy``
sigma          ``qerl/aqn_sigma`` (the AQN noise scale of the step)
kl             ``rollout_corr/kl`` (rollout-vs-actor KL; ``actor/rollout_corr/kl`` in verl's bypass mode)
probs_diff     ``training/rollout_probs_diff_mean`` (mean rollout-vs-actor token probability gap)
step_time      ``timing_s/step``
=============  ==================================================================================

``--keys`` picks quantities by these names or any metric key (``*`` wildcards allowed). Runs are
labelled by ``--labels`` or their file's folder name (the file name when files share a folder, as in
verl's ``<project>/<experiment>.jsonl``); runs sharing a label (seeds) are drawn as their
mean with a min-max band (``--group``; automatic when labels repeat, ``--no-group`` to draw each).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

__all__ = ["QUANTITIES", "PlotError", "Quantity", "Run", "add_arguments", "plot_metrics", "read_metrics", "run"]

HELP = "plot reward, validation accuracy, entropy, AQN sigma, KL and step time from verl metrics.jsonl files"


class PlotError(ValueError):
    """Bad input for ``qerl plot``; the message names the file and the fix."""


@dataclass(frozen=True)
class Quantity:
    """One panel: the metric keys it draws (exact, or a regex whose ``sub`` group names the series)."""

    name: str
    title: str
    keys: tuple[str, ...] = ()
    pattern: str | None = None
    smooth: bool = True  # --smooth applies (not to schedules such as sigma)

    def series(self, metric_keys: set[str]) -> dict[str, str]:
        """{series name ("" for the only one): metric key} among ``metric_keys``."""
        if self.pattern is None:
            return {"": k for k in self.keys if k in metric_keys}
        out = {}
        for k in sorted(metric_keys):
            m = re.fullmatch(self.pattern, k)
            if m:
                out[m.group("sub")] = k
        return out


QUANTITIES: tuple[Quantity, ...] = (
    Quantity("reward", "train reward (critic/score/mean)", keys=("critic/score/mean",)),
    Quantity("val_acc", "validation accuracy (val-core/*/acc/mean@n)", pattern=r"val-core/(?P<sub>.+)/acc/mean@\d+", smooth=False),
    Quantity("entropy", "policy entropy (actor/entropy)", keys=("actor/entropy",)),
    Quantity("sigma", "AQN sigma (qerl/aqn_sigma)", keys=("qerl/aqn_sigma",), smooth=False),
    Quantity("kl", "rollout-vs-actor KL (rollout_corr/kl)", keys=("rollout_corr/kl", "actor/rollout_corr/kl")),
    Quantity("probs_diff", "rollout-vs-actor prob. gap (training/rollout_probs_diff_mean)", keys=("training/rollout_probs_diff_mean",)),
    Quantity("step_time", "step time, s (timing_s/step)", keys=("timing_s/step",)),
)
_BY_NAME = {q.name: q for q in QUANTITIES}


def _expected_keys(quantities: Sequence[Quantity] = QUANTITIES) -> list[str]:
    return [k for q in quantities for k in (q.keys or ("val-core/<data_source>/acc/mean@<n>",))]


@dataclass
class Run:
    """One metrics file: ``values[key] = [(step, value), ...]`` sorted by step (a repeated step keeps its last value)."""

    path: Path
    label: str
    values: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def read_metrics(path: str | Path, label: str | None = None) -> Run:
    """Parse verl's file-logger JSON lines."""
    path = Path(path)
    if not path.is_file():
        raise PlotError(f"{path}: no such file; give the metrics.jsonl that verl's file logger wrote (trainer.logger=[file])")
    by_key: dict[str, dict[int, float]] = {}
    lines = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PlotError(
                    f"{path} line {lineno}: not JSON ({exc.msg}); expected verl's file-logger lines "
                    '{"step": N, "data": {metric: value}}'
                ) from None
            if not (isinstance(rec, dict) and isinstance(rec.get("step"), int) and isinstance(rec.get("data"), dict)):
                raise PlotError(
                    f'{path} line {lineno}: expected {{"step": N, "data": {{metric: value}}}} as verl\'s file logger '
                    f"writes, got {line.strip()[:80]!r}"
                )
            lines += 1
            for key, value in rec["data"].items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    continue
                by_key.setdefault(key, {})[rec["step"]] = float(value)
    if not lines:
        raise PlotError(f"{path}: empty; the run logged no step yet (verl writes a line per step with trainer.logger=[file])")
    values = {k: sorted(v.items()) for k, v in by_key.items()}
    return Run(path=path, label=label if label is not None else (path.parent.name or path.stem), values=values)


def _select(runs: Sequence[Run], keys: Sequence[str] | None) -> list[Quantity]:
    """The quantities to draw: ``keys`` (names or metric keys, wildcards allowed), else every known one present."""
    present = set().union(*(r.values for r in runs))
    if not keys:
        chosen = [q for q in QUANTITIES if q.series(present)]
    else:
        chosen = []
        for key in keys:
            if key in _BY_NAME:
                chosen.append(_BY_NAME[key])
                continue
            matched = sorted(k for k in present if fnmatch.fnmatchcase(k, key))
            if not matched:
                raise PlotError(
                    f"--keys {key!r}: no run has this metric; give a quantity ({', '.join(_BY_NAME)}) or a metric "
                    f"key the files hold, e.g. {sorted(present)[:5]}"
                )
            chosen += [Quantity(k, k, keys=(k,)) for k in matched]
    for r in runs:
        if not any(q.series(set(r.values)) for q in chosen):
            have = sorted(r.values)
            wanted = _expected_keys(chosen if keys else QUANTITIES)
            raise PlotError(
                f"{r.path}: none of the metrics to plot; it has {have[:6]}{' ...' if len(have) > 6 else ''} and "
                f"qerl plot expects {wanted}: is it verl's file-logger output of a PPO/GRPO run? (--keys picks other metrics)"
            )
    return chosen


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (fewer at the start)."""
    if window <= 1:
        return list(values)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _marker(steps: Sequence[int]) -> str | None:
    """Dots where points are few (sparse validation, short runs), so single points show."""
    return "o" if len(steps) <= 12 else None


def plot_metrics(
    paths: Sequence[str | Path],
    out: str | Path,
    *,
    labels: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    smooth: int = 1,
    group: bool | None = None,
    title: str | None = None,
    dpi: int = 120,
):
    """Draw the runs in ``paths`` and save the figure to ``out``; returns the matplotlib figure.

    ``group`` None groups runs by label only when a label repeats.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    if not paths:
        raise PlotError("no metrics files given")
    if labels is not None and len(labels) != len(paths):
        raise PlotError(f"--labels: {len(labels)} labels for {len(paths)} files; give one label per file, in order")
    if smooth < 1:
        raise PlotError(f"--smooth {smooth}: the window must be at least 1 point (1 = no smoothing)")
    runs = [read_metrics(p, labels[i] if labels else None) for i, p in enumerate(paths)]
    if labels is None:
        # verl's default layout puts every experiment of a project in one folder: name those by file
        folders = [r.path.resolve().parent for r in runs]
        for r, folder in zip(runs, folders):
            if folders.count(folder) > 1:
                r.label = r.path.stem
    quantities = _select(runs, keys)
    order = list(dict.fromkeys(r.label for r in runs))
    if group is None:
        group = len(order) < len(runs)
    colors = {label: f"C{i % 10}" for i, label in enumerate(order)}
    size = {label: sum(r.label == label for r in runs) for label in order}

    ncols = 1 if len(quantities) == 1 else 2
    nrows = math.ceil(len(quantities) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 3.4 * nrows + 0.6), squeeze=False, layout="constrained")
    flat = list(axes.flat)
    for ax in flat[len(quantities) :]:
        fig.delaxes(ax)
    styles = ("-", "--", ":", "-.")
    for ax, q in zip(flat, quantities):
        subs = sorted(set().union(*(q.series(set(r.values)) for r in runs)))
        window = smooth if q.smooth else 1
        for j, sub in enumerate(subs):
            style = styles[j % len(styles)]
            suffix = f" ({sub})" if sub else ""
            if group:
                for label in order:
                    curves = []
                    for r in runs:
                        key = q.series(set(r.values)).get(sub)
                        if r.label == label and key:
                            pts = r.values[key]
                            curves.append(dict(zip([s for s, _ in pts], _smooth([v for _, v in pts], window))))
                    if not curves:
                        continue
                    steps = sorted(set().union(*curves))
                    at = [[c[s] for c in curves if s in c] for s in steps]
                    mean = [sum(v) / len(v) for v in at]
                    ax.plot(steps, mean, style, color=colors[label], label=f"{label}{suffix}", marker=_marker(steps))
                    if len(curves) > 1:
                        ax.fill_between(steps, [min(v) for v in at], [max(v) for v in at], color=colors[label], alpha=0.2, linewidth=0)
            else:
                for r in runs:
                    key = q.series(set(r.values)).get(sub)
                    if not key:
                        continue
                    steps = [s for s, _ in r.values[key]]
                    raw = [v for _, v in r.values[key]]
                    marker = _marker(steps)
                    if window > 1:
                        ax.plot(steps, raw, style, color=colors[r.label], alpha=0.25, linewidth=1)
                    ax.plot(steps, _smooth(raw, window), style, color=colors[r.label], label=f"{r.label}{suffix}", marker=marker)
        ys = [v for r in runs for key in q.series(set(r.values)).values() for _, v in r.values[key]]
        if q.name == "sigma" and ys and min(ys) > 0 and max(ys) / min(ys) > 20:
            ax.set_yscale("log")
        ax.set_title(q.title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if len(subs) > 1:
            ax.legend(fontsize=7)
    handles = [
        Line2D([], [], color=colors[label], label=f"{label} (mean, min-max of {size[label]})" if group and size[label] > 1 else label)
        for label in order
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4), frameon=False, fontsize=9)
    if title:
        fig.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, dpi=dpi)
    except ValueError as exc:  # unknown extension
        raise PlotError(f"-o {out}: {exc}; use .png, .pdf or .svg") from None
    plt.close(fig)
    return fig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", metavar="METRICS.jsonl", nargs="+", help="verl file-logger output, one file per run")
    parser.add_argument("-o", "--out", required=True, metavar="FILE.png", help="image to write (.png, .pdf, .svg)")
    parser.add_argument("--labels", nargs="+", metavar="LABEL", help="one label per file (default: the file's folder name, or its name when files share a folder)")
    parser.add_argument(
        "--keys", nargs="+", metavar="KEY",
        help=f"what to draw: quantities ({', '.join(_BY_NAME)}) or metric keys, '*' wildcards allowed (default: every quantity present)",
    )  # fmt: skip
    parser.add_argument("--smooth", type=int, default=1, metavar="N", help="moving average over N steps (default 1: none)")
    grouping = parser.add_mutually_exclusive_group()
    grouping.add_argument("--group", dest="group", action="store_true", default=None, help="mean and min-max band over runs sharing a label (default when labels repeat)")
    grouping.add_argument("--no-group", dest="group", action="store_false", help="draw every run, even when labels repeat")
    parser.add_argument("--title", help="figure title")
    parser.add_argument("--dpi", type=int, default=120, help="resolution (default 120)")


def run(args: argparse.Namespace) -> int:
    fig = plot_metrics(
        args.metrics, args.out, labels=args.labels, keys=args.keys, smooth=args.smooth, group=args.group, title=args.title, dpi=args.dpi
    )
    panels = ", ".join(ax.get_title() for ax in fig.axes)
    print(f"wrote {args.out}: {len(fig.axes)} panels ({panels}) for {len(args.metrics)} runs", file=sys.stdout)
    return 0
