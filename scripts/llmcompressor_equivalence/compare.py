"""Compare two compressed-tensors NVFP4 checkpoints byte for byte (e.g. ``qerl quantize`` vs llmcompressor).

    python scripts/llmcompressor_equivalence/compare.py A B [--json REPORT.json]

For every quantized module (a ``<module>.weight_packed`` on either side) the three tensors
``weight_packed``, ``weight_scale`` and ``weight_global_scale`` must have the same dtype, shape and bytes;
every other tensor must be identical too. Differences are explained (how many bytes / E2M1 codes /
FP8 scales differ, the first one with both values). ``config.json``'s ``quantization_config`` is compared
key by key, each difference marked as one vLLM 0.24 reads when it loads the checkpoint ("vllm") or one it
ignores ("cosmetic"); the rest of ``config.json`` is compared as well.

Prints a table and exits 1 when a tensor differs, is missing on one side, or a "vllm" config key differs;
cosmetic config differences are reported and do not fail. Needs only torch and safetensors.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

QUANT_PARTS = ("weight_packed", "weight_scale", "weight_global_scale")

# quantization_config keys vLLM 0.24's CompressedTensorsConfig never reads (checked in
# vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py): differences are cosmetic.
COSMETIC_QCONFIG_KEYS = {
    "version",  # compressed-tensors version that wrote the file
    "global_compression_ratio",
    "quantization_status",  # "compressed" on both sides in practice; transformers reads it, vLLM does not
    "observer",  # calibration-time observer name
    "observer_kwargs",
    "zp_dtype",  # symmetric NVFP4 stores no zero point
}
# top-level config.json keys that only record who wrote the file
COSMETIC_CONFIG_KEYS = {"transformers_version", "_name_or_path"}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ----------------------------------------------------------------------------------------------------
# loading


def load_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(ckpt).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt} holds no *.safetensors files; pass a checkpoint directory")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                if k in out:
                    raise ValueError(f"{ckpt}: tensor {k} appears in two shards")
                out[k] = fh.get_tensor(k)
    return out


def load_config(ckpt: Path) -> dict:
    path = Path(ckpt) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; pass a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------------------------------
# tensor comparison


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """Number of differing elements and the index of the first one (same dtype and shape)."""
    ne = raw_bytes(a).view(-1, a.element_size()).ne(raw_bytes(b).view(-1, b.element_size())).any(-1)
    n = int(ne.sum())
    if n == 0:
        return 0, ()
    flat = int(ne.nonzero()[0])
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    return n, idx


def diff_tensor(part: str, a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    """'equal', or a one-line explanation of how ``a`` and ``b`` differ."""
    if a is None or b is None:
        return "missing in A" if a is None else "missing in B"
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if tuple(a.shape) != tuple(b.shape):
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if torch.equal(raw_bytes(a), raw_bytes(b)):
        return "equal"
    n, idx = _first_diff(a, b)
    total = a.numel()
    if part == "weight_packed" and a.dtype == torch.uint8 and a.dim() == 2:
        ca = torch.stack((a & 0x0F, a >> 4), -1).reshape(a.shape[0], -1)
        cb = torch.stack((b & 0x0F, b >> 4), -1).reshape(b.shape[0], -1)
        codes = ca.ne(cb)
        r, c = (int(i) for i in codes.nonzero()[0])
        va, vb = E2M1[int(ca[r, c])], E2M1[int(cb[r, c])]
        sign_only = int((codes & ((ca ^ cb) == 8)).sum())
        return (
            f"{n}/{total} bytes, {int(codes.sum())} codes differ ({sign_only} only in the sign of zero); "
            f"first [{r},{c}] A={va:+g} B={vb:+g} (group {c // 16})"
        )
    va = a[idx].float().item() if a.dim() else a.float().item()
    vb = b[idx].float().item() if b.dim() else b.float().item()
    return f"{n}/{total} values differ; first {list(idx)} A={va!r} B={vb!r}"


# ----------------------------------------------------------------------------------------------------
# config comparison


def _normalize_groups(qc: dict) -> dict:
    """config_groups keyed by their sorted targets, so group names (group_0, ...) do not matter."""
    qc = dict(qc)
    groups = qc.get("config_groups") or {}
    qc["config_groups"] = {",".join(sorted(g.get("targets") or [])): g for g in groups.values()}
    return qc


def _walk(a: Any, b: Any, path: tuple[str, ...], out: list[tuple[str, Any, Any]]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            _walk(a.get(k, "<missing>"), b.get(k, "<missing>"), path + (k,), out)
        return
    if isinstance(a, list) and isinstance(b, list) and all(not isinstance(x, (dict, list)) for x in a + b):
        a, b = sorted(map(str, a)), sorted(map(str, b))  # ignore lists and target lists are sets
    if a != b:
        out.append((".".join(path), a, b))


def _empty(v: Any) -> bool:
    return v in (None, "<missing>", {}, [])


@dataclass
class ConfigDiff:
    key: str
    a: Any
    b: Any
    kind: str  # "vllm" | "cosmetic"


def diff_configs(ca: dict, cb: dict) -> list[ConfigDiff]:
    diffs: list[ConfigDiff] = []
    raw: list[tuple[str, Any, Any]] = []
    qa = _normalize_groups(ca.get("quantization_config") or {})
    qb = _normalize_groups(cb.get("quantization_config") or {})
    _walk(qa, qb, ("quantization_config",), raw)
    rest_a = {k: v for k, v in ca.items() if k != "quantization_config"}
    rest_b = {k: v for k, v in cb.items() if k != "quantization_config"}
    _walk(rest_a, rest_b, (), raw)
    for key, a, b in raw:
        leaf = key.rsplit(".", 1)[-1]
        if key.startswith("quantization_config."):
            cosmetic = leaf in COSMETIC_QCONFIG_KEYS or (_empty(a) and _empty(b))
        else:
            cosmetic = key in COSMETIC_CONFIG_KEYS
        diffs.append(ConfigDiff(key, a, b, "cosmetic" if cosmetic else "vllm"))
    return diffs


# ----------------------------------------------------------------------------------------------------
# report


@dataclass
class Report:
    a: str
    b: str
    modules: dict[str, dict[str, str]] = field(default_factory=dict)  # module -> part -> verdict
    others: dict[str, str] = field(default_factory=dict)  # tensor name -> verdict
    config: list[ConfigDiff] = field(default_factory=list)

    @property
    def tensor_failures(self) -> list[str]:
        bad = [f"{m}.{p}: {v}" for m, parts in self.modules.items() for p, v in parts.items() if v != "equal"]
        return bad + [f"{n}: {v}" for n, v in self.others.items() if v != "equal"]

    @property
    def config_failures(self) -> list[ConfigDiff]:
        return [d for d in self.config if d.kind == "vllm"]

    @property
    def ok(self) -> bool:
        return not self.tensor_failures and not self.config_failures

    def table(self) -> str:
        lines = [f"A: {self.a}", f"B: {self.b}", ""]
        width = max([len(m) for m in self.modules] + [len("module")])
        lines.append(f"{'module':<{width}}  " + "  ".join(f"{p:<20}" for p in QUANT_PARTS))
        lines.append("-" * (width + 2 + 22 * len(QUANT_PARTS)))
        details = []
        for m in sorted(self.modules):
            parts = self.modules[m]
            cells = []
            for p in QUANT_PARTS:
                v = parts[p]
                cells.append(f"{'equal' if v == 'equal' else 'DIFFERS':<20}")
                if v != "equal":
                    details.append(f"  {m}.{p}: {v}")
            lines.append(f"{m:<{width}}  " + "  ".join(cells))
        if details:
            lines += ["", "tensor differences:"] + details
        n_other = len(self.others)
        bad_other = {n: v for n, v in self.others.items() if v != "equal"}
        lines += ["", f"non-quantized tensors: {n_other - len(bad_other)}/{n_other} equal (dtype, shape, bytes)"]
        lines += [f"  {n}: {v}" for n, v in sorted(bad_other.items())]
        lines += ["", f"config.json differences: {len(self.config)} ({len(self.config_failures)} read by vLLM)"]
        for d in self.config:
            lines.append(f"  [{d.kind:<8}] {d.key}: A={json.dumps(d.a)} B={json.dumps(d.b)}")
        n_mod = len(self.modules)
        n_eq = sum(all(v == "equal" for v in parts.values()) for parts in self.modules.values())
        lines += [
            "",
            f"quantized modules: {n_eq}/{n_mod} byte-identical in weight_packed, weight_scale, weight_global_scale",
            f"RESULT: {'IDENTICAL' if self.ok else 'DIFFERENT'}",
        ]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "a": self.a,
            "b": self.b,
            "ok": self.ok,
            "modules": self.modules,
            "others": self.others,
            "config": [d.__dict__ for d in self.config],
        }


def compare_checkpoints(a: str | Path, b: str | Path) -> Report:
    ta, tb = load_tensors(Path(a)), load_tensors(Path(b))
    report = Report(str(a), str(b))
    modules = sorted(
        {k[: -len(".weight_packed")] for k in list(ta) + list(tb) if k.endswith(".weight_packed")}
    )
    seen = set()
    for m in modules:
        report.modules[m] = {}
        for p in QUANT_PARTS:
            key = f"{m}.{p}"
            seen.add(key)
            report.modules[m][p] = diff_tensor(p, ta.get(key), tb.get(key))
    for name in sorted((set(ta) | set(tb)) - seen):
        report.others[name] = diff_tensor(name.rsplit(".", 1)[-1], ta.get(name), tb.get(name))
    report.config = diff_configs(load_config(Path(a)), load_config(Path(b)))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="first checkpoint directory (e.g. qerl quantize output)")
    parser.add_argument("b", help="second checkpoint directory (e.g. llmcompressor output)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = compare_checkpoints(args.a, args.b)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
