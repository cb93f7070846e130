"""The LoRA adapter inside a verl 0.9.1 FSDP checkpoint of the actor, read without its base (for ``qerl export``).

verl's ``FSDPCheckpointManager.save_checkpoint`` writes to ``global_step_N/actor``: on every rank
``model_world_size_W_rank_R.pt`` (that rank's ``state_dict()``: parameters as DTensor shards, the NVFP4 buffers
as plain tensors, whole on every rank; only the ``lora_*`` entries under ``checkpoint.save_lora_only``),
``optim_*`` and ``extra_state_*``; on rank 0 ``fsdp_config.json``, ``lora_train_meta.json`` (r, lora_alpha,
task_type) and ``huggingface/`` (config, tokenizer). It writes no PEFT adapter. Here the rank files are
memory-mapped, only the entries of LoRA adapter ``default`` are read, and their shards are merged as verl's
``FSDPModelMerger`` merges them, keeping their dtype. (verl's ``python -m verl.model_merger merge --backend fsdp``
also writes a ``lora_adapter/`` for this actor, but casts it to bf16, reads every rank's copy of the base, and
writes beside it a "merged model" of the NVFP4 buffers cast to bf16, which nothing loads.)
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger("qerl.verl.export")

ADAPTER_CONFIG = "adapter_config.json"
FSDP_CONFIG = "fsdp_config.json"  # {"FSDP_version": 2, "world_size": W}
LORA_META = "lora_train_meta.json"  # {"r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM"}
TRACKER = "latest_checkpointed_iteration.txt"  # verl's trainer, next to the global_step_N folders
_RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")


class ExportError(ValueError):
    """Bad input for ``qerl export``; the message names the file and the fix."""


# ---------------------------------------------------------------------------------------------------------
# the checkpoint's files


def _rank_files(path: Path) -> dict[int, dict[int, Path]]:
    found: dict[int, dict[int, Path]] = {}
    for p in path.iterdir():
        m = _RANK_FILE.match(p.name)
        if m:
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = p
    return found


def _is_actor_dir(path: Path) -> bool:
    return (path / FSDP_CONFIG).is_file() or bool(_rank_files(path))


def resolve_actor_dir(path: str | os.PathLike) -> Path:
    """The folder holding the rank files: CHECKPOINT_DIR itself, its ``actor/``, or the tracker's step's."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ExportError(f"{p}: {'not a directory' if p.exists() else 'no such directory'}; pass a verl checkpoint "
                          "folder such as checkpoints/<project>/<run>/global_step_N/actor")
    if not _is_actor_dir(p) and (p / TRACKER).is_file():
        step = (p / TRACKER).read_text().strip()
        if not step.isdigit() or not (p / f"global_step_{step}").is_dir():
            raise ExportError(f"{p / TRACKER}: names step {step!r}, but {p}/global_step_{step} does not exist; "
                              "pass a global_step_N folder")
        p = p / f"global_step_{step}"
        logger.info("qerl export: %s names the latest step: %s", TRACKER, p)
    if not _is_actor_dir(p) and (p / "actor").is_dir():
        p = p / "actor"
    if _is_actor_dir(p):
        return p
    if (p / "dist_ckpt").is_dir() or (p / "model" / "dist_ckpt").is_dir():
        raise ExportError(f"{p}: a Megatron checkpoint; qerl export reads FSDP checkpoints (actor.strategy fsdp/fsdp2)")
    if (p / ADAPTER_CONFIG).is_file():
        raise ExportError(f"{p}: already a PEFT adapter directory ({ADAPTER_CONFIG}); pass it to vLLM or PEFT directly")
    what = "a Hugging Face model directory" if (p / "config.json").is_file() else "not a verl checkpoint"
    seen = sorted(q.name for q in p.iterdir())
    raise ExportError(
        f"{p}: {what}; expected a verl FSDP actor checkpoint: {FSDP_CONFIG} and model_world_size_<W>_rank_<R>.pt "
        f"files (verl saves them to <trainer.default_local_dir>/global_step_N/actor); found "
        f"{', '.join(seen[:6]) + (' ...' if len(seen) > 6 else '') if seen else 'nothing'}"
    )


