"""qerl's keys in a verl 0.9.1 config, and the checks run before any GPU work.

The keys are ``actor_rollout_ref.rollout.quantization: nvfp4`` (verl's own field) and the block
``actor_rollout_ref.rollout.custom.qerl`` (``RolloutConfig.custom``, verl's extension point, which reaches the
driver, the workers and the vLLM servers)::

    actor_rollout_ref:
      rollout:
        quantization: nvfp4
        custom:
          qerl:
            aqn: {enable: true, sigma_start: 1.0e-2, sigma_end: 1.0e-4, num_stages: 10, schedule: exponential,
                  seed: 0, total_steps: null, noise_free_first_stage: true, resample: stage, apply_to_actor: false}
            actor: {no_recompute_layers: 0}   # the last N decoder layers keep their activations (verl_ext.recompute)

:func:`validate` runs in the driver inside verl's ``validate_config`` and raises :class:`QerlConfigError`
naming the key and the fix; :mod:`verl_ext.settings` parses the keys. This module imports nothing from verl
at the top: ``import verl`` resolves :func:`wrap_validate_config` from here. Design: docs/design.md, "Settings".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from qerl_plugin import options

if TYPE_CHECKING:  # pragma: no cover
    from verl_ext.settings import QerlSettings

logger = logging.getLogger("qerl.verl.config")

ROLLOUT = "actor_rollout_ref.rollout"
MODEL = "actor_rollout_ref.model"
ACTOR = "actor_rollout_ref.actor"
QERL_KEY = f"{ROLLOUT}.custom.qerl"
AQN_KEY = f"{QERL_KEY}.aqn"
ACTOR_BLOCK_KEY = f"{QERL_KEY}.actor"
NO_RECOMPUTE_KEY = f"{ACTOR_BLOCK_KEY}.no_recompute_layers"
NVFP4 = options.METHOD

QERL_BLOCK_KEYS = ("aqn", "actor")
ACTOR_BLOCK_KEYS = ("no_recompute_layers",)
# keys of the aqn block that are ours, not qerl_plugin.aqn.AQNConfig's
AQN_EXTRA_KEYS = ("enable", "apply_to_actor")
_NEAR_MISSES = {"fp4", "nvfp4a16", "nvfp4_a16", "w4a16_fp4", "nvfp4-a16", "qerl", "qerl_nvfp4", "nv_fp4"}


class QerlConfigError(ValueError):
    """A qerl setting in a verl config is wrong; the message names the key and the fix."""


# ---------------------------------------------------------------------------------------------------------
# reading config trees (omegaconf DictConfig, plain dicts, verl's BaseConfig dataclasses)


def to_plain(value: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def get(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg.a.b.c`` for DictConfig / dict / dataclass trees; ``default`` if any part is missing or None."""
    node = cfg
    for part in dotted.split(".") if dotted else []:
        if node is None:
            return default
        if isinstance(node, Mapping) or hasattr(node, "keys") and hasattr(node, "__getitem__"):
            try:
                node = node[part] if part in node else None
            except Exception:
                node = None
        else:
            node = getattr(node, part, None)
    return default if node is None else node


# ---------------------------------------------------------------------------------------------------------
# the driver-side check


def _lora_rank(cfg: Any) -> int:
    rank = get(cfg, f"{MODEL}.lora.rank", 0) or 0
    if rank <= 0:
        rank = get(cfg, f"{MODEL}.lora_rank", 0) or 0
    return int(rank)


def _set(cfg: Any, dotted: str, value: Any) -> None:
    from omegaconf import DictConfig, OmegaConf, open_dict

    if isinstance(cfg, DictConfig):
        with open_dict(cfg):
            OmegaConf.update(cfg, dotted, value, merge=False)
        return
    node = cfg
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node[p]
    node[parts[-1]] = value


