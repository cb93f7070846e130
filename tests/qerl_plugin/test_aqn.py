"""AQN schedule and noise: closed formulas, the released code's step->stage rule, determinism, names."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from qerl_plugin.aqn import (
    AQNConfig,
    AQNSchedule,
    apply_noise_fp32,
    is_aqn_target,
    noise_seed,
    noise_vector,
    normalize_module_name,
)

# ---------------------------------------------------------------------------------------------------------
# references, written independently of the module


def released_code_stage_sigma(step: int, total_steps: int, k: int, s0: float, s1: float) -> tuple[int, float]:
    """NVlabs/QeRL trl_trainer: a float step->interval rule and a numpy exponential trend of K-1 values."""
    trend = (s0 * (s1 / s0) ** (np.arange(k - 1) / (k - 2))).tolist() if k > 2 else [s0]
    step = min(step, total_steps)
    interval = int(step // (total_steps / (len(trend) + 1)))
    if interval == 0:
        return 0, 0.0
    return min(interval, k - 1), trend[min(interval - 1, len(trend) - 1)]


def closed_form(schedule: str, s0: float, s1: float, t: float) -> float:
    return {
        "exponential": lambda: math.exp(math.log(s0) + (math.log(s1) - math.log(s0)) * t),
        "linear": lambda: (1 - t) * s0 + t * s1,
        "cosine": lambda: s1 + (s0 - s1) * (math.cos(math.pi * t) + 1) / 2,
        "log": lambda: s0 - (s0 - s1) * math.log(1 + (math.e - 1) * t),
    }[schedule]()


def expected_sigma(cfg: AQNConfig, step: int) -> float:
    k, total = cfg.num_stages, cfg.total_steps
    stage = min(min(step, total) * k // total, k - 1)
    if cfg.noise_free_first_stage:
        if stage == 0:
            return 0.0
        j, n = stage - 1, k - 1
    else:
        j, n = stage, k
    t = j / (n - 1) if n > 1 else 0.0
    return closed_form(cfg.schedule, cfg.sigma_start, cfg.sigma_end, t)


# ---------------------------------------------------------------------------------------------------------
# schedule


def test_defaults_are_the_released_scripts():
    cfg = AQNConfig(total_steps=100)
    assert (cfg.sigma_start, cfg.sigma_end, cfg.num_stages, cfg.schedule) == (1e-2, 1e-4, 10, "exponential")
    assert cfg.noise_free_first_stage and cfg.resample == "stage"
    sig = AQNSchedule(cfg).sigmas()
    assert len(sig) == 10 and sig[0] == 0.0 and sig[1] == 1e-2 and sig[-1] == 1e-4


@pytest.mark.parametrize("total_steps", [10, 37, 100, 467])
@pytest.mark.parametrize("k", [2, 3, 10])
def test_matches_released_code_every_step(total_steps, k):
    if total_steps < k:
        pytest.skip("fewer steps than stages is rejected")
    sched = AQNSchedule(AQNConfig(total_steps=total_steps, num_stages=k))
    for step in range(0, total_steps + 3):  # past the end stays in the last stage
        ref_stage, ref_sigma = released_code_stage_sigma(step, total_steps, k, 1e-2, 1e-4)
        assert sched.stage(step) == ref_stage, step
        assert math.isclose(sched.sigma(step), ref_sigma, rel_tol=1e-12, abs_tol=0.0), step


@pytest.mark.parametrize("schedule", ["exponential", "linear", "cosine", "log"])
@pytest.mark.parametrize(
    "k,free,total", [(1, False, 1), (1, False, 7), (2, True, 2), (2, False, 9), (5, True, 23), (10, True, 100), (10, False, 101)]
)
def test_closed_formula_every_step(schedule, k, free, total):
    cfg = AQNConfig(sigma_start=0.05, sigma_end=2e-4, num_stages=k, schedule=schedule, total_steps=total,
                    noise_free_first_stage=free)
    sched = AQNSchedule(cfg)
    for step in range(0, total + 1):
        assert math.isclose(sched.sigma(step), expected_sigma(cfg, step), rel_tol=1e-12, abs_tol=1e-18), step
    # first and last step, exactly
    assert sched.sigma(0) == (0.0 if free else 0.05)
    assert sched.sigma(total) == (0.05 if (k - free) == 1 else 2e-4)
    assert sched.stage(total) == k - 1


@pytest.mark.parametrize("schedule", ["exponential", "linear", "cosine", "log"])
def test_monotone_decay_and_stage_sizes(schedule):
    sched = AQNSchedule(AQNConfig(total_steps=1000, num_stages=10, schedule=schedule))
    sig = [sched.sigma(s) for s in range(1001)]
    noisy = sig[sched.stage_start(1):]
    assert all(a >= b for a, b in zip(noisy, noisy[1:]))
    assert all(a > b for a, b in zip(sched.sigmas()[1:], sched.sigmas()[2:]))
    for stage in range(10):  # 1000 / 10: 100 steps each; the first step of a stage is stage_start
        assert sched.stage(sched.stage_start(stage)) == stage
        assert stage == 0 or sched.stage(sched.stage_start(stage) - 1) == stage - 1


def test_log_and_cosine_shapes_differ_from_linear():
    mk = lambda s: AQNSchedule(AQNConfig(sigma_start=1.0, sigma_end=0.0, schedule=s, total_steps=100,
                                         num_stages=11, noise_free_first_stage=False)).sigmas()
    lin, cos, log = mk("linear"), mk("cosine"), mk("log")
    assert lin[5] == pytest.approx(0.5) and cos[5] == pytest.approx(0.5)  # mid point, t = 0.5
    assert cos[1] > lin[1] and cos[9] < lin[9]  # slow start and end
    assert log[1] < lin[1] and log[9] < lin[9]  # fast early decay, concave


def test_noise_key_follows_resample_mode():
    per_stage = AQNSchedule(AQNConfig(total_steps=20, num_stages=4))
    per_step = AQNSchedule(AQNConfig(total_steps=20, num_stages=4, resample="step"))
    assert [per_stage.noise_key(s) for s in (0, 5, 6, 19)] == [0, 1, 1, 3]
    assert [per_step.noise_key(s) for s in (0, 5, 6, 19, 25)] == [0, 5, 6, 19, 20]


def test_step_argument_validation():
    sched = AQNSchedule(AQNConfig(total_steps=10, num_stages=2))
    assert sched.stage(torch.tensor(7)) == 1 and sched.stage(7.0) == 1
    for bad in (-1, 1.5, "3", None, True):
        with pytest.raises(ValueError, match="step"):
            sched.stage(bad)


# ---------------------------------------------------------------------------------------------------------
# config validation


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sigma_start=1e-4, sigma_end=1e-2), r"sigma_end .* larger than sigma_start.*swap"),
        (dict(num_stages=0), r"num_stages: must be >= 1"),
        (dict(num_stages=1), r"num_stages.*noise_free_first_stage=False"),
        (dict(sigma_start=-1e-2), r"sigma_start: must be > 0"),
        (dict(sigma_start=0.0), r"sigma_start: must be > 0.*disable AQN"),
        (dict(sigma_end=-1e-5), r"sigma_end: must be >= 0"),
        (dict(sigma_start=float("nan")), r"sigma_start: must be a finite number"),
        (dict(sigma_end=float("inf")), r"sigma_end: must be a finite number"),
        (dict(sigma_end=0.0), r"exponential schedule needs sigma_end > 0"),
        (dict(schedule="exponentail"), r"schedule: unknown value 'exponentail' \(did you mean 'exponential'\?\)"),
        (dict(schedule="step"), r"schedule: unknown value"),
        (dict(resample="epoch"), r"resample: unknown value"),
        (dict(total_steps=5), r"total_steps \(5\) is smaller than num_stages \(10\)"),
        (dict(total_steps=0, num_stages=2), r"total_steps: must be >= 1"),
        (dict(num_stages=2.5), r"num_stages: expected an integer"),
        (dict(sigma_start="lots"), r"sigma_start: 'lots' is not a number"),
        (dict(noise_free_first_stage="maybe"), r"noise_free_first_stage: expected true or false"),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AQNConfig(**{"total_steps": 100, **kwargs})


def test_config_accepts_zero_end_for_non_exponential_and_equal_ends():
    assert AQNSchedule(AQNConfig(sigma_end=0.0, schedule="linear", total_steps=10)).sigmas()[-1] == 0.0
    assert set(AQNSchedule(AQNConfig(sigma_start=3e-3, sigma_end=3e-3, total_steps=10)).sigmas()[1:]) == {3e-3}


def test_schedule_needs_total_steps():
    cfg = AQNConfig()
    with pytest.raises(ValueError, match="total_steps is not set.*with_total_steps"):
        AQNSchedule(cfg)
    assert AQNSchedule(cfg.with_total_steps(50)).config.total_steps == 50
    with pytest.raises(ValueError, match="total_steps"):
        cfg.with_total_steps(3)


def test_from_dict_plain_and_omegaconf():
    from omegaconf import OmegaConf

    yaml = OmegaConf.create(
        "enable: true\nsigma_start: 1.0e-2\nsigma_end: '1e-4'\nnum_stages: 5\nschedule: Cosine\nseed: ${oc.env:QERL_NO_SUCH_VAR,7}\n"
    )
    cfg = AQNConfig.from_dict(yaml, total_steps=40)
    assert cfg == AQNConfig(sigma_start=0.01, sigma_end=1e-4, num_stages=5, schedule="cosine", seed=7, total_steps=40)
    assert AQNConfig.from_dict(cfg.to_dict()) == cfg
    assert AQNConfig.from_dict({}) == AQNConfig()
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'sigma_strat' \(did you mean 'sigma_start'\?\)"):
        AQNConfig.from_dict({"sigma_strat": 0.1})
    with pytest.raises(ValueError, match="expected a mapping"):
        AQNConfig.from_dict([("sigma_start", 0.1)])


def test_config_is_frozen():
    cfg = AQNConfig(total_steps=10)
    with pytest.raises(Exception):
        cfg.sigma_start = 1.0  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------------
# state


def test_update_reports_only_changes_and_state_round_trip():
    sched = AQNSchedule(AQNConfig(total_steps=30, num_stages=3))
    first = sched.update(1)
    assert first is not None and first.stage == 0 and first.sigma == 0.0 and not first.active
    assert sched.update(2) is None
    s = sched.update(10)
    assert s is not None and s.stage == 1 and s.sigma == 1e-2 and s.key == 1 and s.active
    assert sched.update(15) is None

    state = sched.state_dict()
    resumed = AQNSchedule(AQNConfig(total_steps=30, num_stages=3))
    resumed.load_state_dict(state)
    assert resumed.restored_setting == s
    again = resumed.update(15)  # a restarted engine holds no noise: the setting is pushed again
    assert again is not None and again.key == s.key and again.sigma == s.sigma
    for step in range(31):
        assert resumed.setting(step) == sched.setting(step)


def test_load_state_rejects_changed_config_unless_lenient():
    state = AQNSchedule(AQNConfig(total_steps=30, num_stages=3)).state_dict()
    other = AQNSchedule(AQNConfig(total_steps=30, num_stages=3, seed=5))
    with pytest.raises(ValueError, match=r"seed: saved 0, now 5.*strict=False"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)
    with pytest.raises(ValueError, match="state_dict"):
        other.load_state_dict({"nothing": 1})


# ---------------------------------------------------------------------------------------------------------
# noise


def test_noise_is_deterministic_and_keyed():
    name = "model.layers.3.input_layernorm"
    a = noise_vector(name, 4096, 1e-2, seed=0, stage=2)
    assert a.dtype == torch.float32 and a.shape == (4096,)
    assert torch.equal(a, noise_vector(name, 4096, 1e-2, seed=0, stage=2))
    assert not torch.equal(a, noise_vector(name, 4096, 1e-2, seed=0, stage=3))
    assert not torch.equal(a, noise_vector(name, 4096, 1e-2, seed=1, stage=2))
    assert not torch.equal(a, noise_vector("model.layers.4.input_layernorm", 4096, 1e-2, seed=0, stage=2))
    # the same draw scaled: sigma only multiplies
    b = noise_vector(name, 4096, 1e-4, seed=0, stage=2)
    assert torch.allclose(b * 100, a, rtol=1e-6, atol=0)
    # prefix property: a longer draw starts with the shorter one
    assert torch.equal(noise_vector(name, 16, 1e-2, 0, 2), a[:16])


def test_noise_ignores_the_global_rng():
    torch.manual_seed(123)
    a = noise_vector("model.norm", 64, 1e-2, 0, 1)
    torch.manual_seed(999)
    torch.randn(10)
    assert torch.equal(a, noise_vector("model.norm", 64, 1e-2, 0, 1))


def test_noise_statistics():
    z = noise_vector("model.layers.0.post_attention_layernorm", 1_000_000, 3e-3, seed=4, stage=1).double()
    assert abs(z.std().item() - 3e-3) < 3e-3 * 0.005
    assert abs(z.mean().item()) < 3e-3 * 0.005


def test_zero_sigma_gives_zeros_and_bad_args():
    z = noise_vector("model.norm", 10, 0.0, 0, 0)
    assert z.dtype == torch.float32 and torch.count_nonzero(z) == 0
    assert noise_vector("model.norm", 0, 1e-2, 0, 0).shape == (0,)
    for kwargs, match in [
        (dict(size=-1), "size"),
        (dict(size=3.0), "size"),
        (dict(sigma=-1e-3), "sigma"),
        (dict(sigma=float("nan")), "sigma"),
        (dict(name=""), "module name"),
    ]:
        args = dict(name="model.norm", size=8, sigma=1e-2, seed=0, stage=1) | kwargs
        with pytest.raises(ValueError, match=match):
            noise_vector(**args)


def test_same_noise_in_a_fresh_process():
    names = ["model.layers.0.input_layernorm", "model.layers.27.self_attn.q_norm", "model.norm"]
    here = {n: noise_vector(n, 3584, 1e-2, seed=11, stage=4).numpy().tobytes().hex() for n in names}
    code = textwrap.dedent(
        f"""
        import json, torch
        torch.manual_seed(5)
        from qerl_plugin.aqn import noise_vector
        names = {names!r}
        print(json.dumps({{n: noise_vector(n, 3584, 1e-2, seed=11, stage=4).numpy().tobytes().hex() for n in names}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""})
    import json

    assert json.loads(out.stdout) == here


def test_golden_values_pin_the_generator():
    """If this fails, the hash or torch's CPU generator changed: a trainer and a rollout engine on different
    versions would draw different noise. Update only together with every consumer."""
    assert noise_seed("model.layers.0.input_layernorm", 0, 1) == noise_seed("base_model.model.model.layers.0.input_layernorm.weight", 0, 1)
    z = noise_vector("model.layers.0.input_layernorm", 8, 1.0, seed=0, stage=1)
    digest = hashlib.sha256(z.numpy().tobytes()).hexdigest()
    assert digest == GOLDEN_DIGEST, (digest, z.tolist())


# sha256 of noise_vector("model.layers.0.input_layernorm", 8, 1.0, seed=0, stage=1) with torch 2.11 (float32 bytes):
# [0.63058370, 0.94762474, 0.50555485, -0.04466773, 1.05629468, 0.67621332, 1.39921749, 1.77814960]
GOLDEN_DIGEST = "c8d181c16822869997a3923c4237c5d8bffba337ab40739d4edf695c3e310e48"


@pytest.mark.parametrize(
    "raw",
    [
        "model.layers.3.input_layernorm",
        "model.layers.3.input_layernorm.weight",
        "base_model.model.model.layers.3.input_layernorm",
        "base_model.model.model.layers.3.input_layernorm.modules_to_save.default",
        "base_model.model.model.layers.3.input_layernorm.original_module.weight",
        "_fsdp_wrapped_module.model.layers.3._fsdp_wrapped_module.input_layernorm",
        "_fsdp_wrapped_module.base_model.model._fsdp_wrapped_module.model.layers.3.input_layernorm",
        "_orig_mod.model.layers.3.input_layernorm",
        "model.layers.3._checkpoint_wrapped_module.input_layernorm",
        "module.base_model.model.model.layers.3.input_layernorm.weight",
    ],
)
def test_normalize_module_name(raw):
    assert normalize_module_name(raw) == "model.layers.3.input_layernorm"


def test_normalize_keeps_distinct_norms_distinct():
    names = ["model.layers.3.input_layernorm", "model.layers.3.post_attention_layernorm", "model.layers.13.input_layernorm",
             "model.layers.3.self_attn.q_norm", "model.layers.3.self_attn.k_norm", "model.norm"]
    assert len({normalize_module_name(n) for n in names}) == len(names)
    assert normalize_module_name("model.norm") == "model.norm"
    with pytest.raises(ValueError, match="wrapper prefixes"):
        normalize_module_name("base_model.model.")


def test_fp32_application_keeps_small_noise():
    w = torch.ones(4096, dtype=torch.bfloat16)
    z = noise_vector("model.norm", 4096, 1e-4, 0, 9)
    eff = apply_noise_fp32(w, z)
    assert eff.dtype == torch.float32
    assert torch.count_nonzero(eff - 1.0) >= 4090  # (almost) every perturbation reaches the weight
    assert torch.allclose(eff - 1.0, z, rtol=0, atol=2**-24)  # up to fp32 rounding of 1 + z
    assert torch.count_nonzero((w + z.bfloat16()) - w) < 4096 * 0.05  # bf16 would round nearly all away
    assert torch.equal(apply_noise_fp32(w, None), w.float())
    with pytest.raises(ValueError, match="does not match the norm weight"):
        apply_noise_fp32(w, z[:10])
    with pytest.raises(ValueError, match="float32"):
        apply_noise_fp32(w, z.double())


def test_is_aqn_target():
    assert is_aqn_target("model.layers.0.input_layernorm")
    assert is_aqn_target("model.norm")
    assert is_aqn_target("model.layers.0.self_attn.q_a_layernorm")  # DeepSeek: feeds q_b_proj
    assert not is_aqn_target("model.layers.0.self_attn.q_norm")
    assert not is_aqn_target("model.layers.0.self_attn.k_norm")
