"""Is a predicted answer the same as the gold one? Exact for integers, math-verify otherwise, under a deadline.

verl calls the reward from worker threads, where math-verify's own ``signal.alarm`` timeouts raise. So
math-verify runs with its timeouts off and :func:`is_equivalent` bounds the time itself: with
``signal.setitimer`` in the main thread, in a small pool of persistent helper processes from any other
thread (a helper that overruns its deadline is killed and restarted), and in an abandoned daemon thread if
helper processes cannot start. A comparison that runs out of time returns None (scored as wrong).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from qerl_plugin import notices
from verl_ext.answers import normalize_answer

__all__ = ["VERIFY_MODES", "is_equivalent", "shutdown_helpers", "warn_once"]

logger = logging.getLogger("qerl.verl.reward")  # one logger for the reward and its comparisons

#: ``verify_mode`` values: "auto" (helper processes outside the main thread), "process" (always), "inline" (never).
VERIFY_MODES = ("auto", "process", "inline")
_INTEGER_RE = re.compile(r"^-?\d{1,300}$")


class _Deadline(BaseException):
    """Raised by our SIGALRM handler; a BaseException so math-verify's ``except Exception`` lets it through."""


class _QuietTimeoutWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_FILTER_INSTALLED = False


def _math_verify():
    global _FILTER_INSTALLED
    try:
        import math_verify
    except ImportError as exc:  # pragma: no cover - math-verify comes with verl[math]
        raise ImportError(
            "verl_ext.reward needs math-verify: `pip install math-verify` (it comes with `verl[math]`)"
        ) from exc
    if not _FILTER_INSTALLED:
        # We bound the time ourselves, so math-verify's "you must provide the timeout logic" warning is noise.
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_QuietTimeoutWarning())
        _FILTER_INSTALLED = True
    return math_verify


def _integer_compare(gold: str, pred: str) -> bool | None:
    """Exact answer for two plain integers, None when either side is something else."""
    if _INTEGER_RE.match(gold) and _INTEGER_RE.match(pred):
        return int(gold) == int(pred)
    return None


