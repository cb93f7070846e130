"""AQN on schedule through verl's per-step weight sync: the right sigma per step, the same after a resume.

The hook (:func:`verl_ext.aqn_hook.apply_step_noise`) runs inside ``ActorRolloutRefWorker.update_weights``;
its only outward call is ``ServerAdapter._execute_method("qerl_set_noise", ...)`` (a Ray RPC to the vLLM
server). Here a recorder stands in for that adapter; the schedule, the step bookkeeping, the actor-side
noise and the metrics are the real code, checked against the released QeRL rule computed independently.
"""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from helpers import make_tiny_qwen2
from verl_ext import aqn_hook
from verl_ext.settings import settings_from

TOTAL = 20
K = 5
S0, S1 = 1e-2, 1e-4


class RecordingRollout:
    """Stands in for verl's ServerAdapter at the RPC boundary."""

    _has_server = True

    def __init__(self, answers=None):
        self.calls = []
        self.cleared = 0
        self.answers = answers  # what collective_rpc returns: one dict per vLLM rank

    async def _execute_method(self, method, non_block=False, timeout=None, args=(), kwargs=None):
        self.calls.append((method, dict(kwargs or {})))
        return self.answers

    def _ensure_server_handle(self):
        return False


def _worker(role="actor_rollout", apply_to_actor=False, module=None, **aqn):
    aqn = {"enable": True, "sigma_start": S0, "sigma_end": S1, "num_stages": K, "seed": 7, "apply_to_actor": apply_to_actor, **aqn}
    cfg = OmegaConf.create(
        {
            "rollout": {"quantization": "nvfp4", "custom": {"qerl": {"aqn": aqn}}},
            "model": {"path": "/nonexistent"},
            "actor": {"optim": {"total_training_steps": TOTAL}},
        }
    )
    w = SimpleNamespace(config=cfg, role=role, rollout=RecordingRollout())
    if module is not None:
        w.actor = SimpleNamespace(engine=SimpleNamespace(module=module))
    return w


