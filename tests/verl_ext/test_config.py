"""qerl's keys in verl configs: accepted by verl's own config classes, and bad input caught before any GPU work.

Configs are composed exactly as ``python -m verl.trainer.main_ppo --config-path ... --config-name ...`` does
(Hydra + verl's ``ppo_trainer`` defaults), from the example YAMLs plus overrides.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_ext.config import QerlConfigError, check, compose, validate
from verl_ext.settings import checkpoint_quantization, settings_from

pytest.importorskip("verl")

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny" / "config.yaml"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny", ROOT / "examples" / "tiny" / "make_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("qerl_tiny")
    mod.main([str(out), "--n-train", "16", "--n-test", "4"])
    return out


@pytest.fixture
def env(tiny_dir, monkeypatch):
    monkeypatch.setenv("QERL_TINY_DIR", str(tiny_dir))
    return tiny_dir


def _cfg(*overrides):
    return compose(TINY, list(overrides))


# ---------------------------------------------------------------------------------------------------------
# accepted configs


def test_tiny_example_validates_through_verl(env):
    cfg, settings, notes = check(TINY)
    assert settings.nvfp4 and settings.model_quant == "bf16"
    assert settings.aqn_enabled and settings.aqn.num_stages == 5 and settings.aqn.sigma_start == 1e-2
    assert notes == []
    # verl's own dataclass keeps our block untouched and the quantization string as given
    from verl.utils.config import omega_conf_to_dataclass

    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert type(rollout).__name__ == "RolloutConfig"
    assert rollout.quantization == "nvfp4"
    assert rollout.custom["qerl"]["aqn"]["enable"] is True
    # and the settings the vLLM server derives from that dataclass equal the driver's
    assert settings_from(rollout, cfg.actor_rollout_ref.model).aqn == settings.aqn


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*/config/qwen2.5-*.yaml")), ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_recipe_yamls_compose_and_pass_qerl_checks(example, env):
    cfg = compose(example, [f"actor_rollout_ref.model.path={env / 'model'}"])
    settings, notes = validate(cfg)
    assert settings.nvfp4 and settings.aqn_enabled
    assert cfg.actor_rollout_ref.model.lora_rank == 32
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-5)
    a = settings.aqn
    assert (a.sigma_start, a.sigma_end, a.num_stages, a.schedule) == (1e-2, 1e-4, 10, "exponential")
    # the BF16-LoRA baseline of the same recipe is a valid config too
    base = compose(
        example,
        [
            f"actor_rollout_ref.model.path={env / 'model'}",
            "actor_rollout_ref.rollout.quantization=null",
            "actor_rollout_ref.rollout.custom.qerl.aqn.enable=false",
        ],
    )
    s2, _ = validate(base)
    assert not s2.active


def test_plus_syntax_adds_aqn_to_a_config_without_the_block(env):
    cfg = _cfg(
        "~actor_rollout_ref.rollout.custom",
        "+actor_rollout_ref.rollout.custom.qerl.aqn.enable=true",
        "+actor_rollout_ref.rollout.custom.qerl.aqn.schedule=cosine",
    )
    settings, _ = validate(cfg)
    assert settings.aqn.schedule == "cosine" and settings.aqn.sigma_end == 1e-4  # defaults from qerl_plugin.aqn


def test_dummy_load_format_is_normalised_to_auto(env):
    cfg = _cfg("actor_rollout_ref.rollout.load_format=dummy")
    settings, notes = validate(cfg)
    assert cfg.actor_rollout_ref.rollout.load_format == "auto"
    assert notes and "load_format: dummy -> auto" in notes[0]


def test_aqn_off_and_no_quantization_is_a_plain_verl_run(env):
    cfg = _cfg("actor_rollout_ref.rollout.quantization=null", "actor_rollout_ref.rollout.custom.qerl.aqn.enable=false")
    settings, notes = validate(cfg)
    assert not settings.active and notes == []


def test_no_recompute_layers_is_read_for_any_lora_actor(env, capsys):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    from verl_ext import patches

    cfg = _cfg("+actor_rollout_ref.rollout.custom.qerl.actor.no_recompute_layers=2")
    settings, _ = validate(cfg)
    assert settings.no_recompute_layers == 2 and settings.nvfp4
    patches.apply_all()
    import verl.utils.config as vc

    vc.validate_config(cfg, need_reference_policy(cfg), need_critic(cfg))
    assert "the actor's last 2 decoder layers keep their activations" in capsys.readouterr().out
    # without quantization or AQN the setting alone makes qerl active (its wrapper applies it to a BF16-LoRA actor)
    cfg = _cfg("actor_rollout_ref.rollout.quantization=null", "actor_rollout_ref.rollout.custom.qerl.aqn.enable=false",
               "+actor_rollout_ref.rollout.custom.qerl.actor.no_recompute_layers=1")
    settings, _ = validate(cfg)
    assert settings.active and not settings.nvfp4 and settings.no_recompute_layers == 1
    cfg = _cfg("actor_rollout_ref.rollout.quantization=null", "actor_rollout_ref.rollout.custom.qerl.aqn.enable=false",
               "+actor_rollout_ref.rollout.custom.qerl.actor.no_recompute_layers=1", "actor_rollout_ref.model.lora_rank=0")
    with pytest.raises(QerlConfigError, match="no_recompute_layers=1 applies to LoRA actors"):
        validate(cfg)


# ---------------------------------------------------------------------------------------------------------
# bad input: the error names the key and the fix


@pytest.mark.parametrize(
    "overrides, key, fix",
    [
        (["actor_rollout_ref.model.lora_rank=0"], "actor_rollout_ref.model.lora_rank=0", "lora_rank"),
        (["actor_rollout_ref.actor.fsdp_config.qat.enable=true"], "fsdp_config.qat.enable=true", "Remove"),
        (["actor_rollout_ref.rollout.custom.qerl.aqn.sigma_end=0.1"], "custom.qerl.aqn", "swap the two values"),
        (["actor_rollout_ref.rollout.custom.qerl.aqn.num_stages=0"], "custom.qerl.aqn", "num_stages: must be >= 1"),
        (["actor_rollout_ref.rollout.custom.qerl.aqn.schedule=expo"], "custom.qerl.aqn", "choose one of"),
        (["+actor_rollout_ref.rollout.custom.qerl.aqn.sigma=0.1"], "custom.qerl.aqn", "unknown key(s) 'sigma'"),
        (["+actor_rollout_ref.rollout.custom.qerl.noise=1"], "custom.qerl", "takes only aqn"),
        (["actor_rollout_ref.rollout.name=sglang"], "rollout.name='sglang'", "rollout.name=vllm"),
        (["actor_rollout_ref.model.lora.merge=true"], "lora.merge=true", "lora.merge=false"),
        (["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"], "checkpoint_engine.backend='nccl'", "backend=naive"),
        (["actor_rollout_ref.actor.strategy=megatron"], "actor.strategy='megatron'", "strategy=fsdp2"),
        (["actor_rollout_ref.rollout.quantization=NVFP4"], "rollout.quantization", "lower case"),
        (["actor_rollout_ref.rollout.quantization=fp4"], "rollout.quantization='fp4'", "quantization: nvfp4"),
        (["actor_rollout_ref.rollout.quantization_config_file=/x.json"], "quantization_config_file", "remove"),
        (["trainer.v1.trainer_mode=colocate_async"], "trainer_mode='colocate_async'", "trainer_mode=sync"),
        (["trainer.total_training_steps=3"], "total_training_steps=3", "lower num_stages"),
        (["actor_rollout_ref.rollout.custom.qerl.aqn.apply_to_actor=maybe"], "aqn.apply_to_actor", "true or false"),
        (["+actor_rollout_ref.rollout.custom.qerl.actor.no_recompute_layer=2"], "custom.qerl.actor",
         "did you mean 'no_recompute_layers'"),
        (["+actor_rollout_ref.rollout.custom.qerl.actor.no_recompute_layers=-1"], "no_recompute_layers=-1", "whole number"),
        (["+actor_rollout_ref.rollout.custom.qerl.actor.no_recompute_layers=two"], "no_recompute_layers='two'", ">= 0"),
        (["+actor_rollout_ref.rollout.custom.qerl.actor=2"], "custom.qerl.actor", "{no_recompute_layers: 2}"),
        (["+actor_rollout_ref.rollout.custom.qerl.actor.no_recompute_layers=2",
          "actor_rollout_ref.model.enable_gradient_checkpointing=false"],
         "enable_gradient_checkpointing is false", "enable_gradient_checkpointing=true"),
    ],
)
def test_bad_config_is_rejected_with_key_and_fix(env, overrides, key, fix):
    cfg = _cfg(*overrides)
    with pytest.raises(QerlConfigError) as e:
        validate(cfg)
    msg = str(e.value)
    assert key in msg and fix in msg, msg


# ---------------------------------------------------------------------------------------------------------
# model path vs quantization


def _fake_checkpoint(tmp_path: Path, src: Path, quant: dict | None) -> Path:
    dst = tmp_path / "ckpt"
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if quant is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_checkpoint_quantization_detection(env, tmp_path):
    from qerl_plugin.format import quantization_config_dict

    src = env / "model"
    assert checkpoint_quantization(str(src)) == "bf16"
    assert checkpoint_quantization("/no/such/dir") == "unknown"
    assert checkpoint_quantization("Qwen/Qwen2.5-7B-Instruct") == "unknown"  # a hub id is checked by vLLM later
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    nv = _fake_checkpoint(tmp_path / "a", src, quantization_config_dict(ignore=["lm_head"]))
    assert checkpoint_quantization(str(nv)) == "nvfp4"
    fp8 = _fake_checkpoint(tmp_path / "b", src, {"quant_method": "fp8", "fmt": "e4m3"})
    assert checkpoint_quantization(str(fp8)) == "other:fp8"


def test_model_path_quantization_must_match(env, tmp_path):
    from qerl_plugin.format import quantization_config_dict

    src = env / "model"
    (tmp_path / "a").mkdir()
    nv = _fake_checkpoint(tmp_path / "a", src, quantization_config_dict(ignore=["lm_head"]))
    settings, _ = validate(_cfg(f"actor_rollout_ref.model.path={nv}"))
    assert settings.nvfp4_checkpoint
    with pytest.raises(QerlConfigError, match=r"is an NVFP4 .* set actor_rollout_ref.rollout.quantization=nvfp4"):
        validate(_cfg(f"actor_rollout_ref.model.path={nv}", "actor_rollout_ref.rollout.quantization=null"))
    (tmp_path / "b").mkdir()
    fp8 = _fake_checkpoint(tmp_path / "b", src, {"quant_method": "fp8"})
    with pytest.raises(QerlConfigError, match=r"already quantized \(fp8\).*BF16/FP16 checkpoint"):
        validate(_cfg(f"actor_rollout_ref.model.path={fp8}"))
    (tmp_path / "c").mkdir()
    w4a4 = quantization_config_dict(ignore=["lm_head"])
    for group in w4a4["config_groups"].values():
        group["input_activations"] = dict(group["weights"])
    nvfp4_w4a4 = _fake_checkpoint(tmp_path / "c", src, w4a4)
    with pytest.raises(QerlConfigError, match="already quantized"):
        validate(_cfg(f"actor_rollout_ref.model.path={nvfp4_w4a4}"))


def test_verl_validate_config_runs_qerl_checks_first(env):
    """The wrapped verl.utils.config.validate_config (what main_ppo calls) raises qerl's error."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_ext import patches

    patches.apply_all()
    import verl.utils.config as vc

    assert patches.is_patched(vc.validate_config)
    cfg = _cfg("actor_rollout_ref.model.lora_rank=0")
    with pytest.raises(QerlConfigError, match="lora_rank=0"):
        vc.validate_config(cfg, need_reference_policy(cfg), need_critic(cfg))


