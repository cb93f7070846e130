"""verl_ext.reward: answer extraction, math-verify equivalence, timeouts outside the main thread, and the
real verl 0.9.1 loading/calling path (get_custom_reward_fn, load_reward_manager -> run_single)."""

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

import numpy as np
import pytest

from verl_ext import reward
from verl_ext.reward import compute_score, extract_answer, extract_ground_truth
from helpers import chat_tokenizer

REWARD_FILE = Path(reward.__file__).resolve()
# Parsing 10^{10^{10}} and comparing it with anything takes sympy far longer than any sane time limit.
SLOW_GOLD = "10^{10^{10}}"


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
# Cases our normalisation decides before/around math-verify (documented in the module docstring).
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


def test_return_shape_is_the_same_for_every_outcome():
    outs = [
        compute_score("openai/gsm8k", "#### 72", "72"),
        compute_score("openai/gsm8k", "#### 71", "72"),
        compute_score("openai/gsm8k", "", "72"),
        compute_score("math", "\\boxed{\\frac12}", "0.5"),
        compute_score("searchR1_nq", "<answer>Paris</answer>", {"target": ["Paris"]}),  # delegated to verl
    ]
    for out in outs:
        assert set(out) == {"score", "acc", "pred"}
        assert isinstance(out["score"], float) and isinstance(out["acc"], float) and isinstance(out["pred"], str)


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
    assert extract_answer(response) == reward.Extraction(answer, method)


def test_last_number_fallback_can_be_switched_off():
    assert extract_answer("I got 3 and then 6", allow_last_number=False) == reward.Extraction(None, "none")
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


def test_gsm8k_solution_as_ground_truth_scores_like_the_number():
    gt = "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"
    assert compute_score("openai/gsm8k", "3 + 4 = 7\n#### 7", gt)["score"] == 1.0
    assert compute_score("openai/gsm8k", "3 + 4 = 8\n#### 8", gt)["score"] == 0.0
    assert compute_score("openai/gsm8k", "The answer is 7.", ["6", "7"])["score"] == 1.0


def test_empty_ground_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="empty ground truth.*fix the dataset row"):
        compute_score("openai/gsm8k", "#### 7", "   ")


# ----------------------------------------------------------------------------------------------------
# Garbage, long responses, options


@pytest.mark.parametrize(
    "response",
    ["", None, "asdf qwerty", "\\boxed{", "\\boxed{}", "}}}{{{", "####", "The answer is", "\x00\xff\ud7ff",
     "\\boxed{\\frac{1}{}", "$$$$", "\\boxed{\\left(}", "🙂" * 50],
)
def test_garbage_scores_zero_without_raising(response):
    out = compute_score("math", response, "\\frac{1}{2}")
    assert out["score"] == 0.0 and out["acc"] == 0.0


def test_very_long_responses_are_fast():
    filler = "Let me reconsider the problem carefully. " * 5000  # ~200 kB
    start = time.monotonic()
    assert compute_score("openai/gsm8k", filler + "#### 72", "72")["score"] == 1.0
    assert compute_score("math", filler + "\\boxed{\\frac{1}{2}}", "0.5")["score"] == 1.0
    assert compute_score("openai/gsm8k", filler, "72")["score"] == 0.0
    # Degenerate repetition: unclosed boxes, headings, math openers; extraction must stay linear.
    for junk in ("\\boxed{" * 30000, "#### \\(" * 30000, "The answer is \\(" * 15000, "1" * 200000):
        out = compute_score("openai/gsm8k", junk, "72")
        assert out["score"] == 0.0
    assert time.monotonic() - start < 20.0


def test_answer_longer_than_the_limit_is_wrong_without_parsing():
    out = compute_score("math", "\\boxed{" + "x+" * 400 + "1}", "1", max_answer_chars=512)
    assert out["score"] == 0.0 and len(out["pred"]) == 512


def test_reward_values_are_configurable():
    assert compute_score("openai/gsm8k", "#### 5", "5", correct_reward=2.0)["score"] == 2.0
    assert compute_score("openai/gsm8k", "#### 4", "5", incorrect_reward=-1.0)["score"] == -1.0  # DAPO style
    assert compute_score("openai/gsm8k", "", "5", incorrect_reward=-1.0)["score"] == -1.0
    assert compute_score("openai/gsm8k", "", "5", no_answer_reward=-0.5)["score"] == -0.5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"correct_reward": "1"}, "reward_kwargs.correct_reward must be a number"),
        ({"timeout_s": 0}, "reward_kwargs.timeout_s must be a positive"),
        ({"verify_mode": "threads"}, "reward_kwargs.verify_mode must be one of"),
        ({"verify_workers": 0}, "reward_kwargs.verify_workers must be an integer"),
    ],
)
def test_bad_options_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_score("openai/gsm8k", "#### 5", "5", **kwargs)