def read_fsdp_config(actor: Path) -> tuple[int, int | None, list[Path]]:
    """(world size, FSDP version, every rank's model file in rank order); an error names missing ranks."""
    path = actor / FSDP_CONFIG
    files = _rank_files(actor)
    if not path.is_file():
        raise ExportError(f"{path}: missing; verl writes it with every save (rank 0): the checkpoint is incomplete, "
                          "copy the whole actor folder")
    try:
        cfg = json.loads(path.read_text())
        world = int(cfg["world_size"])
        if world < 1:
            raise ValueError(f"world_size {world}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{path}: cannot read world_size from it ({exc}); copy it again from the training machine") from None
    ranks = files.get(world, {})
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        others = sorted(w for w in files if w != world)
        raise ExportError(
            f"{actor}: {FSDP_CONFIG} says world size {world}, but model_world_size_{world}_rank_<R>.pt is missing "
            f"for rank(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            + (f" (there are files for world size {others})" if others else "")
            + "; every rank writes its own shard: copy all of them"
        )
    version = cfg.get("FSDP_version")
    return world, int(version) if isinstance(version, int) else None, [ranks[r] for r in range(world)]


def read_lora_meta(actor: Path) -> tuple[int, float, str]:
    path = actor / LORA_META
    example = '{"r": 32, "lora_alpha": 64, "task_type": "CAUSAL_LM"}'
    if not path.is_file():
        raise ExportError(f"{path}: missing; verl 0.9.1 writes it with every LoRA checkpoint. For a checkpoint from an "
                          f"older verl, write it with the run's actor_rollout_ref.model.lora_rank and lora_alpha: {example}")
    try:
        meta = json.loads(path.read_text())
        r, alpha = int(meta["r"]), float(meta["lora_alpha"])
        if r < 1 or alpha <= 0:
            raise ValueError(f"r={r}, lora_alpha={alpha}: both must be positive")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{path}: cannot read r and lora_alpha ({exc}); it should look like {example}") from None
    return r, alpha, str(meta.get("task_type") or "CAUSAL_LM")


# ---------------------------------------------------------------------------------------------------------
# LoRA tensors out of the rank files


def _load(path: Path) -> dict:
    import torch

    mesh_log = logging.getLogger("torch.distributed.device_mesh")  # warns on every DTensor unpickled without a PG
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)
    try:  # mmap: only the LoRA tensors are ever read, not each rank's copy of the NVFP4 base
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as exc:
        raise ExportError(f"{path}: torch.load cannot read it ({type(exc).__name__}: {exc}); the file is truncated or "
                          "corrupt: copy it again from the training machine") from None
    finally:
        mesh_log.setLevel(level)
    if not isinstance(sd, dict):
        raise ExportError(f"{path}: holds a {type(sd).__name__}, not a model state dict")
    return sd


def _merge(key: str, pieces: list, files: list[Path]):
    """One full tensor from every rank's piece: DTensor shards in mesh order along their dimension (as verl's
    ``FSDPModelMerger``), replicated plain tensors via verl's ``merge_non_dtensor_shards``."""
    import torch
    from torch.distributed.tensor import DTensor

    first = pieces[0]
    if not isinstance(first, DTensor):
        if not isinstance(first, torch.Tensor) or any(isinstance(p, DTensor) for p in pieces):
            raise ExportError(f"{files[0]}: {key} is a {type(first).__name__}; expected DTensor shards or plain tensors")
        from verl.model_merger.fsdp_model_merger import merge_non_dtensor_shards

        try:
            return merge_non_dtensor_shards(key, [p.detach() for p in pieces]).clone()
        except ValueError as exc:
            raise ExportError(f"{files[0].parent}: {exc}") from None
    placements = tuple(first.placements)
    for rank, p in enumerate(pieces):
        if not isinstance(p, DTensor) or tuple(p.placements) != placements or p.shape != first.shape:
            raise ExportError(f"{files[rank]}: {key} is sharded differently from rank 0's; the files come from different saves")
    shards = [(i, p.dim) for i, p in enumerate(placements) if p.is_shard()]
    strided = any(type(placements[i]).__name__ != "Shard" for i, _ in shards)  # _StridedShard: FSDP + TP
    if any(p.is_partial() for p in placements) or len(shards) > 1 or strided:
        raise ExportError(f"{files[0]}: {key} has placements {placements}; qerl export merges FSDP/HSDP shards only "
                          "(one sharded mesh dimension, no tensor parallelism)")
    if not shards:
        return first.to_local().detach().clone()
    mesh_dim, dim = shards[0]
    index = [0] * first.device_mesh.mesh.dim()
    index[mesh_dim] = slice(None)
    ranks = first.device_mesh.mesh[tuple(index)].tolist()
    full = torch.cat([pieces[r].to_local().detach() for r in ranks], dim=dim)
    if full.shape != first.shape:
        raise ExportError(f"{files[0].parent}: the shards of {key} add up to {tuple(full.shape)}, not {tuple(first.shape)}")
    return full


