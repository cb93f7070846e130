"""RPCs the trainer calls on vLLM's workers: AQN noise, in-memory LoRA adapters, memory.

Pass ``worker_extension_cls="vllm_ext.worker_extension.QerlWorkerExtension"`` to ``LLM(...)`` /
``vllm serve --worker-extension-cls ...``; every TP/PP rank then runs these through ``collective_rpc``:

    llm.collective_rpc("qerl_set_noise", args=(1e-2, seed, stage))    # -> one dict per rank
    llm.collective_rpc("qerl_clear_noise")
    llm.collective_rpc("qerl_add_lora_from_tensors", args=(name, int_id, tensors, peft_config))
    llm.collective_rpc("qerl_memory_report")

Noise needs an engine started with ``additional_config={"qerl_aqn": True}``. The class is a plain mixin
(no ``__init__``, every attribute ``qerl_``-prefixed), so verl_ext combines it with verl's own extension.
Design (sleep mode, how an in-memory adapter reaches vLLM's LoRA manager): docs/design.md.
"""

from __future__ import annotations

import logging
import numbers
import os
from typing import Any, Iterable

import torch
from torch import nn

logger = logging.getLogger("qerl.vllm.worker")

IN_MEMORY_LORA_PREFIX = "qerl-in-memory/"
_MAX_LISTED = 8


class LoRAAdapterError(ValueError):
    """An in-memory LoRA adapter that this engine cannot serve; the message names the adapter and the fix."""


# ---------------------------------------------------------------------------------------------------------
# The mixin
# ---------------------------------------------------------------------------------------------------------


class QerlWorkerExtension:
    """Mixin for vLLM's worker; see the module docstring. Methods run on every rank via ``collective_rpc``."""

    # -- AQN ------------------------------------------------------------------------------------------------

    def qerl_set_noise(self, sigma: float, seed: int, stage: int) -> dict:
        """Resample every AQN norm's noise in place for ``(seed, stage)`` at ``sigma``.

        Returns ``{"norms", "sigma", "seed", "stage", "checksum", "enabled", "rank"}``. Bad arguments raise
        ValueError before any buffer is touched (the previous noise stays).
        """
        from vllm_ext import noisy_norm

        report = noisy_norm.set_noise(self._qerl_model(), sigma, seed, stage)
        report["rank"] = self._qerl_rank()
        self._qerl_noise_state = {k: report[k] for k in ("sigma", "seed", "stage")}
        return report

    def qerl_clear_noise(self) -> dict:
        """Zero every AQN norm's noise; returns ``{"norms", "sigma": 0.0, "enabled", "rank"}``."""
        from vllm_ext import noisy_norm

        report = noisy_norm.clear_noise(self._qerl_model())
        report["rank"] = self._qerl_rank()
        self._qerl_noise_state = None
        return report

    # -- LoRA -----------------------------------------------------------------------------------------------

    def qerl_add_lora_from_tensors(
        self,
        lora_name: str,
        lora_int_id: int,
        tensors: dict[str, torch.Tensor],
        peft_config: dict,
    ) -> bool:
        """Load (or replace, same ``lora_int_id``) a LoRA adapter from in-memory tensors; no disk round trip.

        ``tensors`` are PEFT state-dict entries (``base_model.model.<module>.lora_A.weight`` /
        ``lora_B.weight``, HF module names), ``peft_config`` a PEFT ``LoraConfig`` as dict (``r``,
        ``lora_alpha``, ``target_modules``, ...). Raises :class:`LoRAAdapterError` (a ValueError) naming the
        adapter and the fix when the engine cannot serve it; adapters already loaded keep serving.
        Returns vLLM's ``add_adapter`` result (True when the adapter was newly registered).
        """
        manager = self._qerl_worker_lora_manager(lora_name)
        lora_model = build_lora_model(
            lora_name,
            lora_int_id,
            tensors,
            peft_config,
            model=self._qerl_model(),
            lora_config=manager.lora_config,
            adapter_manager=manager._adapter_manager,
            max_position_embeddings=manager.max_position_embeddings,
            vocab_size=manager.vocab_size,
        )
        return add_lora_model(manager, lora_model, lora_name)

    # -- memory ---------------------------------------------------------------------------------------------

    def qerl_memory_report(self) -> dict:
        """Device memory of this worker (torch.cuda statistics on CUDA, process RSS on CPU) plus AQN/LoRA state."""
        from vllm_ext import noisy_norm

        device = getattr(self, "device", None)
        report = memory_report(device if isinstance(device, torch.device) else None)
        report["rank"] = self._qerl_rank()
        try:
            model = self._qerl_model()
        except RuntimeError:
            model = None
        if model is not None:
            norms = noisy_norms_or_empty(model, noisy_norm)
            report["aqn_norms"] = len(norms)
            report["aqn_buffer_bytes"] = sum(b.nbytes for _, n in norms for b in (n.qerl_noise, n.qerl_active))
        report["aqn_noise"] = getattr(self, "_qerl_noise_state", None)
        runner = getattr(self, "model_runner", None)
        lora_manager = getattr(runner, "lora_manager", None)
        if lora_manager is not None:
            report["lora_adapters"] = sorted(lora_manager.list_adapters())
        return report

    # -- helpers (prefixed: vLLM refuses extension attributes that shadow the worker's) --------------------

    def _qerl_model(self) -> nn.Module:
        runner = getattr(self, "model_runner", None)
        if runner is None:
            raise RuntimeError("this vLLM worker has no model_runner yet; call after the engine has loaded the model")
        get_model = getattr(runner, "get_model", None)
        model = get_model() if callable(get_model) else getattr(runner, "model", None)
        if model is None:
            raise RuntimeError("this vLLM worker has no model loaded yet; call after the engine has started")
        return model

    def _qerl_rank(self) -> int:
        rank = getattr(self, "rank", 0)
        return int(rank) if isinstance(rank, numbers.Integral) else 0

    def _qerl_worker_lora_manager(self, lora_name: str) -> Any:
        runner = getattr(self, "model_runner", None)
        manager = getattr(runner, "lora_manager", None)
        if manager is None:
            raise LoRAAdapterError(
                f"cannot load LoRA adapter {lora_name!r}: this engine was started without LoRA. Start it with "
                "enable_lora=True (vllm serve --enable-lora) and max_lora_rank >= the adapter's rank"
            )
        return manager


