"""verl_ext.answers: which answer a response commits to (rule order), and the ground-truth forms."""

from __future__ import annotations

import numpy as np
import pytest

from verl_ext.answers import Extraction, extract_answer, extract_ground_truth
from verl_ext.reward import compute_score


# ----------------------------------------------------------------------------------------------------
# Extraction order


@pytest.mark.parametrize(
    "response,answer,method",
    [
        ("The answer is 3. #### 4\nSo \\boxed{5}, then 6", "5", "boxed"),
        ("The answer is 3.\n#### 4\nthen 6", "4", "####"),
        ("The answer is 3, then 6 more", "3", "answer_is"),
        ("I got 3 and then 6", "6", "last_number"),
        ("\\boxed{1} first, finally \\boxed{2}", "2", "boxed"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", "boxed"),  # nested braces
        ("\\boxed{5} then a truncated \\boxed{6", "5", "boxed"),
        ("\\fbox{9}", "9", "boxed"),
        ("\\boxed{} but #### 8", "8", "####"),  # an empty box does not count
        ("#### 7\nlater\n#### 8", "8", "####"),
        ("#### Step 1: add 2 and 3\nthe answer is 5", "5", "answer_is"),  # a markdown heading, not an answer
        ("#### $1,000.", "1,000", "####"),
        ("**Final Answer:** $\\dfrac{3}{4}$", "\\dfrac{3}{4}", "answer_is"),
        ("Answer: 12 apples.", "12", "answer_is"),
        ("The final answer is $x = 3$. Done.", "x = 3", "answer_is"),
        ("Answer: let me think again. It is 12", "12", "last_number"),  # prose after "Answer:" is skipped
        ("<think>the answer is 5</think>The answer is 6", "6", "answer_is"),
        ("<think>maybe 5</think>no number here", None, "none"),
        ("", None, "none"),
        ("no digits at all", None, "none"),
    ],
)
def test_extraction_order(response, answer, method):
    assert extract_answer(response) == Extraction(answer, method)


def test_last_number_fallback_can_be_switched_off():
    assert extract_answer("I got 3 and then 6", allow_last_number=False) == Extraction(None, "none")
    out = compute_score("openai/gsm8k", "I got 72", "72", allow_last_number=False, no_answer_reward=-1.0)
    assert out == {"score": -1.0, "acc": 0.0, "pred": ""}
    assert compute_score("openai/gsm8k", "I got 72", "72")["acc"] == 1.0


# ----------------------------------------------------------------------------------------------------
# Ground truth formats


@pytest.mark.parametrize(
    "gt,expected",
    [
        ("72", ["72"]),
        ("#### 72", ["72"]),
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72", ["72"]),
        ("#### 1,000", ["1000"]),
        ("\\boxed{\\frac{1}{2}}", ["\\frac{1}{2}"]),
        ("$\\frac{1}{2}$", ["\\frac{1}{2}"]),
        (72, ["72"]),
        (0.5, ["0.5"]),
        (3.0, ["3"]),
        (["3", "x=3"], ["3", "x=3"]),
        (np.array(["4", "#### 5"], dtype=object), ["4", "5"]),
    ],
)
def test_ground_truth_forms(gt, expected):
    assert extract_ground_truth(gt) == expected
