"""``qerl quantize``: stream a Hugging Face checkpoint into an NVFP4A16 compressed-tensors checkpoint.

The output loads in vLLM 0.24 as is: every decoder Linear (``*_proj``) becomes ``weight_packed`` /
``weight_scale`` / ``weight_global_scale`` (:mod:`qerl_plugin.nvfp4`), q/k/v and gate/up sharing one
global scale; every other tensor is copied byte for byte, and NaN/Inf anywhere is refused.
``config.json`` gains the ``quantization_config`` of :mod:`qerl_plugin.format`.

Tensors are read one at a time, so memory stays near one output shard. The output is built in a hidden
directory beside DST and renamed into place only when complete; on any error DST is left as it was.

    plan = plan_quantization("Qwen2.5-7B-Instruct")        # reads headers only
    print(format_plan(plan))
    quantize_checkpoint("Qwen2.5-7B-Instruct", "Qwen2.5-7B-Instruct-NVFP4A16")

The parts live in :mod:`qerl_plugin.source` (finding and reading SRC), :mod:`qerl_plugin.plan`
(what each tensor becomes) and :mod:`qerl_plugin.shards` (output files); this module writes.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from qerl_plugin import format as fmt
from qerl_plugin import nvfp4
from qerl_plugin.plan import SUPPORTED_ARCHITECTURES, OutputTensor, QuantizePlan, format_plan, plan_quantization
from qerl_plugin.shards import DEFAULT_MAX_SHARD_SIZE, human_size, parse_size, write_index
from qerl_plugin.source import CONFIG_FILE, QuantizeError, TensorEntry, open_safetensors, resolve_source

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "SUPPORTED_ARCHITECTURES",
    "OutputTensor",
    "QuantizeError",
    "QuantizePlan",
    "QuantizeResult",
    "TensorEntry",
    "format_plan",
    "human_size",
    "parse_size",
    "plan_quantization",
    "quantize_checkpoint",
    "resolve_source",
]


@dataclass
class QuantizeResult:
    """What :func:`quantize_checkpoint` wrote: the files in ``dst`` and the tensor bytes before and after."""

    dst: Path
    files: list[str]
    src_bytes: int
    dst_bytes: int
    num_quantized: int


class _Readers:
    """safetensors handles by file, read one tensor at a time.

    At most ``keep`` files stay open: a handle maps its whole file, and the pages it has read count as
    this process's memory until it closes; reopening costs one header parse.
    """

    def __init__(self, src: Path, keep: int = 1):
        self.src = src
        self.keep = keep
        self._handles: dict[str, object] = {}

    def get(self, entry: TensorEntry) -> torch.Tensor:
        h = self._handles.pop(entry.file, None)
        if h is None:
            h = open_safetensors(self.src / entry.file)
            while len(self._handles) >= self.keep:
                del self._handles[next(iter(self._handles))]  # least recently used
        self._handles[entry.file] = h
        try:
            return h.get_tensor(entry.name)
        except Exception as exc:
            raise QuantizeError(
                f"{self.src / entry.file}: cannot read tensor {entry.name} ({exc}); the file is corrupt: download it again"
            ) from None

    def close(self) -> None:
        self._handles.clear()


def _check_dst(src: Path, dst: Path, overwrite: bool) -> None:
    dst_r = dst.resolve()
    if dst_r == src or dst_r in src.parents or src in dst_r.parents:
        raise QuantizeError(f"DST {dst} overlaps SRC {src}; write the quantized checkpoint to a separate directory")
    if dst.exists() or dst.is_symlink():
        if not dst.is_dir():
            raise QuantizeError(f"DST {dst} exists and is not a directory; choose another path")
        if any(dst.iterdir()) and not overwrite:
            raise QuantizeError(f"DST {dst} is not empty; pass --overwrite to replace it, or choose another directory")


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    ignore: Iterable[str] = (),
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
    device: str | torch.device = "cpu",
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    plan: QuantizePlan | None = None,
) -> QuantizeResult:
    """Write the NVFP4A16 checkpoint of ``src`` to ``dst``; see the module docstring.

    ``plan`` (from :func:`plan_quantization`) skips planning again; ``ignore`` and ``force`` are used
    only without it. Raises :class:`QuantizeError` for bad input, leaving ``dst`` untouched.
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    log = log or (lambda msg: print(msg, file=sys.stderr))
    limit = parse_size(max_shard_size)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QuantizeError(f"--device {device}: no CUDA device here; use --device cpu")
    if plan is None:
        plan = plan_quantization(src, ignore=ignore, force=force)
    src_dir = plan.src
    dst = Path(dst).expanduser()
    _check_dst(src_dir, dst, overwrite)
    for note in plan.notes:
        log(f"note: {note}")

    parent = dst.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    for stale in sorted(parent.glob(f".{glob.escape(dst.name)}.qerl-*")):
        log(f"note: {stale} is left over from an interrupted run; it is safe to delete")
    need = plan.dst_bytes + sum((src_dir / f).stat().st_size for f in plan.copy_files)
    free = shutil.disk_usage(parent).free
    if free < need:
        raise QuantizeError(f"{parent}: {human_size(free)} free, the output needs {human_size(need)}; free some space or choose another DST")

    layout = plan.shard_layout(limit)
    tag = uuid.uuid4().hex[:8]
    tmp = parent / f".{dst.name}.qerl-partial-{tag}"
    tmp.mkdir()
    old: Path | None = None
    readers = _Readers(src_dir)
    gscales: dict[tuple[str, ...], torch.Tensor] = {}
    by_name = {t.name: t for t in plan.tensors}

    def label(entry: TensorEntry) -> str:
        return f"{entry.name} in {src_dir / entry.file}"

    def group_scale(module: str) -> torch.Tensor | None:
        group = plan.fused.get(module, (module,))
        if len(group) == 1:
            return None
        if group not in gscales:
            amaxes = []
            for part in group:  # one tensor in memory at a time
                entry = by_name[f"{part}.weight"]
                w = readers.get(entry).to(device)
                nvfp4.check_weight(w, label(entry))
                amaxes.append(w.abs().amax().reshape(1))
                del w
            gscales[group] = nvfp4.global_scale(*amaxes)
        return gscales[group]

    weight_map: dict[str, str] = {}
    total = 0
    try:
        bar = tqdm(total=plan.src_bytes, unit="B", unit_scale=True, desc="qerl quantize", disable=not progress, file=sys.stderr)
        done = 0
        for shard_name, entries in layout.items():
            out: dict[str, torch.Tensor] = {}
            for entry in entries:
                tensor = readers.get(entry)
                if entry.name in plan.quantized:
                    module = plan.quantized[entry.name]
                    try:
                        q = nvfp4.quantize(tensor.to(device), group_scale(module), name=label(entry))
                    except nvfp4.NVFP4Error as exc:
                        raise QuantizeError(str(exc)) from None
                    for key, value in q.tensors(module).items():
                        out[key] = value.cpu()
                else:
                    kept_as = plan.kept_reason.get(entry.name, "")
                    try:
                        nvfp4.check_finite(tensor, label(entry), f"kept unquantized: {kept_as}" if kept_as else "")
                    except nvfp4.NVFP4Error as exc:
                        raise QuantizeError(str(exc)) from None
                    out[entry.name] = tensor
                del tensor
                done += 1
                bar.update(entry.nbytes)
                bar.set_postfix_str(f"{done}/{len(plan.tensors)} tensors", refresh=False)
            expected = {o.name for e in entries for o in plan.outputs_of(e)}
            assert set(out) == expected, f"internal error: shard {shard_name} tensors differ from the plan"
            save_file(out, str(tmp / shard_name), metadata={"format": "pt"})
            for key, value in out.items():
                weight_map[key] = shard_name
                total += value.numel() * value.element_size()
            del out
        bar.close()
        readers.close()

        if len(layout) > 1:
            write_index(tmp, weight_map, total)
        config = dict(plan.config)
        config[fmt.QUANTIZATION_CONFIG_NAME] = fmt.quantization_config_dict(plan.ignore)
        with open(tmp / CONFIG_FILE, "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        for name in plan.copy_files:
            shutil.copy2(src_dir / name, tmp / name)

        # swap into place: DST (if any) moves aside, the new tree takes its name, the old one goes
        if dst.exists():
            if any(dst.iterdir()):
                old = parent / f".{dst.name}.qerl-old-{tag}"
                dst.rename(old)
            else:
                dst.rmdir()
        tmp.rename(dst)
    except BaseException:
        readers.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not dst.exists():
            old.rename(dst)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for name, why in plan.skipped_files:
        log(f"skipped {name} ({why})")
    return QuantizeResult(
        dst=dst,
        files=sorted(p.name for p in dst.iterdir()),
        src_bytes=plan.src_bytes,
        dst_bytes=total,
        num_quantized=len(plan.quantized),
    )