def test_unknown_options_are_reported_once(caplog):
    with caplog.at_level("WARNING", logger="qerl.verl.reward"):
        compute_score("openai/gsm8k", "#### 5", "5", corect_reward=2.0)
        compute_score("openai/gsm8k", "#### 5", "5", corect_reward=2.0)
    hits = [r for r in caplog.records if "corect_reward" in r.getMessage()]
    assert len(hits) == 1


# ----------------------------------------------------------------------------------------------------
# Data sources: ours vs verl's built-in scorers


def test_other_data_sources_go_to_verls_default_scorer():
    from verl.utils.reward_score import default_compute_score

    solution, gt = "<answer>Paris</answer>", {"target": ["Paris"]}
    ref = float(default_compute_score("searchR1_nq", solution, gt))
    assert ref == 1.0
    assert compute_score("searchR1_nq", solution, gt) == {"score": ref, "acc": ref, "pred": ""}
    with pytest.raises(NotImplementedError):  # verl's own error for a source nobody knows
        compute_score("my/unknown", "#### 5", "5")
    with pytest.raises(ValueError, match="math_data_sources"):
        compute_score("my/unknown", "#### 5", "5", fallback_to_verl=False)
    assert compute_score("my/unknown", "#### 5", "5", math_data_sources=["my/unknown"])["score"] == 1.0
    assert compute_score("my/unknown", "#### 5", "5", math_data_sources=["*"])["score"] == 1.0


def test_verl_builtin_scorers_are_untouched():
    import verl.utils.reward_score as rs
    from verl.experimental.reward_loop.reward_manager import naive

    assert rs.default_compute_score.__module__ == "verl.utils.reward_score"
    assert naive.default_compute_score is rs.default_compute_score
    assert rs.default_compute_score("openai/gsm8k", "#### 72", "72") == 1.0


@pytest.mark.parametrize(
    "source", ["openai/gsm8k", "gsm8k", "HuggingFaceH4/MATH-500", "math_dapo", "aime2024", "qerl/synthetic_arithmetic"]
)
def test_math_sources_are_ours(source):
    assert reward.is_math_data_source(source)
    assert compute_score(source, "\\boxed{\\frac{1}{2}}", "0.5")["score"] == 1.0


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
    helper = reward._Helper()
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
        from verl_ext import reward
        out = {{}}
        score = lambda: out.update(r=reward.compute_score("math", "\\\\boxed{{0.5}}", "\\\\frac12"))
        t = threading.Thread(target=score)
        t.start(); t.join()
        pids = [h.proc.pid for h in list(reward._POOL._idle.queue) if h.proc is not None]
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


# ----------------------------------------------------------------------------------------------------
# Called exactly the way verl calls it


def _verl_config(path: str, **reward_kwargs):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {"path": path, "name": "compute_score", "reward_kwargs": reward_kwargs},
                "reward_manager": {
                    "source": "register",
                    "name": "naive",
                    "module": {"path": None, "name": "custom_reward_manager"},
                },
            }
        }
    )


@pytest.mark.parametrize("path", ["pkg://verl_ext.reward", str(REWARD_FILE)])
def test_verl_loader_finds_and_wraps_our_function(path):
    from verl.trainer.ppo.reward import get_custom_reward_fn

    fn = get_custom_reward_fn(_verl_config(path, incorrect_reward=-1.0))
    kw = dict(data_source="openai/gsm8k", extra_info={"index": 0})
    assert fn(solution_str="so #### 72", ground_truth="72", **kw) == {"score": 1.0, "acc": 1.0, "pred": "72"}
    assert fn(solution_str="so #### 71", ground_truth="72", **kw)["score"] == -1.0  # reward_kwargs reached us


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "reward.custom_reward_function.path=pkg://verl_ext.reward",
            "reward.custom_reward_function.name=compute_score",
            "+reward.custom_reward_function.reward_kwargs.incorrect_reward=-1.0",
        ],
        # verl's legacy top-level block, migrated by verl to reward.custom_reward_function
        ["custom_reward_function.path=pkg://verl_ext.reward", "custom_reward_function.name=compute_score"],
    ],
)
def test_verls_own_trainer_config_selects_it(overrides):
    """The documented overrides on verl's real ppo_trainer.yaml (Hydra compose + verl's legacy migration)."""
    from hydra import compose, initialize_config_dir
    import verl
    from verl.experimental.reward_loop.reward_loop import migrate_legacy_reward_impl
    from verl.trainer.ppo.reward import get_custom_reward_fn

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = migrate_legacy_reward_impl(compose("ppo_trainer", overrides=overrides))
    fn = get_custom_reward_fn(config)
    kw = dict(data_source="openai/gsm8k", ground_truth="4", extra_info={})
    assert fn(solution_str="#### 4", **kw)["score"] == 1.0
    wrong = -1.0 if any("incorrect_reward" in o for o in overrides) else 0.0
    assert fn(solution_str="#### 3", **kw)["score"] == wrong


