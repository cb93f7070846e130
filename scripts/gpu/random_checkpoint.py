"""Random-weight Qwen2 checkpoints written tensor by tensor, for shapes whose BF16 copy does not fit the disk.

Three kinds, all from one generator (:func:`make_tensor`), so that they hold the same model:

  bf16         the dense BF16 checkpoint (what ``save_pretrained`` of the random model would write);
  nvfp4        the NVFP4A16 checkpoint that ``qerl quantize`` (:func:`qerl_plugin.quantize.quantize_checkpoint`)
               makes of that BF16 checkpoint, written directly: the same tensor names, dtypes and bytes, the same
               ``config.json`` (the BF16 one plus ``quantization_config``), without the BF16 copy on disk;
  bf16_sparse  a BF16 checkpoint of the same config whose matrices (embedding, projections, lm_head) are all zero
               and stored as holes of sparse files (no disk blocks); norms (ones) and biases (zeros) are written
               for real into a small first shard. For memory and step-time runs of the BF16 arm only.

Values: every matrix ~ N(0, 0.02^2) in bf16 (drawn in float32 from a generator seeded with ``seed`` and the
tensor's name, so each tensor is the same whatever the layer count, shard size or order), norm weights are ones
and the q/k/v biases zeros (the values transformers' Qwen2 init gives, as in the 7B build's ``from_config``).

Tensors are generated on ``device`` (CUDA when available), quantized there, moved to the CPU and written one
shard at a time (at most ``max_shard_size`` bytes of output each; a fused q/k/v or gate/up group never straddles
two shards): host memory stays near one shard. The folder is built as ``.<name>.partial`` beside the target and
renamed into place when complete.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from qerl_plugin import format as fmt
from qerl_plugin import nvfp4
from qerl_plugin.plan import _LINEAR_RE  # the decoder Linears qerl quantize quantizes (Qwen2/Llama-style)
from qerl_plugin.shards import write_index

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "KINDS",
    "STD",
    "TensorSpec",
    "allocated_bytes",
    "make_tensor",
    "qwen2_tensor_specs",
    "sparse_files_supported",
    "write_checkpoint",
    "write_zero_safetensors",
]

STD = 0.02
DEFAULT_MAX_SHARD_SIZE = 4 * 10**9
KINDS = ("bf16", "nvfp4", "bf16_sparse")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the checkpoint: name, shape and how it is filled ("normal", "ones" or "zeros"); bf16."""

    name: str
    shape: tuple[int, ...]
    init: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def module(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def quantized(self) -> bool:
        """An NVFP4 checkpoint stores it as weight_packed / weight_scale / weight_global_scale."""
        return bool(_LINEAR_RE.match(self.name))


def qwen2_tensor_specs(cfg) -> list[TensorSpec]:
    """Every tensor of a ``Qwen2ForCausalLM`` of config ``cfg``, in the model's own order."""
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), "normal")]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        specs += [
            TensorSpec(f"{p}.self_attn.q_proj.weight", (q_dim, hidden), "normal"),
            TensorSpec(f"{p}.self_attn.q_proj.bias", (q_dim,), "zeros"),
            TensorSpec(f"{p}.self_attn.k_proj.weight", (kv_dim, hidden), "normal"),
            TensorSpec(f"{p}.self_attn.k_proj.bias", (kv_dim,), "zeros"),
            TensorSpec(f"{p}.self_attn.v_proj.weight", (kv_dim, hidden), "normal"),
            TensorSpec(f"{p}.self_attn.v_proj.bias", (kv_dim,), "zeros"),
            TensorSpec(f"{p}.self_attn.o_proj.weight", (hidden, q_dim), "normal"),
            TensorSpec(f"{p}.mlp.gate_proj.weight", (inter, hidden), "normal"),
            TensorSpec(f"{p}.mlp.up_proj.weight", (inter, hidden), "normal"),
            TensorSpec(f"{p}.mlp.down_proj.weight", (hidden, inter), "normal"),
            TensorSpec(f"{p}.input_layernorm.weight", (hidden,), "ones"),
            TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), "ones"),
        ]
    specs.append(TensorSpec("model.norm.weight", (hidden,), "ones"))
    if not getattr(cfg, "tie_word_embeddings", False):
        specs.append(TensorSpec("lm_head.weight", (vocab, hidden), "normal"))
    return specs


def _seed_of(name: str, seed: int) -> int:
    return (seed * 0x1_0000_0000 + zlib.crc32(name.encode())) % (1 << 63)


