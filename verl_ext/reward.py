"""Math reward for verl 0.9.1: extract the final answer, compare it with math-verify, return score/acc/pred.

Use it from a verl config (opt-in: verl's built-in scorers are untouched)::

    reward:
      custom_reward_function:
        path: pkg://verl_ext.reward      # or the file path of this module
        name: compute_score
        reward_kwargs: {}                # optional, see "Options" below

On the command line: ``reward.custom_reward_function.path=pkg://verl_ext.reward
reward.custom_reward_function.name=compute_score`` and, for options,
``+reward.custom_reward_function.reward_kwargs.incorrect_reward=-1.0``. The legacy top-level
``custom_reward_function: {path, name}`` block works too (verl migrates it to ``reward.``).

How verl calls it (``verl/trainer/ppo/reward.py`` ``get_custom_reward_fn`` loads ``name`` from ``path`` with
``load_extern_object``; the reward-loop managers in ``verl/experimental/reward_loop/reward_manager/``
call it per sample, with ``reward_kwargs`` merged into the keyword arguments, inside
``loop.run_in_executor(None, ...)``, i.e. **in a worker thread of a Ray actor**)::

    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **kwargs)
      -> {"score": float, "acc": float, "pred": str}

``score`` becomes the token-level reward; ``acc`` and ``pred`` go to ``reward_extra_info`` (verl's
validation metrics average ``acc`` and majority-vote on ``pred``). Every call returns the same three keys,
also for data sources delegated to verl, because verl builds its arrays from the first sample's keys.

Answer extraction, in this order (the first rule that finds something wins; within a rule the LAST
occurrence in the response counts):

1. ``\\boxed{...}`` (also ``\\fbox{...}``), with balanced braces.
2. ``#### X`` (the GSM8K format): the rest of that line.
3. ``The final answer is X`` / ``The answer is X`` / ``Answer: X`` (any case; ``**`` markdown allowed).
4. The last number in the response (only with ``allow_last_number=True``, the default).

If the response contains ``</think>``, only the text after the last ``</think>`` is searched. The
extracted text is tidied: after a marker the content of a math span (``$...$``, ``\\(...\\)``) is taken,
a trailing period and ``**`` are dropped, a leading number followed by plain words keeps the number
(``18 dollars`` -> ``18``), ``%``/``\\%``, ``$``/``\\$`` signs and thousands separators go, the unicode
minus becomes ``-``. The ground truth is read the same way: a GSM8K answer with ``#### 72`` gives ``72``,
a ``\\boxed{}`` gives its content, numbers/ints/floats are accepted, a list of strings means "any of these".

Comparison: two plain integers are compared exactly (GSM8K, synthetic data: no sympy at all);
anything else goes through math-verify (``math_verify.parse`` on ``\\boxed{answer}`` with LaTeX and
plain-expression extraction, then ``math_verify.verify(gold, pred)``), so ``0.5 == \\frac{1}{2} ==
\\dfrac12``, ``1,000 == 1000``, ``x=3 == 3``, ``{1,2} == {2,1}``, ``[1,2) == [1,2)``. A percentage is read
as its number (``50%`` equals 50, not 0.5).

Timeouts: math-verify's own timeouts use ``signal.alarm``, which raises in any thread but the main one,
and verl calls us from a thread. So we pass ``parsing_timeout=None``/``timeout_seconds=None`` to
math-verify and bound the time ourselves: in the main thread with ``signal.setitimer`` around the whole
comparison; in any other thread (Ray) by sending the comparison to a small pool of persistent helper
processes (``python -c`` servers that load this file, one JSON line per request; ``verify_workers`` per
reward worker, started on first need, ~60 MB each, exiting with their parent). A helper bounds each
comparison with its own alarm and is killed if it has not answered ``timeout_s + 2`` s later (a computation
stuck in C code); it restarts on the next request. A timed-out comparison scores as wrong.
If helper processes cannot start (said once in the log), the comparison runs in a daemon thread that is
abandoned at the deadline (it cannot be stopped, so a runaway one keeps a core busy until it finishes).

Options (``reward_kwargs``): ``correct_reward`` (1.0), ``incorrect_reward`` (0.0; DAPO uses -1.0),
``no_answer_reward`` (None: same as ``incorrect_reward``; a format penalty, e.g. -1.0, when nothing could
be extracted), ``allow_last_number`` (True; False requires ``\\boxed``/``####``/"answer is"),
``timeout_s`` (5.0 per comparison), ``verify_mode`` ("auto"; "process" always uses helper processes,
"inline" never does), ``verify_workers`` (2 helper processes per reward worker), ``max_answer_chars``
(512; a longer extracted answer scores as wrong), ``math_data_sources`` (extra data sources to score
here; ``["*"]`` = all), ``fallback_to_verl`` (True: other data sources go to verl's
``default_compute_score``; False: they raise).

Data sources scored here: ``openai/gsm8k``, ``gsm8k``, the MATH sets verl knows
(``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``), ``math``,
``math_dapo``, ``math_dapo_reasoning``, ``BytedTsinghua-SIA/DAPO-Math-17k``, and anything starting with
``aime``, ``numina_``, ``qerl/`` (our synthetic data is ``qerl/synthetic_arithmetic``).
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
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

__all__ = [
    "Extraction",
    "compute_score",
    "extract_answer",
    "extract_ground_truth",
    "is_equivalent",
    "is_math_data_source",
    "normalize_answer",
    "shutdown_helpers",
]

logger = logging.getLogger("qerl.verl.reward")

MATH_DATA_SOURCES = frozenset(
    {
        "openai/gsm8k",
        "gsm8k",
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
        "math",
        "math_dapo",
        "math_dapo_reasoning",
        "BytedTsinghua-SIA/DAPO-Math-17k",
    }
)
MATH_DATA_SOURCE_PREFIXES = ("aime", "numina_", "qerl/")

# Keyword arguments verl itself may pass besides ours (reward-loop managers, sandbox fusion).
_VERL_KWARGS = frozenset(
    {"reward_router_address", "reward_model_tokenizer", "sandbox_fusion_url", "concurrent_semaphore", "memory_limit_mb"}
)
_VERIFY_MODES = ("auto", "process", "inline")


# ----------------------------------------------------------------------------------------------------
# Extraction


class Extraction(NamedTuple):
    """The answer found in a response: ``answer`` is None when nothing was found; ``method`` names the
    rule that found it ("boxed", "####", "answer_is", "last_number" or "none").

    (A NamedTuple, not a dataclass: verl loads a ``path:`` file without registering it in ``sys.modules``,
    which dataclasses need.)"""

    answer: str | None
    method: str


_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
# A number at the start of a string, optionally with a currency sign and a percent sign.
_LEADING_NUMBER_RE = re.compile(r"^(?:\\?\$\s*)?(" + _NUMBER + r")(?:\s*\\?%)?")
# The text after a marker is read up to the end of its line, at most 1024 characters (keeps regexes linear).
_HASH_RE = re.compile(r"####[ \t]*([^\n]{0,1024})")
_ANSWER_IS_RE = re.compile(
    r"(?:final\s+answer\s+is|answer\s+is|final\s+answer\s*:|answer\s*:)[ \t]*\**[ \t]*:?[ \t]*([^\n]{0,1024})",
    re.IGNORECASE,
)
_MATH_SPAN_RE = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
# End of the answer inside a sentence: a period before whitespace/end, a semicolon, or a comma before a word.
_SENTENCE_END_RE = re.compile(r"\.(?=\s|$)|;|,\s+(?=[A-Za-z]{2,})")
# After a leading number: a word ("18 dollars", "3 then 6") or punctuation before a word or the end ("72.",
# "5, which"). Not "2x", "3/4", "1, 2", "3 + 4" or "3 \\text{cm}": those stay whole.
_WORDS_AFTER_NUMBER_RE = re.compile(r"^(?:\s+[A-Za-z]|\s*[.,;:!?)]+\s*(?:[A-Za-z]|$))")
_HASH_START_RE = re.compile(r"^\s*(?:\\?\$|-|\u2212|\d|\\|\(|\[|\{)")
_PROSE_RE = re.compile(r"[A-Za-z][A-Za-z']+[ \t]+[A-Za-z][A-Za-z']+")
_INTEGER_RE = re.compile(r"^-?\d{1,300}$")
_GROUPED_INTEGER_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+$")
_PLAIN_NUMBER_RE = re.compile(r"^-?(?:\d{1,3}(?:,\d{3})+|\d{1,300})(?:\.\d{1,300})?$")


def _last_braced(text: str, commands: Sequence[str]) -> str | None:
    """Content of the last ``\\cmd{...}`` for any of ``commands`` whose braces close; None if none does.

    Linear time: when the box opened at ``start`` never closes, an earlier box can only be complete if it
    closes before ``start`` (its depth stays above zero after that), so each retry scans up to the last
    failed start."""
    pattern = re.compile("(?:" + "|".join(re.escape(cmd) for cmd in commands) + r")\{")
    starts = [match.end() for match in pattern.finditer(text)]
    limit = len(text)
    for start in reversed(starts):
        depth = 1
        for i in range(start, limit):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
        limit = start  # unclosed (e.g. a truncated response): try the previous one
    return None


def _cut_sentence(text: str) -> str:
    match = _SENTENCE_END_RE.search(text)
    return text[: match.start()] if match else text


def _tidy(raw: str, *, boxed: bool = False) -> str:
    """Turn the text inside a box, or after a marker, into an answer string."""
    text = raw.strip().replace("\u2212", "-")
    if not boxed:
        text = text.replace("**", "").strip()
    span = _MATH_SPAN_RE.search(text)
    lead = _LEADING_NUMBER_RE.match(text)
    if lead is not None:
        rest = text[lead.end() :]
        if not rest or _WORDS_AFTER_NUMBER_RE.match(rest):
            return lead.group(1)
    if span is not None and not boxed:
        text = next(group for group in span.groups() if group is not None)
    elif not boxed:
        text = _cut_sentence(text)
    return text.strip().rstrip(".").strip()


def _is_prose(text: str) -> bool:
    """Two plain words in a row outside LaTeX commands: a sentence, not an answer."""
    plain = re.sub(r"\\[A-Za-z]+(\{[^{}]*\})?", " ", text)
    return _PROSE_RE.search(plain) is not None


_MAX_MARKER_TRIES = 16  # markers looked at, from the last one backwards, before a rule gives up


def _last_hash_answer(text: str) -> str | None:
    # "#### 72" counts; "#### Step 2: ..." (a markdown heading) does not.
    candidates = [m.group(1) for m in _HASH_RE.finditer(text) if _HASH_START_RE.match(m.group(1))]
    for raw in reversed(candidates[-_MAX_MARKER_TRIES:]):
        answer = _tidy(raw)
        if answer:
            return answer
    return None


def _last_answer_is(text: str) -> str | None:
    candidates = [m.group(1) for m in _ANSWER_IS_RE.finditer(text) if m.group(1).strip()]
    for raw in reversed(candidates[-_MAX_MARKER_TRIES:]):
        answer = _tidy(raw)
        if answer and not _is_prose(answer):
            return answer
    return None


def extract_answer(response: str, *, allow_last_number: bool = True) -> Extraction:
    """Find the final answer in a model response (see the module docstring for the rule order)."""
    if not isinstance(response, str):
        response = "" if response is None else str(response)
    think_end = response.rfind("</think>")
    if think_end >= 0:
        response = response[think_end + len("</think>") :]

    boxed = _last_braced(response, ("\\boxed", "\\fbox"))
    if boxed is not None:
        answer = _tidy(boxed, boxed=True)
        if answer:
            return Extraction(answer, "boxed")
    answer = _last_hash_answer(response)
    if answer:
        return Extraction(answer, "####")
    answer = _last_answer_is(response)
    if answer:
        return Extraction(answer, "answer_is")
    if allow_last_number:
        last = None
        for last in _NUMBER_RE.finditer(response):
            pass
        if last is not None:
            return Extraction(last.group(0), "last_number")
    return Extraction(None, "none")


def normalize_answer(answer: str) -> str:
    """Final clean-up applied to both sides before comparing: unicode minus, currency and percent signs,
    thousands separators in plain numbers, surrounding ``$``, a trailing period."""
    text = answer.strip().replace("\u2212", "-")
    if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
        text = text.strip("$").strip()
    text = re.sub(r"^\\?\$\s*", "", text)
    text = re.sub(r"\s*\\?%$", "", text)
    text = text.rstrip(".").strip()
    if _GROUPED_INTEGER_RE.match(text) or _PLAIN_NUMBER_RE.match(text):
        text = text.replace(",", "")
    return text


def extract_ground_truth(ground_truth: Any) -> list[str]:
    """The acceptable answers in a verl ``reward_model.ground_truth`` value (str, number, or a list of them).

    ``"#### 72"`` (or a whole GSM8K solution) gives ``["72"]``; a ``\\boxed{}`` gives its content."""
    if ground_truth is None:
        return []
    if isinstance(ground_truth, bool):
        raise TypeError(f"ground_truth must be a string, a number or a list of them, got bool {ground_truth!r}")
    if isinstance(ground_truth, int):
        return [str(ground_truth)]
    if isinstance(ground_truth, float):
        return [repr(ground_truth) if not ground_truth.is_integer() else str(int(ground_truth))]
    if isinstance(ground_truth, bytes):
        ground_truth = ground_truth.decode()
    if not isinstance(ground_truth, str):
        if hasattr(ground_truth, "tolist"):  # numpy arrays / scalars from parquet
            ground_truth = ground_truth.tolist()
            if not isinstance(ground_truth, list):
                return extract_ground_truth(ground_truth)
        if isinstance(ground_truth, Iterable):
            out: list[str] = []
            for item in ground_truth:
                out.extend(extract_ground_truth(item))
            return out
        raise TypeError(f"ground_truth must be a string, a number or a list of them, got {type(ground_truth).__name__}")
    text = ground_truth.strip()
    if "####" in text:
        text = _tidy(text[text.rfind("####") + 4 :])
    else:
        boxed = _last_braced(text, ("\\boxed", "\\fbox"))
        if boxed is not None:
            text = boxed.strip()
    text = normalize_answer(text)
    return [text] if text else []


# ----------------------------------------------------------------------------------------------------
# Comparison with a time bound


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


_SERVER_CODE = (
    "import json, os, sys\n"
    "sys.path[:] = json.loads(os.environ['QERL_REWARD_SYSPATH'])\n"
    "import importlib.util as u\n"
    "s = u.spec_from_file_location('_qerl_reward_helper', os.environ['QERL_REWARD_FILE'])\n"
    "m = u.module_from_spec(s)\n"
    "sys.modules[s.name] = m\n"
    "s.loader.exec_module(m)\n"
    "m._serve()\n"
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
        env["QERL_REWARD_FILE"] = os.path.abspath(__file__)
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
_NOTICES: set[str] = set()
_TIMEOUTS = 0


def _notice_once(key: str, msg: str, *args: Any) -> None:
    if key not in _NOTICES:
        _NOTICES.add(key)
        logger.warning(msg, *args)


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

    Plain integers compare exactly; anything else through math-verify under a time bound that works in
    any thread (see the module docstring)."""
    if verify_mode not in _VERIFY_MODES:
        raise ValueError(f"verify_mode={verify_mode!r} is not one of {_VERIFY_MODES}")
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
        _notice_once(
            "no-helper",
            "qerl reward: %s; comparing in daemon threads that are abandoned (not stopped) at the time limit",
            exc,
        )
        return _equal_abandonable(gold, pred, timeout_s)