# ---------------------------------------------------------------------------------------------------------
# Ray CPUs: a cluster smaller than verl's own driver-side actors waits forever (seen on the H100, 2026-11-24)


def test_ray_cpus_below_verls_own_actors_are_refused(env):
    with pytest.raises(QerlConfigError, match=r"ray_kwargs.ray_init.num_cpus=6 is less than the 10 logical CPUs"):
        validate(_cfg("ray_kwargs.ray_init.num_cpus=6"))
    validate(_cfg("ray_kwargs.ray_init.num_cpus=10"))
    validate(_cfg())  # unset: Ray counts the host's cores
    # fewer storage units need fewer CPUs
    validate(_cfg("ray_kwargs.ray_init.num_cpus=6", "transfer_queue.backend.SimpleStorage.num_data_storage_units=4"))


def test_ray_cpus_needed_matches_the_installed_transfer_queue(env):
    """The count assumes one logical CPU per transfer-queue actor: read it from the installed package."""
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    from verl_ext.config import ray_cpus_needed

    per_actor = {TransferQueueController._default_options.get("num_cpus"), SimpleStorageUnit._default_options.get("num_cpus")}
    assert per_actor == {1}
    cfg = _cfg()
    units = cfg.transfer_queue.backend.SimpleStorage.num_data_storage_units
    assert ray_cpus_needed(cfg) == 1 + 1 + units  # TaskRunner + controller + storage units