def noisy_norms_or_empty(model: nn.Module, noisy_norm_module: Any) -> list:
    try:
        return noisy_norm_module.noisy_norms(model)
    except RuntimeError:
        return []


# ---------------------------------------------------------------------------------------------------------
# In-memory LoRA
# ---------------------------------------------------------------------------------------------------------


def _listed(items: list[str]) -> str:
    items = sorted(items)
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more


def lora_module_table(
    model: nn.Module, lora_config: Any, adapter_manager: Any = None
) -> dict[str, tuple[nn.Module | None, int | None]]:
    """Adapter-visible module names this engine serves -> (base layer, slice index in a packed layer).

    With a live ``adapter_manager`` (vLLM's ``LoRAModelManager``) its ``modules``/``packed_modules`` are the
    truth; without one (CPU tests, before LoRA init) the same table is derived from ``model`` with vLLM's
    own helpers, applying ``lora_config.target_modules`` as the manager would.
    """
    table: dict[str, tuple[nn.Module | None, int | None]] = {}
    if adapter_manager is not None:
        packed: dict[str, list[str]] = dict(getattr(adapter_manager, "packed_modules", {}))
        for name, module in adapter_manager.modules.items():
            base = getattr(module, "base_layer", module)
            if name in packed:
                for index, sub in enumerate(packed[name]):
                    table[sub] = (base, index)
            else:
                table[name] = (base, None)
        return table

    from vllm.lora.utils import (
        get_supported_lora_modules,
        is_in_target_modules,
        is_supported_lora_module,
        process_packed_modules_mapping,
    )
    from vllm.model_executor.models.utils import PPMissingLayer

    supported = get_supported_lora_modules(model)
    packed_mapping = process_packed_modules_mapping(model)
    target_modules = getattr(lora_config, "target_modules", None)
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, PPMissingLayer) or not name:
            continue
        if not is_supported_lora_module(name, supported):
            continue
        if not is_in_target_modules(name, target_modules, packed_mapping):
            continue
        prefix, _, leaf = name.rpartition(".")
        subs = packed_mapping.get(leaf, [])
        if len(subs) > 1:
            for index, sub in enumerate(subs):
                table[f"{prefix}.{sub}" if prefix else sub] = (module, index)
        else:
            table[name] = (module, None)
    return table


def _peft_dict(lora_name: str, peft_config: Any) -> dict:
    if hasattr(peft_config, "to_dict") and not isinstance(peft_config, dict):
        peft_config = peft_config.to_dict()
    if not isinstance(peft_config, dict):
        raise LoRAAdapterError(
            f"LoRA adapter {lora_name!r}: peft_config must be a dict (PEFT LoraConfig.to_dict()), "
            f"got {type(peft_config).__name__}"
        )
    config = dict(peft_config)
    target = config.get("target_modules")
    if isinstance(target, (set, frozenset, tuple)):
        config["target_modules"] = sorted(target)
    return config