def validate(cfg: Any, normalize: bool = True) -> tuple[QerlSettings, list[str]]:
    """Check a whole verl config (the driver's); returns (settings, notices of what was normalised).

    Raises :class:`QerlConfigError` with the key and the fix. With ``normalize`` the config is updated in
    place (``load_format: dummy`` -> ``auto`` under nvfp4). Does nothing (and returns inactive settings)
    when the config asks for no qerl feature.
    """
    from verl_ext.settings import checkpoint_quantization, settings_from

    notes: list[str] = []
    rollout = get(cfg, ROLLOUT)
    raw_quant = get(cfg, f"{ROLLOUT}.quantization")
    quant = str(raw_quant).strip() if raw_quant is not None else None
    if quant is not None and quant.lower() == NVFP4 and quant != NVFP4:
        raise QerlConfigError(f"{ROLLOUT}.quantization: write it in lower case: quantization: nvfp4 (got {quant!r})")
    if quant is not None and quant.lower() in _NEAR_MISSES:
        raise QerlConfigError(
            f"{ROLLOUT}.quantization={quant!r} is not a quantization method; for QeRL's NVFP4 base + LoRA use "
            "quantization: nvfp4"
        )
    settings = settings_from(rollout, get(cfg, MODEL))

    if settings.nvfp4:
        _check_nvfp4(cfg, settings)
        load_format = str(get(cfg, f"{ROLLOUT}.load_format", "dummy"))
        if "dummy" in load_format:
            if normalize:
                _set(cfg, f"{ROLLOUT}.load_format", "auto")
            notes.append(
                f"{ROLLOUT}.load_format: {load_format} -> auto (under nvfp4 vLLM loads the base from model.path "
                "and quantizes it itself; only the LoRA adapter is synced, so a dummy base would stay random)"
            )
    else:
        mq = checkpoint_quantization(get(cfg, f"{MODEL}.path"))
        if mq == "nvfp4":
            raise QerlConfigError(
                f"{MODEL}.path={get(cfg, f'{MODEL}.path')!r} is an NVFP4 (compressed-tensors nvfp4-pack-quantized) "
                f"checkpoint, but {ROLLOUT}.quantization is {raw_quant!r}: set {ROLLOUT}.quantization=nvfp4 to "
                "train LoRA on it with qerl, or point model.path at the BF16 checkpoint"
            )

    if settings.aqn_enabled:
        _check_aqn(cfg, settings)

    if settings.no_recompute_layers:
        _check_no_recompute(cfg, settings)

    if settings.active:
        _bypass_mode_to_actor(cfg, normalize, notes)
        _check_ray_cpus(cfg)
        from verl_ext import patches

        try:
            patches.require("qerl (" + ", ".join(
                x for x in ("quantization=nvfp4" if settings.nvfp4 else "", "AQN" if settings.aqn_enabled else "") if x
            ) + ")")
        except RuntimeError as e:
            raise QerlConfigError(str(e)) from None
    return settings, notes


ROLLOUT_CORRECTION = "algorithm.rollout_correction"
POLICY_LOSS = f"{ACTOR}.policy_loss"


def _bypass_mode_to_actor(cfg: Any, normalize: bool, notes: list[str]) -> None:
    """verl's bypass mode (``algorithm.rollout_correction.bypass_mode: true``: the rollout's log-probs are the PPO
    anchor and the actor's old-log-prob pass is skipped) reaches the actor worker's loss too.

    verl 0.9.1's trainer switches ``actor.policy_loss.loss_mode`` to ``bypass_mode`` (with the rollout-correction
    block) only in the driver's copy of the config, after the actor workers were built from it: their loss stays
    ``vanilla`` (the same PPO-clip objective for ``loss_type: ppo_clip``, but no ``rollout_corr/*`` metrics, and
    ``loss_type: reinforce`` silently not applied). Done here, before the workers exist, they get it.
    """
    bypass = bool(get(cfg, f"{ROLLOUT_CORRECTION}.bypass_mode", False))
    mode = str(get(cfg, f"{POLICY_LOSS}.loss_mode", "vanilla"))
    if not bypass:
        if mode == "bypass_mode":
            raise QerlConfigError(
                f"{POLICY_LOSS}.loss_mode=bypass_mode treats the old log-probs as the rollout's, but "
                f"{ROLLOUT_CORRECTION}.bypass_mode is false (the actor recomputes them): set "
                f"{ROLLOUT_CORRECTION}.bypass_mode=true, or loss_mode=vanilla"
            )
        return
    if mode not in ("vanilla", "bypass_mode"):
        raise QerlConfigError(
            f"{ROLLOUT_CORRECTION}.bypass_mode=true replaces the actor's loss with verl's bypass_mode loss, but "
            f"{POLICY_LOSS}.loss_mode is {mode!r}: set loss_mode=vanilla (or bypass_mode), or bypass_mode=false"
        )
    block = to_plain(get(cfg, ROLLOUT_CORRECTION))
    if mode == "bypass_mode" and to_plain(get(cfg, f"{POLICY_LOSS}.rollout_correction")) == block:
        return
    if normalize:
        _set(cfg, f"{POLICY_LOSS}.loss_mode", "bypass_mode")
        _set(cfg, f"{POLICY_LOSS}.rollout_correction", block)
    notes.append(
        f"{POLICY_LOSS}.loss_mode: {mode} -> bypass_mode with {ROLLOUT_CORRECTION} (verl's bypass mode, set before "
        "the actor workers are built so that their loss and rollout_corr metrics follow it)"
    )


