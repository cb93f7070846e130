"""``qerl_plugin.gpu_clocks``: nvidia-smi samples of the GPU's clocks and what they say (no GPU here: a stand-in
nvidia-smi, the samples recorded on two H100s in docs/gpu-runs, and NVML's own constants as the references)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_clock_event_reason_bits_are_nvmls():
    """gpu_clocks' reason bits against NVML's own constants (nvidia-ml-py, installed with vLLM): the slowdown set is
    HW slowdown, SW and HW thermal slowdown and HW power brake; idle and the SW power cap are not slowdowns."""
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py (a vLLM dependency) holds NVML's reason constants")
    from qerl_plugin import gpu_clocks as clocks
    nvml = {"idle": pynvml.nvmlClocksEventReasonGpuIdle, "SW power cap": pynvml.nvmlClocksEventReasonSwPowerCap,
            "HW slowdown": pynvml.nvmlClocksEventReasonHwSlowdown, "sync boost": pynvml.nvmlClocksEventReasonSyncBoost,
            "SW thermal slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
            "HW thermal slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
            "HW power brake slowdown": pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown,
            "applications clocks setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
            "display clock setting": pynvml.nvmlClocksEventReasonDisplayClockSetting}
    assert {name: bit for bit, name in clocks.REASONS.items()} == nvml
    slow = [nvml[k] for k in ("HW slowdown", "SW thermal slowdown", "HW thermal slowdown", "HW power brake slowdown")]
    assert clocks.SLOWDOWN == sum(slow) and clocks.IDLE == nvml["idle"]
    assert clocks.reason_names(0x24) == ["SW power cap", "SW thermal slowdown"] and clocks.reason_names(0) == ["none"]


def test_clock_summary_tells_the_slowed_h100_from_a_healthy_one():
    """§4x's two H100s. The healthy one (call 15's samples, read back from its csv): power-capped at a median 1 380 of
    1 980 MHz, no slowdown, not slowed. The slowed one (call 13's six matmul and copy samples, as its output.txt lists
    them, plus an idle sample): SW thermal slowdown in every busy sample, median 780 MHz, 87 C: slowed, and the problem
    line says why and what to do. Idle samples do not count; unparseable lines are dropped."""
    from qerl_plugin import gpu_clocks as clocks
    runs = ROOT / "docs" / "gpu-runs" / "2026-11-27" / "twentysecond"
    healthy = clocks.summarize(clocks.read_csv(runs / "call15-clock-check" / "gpu_clocks.csv"))
    assert healthy == {"samples": 86, "busy": 86, "temp_c_max": 64, "sm_mhz_median": 1380.0, "sm_mhz_rated": 1980,
                       "reasons": {"SW power cap": 1.0}, "slowdown_share": 0.0, "slowed": False}
    assert clocks.problem(healthy) is None
    assert "0x0000000000000020" in (runs / "call13-clock-probe" / "output.txt").read_text()
    lines = [f"{used}, {mhz}, 1980, {temp}, {bits}" for used, mhz, temp, bits in (
        (40000, 405, 87, "0x0000000000000020"), (40000, 360, 87, "0x0000000000000020"),
        (40000, 360, 87, "0x0000000000000020"), (44000, 1170, 86, "0x0000000000000020"),
        (44000, 1275, 86, "0x0000000000000020"), (44000, 1305, 86, "0x0000000000000020"),
        (500, 345, 80, "0x0000000000000001"))] + ["[N/A], [N/A], 1980, 80, 0x0", "", "nvidia-smi failed"]
    samples = [s for s in map(clocks.parse, lines) if s is not None]
    assert len(samples) == 7
    slowed = clocks.summarize(samples)
    assert (slowed["busy"], slowed["sm_mhz_median"], slowed["temp_c_max"]) == (6, 787.5, 87)
    assert slowed["reasons"] == {"SW thermal slowdown": 1.0} and slowed["slowed"] is True
    msg = clocks.problem(slowed)
    assert msg.startswith("GPU slowed itself down in 100% of busy samples (SW thermal slowdown 100%; median SM clock")
    assert "another machine" in msg
    # the limit: a slowdown in 1 of 20 busy samples (5 %) passes, in 2 of 20 it does not
    ok = clocks.Sample(1000, 1400, 1980, 60, 0x4)
    hot = clocks.Sample(1000, 900, 1980, 85, 0x20)
    assert clocks.summarize([hot] + [ok] * 19)["slowed"] is False
    assert clocks.summarize([hot] * 2 + [ok] * 18)["slowed"] is True
    assert clocks.summarize([clocks.Sample(0, 345, 1980, 35, 0x1)])["slowed"] is False  # idle only: nothing to judge


@pytest.mark.skipif(os.name != "posix", reason="a stand-in nvidia-smi is a shell script on PATH")
def test_sampler_writes_each_sample_and_keeps_the_peak(tmp_path, monkeypatch):
    """The Sampler around a run, with a stand-in nvidia-smi (none on this machine) that answers two lines in turn:
    each sample a csv line with its time, the peak memory.used over them, the summary of the busy ones; the query it
    ran is smi_command's."""
    from qerl_plugin import gpu_clocks as clocks

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state, args = tmp_path / "n", tmp_path / "args"
    (bin_dir / "nvidia-smi").write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {args}\n'
        f"n=$(cat {state} 2>/dev/null || echo 0); echo $((n + 1)) > {state}\n"
        'if [ $((n % 2)) = 0 ]; then echo "51200, 1400, 1980, 61, 0x0000000000000004"; '
        'else echo "20480, 1980, 1980, 58, 0x0000000000000000"; fi\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    with clocks.Sampler(tmp_path / "smi.csv", gpu=1, every=0.05) as smp:
        deadline = time.monotonic() + 20
        while len(smp.samples) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    rows = (tmp_path / "smi.csv").read_text().splitlines()
    assert len(rows) >= 4 and rows[0].split(",")[1:] == ["51200", "1400", "1980", "61", "0x4"]
    assert rows[1].split(",")[1:] == ["20480", "1980", "1980", "58", "0x0"]
    assert smp.peak == 51200 and clocks.read_csv(tmp_path / "smi.csv") == smp.samples[: len(rows)]
    s = smp.summary()
    assert s["busy"] == len(smp.samples) and s["slowed"] is False and s["sm_mhz_rated"] == 1980
    assert args.read_text().split() == clocks.smi_command(1)[1:]


