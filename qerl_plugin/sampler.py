"""A wall-clock sampling profiler for every process of a run: where each thread spends its time.

verl spreads a training step over Ray actors (the driver, the actor/rollout worker, the vLLM server, agent-loop
and reward workers); torch's profiler sees one process at a time and only its torch ops. This sampler runs a
daemon thread in each process that imports it with ``QERL_PROFILE_DIR`` set: every ``QERL_PROFILE_INTERVAL_MS``
(default 10) it records the Python stack of every other thread, and every 20 s it rewrites
``$QERL_PROFILE_DIR/<pid>.txt`` with the process's command line and, per thread, the functions that were on the
stack most often (inclusive: a sample counts once for every distinct function in its stack) and the innermost
frames (exclusive). Samples in idle waits (``select``, ``wait``, ``sleep``, ``accept``...) count like any other,
so a worker's own time shows next to its waits.

    QERL_PROFILE_DIR=/tmp/prof python -m verl.trainer.main_ppo ...     # verl imports qerl in every process

Imports only the standard library.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

ENV_DIR = "QERL_PROFILE_DIR"
ENV_INTERVAL = "QERL_PROFILE_INTERVAL_MS"
_TOP = 40
_started = False


def _frame_key(frame) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("site-packages/", "lib/python3", "/work/"):
        i = path.find(marker)
        if i >= 0:
            path = path[i + len(marker):]
            break
    return f"{path}:{code.co_name}"


class Sampler:
    """Counts, per thread name, the functions on the stack (inclusive) and at its top (exclusive)."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.samples: collections.Counter[str] = collections.Counter()
        self.inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.exclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._me = None

    def sample_once(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == self._me:
                continue
            thread = names.get(ident, str(ident))
            self.samples[thread] += 1
            self.exclusive[thread][_frame_key(frame)] += 1
            seen = set()
            while frame is not None:
                key = _frame_key(frame)
                if key not in seen:
                    seen.add(key)
                    self.inclusive[thread][key] += 1
                frame = frame.f_back

    def report(self) -> str:
        lines = [f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}", f"interval {self.interval_s * 1000:.0f} ms"]
        for thread, n in self.samples.most_common():
            lines.append(f"\n== thread {thread}: {n} samples ({n * self.interval_s:.1f} s)")
            lines.append("-- inclusive (share of samples with the function on the stack)")
            for key, c in self.inclusive[thread].most_common(_TOP):
                lines.append(f"{100 * c / n:6.1f}%  {key}")
            lines.append("-- exclusive (innermost frame)")
            for key, c in self.exclusive[thread].most_common(_TOP // 2):
                lines.append(f"{100 * c / n:6.1f}%  {key}")
        return "\n".join(lines) + "\n"

    def run(self, path: str, flush_every_s: float = 20.0) -> None:
        self._me = threading.get_ident()
        last = time.monotonic()
        while True:
            time.sleep(self.interval_s)
            self.sample_once()
            if time.monotonic() - last >= flush_every_s:
                last = time.monotonic()
                try:
                    with open(path + ".tmp", "w") as fh:
                        fh.write(self.report())
                    os.replace(path + ".tmp", path)
                except OSError:
                    return


def _forked() -> None:  # the sampler thread does not survive a fork: let the child start its own
    global _started
    _started = False


os.register_at_fork(after_in_child=_forked)


def start_from_env() -> bool:
    """Start the sampler thread in this process when ``QERL_PROFILE_DIR`` is set (once per process)."""
    global _started
    folder = os.environ.get(ENV_DIR)
    if _started or not folder:
        return False
    try:
        os.makedirs(folder, exist_ok=True)
        interval = float(os.environ.get(ENV_INTERVAL, "10")) / 1000
    except (OSError, ValueError):
        return False
    _started = True
    sampler = Sampler(interval)
    path = os.path.join(folder, f"{os.getpid()}.txt")
    threading.Thread(target=sampler.run, args=(path,), name="qerl-sampler", daemon=True).start()
    return True