# verl 0.9.1's TaskRunner and its transfer queue (controller + SimpleStorage units) are Ray actors of one logical
# CPU each (transfer_queue declares num_cpus=1; a plain actor is scheduled on 1), started before any worker.
TRANSFER_QUEUE_UNITS_KEY = "transfer_queue.backend.SimpleStorage.num_data_storage_units"


def ray_cpus_needed(cfg: Any) -> int:
    """Logical CPUs verl's driver-side actors reserve before the first worker starts (TaskRunner, transfer queue)."""
    backend = get(cfg, "transfer_queue.backend.storage_backend", "SimpleStorage")
    units = int(get(cfg, TRANSFER_QUEUE_UNITS_KEY, 8) or 0) if backend == "SimpleStorage" else 0
    return 2 + units


def _check_ray_cpus(cfg: Any) -> None:
    """A Ray cluster with fewer logical CPUs than verl's own actors reserve never starts training: Ray waits."""
    given = get(cfg, "ray_kwargs.ray_init.num_cpus")
    if given is None:
        return
    need = ray_cpus_needed(cfg)
    if int(given) < need:
        raise QerlConfigError(
            f"ray_kwargs.ray_init.num_cpus={given} is less than the {need} logical CPUs verl 0.9.1 reserves before "
            f"training starts (TaskRunner, transfer-queue controller and {need - 2} storage units, one each): Ray would "
            f"wait for them forever. Leave num_cpus unset (Ray counts the host's cores) or set it to at least {need} "
            f"plus the workers' CPUs; several runs on one host can share the cores (the count is logical), or lower "
            f"{TRANSFER_QUEUE_UNITS_KEY}"
        )


def _require_vllm(cfg: Any, problem: str) -> None:
    """Raise ``problem`` (formatted with the rollout engine's ``name``) unless the rollout engine is vLLM."""
    name = get(cfg, f"{ROLLOUT}.name")
    if name != "vllm":
        raise QerlConfigError(problem.format(name=name))


