"""AQN inside vLLM: an out-of-tree RMSNorm whose weight carries a per-norm fp32 noise vector.

:class:`NoisyRMSNorm` replaces vLLM's ``RMSNorm`` through ``CustomOp.register_oot`` (no patching). An engine
built with ``additional_config={"qerl_aqn": true}`` gives every norm fp32 noise buffers that
:func:`set_noise` rewrites in place (CUDA graphs and compiled code read them), computing
``normalize(x) * (w + z)``; any other engine runs vLLM's own RMSNorm code. Design: docs/design.md, "AQN".
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.layernorm import RMSNorm

from qerl_plugin import options
from qerl_plugin.aqn import is_aqn_target, noisy_weight, rms_normalize

logger = logging.getLogger("qerl.vllm.aqn")


# ---------------------------------------------------------------------------------------------------------
# The switch
# ---------------------------------------------------------------------------------------------------------


def aqn_enabled(vllm_config: Any = None) -> bool:
    """Whether norms built now carry AQN noise: ``additional_config["qerl_aqn"]`` of ``vllm_config``
    (default: vLLM's current config, if one is set)."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    return options.aqn_enabled(getattr(vllm_config, "additional_config", None))


# ---------------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------------


class NoisyRMSNorm(RMSNorm):
    """vLLM ``RMSNorm`` with an optional fp32 noise vector added to its weight (see the module docstring).

    Attributes beyond vLLM's: ``qerl_aqn`` (bool, fixed at construction); when it is set, buffers
    ``qerl_noise`` (fp32, ``hidden_size``) and ``qerl_active`` (bool, ``[1]``); ``qerl_name`` (HF module name,
    set by :func:`noisy_norms`).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        var_hidden_size: int | None = None,
        has_weight: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden_size, eps, var_hidden_size, has_weight, dtype)
        self.qerl_name: str | None = None
        self.qerl_aqn = bool(has_weight) and aqn_enabled()
        if self.qerl_aqn:
            device = self.weight.device
            noise = torch.zeros(hidden_size, dtype=torch.float32, device=device)
            self.register_buffer("qerl_noise", noise, persistent=False)
            self.register_buffer("qerl_active", torch.zeros(1, dtype=torch.bool, device=device), persistent=False)

    # vLLM dispatches to forward_cuda on CUDA/ROCm/XPU and to forward_native elsewhere (and when the op is
    # disabled, the default under Inductor). Both go through the same noisy expression when AQN is on.
    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.qerl_aqn:
            return super().forward_native(x, residual)
        return self._qerl_forward(x, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.qerl_aqn:
            return super().forward_cuda(x, residual)
        return self._qerl_forward(x, residual)

    def _qerl_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # Same steps as vllm.ir.ops.rms_norm / fused_add_rms_norm (native) up to the weight multiply.
        orig_dtype = x.dtype
        h = x.to(torch.float32)
        if residual is not None:
            h = h + residual.to(torch.float32)
            new_residual = h.to(orig_dtype)
        h = rms_normalize(h, self.variance_epsilon, self.variance_size_override)
        weight = self.weight.data
        stock = (h.to(weight.dtype) * weight).to(orig_dtype)
        noisy = (h * noisy_weight(weight, self.qerl_noise)).to(orig_dtype)
        out = torch.where(self.qerl_active, noisy, stock)
        if residual is None:
            return out
        return out, new_residual

    def extra_repr(self) -> str:
        return super().extra_repr() + f", qerl_aqn={self.qerl_aqn}"


def register() -> None:
    """Install :class:`NoisyRMSNorm` as vLLM's out-of-tree ``RMSNorm``; safe to call any number of times."""
    from vllm.model_executor.custom_op import op_registry_oot

    existing = op_registry_oot.get("RMSNorm")
    if existing is not None:
        if getattr(existing, "__qualname__", "") == NoisyRMSNorm.__qualname__ and (
            getattr(existing, "__module__", "") == __name__
        ):
            return
        raise RuntimeError(
            f"vLLM's RMSNorm is already replaced out of tree by {existing.__module__}."
            f"{existing.__qualname__}; qerl-plugin's AQN norm cannot be installed next to it. "
            "Load only one of the two plugins (VLLM_PLUGINS=<names>)."
        )
    RMSNorm.register_oot(NoisyRMSNorm)
    # register_oot renames the class to the lookup key ("RMSNorm"); keep vLLM's op name so that
    # custom_ops=["+rms_norm"/"-rms_norm"] enables/disables our class exactly as it does the stock one.
    NoisyRMSNorm.name = RMSNorm.name
    logger.debug("qerl: vLLM RMSNorm replaced by %s", NoisyRMSNorm.__qualname__)


# ---------------------------------------------------------------------------------------------------------
# Names: vLLM module name -> HF module name
# ---------------------------------------------------------------------------------------------------------


def hf_module_name(vllm_name: str, model: nn.Module | None = None) -> str:
    """HF module name of the vLLM module ``vllm_name`` in ``model``.

    Inverts the prefix and substring rules of ``model.hf_to_vllm_mapper`` (vLLM's ``WeightsMapper``) and
    keeps the first candidate that the forward mapper sends back to ``vllm_name``; identity otherwise.
    """
    mapper = getattr(model, "hf_to_vllm_mapper", None) if model is not None else None
    if mapper is None:
        return vllm_name
    key = vllm_name + ".weight"
    candidates: list[str] = []
    for hf_prefix, vllm_prefix in getattr(mapper, "orig_to_new_prefix", {}).items():
        if vllm_prefix is not None and key.startswith(vllm_prefix):
            candidates.append(hf_prefix + key[len(vllm_prefix) :])
    for hf_sub, vllm_sub in getattr(mapper, "orig_to_new_substr", {}).items():
        if vllm_sub and vllm_sub in key:
            candidates.append(key.replace(vllm_sub, hf_sub, 1))
    candidates.append(key)
    for candidate in candidates:
        if mapper._map_name(candidate) == key:
            return candidate[: -len(".weight")]
    return vllm_name


def noisy_norms(model: nn.Module) -> list[tuple[str, NoisyRMSNorm]]:
    """``(hf_name, norm)`` for every AQN-carrying norm of ``model``, sorted by name; sets ``qerl_name``."""
    found: dict[str, NoisyRMSNorm] = {}
    for vllm_name, module in model.named_modules():
        if not isinstance(module, NoisyRMSNorm) or not module.qerl_aqn:
            continue
        name = hf_module_name(vllm_name, model)
        if not is_aqn_target(name):
            continue
        if name in found and found[name] is not module:
            raise RuntimeError(
                f"two norms of {type(model).__name__} map to the HF name {name!r}; AQN cannot seed them apart"
            )
        module.qerl_name = name
        found[name] = module
    return sorted(found.items())


# ---------------------------------------------------------------------------------------------------------
# Setting the noise
# ---------------------------------------------------------------------------------------------------------


def validate_noise_args(sigma: Any, seed: Any, stage: Any) -> tuple[float, int, int]:
    """Check the arguments of :func:`set_noise`; raise ValueError naming the bad value and the fix."""
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real):
        raise ValueError(f"sigma={sigma!r} is not a number; pass a float >= 0 (e.g. 1e-2)")
    sigma_f = float(sigma)
    if not math.isfinite(sigma_f) or sigma_f < 0:
        raise ValueError(f"sigma={sigma!r} must be finite and >= 0 (e.g. 1e-2; 0 clears the noise)")
    for label, value in (("seed", seed), ("stage", stage)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{label}={value!r} is not an int; pass a non-negative integer")
        if int(value) < 0:
            raise ValueError(f"{label}={value!r} is negative; pass a non-negative integer")
    return sigma_f, int(seed), int(stage)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_noise(model: nn.Module, sigma: Any, seed: Any, stage: Any) -> dict:
    """Resample the noise of every AQN norm of ``model`` in place; all-or-nothing.

    Arguments are validated and all vectors are drawn before any buffer is written, so a failure leaves the
    previous noise in place. Returns ``{"norms", "sigma", "seed", "stage", "checksum", "enabled"}``, where
    ``checksum`` is the fp64 sum of all noise entries (compare it with the trainer's to check the match).
    """
    sigma_f, seed_i, stage_i = validate_noise_args(sigma, seed, stage)
    norms = noisy_norms(model)
    if not norms:
        if sigma_f == 0.0:
            return {"norms": 0, "sigma": 0.0, "seed": seed_i, "stage": stage_i, "checksum": 0.0, "enabled": False}
        raise RuntimeError(
            f"no AQN norm in {type(model).__name__}: the engine was started without AQN. Start it with "
            f"additional_config={{'{options.AQN_KEY}': True}} (vllm serve --additional-config "
            f"'{{\"{options.AQN_KEY}\": true}}')"
        )
    if sigma_f == 0.0:
        vectors = [None] * len(norms)
    else:
        from qerl_plugin.aqn import noise_vector

        vectors = []
        for name, norm in norms:
            buf = norm.qerl_noise
            z = noise_vector(name, buf.numel(), sigma_f, seed_i, stage_i, device=buf.device)
            if z.shape != buf.shape or z.dtype != torch.float32:
                raise RuntimeError(
                    f"noise_vector({name!r}) returned {tuple(z.shape)} {z.dtype}; expected "
                    f"{tuple(buf.shape)} torch.float32"
                )
            vectors.append(z.to(buf.device))
    _write(norms, vectors)
    checksum = float(sum(v.double().sum().item() for v in vectors if v is not None))
    return {
        "norms": len(norms),
        "sigma": sigma_f,
        "seed": seed_i,
        "stage": stage_i,
        "checksum": checksum,
        "enabled": True,
    }


def clear_noise(model: nn.Module) -> dict:
    """Zero the noise of every AQN norm of ``model`` (the engine then computes vLLM's native RMSNorm)."""
    norms = noisy_norms(model)
    _write(norms, [None] * len(norms))
    return {"norms": len(norms), "sigma": 0.0, "enabled": bool(norms)}


def _write(norms: Iterable[tuple[str, NoisyRMSNorm]], vectors: list[torch.Tensor | None]) -> None:
    """Copy each vector into its norm's buffer (None: zero it and select the stock expression)."""
    norms = list(norms)
    devices = {norm.qerl_noise.device for _, norm in norms}
    # A forward already queued on another stream must not read a half-written set of vectors.
    for device in devices:
        _synchronize(device)
    with torch.no_grad():
        for (_, norm), z in zip(norms, vectors, strict=True):
            if z is None:
                norm.qerl_noise.zero_()
                norm.qerl_active.fill_(False)
            else:
                norm.qerl_noise.copy_(z)
                norm.qerl_active.fill_(True)
    for device in devices:
        _synchronize(device)