def test_sampler_is_off_without_nvidia_smi_or_with_no_interval(tmp_path, monkeypatch):
    """No nvidia-smi on PATH (this machine), or an interval of 0: nothing is sampled, no file is written, and the
    summary is empty and not slowed, so a record on a machine without the tool says nothing false."""
    from qerl_plugin import gpu_clocks as clocks

    monkeypatch.setenv("PATH", str(tmp_path))  # a folder without nvidia-smi
    for every in (0.2, 0.0):
        with clocks.Sampler(tmp_path / f"smi{every}.csv", every=every) as smp:
            time.sleep(0.1)
        assert smp.available is False and smp.samples == [] and smp.peak == 0
        assert not (tmp_path / f"smi{every}.csv").exists()
        assert smp.summary() == {"samples": 0, "busy": 0, "temp_c_max": None, "sm_mhz_median": None,
                                 "sm_mhz_rated": None, "reasons": {}, "slowdown_share": None, "slowed": False}


def test_visible_gpu_is_one_index_or_none():
    from qerl_plugin.gpu_clocks import visible_gpu

    assert visible_gpu({"CUDA_VISIBLE_DEVICES": "1"}) == 1 and visible_gpu({"CUDA_VISIBLE_DEVICES": " 0 "}) == 0
    for value in ("", "0,1", "GPU-5f1c2d3e", " "):
        assert visible_gpu({"CUDA_VISIBLE_DEVICES": value}) is None
    assert visible_gpu({}) is None