def _check_nvfp4(cfg: Any, s: QerlSettings) -> None:
    _require_vllm(
        cfg, f"{ROLLOUT}.name={{name!r}}: quantization=nvfp4 runs on vLLM (qerl's 'nvfp4' method); set {ROLLOUT}.name=vllm"
    )
    if _lora_rank(cfg) <= 0:
        raise QerlConfigError(
            f"{MODEL}.lora_rank=0: quantization=nvfp4 trains a LoRA adapter on a frozen NVFP4 base and cannot "
            f"update the 4-bit weights themselves; set {MODEL}.lora_rank (QeRL uses 32; e.g. lora_rank: 32, "
            "lora_alpha: 64)"
        )
    if get(cfg, f"{MODEL}.lora.merge", False):
        raise QerlConfigError(
            f"{MODEL}.lora.merge=true: merging LoRA into an NVFP4 base is not possible (it would need the BF16 "
            f"weights) and would sync the whole model; set {MODEL}.lora.merge=false (adapter-only sync)"
        )
    lora_type = get(cfg, f"{MODEL}.lora.type", "lora")
    if lora_type not in ("lora", None):
        raise QerlConfigError(f"{MODEL}.lora.type={lora_type!r}: quantization=nvfp4 supports plain LoRA; set lora.type=lora")
    for key in (f"{ACTOR}.fsdp_config.qat.enable", f"{ACTOR}.megatron.qat.enable", f"{ROLLOUT}.qat.enable"):
        if get(cfg, key, False):
            raise QerlConfigError(
                f"{key}=true together with {ROLLOUT}.quantization=nvfp4: these are two different NVFP4 paths "
                "(verl's QAT fake-quantizes a trained BF16 model and re-sends it every step; qerl keeps a frozen "
                f"NVFP4 base and syncs only LoRA). Remove {key} (or set it to false)"
            )
    strategy = get(cfg, f"{ACTOR}.strategy", "fsdp")
    if strategy not in ("fsdp", "fsdp2"):
        raise QerlConfigError(
            f"{ACTOR}.strategy={strategy!r}: quantization=nvfp4 is implemented for verl's FSDP engine; set "
            f"{ACTOR}.strategy=fsdp2 (or fsdp)"
        )
    backend = get(cfg, f"{ROLLOUT}.checkpoint_engine.backend", "naive")
    if backend != "naive":
        raise QerlConfigError(
            f"{ROLLOUT}.checkpoint_engine.backend={backend!r}: quantization=nvfp4 syncs only the LoRA adapter "
            "through verl's colocated ('naive') path; verl 0.9.1's other backends send base weights. Set "
            f"{ROLLOUT}.checkpoint_engine.backend=naive"
        )
    if get(cfg, "actor_rollout_ref.hybrid_engine", True) is False:
        raise QerlConfigError(
            "actor_rollout_ref.hybrid_engine=false: quantization=nvfp4 needs the colocated actor + rollout "
            "(hybrid engine); set actor_rollout_ref.hybrid_engine=true"
        )
    if get(cfg, f"{ROLLOUT}.quantization_config_file") is not None:
        raise QerlConfigError(
            f"{ROLLOUT}.quantization_config_file is set, but quantization=nvfp4 defines the format itself "
            "(NVFP4A16, lm_head kept in BF16); remove quantization_config_file"
        )
    mq = s.model_quant
    if mq.startswith("other:"):
        raise QerlConfigError(
            f"{MODEL}.path={s.model_path!r} is already quantized ({mq[6:]}), which quantization=nvfp4 cannot use: "
            "point model.path at the BF16/FP16 checkpoint (quantized when loaded) or at an NVFP4A16 checkpoint "
            "written by `qerl quantize`"
        )
    if mq == "nvfp4" and get(cfg, f"{MODEL}.lora_adapter_path") is None and get(cfg, f"{MODEL}.use_shm", False):
        raise QerlConfigError(f"{MODEL}.use_shm=true is not supported with an NVFP4 checkpoint; set use_shm=false")


def _check_aqn(cfg: Any, s: QerlSettings) -> None:
    _require_vllm(
        cfg,
        f"{AQN_KEY}.enable=true: AQN perturbs the norms of the vLLM rollout engine; set {ROLLOUT}.name=vllm "
        "(got {name!r}) or disable AQN",
    )
    if get(cfg, "trainer.use_v1", True):
        mode = get(cfg, "trainer.v1.trainer_mode", "sync")
        if mode != "sync":
            raise QerlConfigError(
                f"{AQN_KEY}.enable=true with trainer.v1.trainer_mode={mode!r}: AQN follows the per-step weight sync "
                "of the synchronous trainer; set trainer.v1.trainer_mode=sync or disable AQN"
            )
        pss = get(cfg, "trainer.v1.sync.parameter_sync_step", 1)
        if pss not in (None, 1):
            raise QerlConfigError(
                f"{AQN_KEY}.enable=true with trainer.v1.sync.parameter_sync_step={pss}: AQN counts one step per "
                "weight sync; set parameter_sync_step=1 or disable AQN"
            )
    total = s.aqn.total_steps or get(cfg, "trainer.total_training_steps")
    if total is not None:
        try:
            s.aqn.with_total_steps(int(total))
        except ValueError as e:
            where = f"{AQN_KEY}.total_steps" if s.aqn.total_steps else "trainer.total_training_steps"
            raise QerlConfigError(f"{AQN_KEY} with {where}={total}: {str(e).replace('AQNConfig.', '')}") from None