def _mv_equal(gold: str, pred: str) -> bool:
    mv = _math_verify()
    config = (mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig())
    gold_parsed = mv.parse("\\boxed{" + gold + "}", config, parsing_timeout=None)
    pred_parsed = mv.parse("\\boxed{" + pred + "}", config, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(mv.verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _equal_with_alarm(gold: str, pred: str, timeout_s: float | None) -> bool | None:
    """math-verify comparison bounded by SIGALRM (main thread only). None means it timed out."""
    use_alarm = (
        timeout_s is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not use_alarm:
        return _mv_equal(gold, pred)

    def _on_alarm(signum, frame):
        raise _Deadline()

    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    old_timer = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return _mv_equal(gold, pred)
    except _Deadline:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_timer[0] > 0:  # someone else's timer was running: give it back what is left of it
            left = max(old_timer[0] - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, old_timer[1])


def _equal_abandonable(gold: str, pred: str, timeout_s: float | None) -> bool | None:
    """Last resort without helper processes: compare in a daemon thread and stop waiting at the deadline.
    A thread cannot be killed, so an overrunning comparison keeps running in the background."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["r"] = _mv_equal(gold, pred)
        except BaseException:  # noqa: BLE001 - a comparison that fails is a mismatch
            box["r"] = False

    worker = threading.Thread(target=run, name="qerl-reward-compare", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return box.get("r") if not worker.is_alive() else None


class _HelperUnavailable(RuntimeError):
    pass


# A helper process: the parent's sys.path, then this module's request loop.
_SERVER_CODE = (
    "import json, os, sys\n"
    "sys.path[:] = json.loads(os.environ['QERL_REWARD_SYSPATH'])\n"
    "from verl_ext import verify\n"
    "verify._serve()\n"
)


def _serve() -> None:
    """Helper-process loop: one JSON request per stdin line, one JSON reply per stdout line."""
    _math_verify()
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            result = _equal_with_alarm(req["g"], req["p"], req["t"])
            reply = {"r": None if result is None else bool(result)}
        except Exception as exc:  # never die on a bad request; report it
            reply = {"r": False, "err": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class _Helper:
    """One persistent helper process running :func:`_serve`."""

    STARTUP_TIMEOUT_S = 120.0

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._buf = b""

    def _read_line(self, deadline: float) -> bytes | None:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("reward helper process exited")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def start(self) -> None:
        env = dict(os.environ)
        env["QERL_REWARD_SYSPATH"] = json.dumps([p for p in sys.path if isinstance(p, str)])
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER_CODE],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                close_fds=True,
            )
            self._buf = b""
            line = self._read_line(time.monotonic() + self.STARTUP_TIMEOUT_S)
        except (OSError, EOFError) as exc:
            self.kill()
            raise _HelperUnavailable(f"could not start a reward helper process ({exc})") from exc
        if line is None or not json.loads(line).get("ready"):
            self.kill()
            raise _HelperUnavailable(f"reward helper process did not start within {self.STARTUP_TIMEOUT_S:.0f} s")

    def kill(self) -> None:
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=10)
            except Exception:  # already gone
                pass
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    pipe.close()
                except Exception:
                    pass
        self.proc = None
        self._buf = b""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def compare(self, gold: str, pred: str, timeout_s: float | None) -> bool | None:
        for attempt in range(2):
            if not self.alive():
                self.kill()
                self.start()
            assert self.proc is not None and self.proc.stdin is not None
            try:
                self.proc.stdin.write((json.dumps({"g": gold, "p": pred, "t": timeout_s}) + "\n").encode())
                self.proc.stdin.flush()
                # The helper bounds itself with SIGALRM; we wait a little longer and kill it if it overran
                # (a computation stuck in C code does not see the signal).
                wait = 3600.0 if timeout_s is None else timeout_s + 2.0
                line = self._read_line(time.monotonic() + wait)
            except (OSError, EOFError):
                self.kill()  # crashed (e.g. killed for memory): restart once
                if attempt == 0:
                    continue
                raise _HelperUnavailable("reward helper process died twice in a row") from None
            if line is None:
                self.kill()
                return None
            reply = json.loads(line)
            if "err" in reply:
                logger.debug("reward helper error: %s", reply["err"])
            return reply["r"]
        return None  # pragma: no cover


class _HelperPool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: queue.LifoQueue[_Helper] = queue.LifoQueue()
        self._created = 0
        self.size = 2
        self.broken: str | None = None  # set once a helper failed to start: stop trying

    def compare(self, gold: str, pred: str, timeout_s: float | None, size: int) -> bool | None:
        if self.broken is not None:
            raise _HelperUnavailable(self.broken)
        with self._lock:
            self.size = max(self.size, size)
            helper = None
            try:
                helper = self._idle.get_nowait()
            except queue.Empty:
                if self._created < self.size:
                    self._created += 1
                    helper = _Helper()
        if helper is None:
            helper = self._idle.get()
        try:
            return helper.compare(gold, pred, timeout_s)
        except _HelperUnavailable as exc:
            self.broken = str(exc)
            raise
        finally:
            self._idle.put(helper)

    def shutdown(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                break
        with self._lock:
            self._created = 0
            self.broken = None


_POOL = _HelperPool()


def warn_once(key: str, msg: str, *args: Any) -> None:
    """``logger.warning(msg, *args)`` on this module's logger the first time this process sees ``key``
    (:func:`qerl_plugin.notices.warn_once`, keys under ``verify/``)."""
    notices.warn_once(logger, "verify/" + key, msg, *args)


def shutdown_helpers() -> None:
    """Stop this process's helper processes (they also exit by themselves when this process ends)."""
    _POOL.shutdown()


def is_equivalent(
    gold: str,
    pred: str,
    *,
    timeout_s: float | None = 5.0,
    verify_mode: str = "auto",
    verify_workers: int = 2,
) -> bool | None:
    """Is ``pred`` the same answer as ``gold`` (both already extracted strings)? None means timed out.

    Both sides are normalised first (:func:`verl_ext.answers.normalize_answer`; a percentage is read as its
    number, ``50%`` equals 50, not 0.5). Two plain integers then compare exactly, without sympy; anything
    else goes through math-verify (``parse`` of ``\\boxed{answer}`` with LaTeX and plain-expression
    extraction, then ``verify(gold, pred)``), so ``0.5 == \\frac{1}{2} == \\dfrac12``, ``x=3 == 3``,
    ``{1,2} == {2,1}``, under a time bound that works in any thread (see the module docstring).
    ``verify_mode``: one of :data:`VERIFY_MODES`; ``verify_workers``: how many helper processes this
    process may start."""
    if verify_mode not in VERIFY_MODES:
        raise ValueError(f"verify_mode={verify_mode!r} is not one of {VERIFY_MODES}")
    gold, pred = normalize_answer(gold), normalize_answer(pred)
    if not gold or not pred:
        return False
    exact = _integer_compare(gold, pred)
    if exact is not None:
        return exact
    if gold == pred:
        return True
    in_main = threading.current_thread() is threading.main_thread()
    if verify_mode == "inline" or (verify_mode == "auto" and in_main):
        return _equal_with_alarm(gold, pred, timeout_s)
    try:
        return _POOL.compare(gold, pred, timeout_s, verify_workers)
    except _HelperUnavailable as exc:
        warn_once(
            "no-helper",
            "qerl reward: %s; comparing in daemon threads that are abandoned (not stopped) at the time limit",
            exc,
        )
        return _equal_abandonable(gold, pred, timeout_s)
