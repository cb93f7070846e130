"""verl custom reward for math: ``compute_score`` extracts the final answer and checks it against the ground truth.

Opt-in from a verl config (verl's built-in scorers are untouched)::

    reward:
      custom_reward_function:
        path: pkg://verl_ext.reward      # or the file path of this module
        name: compute_score
        reward_kwargs: {}                # optional, see compute_score

On the command line: ``reward.custom_reward_function.path=pkg://verl_ext.reward
reward.custom_reward_function.name=compute_score`` and, for options,
``+reward.custom_reward_function.reward_kwargs.incorrect_reward=-1.0``. The legacy top-level
``custom_reward_function: {path, name}`` block works too (verl migrates it to ``reward.``).

This module routes by data source; :mod:`verl_ext.answers` extracts the answers and
:mod:`verl_ext.verify` compares them (with time limits that work in verl's reward worker threads).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from verl_ext.answers import extract_answer, extract_ground_truth, normalize_answer
from verl_ext.verify import VERIFY_MODES, is_equivalent, warn_once

__all__ = ["MATH_DATA_SOURCES", "MATH_DATA_SOURCE_PREFIXES", "compute_score", "is_math_data_source"]

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
_TIMEOUTS = 0


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
    """verl custom reward function: ``{"score", "acc", "pred"}`` for one response.

    ``score`` becomes the token-level reward; ``acc`` and ``pred`` go to ``reward_extra_info`` (verl's
    validation metrics average ``acc`` and majority-vote on ``pred``). Every call returns the same three
    keys, also for data sources delegated to verl, because verl builds its arrays from the first sample's
    keys. A response is correct when its extracted answer equals any of the ground truth's answers.

    Scored here: :data:`MATH_DATA_SOURCES` and names starting with :data:`MATH_DATA_SOURCE_PREFIXES` (our
    synthetic data is ``qerl/synthetic_arithmetic``).

    Options (``reward_kwargs``): ``correct_reward`` (1.0), ``incorrect_reward`` (0.0; DAPO uses -1.0),
    ``no_answer_reward`` (None: same as ``incorrect_reward``; a format penalty, e.g. -1.0, when nothing could
    be extracted), ``allow_last_number`` (True; False requires ``\\boxed``/``####``/"answer is"),
    ``timeout_s`` (5.0 per comparison; a timed-out comparison scores as wrong), ``verify_mode`` ("auto";
    "process" always uses helper processes, "inline" never does), ``verify_workers`` (2 helper processes
    per reward worker), ``max_answer_chars`` (512; a longer extracted answer scores as wrong),
    ``math_data_sources`` (extra data sources to score here; ``["*"]`` = all), ``fallback_to_verl`` (True:
    other data sources go to verl's ``default_compute_score``; False: they raise).
    """
    global _TIMEOUTS
    correct = _as_float("correct_reward", correct_reward)
    incorrect = _as_float("incorrect_reward", incorrect_reward)
    no_answer = incorrect if no_answer_reward is None else _as_float("no_answer_reward", no_answer_reward)
    bad_timeout = isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0
    if timeout_s is not None and bad_timeout:
        raise ValueError(f"reward_kwargs.timeout_s must be a positive number of seconds or null, got {timeout_s!r}")
    if verify_mode not in VERIFY_MODES:
        raise ValueError(f"reward_kwargs.verify_mode must be one of {VERIFY_MODES}, got {verify_mode!r}")
    if isinstance(verify_workers, bool) or not isinstance(verify_workers, int) or verify_workers < 1:
        raise ValueError(f"reward_kwargs.verify_workers must be an integer >= 1, got {verify_workers!r}")
    if isinstance(math_data_sources, str):
        math_data_sources = [math_data_sources]
    extra_sources = tuple(str(s) for s in (math_data_sources or ()))
    unknown = set(kwargs) - _VERL_KWARGS
    if unknown:
        warn_once(
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
