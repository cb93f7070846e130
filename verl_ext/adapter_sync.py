"""Adapter-only sync, actor -> vLLM: take the LoRA tensors by name, check vLLM will recognise every one.

verl 0.9.1's ``collect_lora_params`` returns an empty adapter under FSDP1 with PEFT 0.21 (PEFT matches
FSDP1's wrapped module names against clean state-dict keys), which vLLM then fails on with a bare
``StopIteration``. :func:`wrap_collect_lora_params` extracts the adapter by parameter name instead, in PEFT's
checkpoint keys; :func:`check_adapter_for_vllm` (run inside vLLM) refuses an empty or unrecognised adapter,
listing the names. Design: docs/design.md, "Weight sync".
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from typing import Any, Iterable, Mapping

from qerl_plugin.aqn import PEFT_PREFIX, strip_wrappers

logger = logging.getLogger("qerl.verl.adapter_sync")

ADAPTER_NAME = "default"
# PEFT's LoRA sub-modules: their tensors are the adapter.
LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


class AdapterSyncError(RuntimeError):
    """The LoRA adapter sent to vLLM is empty or has tensors vLLM would not apply."""


# ---------------------------------------------------------------------------------------------------------
# naming


_LORA_KEY = re.compile(
    rf"^(?P<module>.+)\.(?P<part>{'|'.join(LORA_PARTS)})"
    r"(?:\.(?P<adapter>[^.]+))?(?P<tail>\.weight)?$"
)


def adapter_key(name: str, adapter: str = ADAPTER_NAME) -> str | None:
    """The PEFT checkpoint key of a LoRA state-dict entry of ``adapter``, or None for any other entry.

    ``base_model.model._fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.self_attn.q_proj.lora_A.default.weight``
    -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``. Embedding LoRA
    (``...embed_tokens.lora_embedding_A.default``) -> ``...embed_tokens.lora_embedding_A``.
    """
    clean = strip_wrappers(name)
    m = _LORA_KEY.match(clean)
    if m is None:
        return None
    part, adapter_seg, tail = m.group("part"), m.group("adapter"), m.group("tail")
    if part.startswith("lora_embedding"):
        # ParameterDict entries: "<module>.lora_embedding_A.<adapter>"
        if adapter_seg != adapter or tail:
            return None
        return f"{m.group('module')}.{part}"
    if adapter_seg != adapter or tail != ".weight":
        return None
    return f"{m.group('module')}.{part}.weight"


def normalize_adapter_keys(tensors: Mapping[str, Any]) -> "OrderedDict[str, Any]":
    """Map received names to PEFT checkpoint keys (idempotent on already-clean keys)."""
    out: OrderedDict[str, Any] = OrderedDict()
    for name, t in tensors.items():
        key = strip_wrappers(name)
        cleaned = adapter_key(key)
        if cleaned is not None:
            key = cleaned
        if not key.startswith("base_model."):  # PEFT_PREFIX, or another key already under base_model
            key = PEFT_PREFIX + key
        if key in out:
            raise AdapterSyncError(f"two adapter tensors map to the same name {key!r} (one of them is {name!r})")
        out[key] = t
    return out


# ---------------------------------------------------------------------------------------------------------
# the actor side: extraction


def _full(t):
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().cpu()


def lora_state_dict(module, adapter: str = ADAPTER_NAME) -> "OrderedDict[str, Any]":
    """The LoRA tensors of ``adapter`` in a (possibly FSDP1/FSDP2-wrapped) PEFT model, on CPU, keyed as PEFT
    saves them. For FSDP1, call inside ``FSDP.summon_full_params`` (as :func:`collect_adapter` does)."""
    peft_model = getattr(module, "_fsdp_wrapped_module", module)
    out: OrderedDict[str, Any] = OrderedDict()
    for name, tensor in peft_model.state_dict().items():
        key = adapter_key(name, adapter)
        if key is None:
            continue
        if key in out:
            raise AdapterSyncError(f"LoRA tensor {key!r} appears twice in the state dict (second as {name!r})")
        out[key] = _full(tensor)
    return out


def collect_adapter(module) -> "OrderedDict[str, Any]":
    """:func:`lora_state_dict` with FSDP1's full parameters summoned (no write-back)."""
    from verl.utils.fsdp_utils import fsdp_version

    if fsdp_version(module) == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(module, writeback=False):
            params = lora_state_dict(module)
    else:
        params = lora_state_dict(module)
    try:
        from verl.utils.device import get_torch_device

        get_torch_device().empty_cache()
    except Exception:  # pragma: no cover - CPU-only
        pass
    return params


