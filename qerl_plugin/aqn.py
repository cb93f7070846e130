"""Adaptive Quantization Noise (AQN): the sigma schedule and the per-norm noise vectors.

AQN (QeRL, arXiv 2510.11696, Sec. 3.3) adds a channel-wise Gaussian ``z ~ N(0, sigma^2 I)`` to every RMSNorm
weight of the rollout model, with sigma decaying over discrete stages. Here ``z`` is a pure function of
(seed, stage, module name), added in float32, so vLLM's norms and the actor's get identical vectors and a
resumed run redraws what the interrupted one used. The schedules and how this differs from NVlabs/QeRL's
released code: docs/design.md, "AQN".

    cfg = AQNConfig(total_steps=500)                     # 1e-2 -> 1e-4, 10 stages, exponential
    sched = AQNSchedule(cfg)
    s = sched.setting(global_step)                       # NoiseSetting(stage, sigma, key, ...)
    z = noise_vector("model.layers.0.input_layernorm", 3584, s.sigma, cfg.seed, s.key)
    w_eff = apply_noise_fp32(norm.weight, z)             # fp32

Imports only torch (omegaconf optionally, for :meth:`AQNConfig.from_dict`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from qerl_plugin.options import PEFT_PREFIX, parse_bool

__all__ = [
    "AQN_SKIPPED_NORMS",
    "PEFT_PREFIX",
    "WRAPPER_FRAGMENTS",
    "AQNConfig",
    "AQNSchedule",
    "NoiseSetting",
    "RESAMPLE_MODES",
    "SCHEDULES",
    "apply_noise_fp32",
    "is_aqn_target",
    "noise_seed",
    "noise_vector",
    "noisy_weight",
    "normalize_module_name",
    "rms_normalize",
    "strip_wrappers",
]

SCHEDULES = ("exponential", "linear", "cosine", "log")
RESAMPLE_MODES = ("stage", "step")
# Keys that verl-style config blocks carry next to the AQN fields; from_dict skips them (callers check
# ``enable`` themselves).
_IGNORED_KEYS = frozenset({"_target_", "enable", "enabled"})
_STATE_VERSION = 1
# Bumping this changes every noise vector: keep it fixed once runs depend on it.
_HASH_DOMAIN = "qerl-aqn/v1"


# ---------------------------------------------------------------------------------------------------------
# config


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"AQNConfig.{name}: expected a number, got the boolean {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"AQNConfig.{name}: {value!r} is not a number; write e.g. {name}: 1.0e-2") from None
    if not isinstance(value, (int, float)):
        raise ValueError(f"AQNConfig.{name}: expected a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"AQNConfig.{name}: must be a finite number, got {value}")
    return value


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"AQNConfig.{name}: expected an integer, got the boolean {value!r}")
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"AQNConfig.{name}: {value!r} is not an integer") from None
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"AQNConfig.{name}: expected an integer, got {value}")
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(f"AQNConfig.{name}: expected an integer, got {type(value).__name__} {value!r}")
    return value


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.strip().lower() not in choices:
        close = difflib.get_close_matches(str(value).lower(), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"AQNConfig.{name}: unknown value {value!r}{hint}; choose one of {', '.join(choices)}")
    return value.strip().lower()


@dataclass(frozen=True)
class AQNConfig:
    """The AQN hyper-parameters. Every field is checked; a bad one raises ``ValueError`` naming it.

    ``total_steps`` is the number of optimizer steps of the run (verl: ``trainer.total_training_steps``);
    it may stay ``None`` while the config is parsed and be filled in later with :meth:`with_total_steps`,
    but :class:`AQNSchedule` needs it.
    """

    sigma_start: float = 1e-2
    sigma_end: float = 1e-4
    num_stages: int = 10
    schedule: str = "exponential"
    total_steps: int | None = None
    seed: int = 0
    noise_free_first_stage: bool = True
    resample: str = "stage"

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise the values in place once
        set_(self, "sigma_start", _as_float("sigma_start", self.sigma_start))
        set_(self, "sigma_end", _as_float("sigma_end", self.sigma_end))
        set_(self, "num_stages", _as_int("num_stages", self.num_stages))
        set_(self, "schedule", _choice("schedule", self.schedule, SCHEDULES))
        set_(self, "seed", _as_int("seed", self.seed))
        set_(self, "noise_free_first_stage", parse_bool(self.noise_free_first_stage, "AQNConfig.noise_free_first_stage"))
        set_(self, "resample", _choice("resample", self.resample, RESAMPLE_MODES))
        if self.total_steps is not None:
            set_(self, "total_steps", _as_int("total_steps", self.total_steps))

        if self.sigma_start <= 0:
            raise ValueError(
                f"AQNConfig.sigma_start: must be > 0, got {self.sigma_start}; to run without noise, disable AQN "
                "instead of setting sigma_start to 0"
            )
        if self.sigma_end < 0:
            raise ValueError(f"AQNConfig.sigma_end: must be >= 0, got {self.sigma_end}")
        if self.sigma_end > self.sigma_start:
            raise ValueError(
                f"AQNConfig.sigma_end ({self.sigma_end}) is larger than sigma_start ({self.sigma_start}): AQN "
                "decays the noise; swap the two values"
            )
        if self.schedule == "exponential" and self.sigma_end == 0:
            raise ValueError(
                "AQNConfig.sigma_end: the exponential schedule needs sigma_end > 0 (it interpolates "
                "log(sigma)); use e.g. 1e-4, or schedule='linear' / 'cosine' / 'log' to decay to exactly 0"
            )
        if self.num_stages < 1:
            raise ValueError(f"AQNConfig.num_stages: must be >= 1, got {self.num_stages}")
        if self.noise_free_first_stage and self.num_stages < 2:
            raise ValueError(
                "AQNConfig.num_stages: with noise_free_first_stage=True, stage 0 is noise-free, so num_stages=1 "
                "would never add noise; use num_stages >= 2 or noise_free_first_stage=False"
            )
        if self.total_steps is not None:
            if self.total_steps < 1:
                raise ValueError(f"AQNConfig.total_steps: must be >= 1, got {self.total_steps}")
            if self.total_steps < self.num_stages:
                raise ValueError(
                    f"AQNConfig.total_steps ({self.total_steps}) is smaller than num_stages ({self.num_stages}): "
                    "some stages would get no step; lower num_stages or train for more steps"
                )

    # -- construction ------------------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | Any, **overrides: Any) -> "AQNConfig":
        """Build from a plain dict or an omegaconf ``DictConfig`` (e.g. a verl YAML block).

        ``_target_``, ``enable`` and ``enabled`` are skipped (the caller decides whether AQN is on); any other
        unknown key is an error. ``overrides`` win over ``data`` (e.g. ``total_steps=...`` known later).
        """
        if data is None:
            data = {}
        try:  # omegaconf is optional: resolve interpolations when it is a DictConfig
            from omegaconf import DictConfig, OmegaConf

            if isinstance(data, DictConfig):
                data = OmegaConf.to_container(data, resolve=True)
        except ImportError:  # pragma: no cover - omegaconf ships with verl
            pass
        if not isinstance(data, Mapping):
            raise ValueError(f"AQNConfig.from_dict: expected a mapping of AQN fields, got {type(data).__name__}")
        merged = {k: v for k, v in dict(data).items() if k not in _IGNORED_KEYS}
        merged.update(overrides)
        names = cls.field_names()
        unknown = sorted(k for k in merged if k not in names)
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(str(k), names, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"AQNConfig: unknown key(s) {', '.join(hints)}; valid keys are {', '.join(names)}")
        return cls(**merged)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_total_steps(self, total_steps: int) -> "AQNConfig":
        """A copy with ``total_steps`` set (validated)."""
        return dataclasses.replace(self, total_steps=total_steps)

    @property
    def num_noisy_stages(self) -> int:
        return self.num_stages - 1 if self.noise_free_first_stage else self.num_stages


# ---------------------------------------------------------------------------------------------------------
# schedule


def _interpolate(schedule: str, s0: float, s1: float, t: float) -> float:
    """sigma at fraction ``t`` in [0, 1] of the noisy stages; exact at both ends."""
    if t <= 0.0:
        return s0
    if t >= 1.0:
        return s1
    if schedule == "exponential":
        return s0 * (s1 / s0) ** t
    if schedule == "linear":
        return s0 + (s1 - s0) * t
    if schedule == "cosine":
        return s1 + (s0 - s1) * 0.5 * (1.0 + math.cos(math.pi * t))
    if schedule == "log":
        return s0 - (s0 - s1) * math.log1p((math.e - 1.0) * t)
    raise AssertionError(schedule)  # AQNConfig validated it


@dataclass(frozen=True)
class NoiseSetting:
    """What to apply at one step: ``noise_vector(name, size, sigma, seed, key)`` for every norm."""

    step: int
    stage: int
    sigma: float
    seed: int
    key: int  # the ``stage`` argument of noise_vector: the stage, or the step when resample="step"

    @property
    def active(self) -> bool:
        return self.sigma > 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class AQNSchedule:
    """Step -> stage -> sigma, as the module docstring defines. Pure functions of (config, step).

    :meth:`update` additionally remembers the last setting it returned, so a training loop can push noise
    to the rollout engine only when it changes; :meth:`state_dict` saves that and the config.
    """

    def __init__(self, config: AQNConfig):
        if not isinstance(config, AQNConfig):
            raise TypeError(f"AQNSchedule needs an AQNConfig, got {type(config).__name__}; use AQNConfig.from_dict")
        if config.total_steps is None:
            raise ValueError(
                "AQNConfig.total_steps is not set: the schedule splits the run's optimizer steps into stages; "
                "use config.with_total_steps(trainer.total_training_steps)"
            )
        self.config = config
        self._sigmas = self._stage_sigmas(config)
        self._last: NoiseSetting | None = None
        self.restored_setting: NoiseSetting | None = None  # set by load_state_dict

    @staticmethod
    def _stage_sigmas(cfg: AQNConfig) -> list[float]:
        n = cfg.num_noisy_stages
        noisy = [_interpolate(cfg.schedule, cfg.sigma_start, cfg.sigma_end, j / (n - 1) if n > 1 else 0.0) for j in range(n)]
        return ([0.0] if cfg.noise_free_first_stage else []) + noisy

    # -- pure functions ----------------------------------------------------------------------------------

    def _check_step(self, step: int) -> int:
        if isinstance(step, bool) or not isinstance(step, int):
            if isinstance(step, float) and step.is_integer():
                step = int(step)
            elif isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
                step = int(step.item())
            else:
                raise ValueError(f"AQN step must be an integer, got {type(step).__name__} {step!r}")
        if step < 0:
            raise ValueError(f"AQN step must be >= 0, got {step}")
        return min(step, self.config.total_steps)  # past the end: stay in the last stage, as the reference

    def stage(self, step: int) -> int:
        """Stage index in ``[0, num_stages)``: ``min(step * K // total_steps, K - 1)``."""
        step = self._check_step(step)
        k, total = self.config.num_stages, self.config.total_steps
        return min(step * k // total, k - 1)

    def sigma(self, step: int) -> float:
        return self._sigmas[self.stage(step)]

    def sigmas(self) -> list[float]:
        """sigma of every stage, stage 0 first."""
        return list(self._sigmas)

    def stage_start(self, stage: int) -> int:
        """The first step (>= 0) that falls in ``stage``: ``ceil(stage * total_steps / K)``."""
        k, total = self.config.num_stages, self.config.total_steps
        if not 0 <= stage < k:
            raise ValueError(f"stage must be in [0, {k}), got {stage}")
        return -((-stage * total) // k)

    def noise_key(self, step: int) -> int:
        """The ``stage`` argument for :func:`noise_vector`: the stage, or the step with ``resample='step'``."""
        return self.stage(step) if self.config.resample == "stage" else self._check_step(step)

    def setting(self, step: int) -> NoiseSetting:
        step = self._check_step(step)
        return NoiseSetting(
            step=step, stage=self.stage(step), sigma=self.sigma(step), seed=self.config.seed, key=self.noise_key(step)
        )

    # -- stateful helper ---------------------------------------------------------------------------------

    def update(self, step: int) -> NoiseSetting | None:
        """The setting for ``step`` if its (sigma, key) differs from the last one returned here, else None."""
        s = self.setting(step)
        if self._last is not None and (s.sigma, s.key, s.seed) == (self._last.sigma, self._last.key, self._last.seed):
            return None
        self._last = s
        return s

    @property
    def last_setting(self) -> NoiseSetting | None:
        return self._last

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "config": self.config.to_dict(),
            "last_setting": None if self._last is None else self._last.to_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore :meth:`state_dict`. With ``strict`` a config that differs from the saved one is an error.

        Stage and sigma are functions of (config, step), so a resumed run at step s gets the same stage, sigma
        and noise vectors as an uninterrupted run. The restored ``last_setting`` is informative only: a
        restarted rollout engine holds no noise, so the next :meth:`update` always returns a setting.
        """
        if not isinstance(state, Mapping) or "config" not in state:
            raise ValueError("AQNSchedule.load_state_dict: expected the dict returned by AQNSchedule.state_dict()")
        version = state.get("version")
        if version != _STATE_VERSION:
            raise ValueError(f"AQNSchedule.load_state_dict: state version {version!r}, this code reads {_STATE_VERSION}")
        saved = AQNConfig.from_dict(state["config"])
        if strict and saved != self.config:
            diffs = [
                f"{n}: saved {getattr(saved, n)!r}, now {getattr(self.config, n)!r}"
                for n in AQNConfig.field_names()
                if getattr(saved, n) != getattr(self.config, n)
            ]
            raise ValueError(
                "AQN config changed since the checkpoint (" + "; ".join(diffs) + "); resume with the saved config, "
                "or pass strict=False to continue with the new one"
            )
        last = state.get("last_setting")
        self.restored_setting = None if last is None else NoiseSetting(**last)
        self._last = None

    def __repr__(self) -> str:
        c = self.config
        return (
            f"AQNSchedule({c.schedule}, {c.sigma_start:g}->{c.sigma_end:g}, K={c.num_stages}, "
            f"total_steps={c.total_steps}, noise_free_first_stage={c.noise_free_first_stage}, resample={c.resample})"
        )


# ---------------------------------------------------------------------------------------------------------
# names and noise

# Wrapper fragments that frameworks insert between an HF module path's parts.
WRAPPER_FRAGMENTS = (
    "_fsdp_wrapped_module.",  # FSDP1 (use_orig_params) and verl's FSDP wrappers
    "_orig_mod.",  # torch.compile
    "_checkpoint_wrapped_module.",  # activation checkpointing wrapper
    "_offload_wrapped_module.",
)
_PEFT_MODULES_TO_SAVE = re.compile(r"\.(?:modules_to_save\.[^.]+|original_module)(?=\.|$)")
# Last name part of the RMSNorms AQN leaves alone: per-head q/k norms scale attention logits and feed no
# linear projection.
AQN_SKIPPED_NORMS = frozenset({"q_norm", "k_norm"})


def strip_wrappers(name: str) -> str:
    """``name`` without the FSDP / torch.compile / checkpoint wrapper fragments (:data:`WRAPPER_FRAGMENTS`)."""
    for frag in WRAPPER_FRAGMENTS:
        name = name.replace(frag, "")
    return name


def is_aqn_target(name: str) -> bool:
    """AQN perturbs the norm called ``name`` (any form of its module name) unless it is a per-head q/k norm."""
    return name.rsplit(".", 1)[-1] not in AQN_SKIPPED_NORMS


def normalize_module_name(name: str) -> str:
    """The canonical name of a module, used to seed its noise.

    Maps the forms one norm takes in HF (``model.layers.3.input_layernorm``), PEFT
    (``base_model.model.model.layers.3.input_layernorm``, also ``....modules_to_save.default`` and
    ``....original_module`` when the norm is trained), FSDP / torch.compile / checkpoint wrappers
    (``_fsdp_wrapped_module.``, ``_orig_mod.``, ``_checkpoint_wrapped_module.`` anywhere), DDP (a leading
    ``module.``), a trailing parameter name (``.weight``) and vLLM (``model.layers.3.input_layernorm``) to
    the HF form. Names are otherwise kept: vLLM and HF must already agree on the module path.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"module name must be a non-empty string, got {name!r}")
    n = name
    for frag in WRAPPER_FRAGMENTS:
        n = n.replace(frag, "")
        if n.endswith(frag[:-1]):
            n = n[: -len(frag)]  # a trailing wrapper fragment without its dot
    n = _PEFT_MODULES_TO_SAVE.sub("", n)
    while True:  # leading wrappers, possibly nested (DDP around PEFT)
        if n.startswith(PEFT_PREFIX):
            n = n[len(PEFT_PREFIX) :]
        elif n.startswith("module."):
            n = n[len("module.") :]
        else:
            break
    if n.endswith(".weight"):
        n = n[: -len(".weight")]
    n = n.strip(".")
    if not n:
        raise ValueError(f"module name {name!r} is only wrapper prefixes; pass the norm's full module path")
    return n


def noise_seed(name: str, seed: int, stage: int) -> int:
    """The 63-bit generator seed of (seed, stage, canonical name): SHA-256, independent of the process."""
    key = f"{_HASH_DOMAIN}\x00{int(seed)}\x00{int(stage)}\x00{normalize_module_name(name)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def noise_vector(
    name: str,
    size: int,
    sigma: float,
    seed: int,
    stage: int,
    device: torch.device | str | None = None,
    generator_device: str = "cpu",
) -> torch.Tensor:
    """The float32 noise ``z`` (``[size]``) for the norm ``name``: ``float32(sigma * n)``, ``n ~ N(0, 1)``.

    ``n`` comes from a ``torch.Generator`` on ``generator_device`` (CPU by default, so every machine and
    rank draws the same values) seeded with :func:`noise_seed`, drawn in float64 (torch's scalar CPU path,
    independent of the CPU's vector units) and rounded once to float32 after scaling. ``name`` is
    canonicalised with :func:`normalize_module_name`, so HF, PEFT, FSDP and vLLM names of one norm agree.
    At ``sigma == 0`` the result is zeros (no draw): callers can always add it. The result is moved to
    ``device`` (default: ``generator_device``).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"noise_vector: size must be a non-negative integer, got {size!r}")
    sigma = float(sigma)
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"noise_vector: sigma must be a finite number >= 0, got {sigma}")
    gen_device = torch.device(generator_device)
    out_device = torch.device(device) if device is not None else gen_device
    if sigma == 0.0:
        return torch.zeros(size, dtype=torch.float32, device=out_device)
    gen = torch.Generator(device=gen_device)
    gen.manual_seed(noise_seed(name, seed, stage))
    z = torch.randn(size, generator=gen, dtype=torch.float64, device=gen_device)
    return z.mul_(sigma).to(device=out_device, dtype=torch.float32)


def rms_normalize(h: torch.Tensor, eps: float, variance_size: int | None = None) -> torch.Tensor:
    """``h / rms(h)`` for a float32 ``h``, as vLLM's and Hugging Face's RMSNorm compute it (the mean of squares
    over the first ``variance_size`` channels, all when None)."""
    h_var = h if variance_size is None else h[..., :variance_size]
    return h * torch.rsqrt(h_var.pow(2).mean(dim=-1, keepdim=True) + eps)


def noisy_weight(weight: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The effective norm weight ``weight.float() + noise`` in float32, without checks (it runs inside
    vLLM's compiled graphs); :func:`apply_noise_fp32` is the checked form."""
    return weight.float() + noise


def apply_noise_fp32(weight: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """The effective norm weight ``weight.float() + noise``, in float32 (bf16 would round 1e-4 away).

    ``noise`` None returns ``weight.float()``. Shapes must match exactly (one value per channel).
    """
    if noise is None:
        return weight.float()
    if noise.shape != weight.shape:
        raise ValueError(
            f"AQN noise of shape {tuple(noise.shape)} does not match the norm weight {tuple(weight.shape)}; draw it "
            "with noise_vector(name, weight.numel(), ...)"
        )
    if noise.dtype != torch.float32:
        raise ValueError(f"AQN noise must be float32 (got {noise.dtype}): noise_vector returns float32")
    return noisy_weight(weight, noise.to(weight.device))
