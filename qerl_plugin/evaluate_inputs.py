"""What ``qerl eval`` reads, checked before any model is loaded: the data, MODEL, the adapter, the reward.

* :func:`read_examples`  verl RL rows (``data_source``, ``prompt`` chat messages, ``reward_model.ground_truth``)
  from parquet or JSON lines;
* :func:`inspect_model`  MODEL's config and the shape of every Linear from the safetensors headers (an
  NVFP4A16 checkpoint's ``weight_packed [out, in/2]`` counts as ``[out, in]``);
* :func:`inspect_adapter` / :func:`check_adapter_fits`  a PEFT LoRA directory and whether every tensor fits
  MODEL's modules, so an adapter trained on another base is refused naming the module, not deep in a loader;
* :func:`load_reward`    the reward function by dotted name (``verl_ext.reward:compute_score``).

Every problem raises :class:`EvalError` (or ``FileNotFoundError``) naming the file and the fix.
"""

from __future__ import annotations

import json
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from qerl_plugin.options import PEFT_PREFIX
from qerl_plugin.source import CONFIG_FILE, read_headers, weight_files

__all__ = [
    "ADAPTER_CONFIG",
    "DEFAULT_REWARD",
    "AdapterInfo",
    "EvalError",
    "Example",
    "ModelInfo",
    "check_adapter_fits",
    "inspect_adapter",
    "inspect_model",
    "load_reward",
    "read_examples",
]

DEFAULT_REWARD = "verl_ext.reward:compute_score"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
REQUIRED = ("data_source", "prompt", "reward_model.ground_truth")
_DATA_HINT = (
    "qerl eval reads verl RL rows with data_source, prompt (chat messages) and reward_model.ground_truth, "
    "as scripts/data/make_synthetic_arithmetic.py and scripts/data/prepare_gsm8k.py write them"
)


class EvalError(ValueError):
    """Bad input for ``qerl eval``; the message names the file and the fix."""


# ----------------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class Example:
    """One evaluation problem."""

    row: int  # position in the data file
    data_source: str
    messages: list[dict[str, str]]
    ground_truth: Any
    extra_info: dict[str, Any] | None = None


