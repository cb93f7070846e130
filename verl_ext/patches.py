"""Applies qerl's wrappers of verl callables: the ``wraps`` entries of :data:`qerl_plugin.upstream.SURFACE`.

Nothing on disk is edited. :func:`install` (run by ``verl_ext/__init__`` on every ``import verl``) imports
nothing from verl or vLLM: it puts a finder on ``sys.meta_path`` that patches each target module right after
its body runs (modules already imported are patched at once). Applying is idempotent (a wrapper carries
``__qerl_patch__``); a target that cannot be wrapped is recorded in :data:`STATUS` and logged, and
:func:`require` (called by the config check of a qerl run) raises listing them. ``QERL_VERL_PATCHES=0``
installs nothing. Every wrapper passes straight through to verl unless the run asked for qerl, except the
LoRA-adapter extraction fix (``collect_lora_params``), which is on for every LoRA run, and the blocked
log-probabilities (``logprobs_from_logits_v2``, :mod:`verl_ext.logprobs`), the replay buffer's 0.1 s poll
(:mod:`verl_ext.replay`) and the per-cluster weight-transfer socket name (:mod:`verl_ext.weight_socket`), on
for every run.
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

from qerl_plugin import upstream
from qerl_plugin.options import parse_bool
from qerl_plugin.upstream import Upstream

logger = logging.getLogger("qerl.verl.patches")

ENV_DISABLE = "QERL_VERL_PATCHES"

# The callables wrapped at import; each entry names the target, the parameters the wrapper relies on and
# the factory that builds the wrapper (``factory(original, target)``).
_PATCH_TARGETS: tuple[Upstream, ...] = upstream.wrapped()

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


def _apply(target: Upstream, module) -> None:
    owner, attr = _owner_and_attr(module, target.qualname)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
    if raw is None:
        raw = getattr(owner, attr)  # inherited method: wrap what the class resolves
    if isinstance(raw, (staticmethod, classmethod)):
        raise TypeError(f"{target.target} is a {type(raw).__name__}; qerl wraps plain functions only")
    if is_patched(raw):
        STATUS[target.target] = "applied"
        return
    factory = pkgutil.resolve_name(target.wrapper)
    wrapper = factory(raw, target.target)
    functools.update_wrapper(wrapper, raw)  # keeps verl's @register attributes (__dict__) and __wrapped__
    if inspect.iscoroutinefunction(raw) and not inspect.iscoroutinefunction(wrapper):
        raise TypeError(f"{target.wrapper} returned a plain function for the async {target.target}")
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
                    upstream.VERL_VERSION,
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


def _enabled() -> bool:
    try:
        return parse_bool(os.environ.get(ENV_DISABLE, "1"), ENV_DISABLE)
    except ValueError as e:  # never break ``import verl``: an unreadable value leaves the patches on
        logger.warning("qerl-plugin: %s; the verl patches stay installed", e)
        return True


def install() -> bool:
    """Arrange for every target to be patched when (or, if already imported, as soon as) its module loads.

    Cheap: imports nothing from verl or vLLM. Returns False when disabled by ``QERL_VERL_PATCHES=0``.
    """
    global _finder
    if not _enabled():
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
            f"qerl-plugin targets verl {upstream.VERL_VERSION} / vLLM {upstream.VLLM_VERSION}; install those versions."
        )