def parse_lora_names(
    names: Iterable[str], weights_mapper: Any = None, skip_prefixes: list[str] | None = None
) -> tuple[list[tuple[str, str, bool]], list[str]]:
    """Adapter tensor names as ``LoRAModel.from_lora_tensors`` reads them: ``(name, module, is_lora_a)`` for each
    LoRA weight, and the names ``parse_fine_tuned_lora_name`` refuses. Base-embedding weights and names under
    ``skip_prefixes`` are left out, as vLLM leaves them out."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    entries: list[tuple[str, str, bool]] = []
    unparsed: list[str] = []
    for name in names:
        if is_base_embedding_weights(name):
            continue
        if skip_prefixes and LoRAModel._should_skip_module(name, skip_prefixes):
            continue
        try:
            module, is_a = parse_fine_tuned_lora_name(name, weights_mapper)
        except ValueError:
            unparsed.append(name)
            continue
        entries.append((name, module, is_a))
    return entries, unparsed


def build_lora_model(
    lora_name: str,
    lora_int_id: int,
    tensors: dict[str, torch.Tensor],
    peft_config: Any,
    *,
    model: nn.Module,
    lora_config: Any,
    adapter_manager: Any = None,
    max_position_embeddings: int | None = None,
    vocab_size: int | None = None,
) -> Any:
    """Validate an in-memory adapter against this engine and build vLLM's ``LoRAModel`` (CPU tensors).

    Raises :class:`LoRAAdapterError` naming the adapter, the offending rank/modules/tensors and the fix.
    """
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    if not isinstance(lora_name, str) or not lora_name:
        raise LoRAAdapterError(f"lora_name={lora_name!r} must be a non-empty string")
    if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, numbers.Integral) or lora_int_id < 1:
        raise LoRAAdapterError(
            f"LoRA adapter {lora_name!r}: lora_int_id={lora_int_id!r} must be an int >= 1 (vLLM reserves 0)"
        )
    lora_int_id = int(lora_int_id)
    if not isinstance(tensors, dict) or not tensors:
        raise LoRAAdapterError(
            f"LoRA adapter {lora_name!r} has no tensors; pass the PEFT adapter state dict "
            "(get_peft_model_state_dict(model)), names like base_model.model.<module>.lora_A.weight"
        )
    not_tensors = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise LoRAAdapterError(f"LoRA adapter {lora_name!r}: entries are not tensors: {_listed(not_tensors)}")

    # -- config and rank ---------------------------------------------------------------------------------
    config = _peft_dict(lora_name, peft_config)
    if max_position_embeddings is not None:
        config.setdefault("vllm_max_position_embeddings", max_position_embeddings)
    try:
        helper = PEFTHelper.from_dict(config)
    except (TypeError, ValueError) as err:
        raise LoRAAdapterError(f"LoRA adapter {lora_name!r}: invalid peft_config ({err})") from err
    rank = helper.r
    max_rank = getattr(lora_config, "max_lora_rank", None)
    if max_rank is not None and rank > max_rank:
        raise LoRAAdapterError(
            f"LoRA adapter {lora_name!r} has rank r={rank} but this engine was started with "
            f"max_lora_rank={max_rank}; restart vLLM with max_lora_rank >= {rank} (allowed: 1, 8, 16, 32, "
            "64, 128, 256, 320, 512) or train the adapter with a smaller rank"
        )
    try:
        helper.validate_legal(lora_config)
    except ValueError as err:
        raise LoRAAdapterError(f"LoRA adapter {lora_name!r} cannot be served: {err}") from err

    # -- modules -----------------------------------------------------------------------------------------
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    skip_prefixes = getattr(model, "lora_skip_prefixes", None) or None
    table = lora_module_table(model, lora_config, adapter_manager)
    served_suffixes = sorted({name.rsplit(".", 1)[-1] for name in table})
    entries, bad_names = parse_lora_names(tensors, mapper, skip_prefixes)
    parsed: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, module_name, is_a in entries:
        parsed.setdefault(module_name, {})["A" if is_a else "B"] = tensors[tensor_name]
    if bad_names:
        raise LoRAAdapterError(
            f"LoRA adapter {lora_name!r}: tensor names are not LoRA weights: {_listed(bad_names)}; expected "
            "<module>.lora_A.weight / <module>.lora_B.weight (PEFT state dict)"
        )
    if not parsed:
        raise LoRAAdapterError(f"LoRA adapter {lora_name!r} carries no LoRA module (only skipped/base tensors)")

    unknown = [m for m in parsed if m not in table and not _is_served_expert(m, table)]
    if unknown:
        raise LoRAAdapterError(
            f"LoRA adapter {lora_name!r} targets modules this engine does not serve with LoRA: "
            f"{_listed(unknown)}. Served module types: {', '.join(served_suffixes) or 'none'}"
            f" (vLLM lora target_modules={getattr(lora_config, 'target_modules', None)}). Train the adapter "
            "on the same base model with target_modules among those, or restart vLLM without a "
            "--lora-target-modules restriction that excludes them"
        )
    target = config.get("target_modules")
    if isinstance(target, list):
        missing = [t for t in target if not _target_matches(t, table)]
        if missing:
            raise LoRAAdapterError(
                f"LoRA adapter {lora_name!r}: peft_config target_modules {missing} match no module this "
                f"engine serves with LoRA ({', '.join(served_suffixes) or 'none'}); fix target_modules or "
                "the engine's LoRA target modules"
            )

    # -- shapes --------------------------------------------------------------------------------------------
    problems: list[str] = []
    for module_name, pair in parsed.items():
        if set(pair) != {"A", "B"}:
            problems.append(f"{module_name}: lora_{'B' if 'A' in pair else 'A'} missing")
            continue
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2:
            problems.append(f"{module_name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not 2-D")
            continue
        if a.shape[0] != rank or b.shape[1] != rank:
            problems.append(
                f"{module_name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have rank r={rank}"
            )
            continue
        base, index = table.get(module_name, (None, None))
        in_size = getattr(base, "input_size", None)
        if isinstance(in_size, int) and a.shape[1] != in_size:
            problems.append(f"{module_name}: lora_A has {a.shape[1]} input features, the layer has {in_size}")
        out_size = _slice_output_size(base, index)
        if out_size is not None and b.shape[0] != out_size:
            problems.append(f"{module_name}: lora_B has {b.shape[0]} output features, the layer has {out_size}")
    if problems:
        raise LoRAAdapterError(
            f"LoRA adapter {lora_name!r} does not fit this model: {'; '.join(problems[:_MAX_LISTED])}"
            + (f" (+{len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else "")
            + ". Was it trained on this base model with this peft_config?"
        )

    dtype = getattr(lora_config, "lora_dtype", None)
    cpu_tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
    lora_model = LoRAModel.from_lora_tensors(
        lora_model_id=lora_int_id,
        tensors=cpu_tensors,
        peft_helper=helper,
        device="cpu",
        dtype=dtype if isinstance(dtype, torch.dtype) else None,
        model_vocab_size=vocab_size,
        weights_mapper=mapper,
        skip_prefixes=skip_prefixes,
    )
    if not lora_model.loras:
        raise LoRAAdapterError(f"LoRA adapter {lora_name!r} produced no LoRA layer")
    return lora_model


def _is_served_expert(module_name: str, table: dict) -> bool:
    marker = module_name.find(".experts.")
    if marker < 0:
        return False
    owner = module_name[: marker + len(".experts")]
    return owner in table or any(name.startswith(owner) for name in table)


def _target_matches(target: str, table: dict) -> bool:
    return any(name == target or name.endswith("." + target) for name in table)


def _slice_output_size(base: Any, index: int | None) -> int | None:
    if base is None:
        return None
    if index is None:
        size = getattr(base, "output_size", None)
        return size if isinstance(size, int) else None
    sizes = getattr(base, "output_sizes", None)
    if not isinstance(sizes, (list, tuple)) or index >= len(sizes):
        return None
    # QKV layers replicate KV heads when tp_size > num_kv_heads; their output_sizes then overstate the
    # adapter's k/v width, so k/v slices are only checked without replication.
    if index > 0 and getattr(base, "num_kv_head_replicas", 1) != 1:
        return None
    size = sizes[index]
    return size if isinstance(size, int) else None


def add_lora_model(worker_lora_manager: Any, lora_model: Any, lora_name: str) -> bool:
    """Hand a built ``LoRAModel`` to vLLM's worker LoRA manager (LRU cache, in-place replace, activate)."""
    from vllm.lora.request import LoRARequest

    request = LoRARequest(
        lora_name=lora_name,
        lora_int_id=lora_model.id,
        lora_path=IN_MEMORY_LORA_PREFIX + lora_name,
        load_inplace=True,
    )
    # vLLM only knows how to load adapters from a path; shadow _load_adapter on this instance for this one
    # call so that add_adapter's own bookkeeping (eviction, replacement, activation) runs unchanged.
    worker_lora_manager._load_adapter = lambda _request: lora_model
    try:
        return bool(worker_lora_manager.add_adapter(request))
    finally:
        del worker_lora_manager._load_adapter


# ---------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------


def memory_report(device: torch.device | None = None) -> dict:
    """Memory of ``device`` (CUDA: torch.cuda statistics and cudaMemGetInfo) or of this process (CPU)."""
    if device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device),
            "allocated_bytes": torch.cuda.memory_allocated(device),
            "reserved_bytes": torch.cuda.memory_reserved(device),
            "max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "free_bytes": free,
            "total_bytes": total,
        }
    return {"device": "cpu", "rss_bytes": _rss_bytes(), "total_bytes": _total_ram_bytes()}


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _total_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