def load_lora_tensors(files: list[Path]) -> tuple[dict, set[str]]:
    """(PEFT key -> full tensor for adapter ``default``, every other module name in the checkpoint)."""
    from verl_ext.adapter_sync import adapter_key, normalize_adapter_keys, strip_wrappers

    pieces: dict[str, list] = {}
    others: set[str] = set()
    names0: list[str] = []
    for rank, path in enumerate(files):
        sd = _load(path)
        names = sorted(sd)
        if rank == 0:
            names0 = names
            dora = [n for n in names if "lora_magnitude_vector" in n]
            if dora:
                raise ExportError(f"{path}: DoRA tensors ({dora[0]}); vLLM does not serve DoRA adapters")
        elif names != names0:
            diff = sorted(set(names) ^ set(names0))
            raise ExportError(f"{path}: holds other tensors than {files[0].name} ({len(diff)} differ, e.g. {diff[:3]}); "
                              "the rank files come from different saves")
        lora = {n: sd[n] for n in names if adapter_key(n) is not None}
        for key, t in normalize_adapter_keys(lora).items():
            pieces.setdefault(key, []).append(t)
        if rank == 0:
            others = {strip_wrappers(n).rsplit(".", 1)[0].removesuffix(".base_layer") for n in names if n not in lora}
        del sd, lora
    if not pieces:
        other_lora = [n for n in names0 if "lora_" in n]
        if other_lora:
            why = f"LoRA tensors of an adapter other than 'default' ({other_lora[0]})"
        else:
            why = (f"no LoRA tensors among its {len(names0)} tensors: a full fine-tune checkpoint; export the whole model "
                   f"with python -m verl.model_merger merge --backend fsdp --local_dir {files[0].parent} --target_dir DIR")
        raise ExportError(f"{files[0]}: {why}")
    merged = {key: _merge(key, ps, files) for key, ps in sorted(pieces.items())}
    return merged, others


def by_module(tensors: dict) -> dict[str, dict[str, object]]:
    """PEFT key -> tensor, regrouped as module -> {"lora_A": ..., "lora_B": ...}."""
    modules: dict[str, dict[str, object]] = {}
    for key, t in tensors.items():
        module, part = key.removesuffix(".weight").rsplit(".", 1)
        modules.setdefault(module, {})[part] = t
    return modules


def check_ranks(modules: dict[str, dict[str, object]], r: int, meta_path: Path) -> None:
    """Every module has both halves, of rank ``r``."""
    problems = []
    for module, parts in modules.items():
        a = parts.get("lora_A", parts.get("lora_embedding_A"))
        b = parts.get("lora_B", parts.get("lora_embedding_B"))
        if a is None or b is None:
            problems.append(f"{module} has {sorted(parts)} only")
        elif a.shape[0] != r or b.shape[1] != r:
            problems.append(f"{module}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}")
    if problems:
        raise ExportError(f"the LoRA tensors do not match r={r} of {meta_path} ({len(problems)} module(s)): "
                          + "; ".join(problems[:4]) + ("; ..." if len(problems) > 4 else ""))
