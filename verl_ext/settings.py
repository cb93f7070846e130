"""The qerl settings of a run: ``rollout.quantization`` and ``rollout.custom.qerl`` of a verl config, parsed
once per process into :class:`QerlSettings`.

The driver parses them in verl's ``validate_config`` (:func:`verl_ext.config.validate`), each actor/rollout
worker in ``init_model``, each vLLM server at its first hook, the trainer's logger from its config; each keeps
the result and passes it on. The vLLM engines get what they need through ``additional_config``
(:meth:`QerlSettings.engine_config`), never through the environment.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from verl.base_config import BaseConfig

from qerl_plugin import options
from verl_ext.config import (
    ACTOR_BLOCK_KEY,
    ACTOR_BLOCK_KEYS,
    AQN_EXTRA_KEYS,
    AQN_KEY,
    NO_RECOMPUTE_KEY,
    NVFP4,
    QERL_BLOCK_KEYS,
    QERL_KEY,
    QerlConfigError,
    get,
    read_config_json,
    to_plain,
)

__all__ = [
    "QerlSettings",
    "activate",
    "checkpoint_quantization",
    "current",
    "parse_actor_block",
    "parse_qerl_block",
    "settings_from",
    "settings_of",
]


@dataclass
class QerlSettings(BaseConfig):
    """What one run asked of qerl, read from its verl config; frozen, as verl's ``BaseConfig`` makes it.

    ``aqn`` is a :class:`qerl_plugin.aqn.AQNConfig` (without ``total_steps`` until the run knows it) or
    None when AQN is off. ``no_recompute_layers``: how many of the actor's last decoder layers keep their
    activations under gradient checkpointing (:mod:`verl_ext.recompute`).
    """

    quantization: str | None = None
    aqn: Any = None
    aqn_apply_to_actor: bool = False
    model_path: str | None = None
    model_quant: str = "unknown"  # "bf16" | "nvfp4" | "other:<method>" | "unknown" (remote / unreadable path)
    no_recompute_layers: int = 0

    @property
    def nvfp4(self) -> bool:
        return self.quantization == NVFP4

    @property
    def aqn_enabled(self) -> bool:
        return self.aqn is not None

    @property
    def active(self) -> bool:
        """Whether any qerl behaviour is on (otherwise every wrapper passes straight through to verl)."""
        return self.nvfp4 or self.aqn_enabled or self.no_recompute_layers > 0

    @property
    def nvfp4_checkpoint(self) -> bool:
        return self.model_quant == "nvfp4"

    def engine_config(self) -> dict[str, Any]:
        """What the run's vLLM engines need, as ``additional_config`` entries (see :mod:`qerl_plugin.options`)."""
        return options.engine_config(aqn=self.aqn_enabled)


