"""Scores for ``qerl eval``: the unbiased pass@k estimator and the summary of a run.

pass@k is Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1): with ``n``
samples of which ``c`` are correct, ``1 - C(n-c, k) / C(n, k)`` is the chance that ``k`` of them drawn
without replacement hold at least one correct answer; its mean over problems estimates pass@k without
the bias of ``1 - (1 - c/n)^k``. It is computed as the product ``prod_{i=n-c+1}^{n} (1 - k/i)``, which
stays exact for large ``n``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

__all__ = ["Completion", "Scored", "pass_at_k", "report_ks", "summarize"]


@dataclass(frozen=True)
class Completion:
    """One generated response, as a backend returns it."""

    text: str
    num_tokens: int
    truncated: bool  # stopped by --max-new-tokens, not by an end-of-sequence token


@dataclass(frozen=True)
class Scored:
    """A completion with the reward's verdict."""

    completion: Completion
    score: float
    correct: bool
    pred: str

    def record(self) -> dict[str, Any]:
        c = self.completion
        return {
            "response": c.text,
            "pred": self.pred,
            "score": self.score,
            "correct": self.correct,
            "num_tokens": c.num_tokens,
            "truncated": c.truncated,
        }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``n`` samples, ``c`` correct (Chen et al. 2021)."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def report_ks(n: int) -> list[int]:
    """The k reported for ``n`` samples: the powers of two up to ``n``, and ``n``."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _block(greedy: Sequence[Scored] | None, samples: Sequence[Sequence[Scored]] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"num_examples": len(greedy if greedy is not None else samples or [])}
    if greedy is not None:
        out["greedy"] = {
            "pass@1": _mean(float(s.correct) for s in greedy),
            "mean_score": _mean(s.score for s in greedy),
            "truncated": _mean(float(s.completion.truncated) for s in greedy),
            "mean_tokens": _mean(s.completion.num_tokens for s in greedy),
        }
    if samples:
        n = len(samples[0])
        flat = [s for row in samples for s in row]
        out["sampled"] = {
            "n": n,
            "pass@k": {
                str(k): _mean(pass_at_k(n, sum(s.correct for s in row), k) for row in samples) for k in report_ks(n)
            },
            "mean_score": _mean(s.score for s in flat),
            "truncated": _mean(float(s.completion.truncated) for s in flat),
            "mean_tokens": _mean(s.completion.num_tokens for s in flat),
        }
    return out


def summarize(
    data_sources: Sequence[str],
    greedy: Sequence[Scored] | None,
    samples: Sequence[Sequence[Scored]] | None,
) -> dict[str, Any]:
    """Metrics over all examples, and per data source when there are several.

    ``greedy[i]`` is example i's greedy response, ``samples[i]`` its ``n`` sampled ones (either may be None).
    """
    out = _block(greedy, samples)
    sources = sorted(set(data_sources))
    if len(sources) > 1:
        out["by_data_source"] = {}
        for ds in sources:
            idx = [i for i, d in enumerate(data_sources) if d == ds]
            out["by_data_source"][ds] = _block(
                [greedy[i] for i in idx] if greedy is not None else None,
                [samples[i] for i in idx] if samples else None,
            )
    return out