def make_tensor(spec: TensorSpec, seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """The bf16 value of ``spec`` on ``device``: N(0, STD^2) drawn in float32 from a generator seeded by ``seed`` and
    the tensor's name (the same values for a given device type whatever else is generated), or ones / zeros."""
    device = torch.device(device)
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=torch.bfloat16, device=device)
    if spec.init == "zeros":
        return torch.zeros(spec.shape, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device)
    g.manual_seed(_seed_of(spec.name, seed))
    w = torch.randn(spec.shape, generator=g, dtype=torch.float32, device=device)
    return w.mul_(STD).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# what goes into which file


@dataclass(frozen=True)
class _Unit:
    """Tensors written together: one tensor, or the parts of a fused layer (they share a global scale)."""

    specs: tuple[TensorSpec, ...]
    quantized: bool

    def nbytes(self) -> int:
        if not self.quantized:
            return sum(s.numel * 2 for s in self.specs)
        # weight_packed (uint8, in/2) + weight_scale (fp8, in/16) + weight_global_scale (float32 [1])
        return sum(s.numel // 2 + s.numel // nvfp4.GROUP_SIZE + 4 for s in self.specs)


def _units(specs: list[TensorSpec], quantize: bool) -> list[_Unit]:
    if not quantize:
        return [_Unit((s,), False) for s in specs]
    by_name = {s.name: s for s in specs}
    units, done = [], set()
    for s in specs:
        if s.name in done:
            continue
        if s.quantized:  # the whole fused group at the first part's place (fmt.FUSED_GROUPS: q/k/v, gate/up)
            group = tuple(by_name[f"{m}.weight"] for m in fmt.fused_partners(s.module) if f"{m}.weight" in by_name)
            units.append(_Unit(group, True))
            done.update(g.name for g in group)
        else:
            units.append(_Unit((s,), False))
            done.add(s.name)
    return units


def _shards(units: list[_Unit], max_bytes: int) -> list[list[_Unit]]:
    """Greedy, in order: a new file when the next unit would take this one past ``max_bytes``."""
    shards: list[list[_Unit]] = []
    size = 0
    for u in units:
        n = u.nbytes()
        if not shards or (shards[-1] and size + n > max_bytes):
            shards.append([])
            size = 0
        shards[-1].append(u)
        size += n
    return shards or [[]]


def _file_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


# ---------------------------------------------------------------------------------------------------------
# sparse safetensors files


def write_zero_safetensors(path: str | os.PathLike, specs: Iterable[TensorSpec], metadata: dict | None = None) -> int:
    """A safetensors file of bf16 zeros whose data region is one hole: the header, then the file extended.

    The format (safetensors' spec): an 8-byte little-endian header length N, N bytes of JSON
    ``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (offsets relative to the
    byte after the header, contiguous from 0 to the end of the file), padded with spaces to a multiple of 8.
    Returns the data bytes; the file costs about one block of disk where the filesystem keeps holes.
    """
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for s in specs:
        n = s.numel * 2
        header[s.name] = {"dtype": "BF16", "shape": list(s.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)  # the zeros: a hole, no blocks written
    return offset


def allocated_bytes(path: str | os.PathLike) -> int:
    """Disk space a file takes (its allocated blocks), as opposed to its size."""
    return os.stat(path).st_blocks * 512


def sparse_files_supported(directory: str | os.PathLike, size: int = 64 << 20) -> bool:
    """Whether files in ``directory`` keep holes: a ``size``-byte file extended by truncate takes almost no blocks."""
    probe = Path(directory) / f".sparse-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
            f.truncate(size)
        return allocated_bytes(probe) < size // 4
    finally:
        probe.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------
# writing


def _config_json(cfg, folder: Path, quantized: bool) -> None:
    """config.json as save_pretrained writes it; for NVFP4 plus the quantization_config exactly as quantize_checkpoint
    adds it (the BF16 config read back, the key appended, dumped with indent 2 and a newline)."""
    cfg = copy.deepcopy(cfg)
    if not getattr(cfg, "architectures", None):
        cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(folder)
    if quantized:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config[fmt.QUANTIZATION_CONFIG_NAME] = fmt.quantization_config_dict(["lm_head"])
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")


def write_checkpoint(
    dst: str | os.PathLike,
    cfg,
    kind: str,
    *,
    tokenizer=None,
    generation_config=None,
    seed: int = 0,
    device: str | torch.device | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    log: Callable[[str], None] = print,
) -> dict:
    """Write the random Qwen2 checkpoint of ``cfg`` as ``kind`` (see the module docstring) to ``dst``.

    ``dst`` is replaced if it exists. ``tokenizer`` / ``generation_config`` are saved beside it when given.
    ``device``: where tensors are generated and quantized (default: CUDA when available, else CPU).
    Returns {"dir", "files", "tensor_bytes" (size of the safetensors files), "disk_bytes" (their allocated
    blocks), "seconds"}; logs one line per shard.
    """
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: choose from {KINDS}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    dst = Path(dst)
    specs = qwen2_tensor_specs(cfg)
    t0 = time.time()
    tmp = dst.parent / f".{dst.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    if kind == "bf16_sparse":
        small = [s for s in specs if len(s.shape) < 2]
        big = [_Unit((s,), False) for s in specs if len(s.shape) >= 2]
        plan = [[_Unit(tuple(small), False)]] + _shards(big, max_shard_size)
    else:
        plan = _shards(_units(specs, quantize=kind == "nvfp4"), max_shard_size)
    names = _file_names(len(plan))
    need = sum(u.nbytes() for u in (plan[0] if kind == "bf16_sparse" else [u for sh in plan for u in sh]))
    free = shutil.disk_usage(tmp).free
    if free < need + (1 << 30):
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"{dst.parent}: {free / 1e9:.1f} GB free, the {kind} checkpoint needs {need / 1e9:.1f} GB")

    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    try:
        for i, (fname, units) in enumerate(zip(names, plan)):
            path = tmp / fname
            if kind == "bf16_sparse" and i > 0:
                specs_here = [s for u in units for s in u.specs]
                n = write_zero_safetensors(path, specs_here)
                keys = [s.name for s in specs_here]
                disk = allocated_bytes(path)
                if disk > max(1 << 20, os.path.getsize(path) // 2):
                    raise RuntimeError(
                        f"{path}: {os.path.getsize(path) / 1e9:.2f} GB of zeros take {disk / 1e9:.2f} GB of disk; this "
                        "filesystem does not keep holes, so the sparse BF16 checkpoint would fill it"
                    )
            else:
                out: dict[str, torch.Tensor] = {}
                for u in units:
                    out.update(_unit_tensors(u, seed, device))
                save_file(out, str(path), metadata={"format": "pt"})
                n = sum(t.numel() * t.element_size() for t in out.values())
                keys = list(out)
                del out
            for k in keys:
                weight_map[k] = fname
            total += n
            log(f"{kind} shard {i + 1}/{len(names)} {fname}: {n / 1e9:.2f} GB, {total / 1e9:.2f} GB written, "
                f"{time.time() - t0:.0f} s")
        if len(names) > 1:
            write_index(tmp, weight_map, total)
        _config_json(cfg, tmp, quantized=kind == "nvfp4")
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(dst.glob("*.safetensors"))
    return {
        "dir": str(dst),
        "files": len(files),
        "tensor_bytes": sum(f.stat().st_size for f in files),
        "disk_bytes": sum(allocated_bytes(f) for f in files),
        "seconds": round(time.time() - t0, 1),
    }


def _unit_tensors(unit: _Unit, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The CPU tensors of one unit: as generated (bf16), or quantized with qerl's codec the way quantize_checkpoint
    does (fused parts share the global scale of their largest |value|, computed in bf16)."""
    if not unit.quantized:
        return {s.name: make_tensor(s, seed, device).cpu() for s in unit.specs}
    weights = [make_tensor(s, seed, device) for s in unit.specs]
    modules = [s.module for s in unit.specs]
    if len(weights) > 1:
        qs = nvfp4.quantize_fused(weights, modules)
    else:
        qs = [nvfp4.quantize(weights[0], None, name=modules[0])]
    del weights
    out: dict[str, torch.Tensor] = {}
    for m, q in zip(modules, qs):
        out.update({k: v.cpu() for k, v in q.tensors(m).items()})
    return out


def main(argv: list[str] | None = None) -> int:
    """Write one random checkpoint of a `qerl bench rollout` shape, e.g. the NVFP4A16 checkpoint that the bench's
    stock-nvfp4 configs need (``--nvfp4-model``): vLLM's dummy loader cannot fill FP8 scales with valid values."""
    import argparse

    from transformers import Qwen2Config

    from vllm_ext.bench.shapes import SHAPES, shape_config

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("dst", type=Path, help="folder to write (replaced if it exists)")
    p.add_argument("--shape", default="7B", choices=sorted(SHAPES), help="Qwen2.5 shape (default 7B)")
    p.add_argument("--kind", default="nvfp4", choices=KINDS, help="what to write (default nvfp4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="where tensors are made and quantized (default: CUDA if any)")
    p.add_argument("--if-missing", action="store_true", help="keep dst as it is when its config.json exists")
    args = p.parse_args(argv)
    if args.if_missing and (args.dst / "config.json").exists():
        print(f"{args.dst}: already there, kept")
        return 0
    cfg = Qwen2Config(**shape_config(args.shape))
    info = write_checkpoint(args.dst, cfg, args.kind, seed=args.seed, device=args.device)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
