"""``qerl export CHECKPOINT_DIR OUT``: the LoRA adapter of a verl FSDP checkpoint as a PEFT adapter directory.

CHECKPOINT_DIR is what verl's trainer saved for the NVFP4 + LoRA actor: ``.../global_step_N/actor``, the
``global_step_N`` folder, or the run's checkpoint folder (its ``latest_checkpointed_iteration.txt`` picks the
step). OUT gets ``adapter_config.json`` and ``adapter_model.safetensors`` and nothing of the frozen base, so

    vllm serve NVFP4_MODEL --quantization nvfp4 --enable-lora --max-lora-rank R --lora-modules NAME=OUT
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BF16_MODEL), OUT)

load it. The LoRA tensors keep the dtype they were trained in (``--dtype`` converts), with PEFT's names
(``base_model.model.<module>.lora_A.weight``); r and lora_alpha come from verl's ``lora_train_meta.json``.
FSDP1 and FSDP2 shards of every rank are merged as verl's model merger merges them. ``--base`` checks every
adapter shape against a model directory (bf16, or NVFP4 from ``qerl quantize``) and records it as the
adapter's base. OUT appears only when the export succeeds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from qerl_plugin.options import PEFT_PREFIX
from verl_ext.lora_checkpoint import (
    ADAPTER_CONFIG,
    LORA_META,
    ExportError,
    by_module,
    check_ranks,
    load_lora_tensors,
    read_fsdp_config,
    read_lora_meta,
    resolve_actor_dir,
)

HELP = "turn a verl FSDP checkpoint of the NVFP4 + LoRA actor into a PEFT adapter directory (vLLM --lora-modules)"

ADAPTER_WEIGHTS = "adapter_model.safetensors"
DTYPES = ("keep", "bfloat16", "float16", "float32")


@dataclass
class ExportReport:
    actor_dir: Path
    out: Path
    world_size: int
    fsdp_version: int | None
    r: int
    lora_alpha: float
    modules: int
    target_modules: list[str]
    dtype: str
    nbytes: int

    def summary(self) -> str:
        return (
            f"wrote {self.out}: LoRA r={self.r} alpha={self.lora_alpha:g} on {self.modules} modules "
            f"({', '.join(self.target_modules[:8])}{' ...' if len(self.target_modules) > 8 else ''}), {self.dtype}, "
            f"{self.nbytes / 2**20:.2f} MiB, from {self.actor_dir} (FSDP{self.fsdp_version or '?'}, {self.world_size} rank(s))"
        )


def check_against_base(modules: dict[str, dict[str, object]], base: Path) -> None:
    """Each adapter module must be a linear (``.weight`` or NVFP4 ``.weight_packed``) of ``base`` of fitting shape."""
    from qerl_plugin.source import QuantizeError, read_headers, weight_files

    if not base.is_dir():
        raise ExportError(f"--base {base}: not a directory; pass the model directory the adapter is for "
                          "(the bf16 model, or its NVFP4 checkpoint from qerl quantize)")
    try:
        entries = read_headers(base, *weight_files(base))
    except QuantizeError as exc:
        raise ExportError(f"--base: {exc}") from None
    shapes: dict[str, tuple[int, int]] = {}  # module -> (out, in)
    for e in entries:
        if e.name.endswith(".weight_packed") and len(e.shape) == 2:
            shapes[e.name.removesuffix(".weight_packed")] = (e.shape[0], e.shape[1] * 2)
        elif e.name.endswith(".weight") and len(e.shape) == 2:
            shapes.setdefault(e.name.removesuffix(".weight"), (e.shape[0], e.shape[1]))
    problems = []
    for key, parts in modules.items():
        module = key.removeprefix(PEFT_PREFIX)
        if module not in shapes:
            problems.append(f"{module}: the base has no such module ({module}.weight or .weight_packed)")
            continue
        out_f, in_f = shapes[module]
        if "lora_embedding_A" in parts:  # embedding LoRA: A [r, num_embeddings], B [embedding_dim, r]
            a, b, want_a, want_b = parts["lora_embedding_A"], parts["lora_embedding_B"], out_f, in_f
        else:
            a, b, want_a, want_b = parts["lora_A"], parts["lora_B"], in_f, out_f
        if a.shape[1] != want_a or b.shape[0] != want_b:
            problems.append(f"{module}: adapter lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but the base "
                            f"weight is {out_f}x{in_f} (needs lora_A (r, {want_a}), lora_B ({want_b}, r))")
    if problems:
        raise ExportError(f"the adapter does not fit --base {base} ({len(problems)} module(s)): " + "; ".join(problems[:4])
                          + ("; ..." if len(problems) > 4 else "") + "; pass the model this run trained")


def _target_modules(modules: dict, others: set[str]) -> list[str]:
    """Leaf names as PEFT writes them; full module names when a leaf also names modules the run left without LoRA."""
    names = sorted(m.removeprefix(PEFT_PREFIX) for m in modules)
    leaves = {n.rsplit(".", 1)[-1] for n in names}
    bare = {o.removeprefix(PEFT_PREFIX) for o in others if o.rsplit(".", 1)[-1] in leaves} - set(names)
    return names if bare else sorted(leaves)


# ---------------------------------------------------------------------------------------------------------
# writing


def _check_out(out: Path, actor: Path, overwrite: bool) -> None:
    out_r, ckpt = out.resolve(), actor.resolve().parent
    if out_r == ckpt or ckpt in out_r.parents or out_r in ckpt.parents:
        raise ExportError(f"OUT {out} overlaps the checkpoint {actor.parent}; write the adapter to a separate directory")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise ExportError(f"OUT {out} exists and is not a directory; choose another path")
        entries = sorted(p.name for p in out.iterdir())
        if entries and not overwrite:
            raise ExportError(f"OUT {out} is not empty ({', '.join(entries[:3])}{' ...' if len(entries) > 3 else ''}); "
                              "pass --overwrite to replace it, or choose another directory")


def _write(out: Path, tensors: dict, config: dict, metadata: dict[str, str]) -> None:
    """Both files into a hidden sibling folder, then swapped into place: OUT changes only on success."""
    from safetensors.torch import save_file

    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp, old = parent / f".{out.name}.qerl-export-{os.getpid()}", parent / f".{out.name}.qerl-old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp / ADAPTER_WEIGHTS), metadata=metadata)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def export_adapter(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    base: str | os.PathLike | None = None,
    overwrite: bool = False,
    dtype: str = "keep",
) -> ExportReport:
    """Write the PEFT adapter of the verl checkpoint ``checkpoint`` to ``out`` (see the module docstring)."""
    import torch
    from peft import LoraConfig

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    actor = resolve_actor_dir(checkpoint)
    out = Path(out).expanduser()
    _check_out(out, actor, overwrite)
    world, version, files = read_fsdp_config(actor)
    tensors, others = load_lora_tensors(files)  # first: a full fine-tune has no lora_train_meta.json either
    r, alpha, task_type = read_lora_meta(actor)
    modules = by_module(tensors)
    check_ranks(modules, r, actor / LORA_META)
    if base is not None:
        check_against_base(modules, Path(base).expanduser())
    if dtype != "keep":
        tensors = {k: t.to(getattr(torch, dtype)) for k, t in tensors.items()}
    targets = _target_modules(modules, others)
    config = LoraConfig(
        r=r, lora_alpha=int(alpha) if float(alpha).is_integer() else alpha, target_modules=targets, bias="none",
        task_type=task_type, base_model_name_or_path=None if base is None else str(base), inference_mode=True,
    ).to_dict()
    config = {k: sorted(v) if isinstance(v, set) else getattr(v, "value", v) for k, v in config.items()}
    _write(out, tensors, config, {"format": "pt"})  # one key: safetensors writes metadata in no fixed order
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    return ExportReport(actor, out, world, version, r, alpha, len(modules), targets, "/".join(dtypes),
                        sum(t.numel() * t.element_size() for t in tensors.values()))


# ---------------------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="verl checkpoint: .../global_step_N/actor, "
                        ".../global_step_N, or the folder with latest_checkpointed_iteration.txt")
    parser.add_argument("out", metavar="OUT", help="output directory for adapter_config.json + adapter_model.safetensors")
    parser.add_argument("--base", metavar="MODEL_DIR", help="check every adapter shape against this model (bf16 or "
                        "NVFP4) and record it as base_model_name_or_path")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT (only once the new one is complete)")
    parser.add_argument("--dtype", choices=DTYPES, default="keep",
                        help="dtype of the saved LoRA tensors (default keep: as trained, usually float32)")


def run(args: argparse.Namespace) -> int:
    report = export_adapter(args.checkpoint, args.out, base=args.base, overwrite=args.overwrite, dtype=args.dtype)
    print(report.summary())
    rank = max(8, 1 << (report.r - 1).bit_length())  # a hint: vLLM's max_lora_rank takes the powers of 2 from 8 to 512
    print(f"serve it: vllm serve {args.base or '<NVFP4 model>'} --quantization nvfp4 --enable-lora "
          f"--max-lora-rank {rank} --lora-modules qerl={report.out}")
    return 0
