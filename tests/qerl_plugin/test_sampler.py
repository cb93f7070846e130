"""The sampling profiler: it attributes a busy thread's time to the function that spends it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from qerl_plugin import sampler


def _spin_in_inner(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def _outer(stop: threading.Event) -> None:
    _spin_in_inner(stop)


def test_busy_function_dominates_its_thread():
    stop = threading.Event()
    t = threading.Thread(target=_outer, args=(stop,), name="busy", daemon=True)
    t.start()
    s = sampler.Sampler(0.002)
    s._me = threading.get_ident()
    try:
        for _ in range(200):
            s.sample_once()
            time.sleep(0.002)
    finally:
        stop.set()
        t.join()
    n = s.samples["busy"]
    assert n >= 150
    inner = next(v for k, v in s.inclusive["busy"].items() if k.endswith(":_spin_in_inner"))
    outer = next(v for k, v in s.inclusive["busy"].items() if k.endswith(":_outer"))
    assert inner / n > 0.9 and outer / n > 0.9  # on the stack in (nearly) every sample
    report = s.report()
    assert "== thread busy" in report and "_spin_in_inner" in report


def test_started_from_the_environment_writes_a_report(tmp_path):
    code = (
        "import time; from qerl_plugin import sampler; assert sampler.start_from_env();"
        "assert not sampler.start_from_env()  # once per process\n"
        "def work():\n    t = time.time()\n    while time.time() - t < 1.5: sum(range(1000))\n"
        "work(); time.sleep(0.3)"
    )
    env = {**os.environ, "QERL_PROFILE_DIR": str(tmp_path), "QERL_PROFILE_INTERVAL_MS": "5"}
    # flush every 20 s in real runs; the test process lives 2 s, so shorten the flush period
    subprocess.run([sys.executable, "-c", "import qerl_plugin.sampler as s; s.Sampler.run.__defaults__ = (0.5,);" + code],
                   check=True, env=env, timeout=60)
    reports = list(tmp_path.glob("*.txt"))
    assert len(reports) == 1
    text = reports[0].read_text()
    assert "MainThread" in text and ":work" in text


def test_off_without_the_environment(monkeypatch):
    monkeypatch.delenv("QERL_PROFILE_DIR", raising=False)
    assert sampler.start_from_env() is False