# ----------------------------------------------------------------------------------------------------
# verl entry point


def is_math_data_source(data_source: str, extra: Iterable[str] = ()) -> bool:
    extra = tuple(extra)
    return (
        "*" in extra
        or data_source in MATH_DATA_SOURCES
        or data_source in extra
        or data_source.startswith(MATH_DATA_SOURCE_PREFIXES)
    )


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"reward_kwargs.{name} must be a number, got {value!r}")
    return float(value)


def _from_verl(result: Any) -> dict[str, Any]:
    """Give a verl scorer's result our three keys (verl requires the same keys on every sample)."""
    if isinstance(result, dict):
        score = float(result["score"])
        acc = result.get("acc", score > 0)
        pred = result.get("pred")
        return {"score": score, "acc": float(acc), "pred": "" if pred is None else str(pred)}
    score = float(result)
    return {"score": score, "acc": score, "pred": ""}


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    correct_reward: float = 1.0,
    incorrect_reward: float = 0.0,
    no_answer_reward: float | None = None,
    allow_last_number: bool = True,
    timeout_s: float | None = 5.0,
    verify_mode: str = "auto",
    verify_workers: int = 2,
    max_answer_chars: int = 512,
    math_data_sources: Sequence[str] | None = None,
    fallback_to_verl: bool = True,
    **kwargs: Any,
) -> dict[str, Any]:
    """verl custom reward function: ``{"score", "acc", "pred"}`` for one response (see module docstring)."""
    global _TIMEOUTS
    correct = _as_float("correct_reward", correct_reward)
    incorrect = _as_float("incorrect_reward", incorrect_reward)
    no_answer = incorrect if no_answer_reward is None else _as_float("no_answer_reward", no_answer_reward)
    bad_timeout = isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0
    if timeout_s is not None and bad_timeout:
        raise ValueError(f"reward_kwargs.timeout_s must be a positive number of seconds or null, got {timeout_s!r}")
    if verify_mode not in _VERIFY_MODES:
        raise ValueError(f"reward_kwargs.verify_mode must be one of {_VERIFY_MODES}, got {verify_mode!r}")
    if isinstance(verify_workers, bool) or not isinstance(verify_workers, int) or verify_workers < 1:
        raise ValueError(f"reward_kwargs.verify_workers must be an integer >= 1, got {verify_workers!r}")
    if isinstance(math_data_sources, str):
        math_data_sources = [math_data_sources]
    extra_sources = tuple(str(s) for s in (math_data_sources or ()))
    unknown = set(kwargs) - _VERL_KWARGS
    if unknown:
        _notice_once(
            "kwargs:" + ",".join(sorted(unknown)),
            "qerl reward: ignoring unknown reward_kwargs %s (known: correct_reward, incorrect_reward, "
            "no_answer_reward, allow_last_number, timeout_s, verify_mode, verify_workers, max_answer_chars, "
            "math_data_sources, fallback_to_verl)",
            sorted(unknown),
        )

    if not is_math_data_source(str(data_source), extra_sources):
        if not fallback_to_verl:
            raise ValueError(
                f"qerl reward scores math data sources only, got data_source={data_source!r}; add it to "
                "reward_kwargs.math_data_sources or set reward_kwargs.fallback_to_verl=true"
            )
        from verl.utils.reward_score import default_compute_score

        sandbox = ("sandbox_fusion_url", "concurrent_semaphore", "memory_limit_mb")
        verl_kwargs = {k: v for k, v in kwargs.items() if k in sandbox}
        return _from_verl(default_compute_score(data_source, solution_str, ground_truth, extra_info, **verl_kwargs))

    golds = extract_ground_truth(ground_truth)
    if not golds:
        raise ValueError(
            f"empty ground truth for data_source={data_source!r} (reward_model.ground_truth={ground_truth!r}); "
            "fix the dataset row"
        )
    found = extract_answer(solution_str, allow_last_number=bool(allow_last_number))
    if found.answer is None:
        return {"score": no_answer, "acc": 0.0, "pred": ""}
    pred = normalize_answer(found.answer)
    if not pred or len(pred) > max_answer_chars:
        return {"score": incorrect, "acc": 0.0, "pred": pred[:max_answer_chars]}
    for gold in golds:
        ok = is_equivalent(gold, pred, timeout_s=timeout_s, verify_mode=verify_mode, verify_workers=verify_workers)
        if ok is None:
            _TIMEOUTS += 1
            if _TIMEOUTS <= 3 or _TIMEOUTS % 100 == 0:
                logger.warning(
                    "qerl reward: comparison timed out after %ss (%d so far); scoring as wrong: gold=%.80r pred=%.80r",
                    timeout_s,
                    _TIMEOUTS,
                    gold,
                    pred,
                )
        elif ok:
            return {"score": correct, "acc": 1.0, "pred": pred}
    return {"score": incorrect, "acc": 0.0, "pred": pred}