def _read_rows(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:
            raise EvalError(f"{path}: not a readable parquet file ({exc}); {_DATA_HINT}") from None
        missing = [c for c in ("data_source", "prompt", "reward_model") if c not in table.column_names]
        if missing:
            raise EvalError(
                f"{path}: missing column(s) {missing} (it has {table.column_names[:8]}); {_DATA_HINT}"
            )
        return table.to_pylist()
    if suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8")
        try:
            if suffix == ".json" and text.lstrip().startswith("["):
                rows = json.loads(text)
            else:
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise EvalError(f"{path}: not valid JSON lines ({exc}); write one JSON object per line") from None
        return rows
    raise EvalError(f"{path}: unsupported file type {suffix!r}; give a .parquet or .jsonl file ({_DATA_HINT})")


def _messages(prompt: Any, at: str) -> list[dict[str, str]]:
    if isinstance(prompt, str) and prompt:
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt:
        out = []
        for msg in prompt:
            if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
                raise EvalError(f"{at}: prompt messages must be {{'role': str, 'content': str}}, got {msg!r}")
            out.append({"role": msg["role"], "content": msg["content"]})
        return out
    raise EvalError(f"{at}: prompt must be a non-empty list of chat messages (or a string), got {prompt!r:.80}")


def read_examples(path: str | Path, limit: int | None = None) -> list[Example]:
    """The rows of ``path`` (parquet, or JSON lines of the same rows), the first ``limit`` of them."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--data {path}: no such file; {_DATA_HINT}")
    if not path.is_file():
        raise EvalError(f"--data {path}: not a file; give the .parquet or .jsonl file itself")
    rows = _read_rows(path)
    if not rows:
        raise EvalError(f"{path}: no rows; {_DATA_HINT}")
    if limit is not None:
        rows = rows[:limit]
    examples = []
    for i, row in enumerate(rows):
        at = f"{path} row {i}"
        if not isinstance(row, dict):
            raise EvalError(f"{at}: expected a JSON object, got {type(row).__name__}; {_DATA_HINT}")
        reward = row.get("reward_model")
        truth = reward.get("ground_truth") if isinstance(reward, dict) else None
        present = {"data_source": row.get("data_source"), "prompt": row.get("prompt"), "reward_model.ground_truth": truth}
        missing = [k for k in REQUIRED if present[k] is None]
        if missing:
            raise EvalError(f"{at}: missing {missing} (it has {sorted(row)[:8]}); {_DATA_HINT}")
        if not isinstance(row["data_source"], str) or not row["data_source"]:
            raise EvalError(f"{at}: data_source must be a non-empty string, got {row['data_source']!r}")
        extra = row.get("extra_info")
        examples.append(
            Example(
                row=i,
                data_source=row["data_source"],
                messages=_messages(row["prompt"], at),
                ground_truth=truth,
                extra_info=extra if isinstance(extra, dict) else None,
            )
        )
    return examples


# ----------------------------------------------------------------------------------------------------
# MODEL


@dataclass
class ModelInfo:
    """MODEL as read from config.json and the safetensors headers."""

    path: Path
    config: dict[str, Any]
    quantization: str | None  # None (BF16/FP16), "nvfp4a16", or the quant_method of another scheme
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tensor name -> shape (NVFP4: dense [out, in])
    nvfp4_modules: list[str] = field(default_factory=list)  # modules stored as weight_packed/scale/global_scale

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))


def _quantization_of(config: dict[str, Any]) -> str | None:
    qc = config.get("quantization_config")
    if qc is None:
        return None
    from qerl_plugin import format as fmt

    try:
        parsed = fmt.parse_quantization_config(qc)
    except Exception:
        return str(qc.get("quant_method", "unknown")) if isinstance(qc, dict) else "unknown"
    return "nvfp4a16" if fmt.is_nvfp4a16_config(parsed) else "compressed-tensors"


def inspect_model(model: str | Path) -> ModelInfo:
    """Check that MODEL is a Hugging Face checkpoint directory and read its tensor shapes (no data)."""
    path = Path(model).expanduser()
    fix = "MODEL must be a local checkpoint directory with config.json and *.safetensors (e.g. examples/smollm2/prepare.py's output or a `qerl quantize` DST)"
    if not path.exists():
        raise EvalError(f"MODEL {model}: no such directory; {fix}")
    if not path.is_dir():
        raise EvalError(f"MODEL {model} is a file; {fix}")
    if (path / ADAPTER_CONFIG).is_file() and not (path / CONFIG_FILE).is_file():
        raise EvalError(f"MODEL {model} is a LoRA adapter; pass its base model as MODEL and the adapter with --adapter {model}")
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise EvalError(f"MODEL {model}: no {CONFIG_FILE}; {fix}")
    try:
        config = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise EvalError(f"{cfg_file}: not valid JSON ({exc}); restore the model's config.json") from None
    if not isinstance(config, dict):
        raise EvalError(f"{cfg_file}: expected a JSON object")
    if not any(path.glob("*.safetensors")):
        raise EvalError(f"MODEL {model}: no *.safetensors weights; {fix}")
    files, weight_map = weight_files(path)
    info = ModelInfo(path=path.resolve(), config=config, quantization=_quantization_of(config))
    for t in read_headers(path, files, weight_map):
        if t.name.endswith(".weight_packed") and len(t.shape) == 2:
            module = t.name[: -len(".weight_packed")]
            info.shapes[f"{module}.weight"] = (t.shape[0], t.shape[1] * 2)
            info.nvfp4_modules.append(module)
        else:
            info.shapes[t.name] = tuple(t.shape)
    return info


# ----------------------------------------------------------------------------------------------------
# Adapter


@dataclass
class AdapterInfo:
    """A PEFT LoRA adapter directory."""

    path: Path
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]  # tensor name without the "base_model.model." prefix -> shape
    rank: int  # the largest LoRA rank of any module

    @property
    def base_name(self) -> str:
        return str(self.config.get("base_model_name_or_path") or "?")


def _adapter_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    if weights.suffix == ".safetensors":
        from qerl_plugin.source import open_safetensors

        with open_safetensors(weights) as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    import torch

    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise EvalError(f"{weights}: cannot read it ({type(exc).__name__}: {exc}); save the adapter again with PEFT") from None
    return {k: tuple(v.shape) for k, v in state.items()}


def inspect_adapter(adapter: str | Path) -> AdapterInfo:
    """Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) without loading it."""
    path = Path(adapter).expanduser()
    fix = "--adapter must be a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors), e.g. from `qerl export`"
    if not path.is_dir():
        raise EvalError(f"--adapter {adapter}: {'no such directory' if not path.exists() else 'not a directory'}; {fix}")
    cfg_file = path / ADAPTER_CONFIG
    if not cfg_file.is_file():
        raise EvalError(f"--adapter {adapter}: no {ADAPTER_CONFIG}; {fix}")
    try:
        config = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise EvalError(f"{cfg_file}: not valid JSON ({exc}); save the adapter again with PEFT") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise EvalError(f"{cfg_file}: peft_type {peft_type!r}; qerl eval loads LoRA adapters")
    weights = next((path / n for n in ADAPTER_WEIGHTS if (path / n).is_file()), None)
    if weights is None:
        raise EvalError(f"--adapter {adapter}: no {' or '.join(ADAPTER_WEIGHTS)}; {fix}")
    shapes = {k.removeprefix(PEFT_PREFIX): s for k, s in _adapter_shapes(weights).items()}
    ranks = [s[0] for k, s in shapes.items() if (".lora_A." in k or ".lora_embedding_A" in k) and s]
    if not ranks:
        raise EvalError(f"{weights}: no lora_A tensors; {fix}")
    return AdapterInfo(path=path.resolve(), config=config, shapes=shapes, rank=max(ranks))


def _base_weight(model: ModelInfo, module: str) -> tuple[str, tuple[int, ...]] | None:
    name = f"{module}.weight"
    if name in model.shapes:
        return name, model.shapes[name]
    if module.rpartition(".")[2] == "lm_head" and model.tied_embeddings:
        for emb in ("model.embed_tokens.weight", "transformer.wte.weight"):
            if emb in model.shapes:
                return emb, model.shapes[emb]
    return None


def check_adapter_fits(adapter: AdapterInfo, model: ModelInfo) -> None:
    """Raise :class:`EvalError` naming the first adapter tensor that does not fit MODEL's module shapes.

    ``lora_A`` is ``[r, in]`` and ``lora_B`` ``[out, r]`` for a Linear ``[out, in]``; for an embedding
    ``[vocab, dim]``, ``lora_embedding_A`` is ``[r, vocab]`` and ``lora_embedding_B`` ``[dim, r]``.
    """
    made_for = f"made for base {adapter.base_name!r}"
    fix = "load it onto the base model it was trained from"
    for key, shape in sorted(adapter.shapes.items()):
        for marker, want in ((".lora_A", "in"), (".lora_B", "out"), (".lora_embedding_A", "rows"), (".lora_embedding_B", "cols")):
            if marker + "." in key or key.endswith(marker):
                module, part = key.split(marker)[0], marker[1:]
                break
        else:
            continue
        base = _base_weight(model, module)
        if base is None:
            have = next((n.removesuffix(".weight") for n in model.shapes if n.endswith("_proj.weight")), "?")
            raise EvalError(
                f"--adapter {adapter.path}: {made_for}; it has LoRA weights for module {module}, which MODEL "
                f"{model.path} does not have (its modules are named like {have}); {fix}"
            )
        name, bshape = base
        if len(shape) != 2 or len(bshape) != 2:
            continue
        out_dim, in_dim = bshape
        ok = {
            "in": shape[1] == in_dim,  # lora_A [r, in]
            "out": shape[0] == out_dim,  # lora_B [out, r]
            "rows": shape[1] == out_dim,  # lora_embedding_A [r, vocab]
            "cols": shape[0] == in_dim,  # lora_embedding_B [dim, r]
        }[want]
        if not ok:
            raise EvalError(
                f"--adapter {adapter.path}: {made_for}, not for MODEL {model.path}: module {module} is "
                f"{list(bshape)} ([out, in]) in MODEL but the adapter's {part} is {list(shape)}; {fix}"
            )


# ----------------------------------------------------------------------------------------------------
# Reward


def load_reward(spec: str) -> Callable[..., Any]:
    """The reward function named ``module:function`` (``compute_score(data_source, solution_str, ground_truth, extra_info)``)."""
    if ":" not in spec:
        raise EvalError(f"--reward {spec!r}: expected MODULE:FUNCTION, e.g. {DEFAULT_REWARD}")
    try:
        fn = pkgutil.resolve_name(spec)
    except (ImportError, AttributeError, ValueError) as exc:
        raise EvalError(
            f"--reward {spec!r} cannot be resolved ({type(exc).__name__}: {exc}); give an importable "
            f"MODULE:FUNCTION (default {DEFAULT_REWARD}, which needs qerl-plugin's verl_ext package)"
        ) from None
    if not callable(fn):
        raise EvalError(f"--reward {spec!r} is a {type(fn).__name__}, not a function")
    return fn
