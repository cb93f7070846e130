"""verl_ext.reward: compute_score's return shape, ground-truth handling, garbage and long responses, options,
data-source routing (ours vs verl's scorers), and the real verl 0.9.1 loading/calling path
(get_custom_reward_fn, load_reward_manager -> run_single, a Ray RewardLoopWorker)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from verl_ext import reward
from verl_ext.reward import compute_score, is_math_data_source
from helpers import SLOW_GOLD, chat_tokenizer

REWARD_FILE = Path(reward.__file__).resolve()


# ----------------------------------------------------------------------------------------------------
# Return shape and ground truth


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
    assert is_math_data_source(source)
    assert compute_score(source, "\\boxed{\\frac{1}{2}}", "0.5")["score"] == 1.0


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
    with ThreadPoolExecutor(max_workers=1) as pool:  # a worker thread, as verl's run_in_executor uses
        assert pool.submit(fn, solution_str="\\boxed{\\frac{2}{4}}", ground_truth="0.5", **kw).result(120)["score"] == 1.0
        assert pool.submit(fn, solution_str="\\boxed{5}", ground_truth=SLOW_GOLD, **kw).result(120)["score"] == 0.0


def test_importing_the_reward_module_is_cheap():
    """Every Ray reward worker imports it (and every helper process verl_ext.verify, which it imports): no verl,
    torch, sympy or math-verify yet."""
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
