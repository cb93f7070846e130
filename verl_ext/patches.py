"""Every change qerl-plugin makes to verl's behaviour at run time, in one table: :data:`_PATCH_TARGETS`.

Targets **verl 0.9.1** (and through it vLLM 0.24.0). Nothing on disk is edited: each entry names a verl
function or method (``module:qualname``, the form :func:`pkgutil.resolve_name` reads), the parameters it
is expected to have, and the ``verl_ext`` factory that wraps it. Every wrapper calls the original
unchanged unless the run asked for qerl (``rollout.quantization: nvfp4`` or an enabled AQN block), with
one exception: the LoRA-adapter extraction fix (``collect_lora_params``) is on for every LoRA run,
because verl 0.9.1's own extraction returns an empty adapter under FSDP1 (see
:mod:`verl_ext.adapter_sync`).

How they get applied, cheaply
    ``import verl`` imports ``verl_ext`` (the ``verl.plugins`` entry point) in every process: the driver,
    the Ray workers, the vLLM server actors. :func:`install` (called by ``verl_ext/__init__``) imports
    nothing from verl or vLLM; it puts a finder on ``sys.meta_path`` that waits for the target modules.
    When one of them is imported, its patches are applied right after the module body has run, before
    anybody else sees the module; targets in modules that are already imported are patched at once. The
    finder removes itself when everything it waits for has been patched.

Idempotent
    A wrapper carries ``__qerl_patch__`` (the target string) and ``__wrapped__`` (the original);
    applying a patch whose target already carries our wrapper does nothing, so :func:`apply_all` and a
    second :func:`install` are harmless.

Failing loudly, but not at ``import verl``
    A target that cannot be resolved or wrapped is recorded in :data:`STATUS` and logged at WARNING (verl's
    plugin loader would hide an exception at DEBUG). :func:`require` raises a clear error listing them;
    the config check calls it when a run asks for qerl, before any GPU work.
    ``tests/verl_ext/test_patches.py`` resolves every target and checks its signature, so an upstream
    change fails CI instead of a training run.

One scoped patch lives outside the table, listed in :data:`_SCOPED_TARGETS`: while
:class:`verl_ext.worker_extension.QerlVerlWorkerExtension` runs verl's extension ``__new__`` for an engine
on qerl's ``nvfp4`` method, ``verl.utils.qat.apply_qat_patches`` is a no-op (restored right after).

Opt out: ``QERL_VERL_PATCHES=0`` in the environment installs nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import logging
import os
import pkgutil
import sys
import threading
from dataclasses import dataclass

logger = logging.getLogger("qerl.verl.patches")

VERL_VERSION = "0.9.1"
VLLM_VERSION = "0.24.0"
ENV_DISABLE = "QERL_VERL_PATCHES"

_ASR = "verl.workers.rollout.vllm_rollout.vllm_async_server"
_FSDP = "verl.workers.engine.fsdp.transformer_impl"
_WORKERS = "verl.workers.engine_workers"


@dataclass(frozen=True)
class PatchTarget:
    """One verl callable we wrap.

    ``target``: ``"module:Qualified.name"``. ``factory``: ``"verl_ext.x:wrap_y"``, called as
    ``factory(original, target)`` and returning the wrapper. ``params``: the leading parameter names the
    original must have (checked by the tests). ``why``: what the wrapper does.
    """

    target: str
    factory: str
    params: tuple[str, ...]
    why: str

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]


_PATCH_TARGETS: tuple[PatchTarget, ...] = (
    PatchTarget(
        "verl.utils.config:validate_config",
        "verl_ext.config:wrap_validate_config",
        ("config", "use_reference_policy", "use_critic"),
        "check the qerl keys and normalise the config in the driver, before Ray starts anything",
    ),
    PatchTarget(
        f"{_ASR}:vLLMHttpServer._apply_quantization",
        "verl_ext.rollout:wrap_apply_quantization",
        ("self",),
        "accept quantization=nvfp4 (verl 0.9.1 raises on it) and route vLLM to qerl's 'nvfp4' method; "
        "switch the engine's AQN norms on (QERL_AQN=1) when AQN is enabled",
    ),
    PatchTarget(
        f"{_ASR}:vLLMHttpServer._get_worker_extension_cls",
        "verl_ext.rollout:wrap_get_worker_extension_cls",
        ("self",),
        "start vLLM workers with verl_ext.worker_extension.QerlVerlWorkerExtension (verl's extension + qerl's "
        "noise and adapter RPCs) when qerl is on",
    ),
    PatchTarget(
        f"{_FSDP}:collect_lora_params",
        "verl_ext.adapter_sync:wrap_collect_lora_params",
        ("module", "layered_summon", "base_sync_done"),
        "extract the LoRA adapter by parameter name: PEFT 0.21 matches FSDP1's wrapped module names against "
        "clean state-dict keys and returns nothing, which vLLM's add_lora then fails on (StopIteration)",
    ),
    PatchTarget(
        "verl.utils.fsdp_utils:collect_lora_params",
        "verl_ext.adapter_sync:wrap_collect_lora_params",
        ("module", "layered_summon", "base_sync_done"),
        "the same fix for callers that import it from verl.utils.fsdp_utils",
    ),
    PatchTarget(
        f"{_FSDP}:FSDPEngine._build_module",
        "verl_ext.actor:wrap_build_module",
        ("self",),
        "for an NVFP4 checkpoint: build the HF model without compressed-tensors and load the packed bytes "
        "into NVFP4Linear layers",
    ),
    PatchTarget(
        f"{_FSDP}:FSDPEngine._build_lora_module",
        "verl_ext.actor:wrap_build_lora_module",
        ("self", "module"),
        "for a BF16 checkpoint: quantize the decoder projections to NVFP4Linear before PEFT wraps them",
    ),
    PatchTarget(
        f"{_WORKERS}:ActorRolloutRefWorker.init_model",
        "verl_ext.actor:wrap_init_model",
        ("self",),
        "read the qerl settings of this worker's config before the actor is built",
    ),
    PatchTarget(
        f"{_WORKERS}:ActorRolloutRefWorker.update_weights",
        "verl_ext.aqn_hook:wrap_update_weights",
        ("self", "global_steps", "mode"),
        "after each adapter sync, set the rollout engine's AQN noise for the next step (qerl_set_noise RPC)",
    ),
    PatchTarget(
        "verl.utils.tracking:Tracking.__init__",
        "verl_ext.aqn_hook:wrap_tracking_init",
        ("self", "project_name", "experiment_name", "default_backend", "config"),
        "remember the run's AQN schedule in the driver's logger",
    ),
    PatchTarget(
        "verl.utils.tracking:Tracking.log",
        "verl_ext.aqn_hook:wrap_tracking_log",
        ("self", "data", "step"),
        "add qerl/aqn_sigma and qerl/aqn_stage of each step to verl's metrics",
    ),
)

# (target, where, why): replaced only inside a ``with`` block, never left in place.
_SCOPED_TARGETS: tuple[tuple[str, str, str], ...] = (
    (
        "verl.utils.qat:apply_qat_patches",
        "verl_ext.worker_extension:_without_verl_qat_patches",
        "verl's extension would apply its NVFP4 QAT vLLM patches (2 of 3 targets gone in vLLM 0.24) to qerl's engine",
    ),
)

# target -> "applied" | "pending" | "failed: <reason>" | "disabled"
STATUS: dict[str, str] = {t.target: "pending" for t in _PATCH_TARGETS}
_lock = threading.RLock()
_finder: "_PostImportFinder | None" = None


# ---------------------------------------------------------------------------------------------------------
# applying one patch


def _owner_and_attr(module, qualname: str):
    """The object holding the attribute and the attribute name (``Cls.meth`` -> (Cls, 'meth'))."""
    parts = qualname.split(".")
    owner = module
    for p in parts[:-1]:
        owner = getattr(owner, p)
    return owner, parts[-1]


def is_patched(obj) -> bool:
    return getattr(obj, "__qerl_patch__", None) is not None


def _apply(target: PatchTarget, module) -> None:
    owner, attr = _owner_and_attr(module, target.qualname)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
    if raw is None:
        raw = getattr(owner, attr)  # inherited method: wrap what the class resolves
    if isinstance(raw, (staticmethod, classmethod)):
        raise TypeError(f"{target.target} is a {type(raw).__name__}; qerl wraps plain functions only")
    if is_patched(raw):
        STATUS[target.target] = "applied"
        return
    factory = pkgutil.resolve_name(target.factory)
    wrapper = factory(raw, target.target)
    functools.update_wrapper(wrapper, raw)  # keeps verl's @register attributes (__dict__) and __wrapped__
    if inspect.iscoroutinefunction(raw) and not inspect.iscoroutinefunction(wrapper):
        raise TypeError(f"{target.factory} returned a plain function for the async {target.target}")
    wrapper.__qerl_patch__ = target.target
    setattr(owner, attr, wrapper)
    STATUS[target.target] = "applied"


def _apply_module(name: str, module) -> None:
    with _lock:
        for t in _PATCH_TARGETS:
            if t.module != name or STATUS.get(t.target) == "applied":
                continue
            try:
                _apply(t, module)
                logger.debug("qerl patched %s", t.target)
            except Exception as e:  # never break verl's import: record and warn
                STATUS[t.target] = f"failed: {type(e).__name__}: {e}"
                logger.warning(
                    "qerl-plugin could not patch %s (%s: %s); qerl features that need it will refuse to run. "
                    "qerl-plugin targets verl %s.",
                    t.target,
                    type(e).__name__,
                    e,
                    VERL_VERSION,
                )
        _forget_if_done()


# ---------------------------------------------------------------------------------------------------------
# waiting for modules


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it asks the other finders, then hooks the loader's
    ``exec_module`` so that the module is patched right after its body ran."""

    def __init__(self, names: set[str]):
        self.names = set(names)
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_module(module, _original=original_exec, _name=fullname):
            _original(module)
            _apply_module(_name, module)

        # Loaders from FileFinder are created per module, so this instance attribute touches only this one.
        loader.exec_module = exec_module
        return spec