def _check_no_recompute(cfg: Any, s: QerlSettings) -> None:
    """``actor.no_recompute_layers`` turns gradient checkpointing off for layers of a LoRA actor: both must be on."""
    n = s.no_recompute_layers
    if not get(cfg, f"{MODEL}.enable_gradient_checkpointing", False):
        raise QerlConfigError(
            f"{NO_RECOMPUTE_KEY}={n}, but {MODEL}.enable_gradient_checkpointing is false: no layer recomputes its "
            f"forward, so every layer keeps its activations already; set enable_gradient_checkpointing=true or "
            f"drop {NO_RECOMPUTE_KEY}"
        )
    if _lora_rank(cfg) <= 0:
        raise QerlConfigError(
            f"{NO_RECOMPUTE_KEY}={n} applies to LoRA actors (it is set where verl adds the adapter), but "
            f"{MODEL}.lora_rank is 0; set lora_rank or drop {NO_RECOMPUTE_KEY}"
        )


# Below this many tokens per actor micro-batch the NVFP4 actor is bound by host time per linear (a decode
# launch per projection and call): on the H100, 7B shape, its forward + backward took 1.48x BF16's time at 2.5k
# tokens, 1.03x at 4k and 1.005x at 16k (docs/benchmarks.md 4e, 4f); end to end, verl's 7B GRPO step went from
# 0.92x to 1.20x of BF16's speed when the micro-batches grew from one sample to 16k tokens
NVFP4_MICRO_BATCH_TOKENS = 4096


def _micro_batch_tokens(cfg: Any) -> tuple[int | None, str]:
    """The most tokens one actor micro-batch holds, and where that number comes from (the key, or micro x seq)."""
    if get(cfg, f"{ACTOR}.use_dynamic_bsz", False):
        cap = get(cfg, f"{ACTOR}.ppo_max_token_len_per_gpu")
        return (int(cap), f"{ACTOR}.ppo_max_token_len_per_gpu={cap}") if cap is not None else (None, "")
    micro = get(cfg, f"{ACTOR}.ppo_micro_batch_size_per_gpu")
    seq = int(get(cfg, "data.max_prompt_length", 0) or 0) + int(get(cfg, "data.max_response_length", 0) or 0)
    if not micro or not seq:
        return None, ""
    most = int(micro) * seq
    return most, f"{ACTOR}.ppo_micro_batch_size_per_gpu={micro} holds at most {most} tokens ({micro} x {seq})"


def read_config_json(model_path: str | os.PathLike | None) -> Any:
    """The parsed ``config.json`` of a local model directory; None when there is no such file or it is not JSON."""
    if not model_path:
        return None
    cfg_file = Path(os.path.expanduser(str(model_path))) / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        return json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _model_config(cfg: Any) -> dict | None:
    """The model's config.json as a dict: from ``model.path`` when it is a directory, else from the Hugging Face
    cache for a hub id (never downloaded here); None when neither has it."""
    path = get(cfg, f"{MODEL}.path")
    if not path:
        return None
    if Path(os.path.expanduser(str(path))).is_dir():
        return read_config_json(path)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(path), local_files_only=True).to_dict()
    except Exception:  # unreadable, not cached, not a transformers config: no hint, nothing else changes
        return None