def _near(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_keys(block: Mapping, allowed: tuple[str, ...]) -> str | None:
    """The keys of ``block`` outside ``allowed``, each with its nearest allowed key if one is close; None if none."""
    unknown = [k for k in block if k not in allowed]
    return ", ".join(f"{k!r}{_near(str(k), allowed)}" for k in unknown) if unknown else None


def _parse_bool(key: str, value: Any) -> bool:
    try:
        return options.parse_bool(value, key)
    except ValueError as e:
        raise QerlConfigError(str(e)) from None


def parse_qerl_block(block: Any) -> tuple[Any, bool]:
    """(AQNConfig or None, apply_to_actor) from the ``custom.qerl`` block; raises QerlConfigError."""
    block = to_plain(block)
    if block is None:
        return None, False
    if not isinstance(block, Mapping):
        raise QerlConfigError(
            f"{QERL_KEY}: expected a mapping with the keys {' and/or '.join(QERL_BLOCK_KEYS)}, got {type(block).__name__} "
            f"{block!r}"
        )
    hints = _unknown_keys(block, QERL_BLOCK_KEYS)
    if hints:
        raise QerlConfigError(
            f"{QERL_KEY}: unknown key(s) {hints}; the qerl block takes only {', '.join(QERL_BLOCK_KEYS)} "
            "(the quantization itself is actor_rollout_ref.rollout.quantization)"
        )
    aqn = block.get("aqn")
    if aqn is None:
        return None, False
    if not isinstance(aqn, Mapping):
        raise QerlConfigError(f"{AQN_KEY}: expected a mapping of AQN settings, got {type(aqn).__name__} {aqn!r}")
    enable = _parse_bool(f"{AQN_KEY}.enable", aqn.get("enable", False))
    apply_to_actor = _parse_bool(f"{AQN_KEY}.apply_to_actor", aqn.get("apply_to_actor", False))
    fields = {k: v for k, v in aqn.items() if k not in AQN_EXTRA_KEYS}
    from qerl_plugin.aqn import AQNConfig

    try:
        cfg = AQNConfig.from_dict(fields)
    except ValueError as e:
        msg = str(e).replace("AQNConfig.from_dict: ", "").replace("AQNConfig: ", "").replace("AQNConfig.", "")
        if "unknown key" in msg:
            msg += f", plus {', '.join(AQN_EXTRA_KEYS)}"
        raise QerlConfigError(f"{AQN_KEY}: {msg}") from None
    if not enable:
        return None, False
    return cfg, apply_to_actor


def parse_actor_block(block: Any) -> int:
    """``no_recompute_layers`` of the ``custom.qerl`` block's ``actor`` mapping (0 when absent); raises
    QerlConfigError naming the key."""
    block = to_plain(block)
    actor = block.get("actor") if isinstance(block, Mapping) else None
    if actor is None:
        return 0
    if not isinstance(actor, Mapping):
        raise QerlConfigError(
            f"{ACTOR_BLOCK_KEY}: expected a mapping such as {{no_recompute_layers: 2}}, got {type(actor).__name__} {actor!r}"
        )
    hints = _unknown_keys(actor, ACTOR_BLOCK_KEYS)
    if hints:
        raise QerlConfigError(f"{ACTOR_BLOCK_KEY}: unknown key(s) {hints}; it takes only {', '.join(ACTOR_BLOCK_KEYS)}")
    n = actor.get("no_recompute_layers", 0)
    if n is None:
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise QerlConfigError(
            f"{NO_RECOMPUTE_KEY}={n!r}: give a whole number of decoder layers >= 0 (the last N layers keep their "
            "activations instead of recomputing them; 0 recomputes all, as gradient checkpointing does)"
        )
    return n


def checkpoint_quantization(model_path: str | None) -> str:
    """What ``model_path``'s ``config.json`` says: ``bf16`` (no quantization_config), ``nvfp4``
    (compressed-tensors NVFP4A16), ``other:<description>``, or ``unknown`` (not a local directory)."""
    data = read_config_json(model_path)
    if data is None:
        return "unknown"
    qc = data.get("quantization_config")
    if not qc:
        return "bf16"
    method = qc.get("quant_method", "?") if isinstance(qc, Mapping) else "?"
    if method == "compressed-tensors":
        from qerl_plugin.format import nvfp4a16_problem

        if nvfp4a16_problem(qc) is None:
            return "nvfp4"
        formats = {qc.get("format")} | {
            g.get("format") for g in (qc.get("config_groups") or {}).values() if isinstance(g, Mapping)
        }
        formats.discard(None)
        return f"other:compressed-tensors {'/'.join(sorted(formats)) or '(no format)'}"
    return f"other:{method}"


def settings_from(rollout: Any, model: Any = None) -> QerlSettings:
    """Settings from a rollout config (DictConfig, dict or verl's RolloutConfig) and a model config.

    Parses without the cross-key checks of :func:`verl_ext.config.validate` (the driver already ran them);
    each process calls it once, through ``validate``, :func:`settings_of` or the driver's metrics hook.
    """
    quant = get(rollout, "quantization")
    quant = str(quant).strip().lower() if quant is not None else None
    block = get(rollout, "custom.qerl")
    aqn, apply_to_actor = parse_qerl_block(block)
    no_recompute = parse_actor_block(block)
    path = (get(model, "local_path") or get(model, "path")) if model is not None else None
    return QerlSettings(
        quantization=quant,
        aqn=aqn,
        aqn_apply_to_actor=apply_to_actor,
        model_path=str(path) if path is not None else None,
        model_quant=checkpoint_quantization(path) if quant == NVFP4 else "unknown",
        no_recompute_layers=no_recompute,
    )


# ---------------------------------------------------------------------------------------------------------
# the settings of a worker, a server, this process

_SETTINGS_ATTR = "_qerl_settings"
_current: QerlSettings | None = None


def settings_of(owner: Any, rollout: Any, model: Any = None) -> QerlSettings:
    """The settings of ``owner`` (a verl worker or vLLM server): parsed from its rollout and model configs the
    first time, then kept on it and returned as they are."""
    settings = getattr(owner, _SETTINGS_ATTR, None)
    if not isinstance(settings, QerlSettings):
        settings = settings_from(rollout, model)
        setattr(owner, _SETTINGS_ATTR, settings)
    return settings


def activate(settings: QerlSettings | None) -> None:
    """Make ``settings`` this process's (the actor worker does, for code that sees no config: the engine)."""
    global _current
    _current = settings


def current() -> QerlSettings:
    return _current if _current is not None else QerlSettings()
