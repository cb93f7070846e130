"""verl_ext.verify: equivalences (math-verify's verdicts and our normalisation), and time limits that work
outside the main thread (the alarm, the helper-process pool, helpers that hang or outlive their parent)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import SLOW_GOLD
from verl_ext import verify
from verl_ext.reward import compute_score


def _mv_reference(gold: str, pred: str) -> bool:
    """math-verify called directly (main thread, its own signal timeouts): the reference verdict."""
    import math_verify as mv

    cfg = (mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig())
    return bool(mv.verify(mv.parse("\\boxed{" + gold + "}", cfg), mv.parse("\\boxed{" + pred + "}", cfg)))


# ----------------------------------------------------------------------------------------------------
# Equivalences

# (model's boxed answer, ground truth, expected acc). The first block is math-verify's own judgement.
MV_CASES = [
    ("0.5", "\\frac{1}{2}", 1),
    ("1/2", "\\frac{1}{2}", 1),
    ("\\dfrac{1}{2}", "0.5", 1),
    ("\\frac12", "1/2", 1),
    ("\\dfrac{3}{4}", "0.75", 1),
    ("x=3", "3", 1),
    ("72.0", "72", 1),
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", 1),
    ("x(x+2)", "x^2+2x", 1),
    ("\\{2,1\\}", "\\{1,2\\}", 1),
    ("[1,2)", "[1,2)", 1),
    ("(1,2]", "[1,2)", 0),
    ("(-\\infty, 3)", "(-\\infty,3)", 1),
    ("\\frac{2}{3}", "\\frac{1}{2}", 0),
    ("0.333", "\\frac{1}{3}", 0),
    ("2\\sqrt{3}", "\\sqrt{12}", 1),
]
# Cases our normalisation decides before/around math-verify (see is_equivalent and normalize_answer).
OWN_CASES = [
    ("1,000", "1000", 1),
    ("1{,}000", "1000", 1),
    ("-7", "-7", 1),
    ("\u22127", "-7", 1),  # unicode minus
    ("7", "-7", 0),
    ("73", "72", 0),
    ("50\\%", "50", 1),  # a percentage is read as its number ...
    ("50%", "50\\%", 1),
    ("50\\%", "0.5", 0),  # ... so 50% is not 0.5
    ("\\$18", "18", 1),
    ("18 dollars", "18", 1),
    ("18 \\text{ dollars}", "18", 1),
    ("1000000000000000000001", "1000000000000000000000", 0),  # exact integers, no float rounding
]


@pytest.mark.parametrize("pred,gold,expected", MV_CASES)
def test_math_verify_equivalences_match_math_verify_itself(pred, gold, expected):
    out = compute_score("math", f"so the result is \\boxed{{{pred}}}.", gold)
    assert out["acc"] == expected and out["score"] == float(expected)
    assert _mv_reference(gold, pred) == bool(expected)  # the verdict is math-verify's, not ours


@pytest.mark.parametrize("pred,gold,expected", OWN_CASES)
def test_normalised_equivalences(pred, gold, expected):
    out = compute_score("math", f"\\boxed{{{pred}}}", gold)
    assert out == {"score": float(expected), "acc": float(expected), "pred": out["pred"]}


# ----------------------------------------------------------------------------------------------------
# Time limits that work outside the main thread


def _in_thread(fn, *args, **kwargs):
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the reward call hung"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_math_verify_signal_timeouts_really_fail_in_threads():
    """The problem we solve: math-verify's default (signal) timeouts raise outside the main thread."""
    import math_verify

    with pytest.raises(ValueError, match="threaded environment"):
        _in_thread(math_verify.parse, "\\boxed{\\frac{1}{2}}")


def test_main_thread_timeout_uses_the_alarm():
    handler_before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    out = compute_score("math", "\\boxed{5}", SLOW_GOLD, timeout_s=0.5)
    elapsed = time.monotonic() - start
    assert out == {"score": 0.0, "acc": 0.0, "pred": "5"}
    assert elapsed < 5.0
    assert signal.getsignal(signal.SIGALRM) is handler_before  # handler restored
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no alarm left behind
    assert compute_score("math", "\\boxed{0.5}", "\\frac12")["score"] == 1.0


def test_worker_thread_timeout_does_not_crash_and_recovers():
    start = time.monotonic()
    out = _in_thread(compute_score, "math", "\\boxed{5}", SLOW_GOLD, timeout_s=1.0)
    assert out == {"score": 0.0, "acc": 0.0, "pred": "5"}
    assert time.monotonic() - start < 60.0  # includes starting a helper process
    # The same thread kind goes on scoring normally afterwards.
    assert _in_thread(compute_score, "math", "\\boxed{\\dfrac{1}{2}}", "0.5", timeout_s=1.0)["score"] == 1.0
    assert _in_thread(compute_score, "math", "\\boxed{0.7}", "0.5", timeout_s=1.0)["score"] == 0.0


def test_stuck_helper_is_killed_and_replaced():
    """A helper that does not answer (here: stopped) is killed at the deadline; the next call restarts it."""
    helper = verify._Helper()
    try:
        assert helper.compare("\\frac{1}{2}", "0.5", 2.0) is True
        pid = helper.proc.pid
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        assert helper.compare("\\frac{1}{2}", "0.5", 0.5) is None
        assert 2.0 < time.monotonic() - start < 10.0  # timeout + grace, then kill
        assert helper.proc is None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert helper.compare("\\frac{1}{2}", "0.5", 2.0) is True  # restarted
        assert helper.proc.pid != pid
    finally:
        helper.kill()


def test_many_threads_share_the_helper_pool():
    cases = [("\\boxed{\\frac{%d}{2}}" % (2 * i), str(i), 1.0) for i in range(1, 13)]
    cases += [("\\boxed{%d.5}" % i, str(i), 0.0) for i in range(1, 13)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        outs = list(pool.map(lambda c: compute_score("math", c[0], c[1], verify_workers=2)["score"], cases))
    assert outs == [c[2] for c in cases]


def test_helpers_exit_with_their_parent(tmp_path):
    script = textwrap.dedent(
        f"""
        import json, threading
        from verl_ext import reward, verify
        out = {{}}
        score = lambda: out.update(r=reward.compute_score("math", "\\\\boxed{{0.5}}", "\\\\frac12"))
        t = threading.Thread(target=score)
        t.start(); t.join()
        pids = [h.proc.pid for h in list(verify._POOL._idle.queue) if h.proc is not None]
        print(json.dumps({{"score": out["r"]["score"], "pids": pids}}))
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["score"] == 1.0 and info["pids"]
    deadline = time.monotonic() + 10
    for pid in info["pids"]:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            # A zombie has exited too; only a running process counts.
            state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "Z"
            if state == "Z":
                break
            assert time.monotonic() < deadline, f"helper {pid} outlived its parent"
            time.sleep(0.1)
