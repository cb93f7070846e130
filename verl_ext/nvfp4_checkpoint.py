"""Load an NVFP4 (compressed-tensors ``nvfp4-pack-quantized``) checkpoint into a model built from its config.

Each quantized projection becomes an :class:`~verl_ext.nvfp4_linear.NVFP4Linear` holding the checkpoint's
bytes as they are, and every other tensor is copied by name; no dense copy of a quantized weight is ever
made, so the model can be built on the meta device.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn as nn

from qerl_plugin import format as fmt
from qerl_plugin.nvfp4 import NVFP4Error
from verl_ext.nvfp4_linear import PACKED_BUFFERS, NVFP4Linear
from verl_ext.nvfp4_replace import ReplaceReport, _dense_bytes, _set_submodule

__all__ = ["load_nvfp4_checkpoint_into"]

logger = logging.getLogger("qerl.verl.nvfp4_checkpoint")


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise NVFP4Error(f"{path}: no *.safetensors files; pass the directory of an NVFP4 checkpoint (qerl quantize output)")
    return files


def _check_quant_config(path: Path) -> None:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        return
    qc = json.loads(cfg_file.read_text()).get("quantization_config")
    if qc is None:
        raise NVFP4Error(f"{path}: config.json has no quantization_config; quantize it first with `qerl quantize`")
    problem = fmt.nvfp4a16_problem(qc)
    if problem is not None:
        raise NVFP4Error(f"{path}: config.json's quantization_config {problem}; expected an NVFP4A16 checkpoint (`qerl quantize`)")


def load_nvfp4_checkpoint_into(
    model: nn.Module,
    path: str | Path,
    device: torch.device | str | None = None,
    strict: bool = True,
) -> ReplaceReport:
    """Load an NVFP4 (compressed-tensors ``nvfp4-pack-quantized``) checkpoint directory into ``model``.

    Every ``<module>.weight_packed`` / ``weight_scale`` / ``weight_global_scale`` triple replaces
    ``<module>`` (an ``nn.Linear``, possibly on the meta device, or an NVFP4Linear) by an
    :class:`NVFP4Linear` holding those exact bytes; every other tensor (embeddings, norms, biases,
    ``lm_head``) is copied into the model's parameter or buffer of that name, cast to its dtype. Tensors go
    to ``device`` (default: where the model's tensor is; CPU for meta tensors). With ``strict``, checkpoint
    tensors the model lacks and model tensors the checkpoint lacks are errors (tied weights count once).
    The model never materialises a dense copy of a quantized weight.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise NVFP4Error(f"{path}: not a directory; pass an NVFP4 checkpoint directory")
    _check_quant_config(path)
    files = _checkpoint_files(path)

    keys: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                keys[k] = f
    quantized = sorted({k[: -len(".weight_packed")] for k in keys if k.endswith(".weight_packed")})
    if not quantized:
        raise NVFP4Error(f"{path}: no *.weight_packed tensors; this is not an NVFP4 checkpoint")

    def read(key: str) -> torch.Tensor:
        with safe_open(str(keys[key]), framework="pt") as fh:
            return fh.get_tensor(key)

    report = ReplaceReport()
    modules = dict(model.named_modules())
    for mod_name in quantized:
        for suffix in PACKED_BUFFERS:
            if f"{mod_name}.{suffix}" not in keys:
                raise NVFP4Error(f"{path}: {mod_name}.{suffix} is missing (the other NVFP4 tensors of {mod_name} are there)")
        old = modules.pop(mod_name, None)
        if old is None or not isinstance(old, nn.Linear):
            if strict:
                raise NVFP4Error(
                    f"{path}: the checkpoint quantizes {mod_name}, which is not an nn.Linear of the model "
                    f"(found {type(old).__name__ if old is not None else 'nothing'}); build the model from this "
                    "checkpoint's config"
                )
            continue
        ref = old.weight_packed if isinstance(old, NVFP4Linear) else old.weight
        target = torch.device(device) if device is not None else (torch.device("cpu") if ref.is_meta else ref.device)
        tensors = [read(f"{mod_name}.{s}").to(target) for s in PACKED_BUFFERS]
        new = NVFP4Linear.from_packed(*tensors, bias=None, name=mod_name)
        if (new.in_features, new.out_features) != (old.in_features, old.out_features):
            raise NVFP4Error(
                f"{path}: {mod_name} is {new.in_features}->{new.out_features} in the checkpoint but "
                f"{old.in_features}->{old.out_features} in the model; the model was built from another config"
            )
        if old.bias is not None:  # filled from "<mod>.bias" below
            new.bias = nn.Parameter(torch.zeros(old.out_features, dtype=old.bias.dtype, device=target), requires_grad=False)
        if not isinstance(old, NVFP4Linear):
            report.dense_bytes += _dense_bytes(old)
        _set_submodule(model, mod_name, new)
        report.replaced.append(mod_name)
        report.nvfp4_bytes += new.nbytes()

    # everything else, by name, into the (possibly just replaced) model
    packed_keys = {f"{m}.{s}" for m in quantized for s in PACKED_BUFFERS}
    del modules
    # name -> (module, attr, is_param); tensors shared by several names (tied weights) are swapped everywhere
    state: dict[str, tuple[nn.Module, str, bool]] = {}
    places: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in list(module._parameters.items()) + list(module._buffers.items()):
            if p is None:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            if full in packed_keys:
                continue
            is_param = pname in module._parameters
            state[full] = (module, pname, is_param)
            places.setdefault(id(p), []).append((module, pname, is_param))

    loaded_ids: set[int] = set()
    unexpected = []
    for key in sorted(keys):
        if key in packed_keys:
            continue
        if key not in state:
            unexpected.append(key)
            continue
        module, pname, is_param = state[key]
        current = module._parameters[pname] if is_param else module._buffers[pname]
        target = torch.device(device) if device is not None else (torch.device("cpu") if current.is_meta else current.device)
        value = read(key)
        if tuple(value.shape) != tuple(current.shape):
            raise NVFP4Error(
                f"{path}: {key} has shape {tuple(value.shape)} in the checkpoint, {tuple(current.shape)} in the model"
            )
        value = value.to(device=target, dtype=current.dtype)
        if is_param:
            value = nn.Parameter(value, requires_grad=current.requires_grad)
        for mod, attr, param in places.pop(id(current), [(module, pname, is_param)]):
            (mod._parameters if param else mod._buffers)[attr] = value  # a meta tensor cannot take .data
        loaded_ids.add(id(value))
        report.loaded.append(key)

    persistent_missing = []
    for full, (module, pname, is_param) in state.items():
        t = module._parameters[pname] if is_param else module._buffers[pname]
        if id(t) in loaded_ids:
            continue
        if not is_param and pname in getattr(module, "_non_persistent_buffers_set", set()):
            continue  # e.g. rotary inv_freq: computed, not stored
        persistent_missing.append(full)
    if strict and (unexpected or persistent_missing):

        def few(names: list[str]) -> str:
            return f"{names[:8]}{' ...' if len(names) > 8 else ''}"

        parts = []
        if unexpected:
            parts.append(f"checkpoint tensors the model lacks: {few(unexpected)}")
        if persistent_missing:
            parts.append(f"model tensors the checkpoint lacks: {few(persistent_missing)}")
        raise NVFP4Error(
            f"{path} does not match the model: {'; '.join(parts)} "
            "(build the model from this checkpoint's config.json, or pass strict=False)"
        )
    report.meta_left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if report.meta_left:
        logger.warning(
            "NVFP4: %d tensors are still on the meta device after loading %s (e.g. %s): they are not stored in "
            "checkpoints (non-persistent buffers such as rotary inv_freq); re-create them, or build the model on CPU",
            len(report.meta_left), path, report.meta_left[:3],
        )
    logger.info("NVFP4: loaded %s from %s", report.summary(), path)
    return report