def wrap_collect_lora_params(original, target: str):
    """verl's ``collect_lora_params`` with the adapter path (``base_sync_done=True``) extracted by name."""

    def collect_lora_params(module, layered_summon, base_sync_done):
        if not base_sync_done:
            return original(module, layered_summon, base_sync_done)
        peft_model = getattr(module, "_fsdp_wrapped_module", module)
        if not hasattr(peft_model, "peft_config"):
            return original(module, layered_summon, base_sync_done)
        params = collect_adapter(module)
        if not params:
            raise AdapterSyncError(
                "the actor has a PEFT model but no LoRA tensors of adapter 'default' were found in its state dict; "
                "check actor_rollout_ref.model.target_modules matches the model's linear layers"
            )
        logger.debug("qerl: collected %d LoRA tensors for the adapter sync", len(params))
        return params

    return collect_lora_params


# ---------------------------------------------------------------------------------------------------------
# the vLLM side: would vLLM apply every tensor?


def expected_lora_modules(lora_manager) -> tuple[set[str], dict[str, str]]:
    """(module names vLLM accepts LoRA for, sub-module -> packed module) from a ``LoRAModelManager``.

    Packed layers (``...qkv_proj``) accept their parts (``...q_proj``, ``...k_proj``, ``...v_proj``).
    """
    accepted: set[str] = set()
    part_of: dict[str, str] = {}
    packed = getattr(lora_manager, "packed_modules", {}) or {}
    for name in getattr(lora_manager, "modules", {}):
        if name in packed:
            for sub in packed[name]:
                accepted.add(sub)
                part_of[sub] = name
        else:
            accepted.add(name)
    return accepted, part_of


def check_adapter_for_vllm(
    tensors: Mapping[str, Any],
    accepted_modules: Iterable[str],
    weights_mapper: Any = None,
    skip_prefixes: Iterable[str] | None = None,
) -> dict[str, list[str]]:
    """Read every name as vLLM does (:func:`vllm_ext.worker_extension.parse_lora_names`); raise
    :class:`AdapterSyncError` unless every tensor lands on an accepted module and every module has both A and B.
    Returns ``{module: [names]}``."""
    from vllm_ext.worker_extension import parse_lora_names

    if not tensors:
        raise AdapterSyncError(
            "the LoRA adapter arrived with 0 tensors: the actor sent an empty adapter (verl 0.9.1 does this under "
            "FSDP1 without qerl's collect_lora_params fix; is qerl-plugin installed in the actor's environment?)"
        )
    accepted = set(accepted_modules)
    by_module: dict[str, list[str]] = {}
    halves: dict[str, set[bool]] = {}
    unknown = []
    entries, unparsed = parse_lora_names(tensors, weights_mapper, list(skip_prefixes or ()))
    for name, module, is_a in entries:
        if module not in accepted:
            unknown.append(f"{name} -> {module}")
            continue
        by_module.setdefault(module, []).append(name)
        halves.setdefault(module, set()).add(is_a)
    problems = []
    if unparsed:
        problems.append(f"{len(unparsed)} name(s) vLLM cannot parse as LoRA weights: {unparsed[:6]}")
    if unknown:
        sample = sorted(accepted)[:4]
        problems.append(
            f"{len(unknown)} tensor(s) for modules vLLM did not wrap with LoRA: {unknown[:6]} "
            f"(vLLM's LoRA modules look like {sample})"
        )
    one_sided = [m for m, h in halves.items() if h != {True, False}]
    if one_sided:
        problems.append(f"{len(one_sided)} module(s) with only lora_A or only lora_B: {sorted(one_sided)[:6]}")
    if not by_module and not problems:
        problems.append("no tensor maps to a LoRA module")
    if problems:
        raise AdapterSyncError("the LoRA adapter does not match vLLM's LoRA modules: " + "; ".join(problems))
    return by_module