# --- verl's bypass mode reaches the actor worker (verl 0.9.1 switches the loss only in the driver's copy)

SMOL = ROOT / "examples" / "smollm2" / "config.yaml"


def _ppo_clip_reference(old, new, adv, mask, low, high):
    """token-mean PPO-clip, written out: -mean(min(r A, clip(r, 1-low, 1+high) A)) over the response tokens."""
    import torch

    r = torch.exp(new - old)
    obj = torch.minimum(r * adv, torch.clamp(r, 1 - low, 1 + high) * adv)
    return float(-(obj * mask).sum() / mask.sum())


def test_smollm2_bypass_mode_sets_the_actors_loss_and_metrics():
    import torch
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose(SMOL, [])
    assert cfg.algorithm.rollout_correction.bypass_mode is True
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"  # as composed: verl's default
    _, notes = validate(cfg)
    assert any("loss_mode: vanilla -> bypass_mode" in n for n in notes)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # what the actor worker builds
    assert actor.policy_loss.loss_mode == "bypass_mode"
    rc = actor.policy_loss.rollout_correction
    assert rc["bypass_mode"] is True and rc["loss_type"] == "ppo_clip" and rc["rollout_is"] == "token"

    torch.manual_seed(0)
    rollout = -torch.rand(6, 9) * 3
    current = rollout + 0.3 * torch.randn(6, 9)  # some ratios beyond the clip range
    adv = torch.randn(6, 9)
    mask = torch.ones(6, 9, dtype=torch.bool)
    mask[:, 7:] = False
    loss, metrics = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old_log_prob=rollout, log_prob=current, advantages=adv, response_mask=mask, loss_agg_mode="token-mean",
        config=actor,
    )
    ref = _ppo_clip_reference(rollout, current, adv, mask.float(), actor.clip_ratio_low, actor.clip_ratio_high)
    assert float(loss) == pytest.approx(ref, rel=1e-5)
    kl = float(((rollout - current) * mask).sum() / mask.sum())  # k1 estimate of KL(rollout || current)
    assert metrics["rollout_corr/kl"] == pytest.approx(kl, rel=1e-4, abs=1e-6)