def hints(cfg: Any, s: QerlSettings) -> list[str]:
    """Advice that changes no setting: where a run's own values are known to make the NVFP4 actor slow, and how
    many layers could keep their activations within a BF16 actor's memory."""
    if not s.nvfp4:
        return []
    out = []
    n = NVFP4_MICRO_BATCH_TOKENS
    tokens, source = _micro_batch_tokens(cfg)
    why = (
        f"the NVFP4 actor is host-bound below ~{n} tokens per micro-batch (H100, 7B: 1.48x BF16's time at 2.5k "
        "tokens, parity at 16k; docs/benchmarks.md 4e/4f)"
    )
    if tokens is not None and tokens < n:
        if get(cfg, f"{ACTOR}.use_dynamic_bsz", False):
            out.append(f"{source}: {why}; raise it (16384 in the example recipes)")
        else:
            out.append(f"{source}: {why}; set {ACTOR}.use_dynamic_bsz=true and {ACTOR}.ppo_max_token_len_per_gpu=16384 "
                       "if memory allows")
    hf = _model_config(cfg)
    if (tokens and hf is not None and not s.no_recompute_layers and _lora_rank(cfg) > 0
            and get(cfg, f"{MODEL}.enable_gradient_checkpointing", False)):
        from verl_ext.nvfp4_linear import saved_weight_budget
        from verl_ext.recompute import suggest_kept_layers

        try:
            kept, saved, per_layer = suggest_kept_layers(hf, tokens, saved_weight_budget())
        except ValueError:
            kept = 0
        if kept:
            out.append(
                f"the NVFP4 base holds ~{saved:.1f} GiB less than a BF16 one; at {tokens} tokens per micro-batch "
                f"{NO_RECOMPUTE_KEY}={kept} spends it on not recomputing the last {kept} layers (~{per_layer:.1f} GiB "
                "of activations each, estimated), keeping the actor's peak near a BF16-LoRA actor's: 1.01-1.12x its "
                "speed on the H100 (docs/benchmarks.md 4u)"
            )
    return out


# ---------------------------------------------------------------------------------------------------------
# the patch: qerl's check runs first inside verl's validate_config


def wrap_validate_config(original, target: str):
    def validate_config(config, use_reference_policy, use_critic, *args, **kwargs):
        settings, notes = validate(config)
        if settings.active:
            what = []
            if settings.nvfp4:
                what.append(f"NVFP4 base ({settings.model_quant} checkpoint) + LoRA, adapter-only sync")
            if settings.aqn_enabled:
                a = settings.aqn
                what.append(
                    f"AQN {a.schedule} {a.sigma_start:g}->{a.sigma_end:g} over {a.num_stages} stages"
                    + (" (also on the actor)" if settings.aqn_apply_to_actor else "")
                )
            if settings.no_recompute_layers:
                what.append(f"the actor's last {settings.no_recompute_layers} decoder layers keep their activations")
            print("[qerl] " + "; ".join(what))
            for n in notes:
                print(f"[qerl] normalised {n}")
            for h in hints(config, settings):
                print(f"[qerl] hint: {h}")
        return original(config, use_reference_policy, use_critic, *args, **kwargs)

    return validate_config


# ---------------------------------------------------------------------------------------------------------
# composing a YAML the way `python -m verl.trainer.main_ppo --config-path ... --config-name ...` does


def compose(yaml_path: str | os.PathLike, overrides: Iterable[str] = ()) -> Any:
    """The DictConfig verl's ``main_ppo`` would see for ``yaml_path`` plus Hydra ``overrides`` (no Ray, no GPU)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    path = Path(yaml_path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{yaml_path}: no such config file")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(path.parent), version_base=None):
        return hydra_compose(config_name=path.stem, overrides=list(overrides))


def check(yaml_path: str | os.PathLike, overrides: Iterable[str] = (), verl_checks: bool = True) -> tuple[Any, QerlSettings, list[str]]:
    """Compose, run qerl's checks, then verl's own ``validate_config`` and dataclass conversions.

    Returns (config, settings, notices). Raises QerlConfigError / verl's errors.
    """
    cfg = compose(yaml_path, overrides)
    settings, notes = validate(cfg)
    if verl_checks:
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import omega_conf_to_dataclass

        validate_config = getattr(__import__("verl.utils.config", fromlist=["validate_config"]), "validate_config")
        original = getattr(validate_config, "__wrapped__", validate_config)
        original(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
        from verl.workers.config import HFModelConfig

        model_path = Path(os.path.expanduser(str(cfg.actor_rollout_ref.model.path)))
        if model_path.is_dir():
            omega_conf_to_dataclass(cfg.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    return cfg, settings, notes
