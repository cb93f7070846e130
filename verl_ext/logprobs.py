"""Label log-probabilities in blocks of rows: verl's path without flash-attn, without its per-row loop.

verl 0.9.1 computes each token's log-probability with flash-attn's cross-entropy kernel when flash-attn is
installed, and otherwise with ``logprobs_from_logits_v2``, which loops over the first dimension of the logits
in Python. Under remove-padding the logits are ``(tokens, vocab)``, so that loop runs one ``logsumexp`` per
token: thousands of kernels and autograd nodes per micro-batch, a large share of the actor's step (profile:
docs/gpu-runs/2026-11-23/prof). :func:`logprobs_blocked` computes the same values in blocks of rows that
keep a bounded amount of memory live (``BLOCK_ELEMENTS`` logits at a time).

The wrapper is on for every verl run that loads qerl (like the adapter-extraction fix): same arithmetic, one
kernel per block instead of one per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# logits per block: 2**27 (128 Mi) elements, 512 MiB in float32 -- 2730 rows of a 49k vocabulary
BLOCK_ELEMENTS = 1 << 27


def logprobs_blocked(logits: torch.Tensor, labels: torch.Tensor, block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """``log_softmax(logits)[..., labels]`` of ``logits [..., vocab]`` and ``labels [...]``, as
    ``logprobs_from_logits_v2`` computes it: float32/float64 as ``x[label] - logsumexp(x)``, lower precisions
    with ``log_softmax`` in their own dtype."""
    shape = labels.shape
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1, 1)
    rows = max(1, block_elements // max(vocab, 1))
    spans = [(i, min(i + rows, flat.shape[0])) for i in range(0, flat.shape[0], rows)]
    if logits.dtype in (torch.float32, torch.float64):
        picked = flat.gather(-1, flat_labels).squeeze(-1)
        lse = [torch.logsumexp(flat[a:b], dim=-1) for a, b in spans]
        out = picked - (torch.cat(lse) if lse else picked.new_empty(0))
    else:
        parts = [F.log_softmax(flat[a:b], dim=-1).gather(-1, flat_labels[a:b]).squeeze(-1) for a, b in spans]
        out = torch.cat(parts) if parts else flat.new_empty(0)
    return out.view(shape)


def wrap_logprobs_from_logits_v2(original, target: str):
    def logprobs_from_logits_v2(logits, labels):
        return logprobs_blocked(logits, labels)

    return logprobs_from_logits_v2