def test_bypass_mode_is_left_alone_when_the_actor_already_has_it():
    cfg = compose(SMOL, [])
    validate(cfg)
    _, notes = validate(cfg)  # second time: nothing to normalise
    assert not any("bypass_mode" in n for n in notes)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["algorithm.rollout_correction.bypass_mode=false", "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"],
         ["algorithm.rollout_correction.bypass_mode is false", "set algorithm.rollout_correction.bypass_mode=true"]),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=gpg"],
         ["loss_mode is 'gpg'", "set loss_mode=vanilla"]),
    ],
)
def test_bypass_mode_conflicts_name_both_keys(overrides, words):
    with pytest.raises(QerlConfigError) as e:
        validate(compose(SMOL, overrides))
    for w in words:
        assert w in str(e.value)


# ---------------------------------------------------------------------------------------------------------
# hints: advice from measurements that changes no setting


@pytest.mark.parametrize(
    "overrides, expect",
    [
        # the tiny example: 8 x (256 + 32) = 2 304 tokens at most per micro-batch
        ((), "ppo_micro_batch_size_per_gpu=8 holds at most 2304 tokens (8 x 288)"),
        (("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",), None),  # 4 608 tokens
        (("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048"),
         "ppo_max_token_len_per_gpu=2048"),
        (("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384"), None),
        # BF16 runs get no NVFP4 advice
        (("actor_rollout_ref.rollout.quantization=null", "actor_rollout_ref.rollout.custom.qerl.aqn.enable=false"), None),
    ],
)
def test_hint_for_small_nvfp4_micro_batches(env, overrides, expect):
    from verl_ext.config import hints

    cfg = _cfg(*overrides)
    settings, notes = validate(cfg)
    got = hints(cfg, settings)
    if expect is None:
        assert got == []
    else:
        assert len(got) == 1 and expect in got[0] and "docs/benchmarks.md" in got[0]