def _released_rule(step: int) -> float:
    """NVlabs/QeRL trl_trainer/noise_scheduler.get_sigma_by_step with the exponential trend, in float64."""
    trend = [S0 * (S1 / S0) ** (j / (K - 2)) for j in range(K - 1)]
    step = min(step, TOTAL)
    interval = int(step // (TOTAL / (len(trend) + 1)))
    return 0.0 if interval == 0 else trend[min(interval - 1, len(trend) - 1)]


def _run(worker, steps):
    async def go():
        for g in steps:
            await aqn_hook.apply_step_noise(worker, g)

    asyncio.run(go())
    return [kw for m, kw in worker.rollout.calls if m == "qerl_set_noise"]


def test_sigma_per_step_follows_the_schedule():
    w = _worker()
    calls = _run(w, range(0, TOTAL + 1))
    assert len(calls) == TOTAL + 1, "one RPC per weight sync"
    for g, kw in enumerate(calls):
        assert kw["sigma"] == pytest.approx(_released_rule(g), rel=1e-12, abs=0), g
        assert kw["seed"] == 7 and kw["stage"] == min(g * K // TOTAL, K - 1)
    assert calls[0]["sigma"] == 0.0  # rollouts of step 1 use the noise-free first stage
    assert calls[-1]["sigma"] == pytest.approx(S1)
    noisy = [c["sigma"] for c in calls if c["stage"] >= 1]
    assert all(a >= b for a, b in zip(noisy, noisy[1:])) and noisy[0] == pytest.approx(S0)  # decays from sigma_start
    assert len({c["stage"] for c in calls}) == K


@pytest.mark.parametrize("resume_at", [1, 7, 12, 19])
def test_resumed_run_continues_the_schedule_exactly(resume_at):
    full = _run(_worker(), range(0, TOTAL + 1))
    resumed = _run(_worker(), range(resume_at, TOTAL + 1))  # verl restores global_steps and syncs once
    assert resumed == full[resume_at:]


def test_resample_per_step_changes_the_key_every_step():
    calls = _run(_worker(resample="step"), range(5, 9))
    assert [c["stage"] for c in calls] == [5, 6, 7, 8]


def test_sync_without_step_keeps_noise_and_other_roles_do_nothing():
    w = _worker()
    assert _run(w, [None]) == []  # nothing set yet: nothing to repeat
    calls = _run(w, [6, None])
    assert calls[1] == calls[0]
    assert _run(_worker(role="ref"), [3]) == []
    off = _worker(enable=False)
    assert _run(off, [3]) == []


def test_missing_total_steps_is_a_clear_error():
    w = _worker()
    w.config.actor.optim.total_training_steps = -1
    with pytest.raises(ValueError, match="AQN needs the number of training steps"):
        _run(w, [0])
    assert _run(_worker(total_steps=10), [9])[0]["stage"] == 4  # aqn.total_steps wins over the trainer's


def test_update_weights_wrapper_syncs_first_then_sets_noise():
    order = []

    async def original(self, global_steps=None, mode="auto"):
        order.append(("sync", global_steps, mode))

    wrapped = aqn_hook.wrap_update_weights(original, "t")
    w = _worker()
    asyncio.run(wrapped(w, global_steps=4, mode="auto"))
    assert order == [("sync", 4, "auto")]
    assert w.rollout.calls[0][0] == "qerl_set_noise" and w.rollout.calls[0][1]["stage"] == 1


# ---------------------------------------------------------------------------------------------------------
# actor-side noise (aqn.apply_to_actor)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("aqn") / "m")


def _model(path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def test_actor_noise_matches_fp32_reference_and_vllm_names(tiny):
    from peft import LoraConfig, get_peft_model

    from qerl_plugin.aqn import AQNConfig, AQNSchedule, noise_vector

    model = get_peft_model(_model(tiny), LoraConfig(r=4, target_modules="all-linear"))
    noise = aqn_hook.ActorNoise(model)
    names = [n for n, _ in noise.norms]
    assert len(names) == 2 * 2 + 1  # input/post-attention norms per layer + final norm
    setting = AQNSchedule(AQNConfig(total_steps=10, num_stages=5, seed=3)).setting(4)
    assert setting.sigma > 0
    assert noise.set(setting) == 5

    norm_name, norm = noise.norms[0]
    assert norm_name == "base_model.model.model.layers.0.input_layernorm"
    z = noise_vector("model.layers.0.input_layernorm", norm.weight.numel(), setting.sigma, setting.seed, setting.key)
    assert torch.equal(noise.noise[id(norm)], z), "the actor's vector is the vLLM norm's (canonical HF name)"

    x = torch.randn(3, norm.weight.numel(), dtype=torch.bfloat16)
    out = norm(x)
    xf = x.double()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(torch.bfloat16).double()
    ref = (ref * (norm.weight.double() + z.double())).to(torch.bfloat16)
    assert torch.equal(out, ref)
    clean = norm.weight.to(torch.bfloat16) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(torch.bfloat16)
    assert not torch.equal(out, clean), "sigma=1e-2 noise must change bf16 outputs"

    from qerl_plugin.aqn import NoiseSetting

    noise.set(NoiseSetting(step=0, stage=0, sigma=0.0, seed=3, key=0))
    assert torch.equal(norm(x), norm.__class__.forward(norm, x))
    noise.remove()


def test_apply_to_actor_moves_actor_logprobs(tiny):
    model = _model(tiny)
    ids = torch.randint(0, 90, (1, 10))
    with torch.no_grad():
        clean = model(input_ids=ids).logits.float()
    w = _worker(apply_to_actor=True, module=model)
    _run(w, [TOTAL // 2])
    with torch.no_grad():
        noisy = model(input_ids=ids).logits.float()
    assert not torch.allclose(clean, noisy)
    _run(w, [0])  # stage 0: noise-free again
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits.float(), clean)


# ---------------------------------------------------------------------------------------------------------
# metrics in verl's own logger


def test_tracking_logs_sigma_and_stage_per_training_step(capsys):
    pytest.importorskip("verl")
    from verl_ext import patches

    patches.apply_all()
    from verl.utils.tracking import Tracking

    full = {
        "actor_rollout_ref": {
            "rollout": {"custom": {"qerl": {"aqn": {"enable": True, "sigma_start": S0, "sigma_end": S1, "num_stages": K}}}},
            "actor": {"optim": {"total_training_steps": TOTAL}},
        },
        "trainer": {"total_training_steps": None},
    }
    tracker = Tracking(project_name="p", experiment_name="e", default_backend="console", config=full)
    assert tracker._qerl_aqn_schedule is not None
    tracker.log({"actor/pg_loss": 0.5, "timing_s/update_weights": 0.1}, step=13)
    tracker.log({"val-core/acc": 1.0}, step=13)
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if "actor/pg_loss" in l]
    assert lines and "qerl/aqn_sigma" in lines[0] and "qerl/aqn_stage" in lines[0]
    # step 13's rollouts used update_weights(12)'s noise: stage 12 * 5 // 20 = 3
    fields = dict(f.split(":", 1) for f in lines[0].split(" - ")[1:])
    assert float(fields["qerl/aqn_sigma"]) == pytest.approx(_released_rule(12), rel=1e-12)
    assert int(fields["qerl/aqn_stage"]) == 3
    assert not any("qerl/" in l for l in out.splitlines() if "val-core" in l)
    plain = Tracking(project_name="p", experiment_name="e", default_backend="console", config={"trainer": {}})
    assert plain._qerl_aqn_schedule is None


def test_each_ranks_noise_checksum_is_reported_and_a_mismatch_is_flagged(capsys, caplog):
    import logging

    w = _worker()
    w.rollout = RecordingRollout([{"rank": 0, "norms": 61, "checksum": 0.25, "sigma": S0},
                                  {"rank": 1, "norms": 61, "checksum": 0.25, "sigma": S0}])
    info = asyncio.run(aqn_hook.apply_step_noise(w, TOTAL // 2))
    assert info["ranks"] == [{"rank": 0, "norms": 61, "checksum": 0.25}, {"rank": 1, "norms": 61, "checksum": 0.25}]
    assert "(noise checksums: rank 0 0.25, rank 1 0.25)" in capsys.readouterr().out
    w.rollout.answers[1]["checksum"] = 0.5
    with caplog.at_level(logging.WARNING, logger="qerl.verl.aqn"):
        asyncio.run(aqn_hook.apply_step_noise(w, TOTAL // 2))
    assert any("different noise" in r.getMessage() for r in caplog.records)