def _one_item(tokenizer, response: str, ground_truth, data_source: str, prompt_len: int = 8, resp_len: int = 96):
    import torch
    from verl import DataProto

    ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(ids) < resp_len  # right padding, as in a real batch
    responses = torch.full((1, resp_len), tokenizer.pad_token_id)
    responses[0, : len(ids)] = torch.tensor(ids)
    attention = torch.zeros((1, prompt_len + resp_len), dtype=torch.long)
    attention[0, :prompt_len] = 1
    attention[0, prompt_len : prompt_len + len(ids)] = 1
    return DataProto.from_dict(
        tensors={
            "prompts": torch.full((1, prompt_len), tokenizer.pad_token_id),
            "responses": responses,
            "attention_mask": attention,
        },
        non_tensors={
            "data_source": np.array([data_source], dtype=object),
            "reward_model": np.array([{"style": "rule", "ground_truth": ground_truth}], dtype=object),
            "extra_info": np.array([{"split": "test", "index": 0}], dtype=object),
        },
    )


@pytest.mark.parametrize("manager", ["naive", "dapo"])
def test_verl_reward_manager_runs_it_in_its_executor_thread(manager):
    """verl's own reward-loop manager decodes the response and calls us via run_in_executor (a thread)."""
    from verl.trainer.ppo.reward import load_reward_manager

    tokenizer = chat_tokenizer()
    config = _verl_config("pkg://verl_ext.reward", timeout_s=1.0)
    config.reward.reward_manager.name = manager
    mgr = load_reward_manager(config, tokenizer)
    assert mgr.compute_score.func.__name__ == "_call_with_kwargs"  # verl's wrapper around our function

    cases = [
        ("Step 1: 48 / 2 = 24.\n#### 72", "72", "openai/gsm8k", 1.0),
        ("So the answer is \\boxed{\\dfrac{1}{2}}.", "0.5", "HuggingFaceH4/MATH-500", 1.0),
        ("\\boxed{5}", SLOW_GOLD, "math", 0.0),  # times out in the executor thread: scored 0, no crash
        ("I give up", "72", "openai/gsm8k", 0.0),
    ]

    async def run_all():
        outs = []
        for response, gt, source, _ in cases:
            outs.append(await mgr.run_single(_one_item(tokenizer, response, gt, source)))
        return outs

    outs = mgr.loop.run_until_complete(run_all())
    for (response, gt, source, expected), out in zip(cases, outs):
        assert out["reward_score"] == expected, (response, out)
        assert out["reward_extra_info"]["acc"] == expected
        assert set(out["reward_extra_info"]) == {"score", "acc", "pred"}
    assert outs[0]["reward_extra_info"]["pred"] == "72"


def test_reward_runs_in_a_ray_like_worker_thread_via_file_path():
    """Loaded by file path (a different module object), called from a thread: still scores and times out."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    fn = get_custom_reward_fn(_verl_config(str(REWARD_FILE), timeout_s=1.0))
    kw = dict(data_source="math", extra_info={})
    assert _in_thread(fn, solution_str="\\boxed{\\frac{2}{4}}", ground_truth="0.5", **kw)["score"] == 1.0
    assert _in_thread(fn, solution_str="\\boxed{5}", ground_truth=SLOW_GOLD, **kw)["score"] == 0.0


def test_importing_the_reward_module_is_cheap():
    """Every Ray reward worker and every helper process imports it: no verl, torch, sympy or math-verify yet."""
    code = (
        "import sys, json; import verl_ext.reward; "
        "print(json.dumps(sorted(m for m in ('verl', 'torch', 'sympy', 'math_verify', 'vllm') if m in sys.modules)))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == []


@pytest.mark.slow
def test_inside_a_real_ray_reward_loop_worker(tmp_path):
    """End to end as in training: verl's RewardLoopWorker as a Ray actor loads the tokenizer and our function
    from the config and scores a batch in its executor threads; the runaway comparison is cut at timeout_s."""
    ray = pytest.importorskip("ray")
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    tokenizer = chat_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    config = _verl_config("pkg://verl_ext.reward", timeout_s=1.0)
    config.actor_rollout_ref = {"model": {"path": str(tmp_path / "tok"), "tokenizer_path": None}}
    config.reward.reward_model = {"enable": False}
    cases = [
        ("Altogether 48 + 24 = 72.\n#### 72", "72", "openai/gsm8k", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", "math", 1.0),
        ("\\boxed{5}", SLOW_GOLD, "math", 0.0),
        ("\\boxed{0.7}", "0.5", "math", 0.0),
        ("#### 8", "8", "qerl/synthetic_arithmetic", 1.0),
    ]
    batch = DataProto.concat([_one_item(tokenizer, r, g, s) for r, g, s, _ in cases])
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        worker = ray.remote(RewardLoopWorker).remote(config)
        outs = ray.get(worker.compute_score_batch.remote(batch), timeout=180)
        ray.kill(worker)
    finally:
        if started:
            ray.shutdown()
    assert [o["reward_score"] for o in outs] == [c[3] for c in cases]
    assert all(set(o["reward_extra_info"]) == {"score", "acc", "pred"} for o in outs)