# a Qwen2.5-7B config.json, as far as the kept-layer hint reads it
QWEN25_7B_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                    "num_key_value_heads": 4}


def test_hint_suggests_kept_layers_for_a_7b_checkpoint(env, tmp_path):
    """A 7B-shaped config.json at model.path: at the recipes' 16 384-token micro-batches the driver suggests the 2
    layers that fitted within BF16's peak on the H100 (§4u); none once the key is set, or without checkpointing."""
    from verl_ext.config import hints

    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    base = (f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384")
    cfg = _cfg(*base)
    got = hints(cfg, settings_from(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model))
    assert len(got) == 1 and "actor.no_recompute_layers=2 spends it" in got[0] and "~8.7 GiB less" in got[0], got
    cfg = _cfg(*base, "+actor_rollout_ref.rollout.custom.qerl.actor.no_recompute_layers=1")
    assert hints(cfg, settings_from(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model)) == []
    cfg = _cfg(*base, "actor_rollout_ref.model.enable_gradient_checkpointing=false")
    assert hints(cfg, settings_from(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model)) == []



def test_hint_reads_a_hub_id_from_the_cache_only(env, tmp_path, monkeypatch):
    """``model.path: Qwen/Qwen2.5-7B-Instruct`` (the recipes'): the config comes from the Hugging Face cache when it is
    there, and nothing is downloaded when it is not."""
    from verl_ext.config import hints

    repo = tmp_path / "hub" / "models--Qwen--Qwen2.5-7B-Instruct"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    base = ("actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192")
    cfg = _cfg(*base)
    settings = settings_from(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model)
    from huggingface_hub import constants  # read when a file is looked up (the env vars only at import)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # belt and braces: the lookup is local_files_only anyway
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    got = hints(cfg, settings)
    assert len(got) == 1 and "actor.no_recompute_layers=4 spends it" in got[0], got
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    assert hints(cfg, settings) == []


def test_hint_is_printed_by_verls_validate_config_and_qerl_train(env, capsys):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    from verl_ext import patches
    from verl_ext.train import _summary

    patches.apply_all()
    import verl.utils.config as vc

    cfg = _cfg()
    vc.validate_config(cfg, need_reference_policy(cfg), need_critic(cfg))
    assert "[qerl] hint: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8" in capsys.readouterr().out
    cfg, settings, notes = check(TINY)
    assert "hint           actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8" in _summary(cfg, settings, notes)