def _forget_if_done() -> None:
    global _finder
    if _finder is None:
        return
    pending = {t.module for t in _PATCH_TARGETS if STATUS.get(t.target) == "pending"}
    _finder.names &= pending
    if not _finder.names:
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
        _finder = None


def install() -> bool:
    """Arrange for every target to be patched when (or, if already imported, as soon as) its module loads.

    Cheap: imports nothing from verl or vLLM. Returns False when disabled by ``QERL_VERL_PATCHES=0``.
    """
    global _finder
    if os.environ.get(ENV_DISABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        for t in _PATCH_TARGETS:
            if STATUS.get(t.target) == "pending":
                STATUS[t.target] = "disabled"
        logger.info("qerl-plugin: verl patches disabled by %s=0", ENV_DISABLE)
        return False
    with _lock:
        for t in _PATCH_TARGETS:
            if STATUS.get(t.target) == "disabled":
                STATUS[t.target] = "pending"
        modules = {t.module for t in _PATCH_TARGETS if STATUS.get(t.target) == "pending"}
        already = {m for m in modules if m in sys.modules}
        waiting = modules - already
        if waiting:
            if _finder is None:
                _finder = _PostImportFinder(waiting)
                sys.meta_path.insert(0, _finder)
            else:
                _finder.names |= waiting
        for m in sorted(already):
            _apply_module(m, sys.modules[m])
    return True


def apply_all() -> dict[str, str]:
    """Import every target module now and patch it (tests, and :func:`require`). Returns :data:`STATUS`."""
    install()
    for name in sorted({t.module for t in _PATCH_TARGETS}):
        try:
            module = importlib.import_module(name)
        except Exception as e:
            for t in _PATCH_TARGETS:
                if t.module == name and STATUS.get(t.target) != "applied":
                    STATUS[t.target] = f"failed: cannot import {name}: {type(e).__name__}: {e}"
            continue
        _apply_module(name, module)
    return dict(STATUS)


def failed() -> dict[str, str]:
    return {k: v for k, v in STATUS.items() if v.startswith("failed")}


def require(what: str = "qerl") -> None:
    """Raise if any patch failed (or patches are disabled): a qerl run cannot work without all of them.

    Resolves every target first (importing the modules), so that a run finds out in the driver.
    """
    if any(v == "disabled" for v in STATUS.values()):
        raise RuntimeError(
            f"{what} needs qerl-plugin's verl patches, but {ENV_DISABLE}=0 disabled them; unset {ENV_DISABLE}"
        )
    apply_all()
    bad = failed()
    if bad:
        lines = "\n".join(f"  {k}: {v}" for k, v in bad.items())
        raise RuntimeError(
            f"{what} needs qerl-plugin's verl patches, and these could not be applied:\n{lines}\n"
            f"qerl-plugin targets verl {VERL_VERSION} / vLLM {VLLM_VERSION}; install those versions."
        )
