"""verl_ext.logprobs against verl's own logprobs_from_logits_v2 (the unpatched function) and a float64 reference."""

from __future__ import annotations

import pytest
import torch

from verl_ext.logprobs import logprobs_blocked


def _verl_v2():
    import verl.utils.torch_functional as tf

    fn = tf.logprobs_from_logits_v2
    return getattr(fn, "__wrapped__", fn)  # verl's own, whether or not qerl's patch is applied


@pytest.mark.parametrize("shape", [(37,), (3, 11), (1, 50)])
@pytest.mark.parametrize("block", [1, 7 * 97, 1 << 27])
def test_float32_equals_verls_loop_values_and_gradients(shape, block):
    torch.manual_seed(0)
    vocab = 97
    logits = torch.randn(*shape, vocab, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, vocab, shape)
    ours = logprobs_blocked(logits, labels, block_elements=block)
    (g_ours,) = torch.autograd.grad(ours.square().sum(), logits)
    ref = _verl_v2()(logits, labels)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), logits)
    assert ours.shape == ref.shape == shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=2e-6)
    exact = torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ours.double(), exact, rtol=0, atol=1e-5)


def test_bfloat16_equals_verls_loop():
    torch.manual_seed(1)
    logits = (3 * torch.randn(4, 9, 300)).to(torch.bfloat16)
    labels = torch.randint(0, 300, (4, 9))
    ours = logprobs_blocked(logits, labels, block_elements=1000)
    ref = _verl_v2()(logits, labels)
    assert ours.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(ours, ref)  # log_softmax of the same rows, in the same dtype


def test_verl_uses_the_blocked_path_once_patched():
    """verl's logprobs_from_logits reaches logprobs_from_logits_v2 through the module, so the patch applies."""
    import verl.utils.torch_functional as tf

    from verl_ext import patches

    patches.apply_all()
    assert patches.is_patched(tf.logprobs_from_logits_v2)
    logits = torch.randn(5, 40, requires_grad=True)
    labels = torch.randint(0, 40, (5,))
    torch.testing.assert_close(tf.logprobs_from_logits_v2(logits, labels), logprobs_blocked(logits, labels))
