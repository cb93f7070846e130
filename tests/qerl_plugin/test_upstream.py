"""qerl_plugin.upstream against the installed vLLM and verl: the pinned versions are installed, and every
entry of the table resolves with the parameters and attributes it declares. Fails when upstream moves or
changes a name qerl depends on."""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil
import re
from importlib import metadata

import pytest

from qerl_plugin import upstream


def test_pinned_versions_are_installed():
    for dist in ("vllm", "verl"):
        installed = metadata.version(dist).split("+", 1)[0]
        assert installed == upstream.PINS[dist], f"qerl targets {dist} {upstream.PINS[dist]}, {installed} is installed"


def test_table_is_well_formed():
    targets = [(e.target, e.kind) for e in upstream.SURFACE]
    assert len(targets) == len(set(targets)), "an entry is listed twice"
    assert {e.package for e in upstream.SURFACE} == {"vllm", "verl"}
    assert all(e.user.split(".")[0] in ("vllm_ext", "verl_ext") for e in upstream.SURFACE)
    assert all(e.package == "verl" for e in upstream.wrapped())  # verl_ext.patches wraps verl only


def _assigned(cls: type, attr: str) -> bool:
    """``attr`` is a field, a class attribute, or assigned (``<obj>.attr = ...``) in the source of ``cls`` or a base."""
    if dataclasses.is_dataclass(cls) and attr in {f.name for f in dataclasses.fields(cls)}:
        return True
    pattern = re.compile(rf"\w\.{re.escape(attr)}\s*(?::[^=\n]*)?=(?!=)")
    for klass in cls.__mro__[:-1]:
        if attr in vars(klass):
            return True
        try:
            if pattern.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            continue
    return False


@pytest.mark.parametrize("entry", upstream.SURFACE, ids=lambda e: f"{e.kind}:{e.target}")
def test_entry_resolves_with_its_parameters_and_attributes(entry):
    pytest.importorskip(entry.package)
    obj = pkgutil.resolve_name(entry.target)
    if entry.params or entry.keywords:
        params = list(inspect.signature(inspect.unwrap(obj)).parameters)
        assert params[: len(entry.params)] == list(entry.params), (
            f"{entry.target} now takes {params}; {entry.user} expects {list(entry.params)} first"
        )
        missing = [k for k in entry.keywords if k not in params]
        assert not missing, f"{entry.target} lost parameters {missing} (has {params}); {entry.user} passes them"
    if entry.attrs:
        assert isinstance(obj, type), f"{entry.target}: attributes are declared on classes"
        missing = [a for a in entry.attrs if not _assigned(obj, a)]
        assert not missing, f"{entry.target} no longer sets {missing}; {entry.user} reads them"
    if entry.kind == "subclasses":
        assert isinstance(obj, type)
    if entry.wrapper:
        assert callable(pkgutil.resolve_name(entry.wrapper)), entry.wrapper


# ---------------------------------------------------------------------------------------------------------
# what vLLM's code reads from ours


def test_prepare_fp4_layer_for_marlin_reads_what_we_set():
    """vllm_ext.nvfp4_backends' scratch module carries exactly the attributes vLLM's Marlin preparation reads."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4

    src = inspect.getsource(marlin_utils_fp4.prepare_fp4_layer_for_marlin)
    for attr in ("weight_global_scale", "output_size_per_partition", "input_size_per_partition", "params_dtype",
                 "layer.weight", "layer.weight_scale", "layer.bias", "layer.workspace"):
        assert attr in src, attr


def test_online_processing_and_dummy_loader_contract():
    """The hooks vLLM's loaders use for online quantization, which BF16 sources rely on."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader import base_loader, dummy_loader

    assert QuantizeMethodBase.uses_meta_device is False  # class default; our method sets it per instance
    assert "uses_meta_device" in inspect.getsource(base_loader)
    assert "_process_online_quant_layer" in inspect.getsource(dummy_loader.DummyModelLoader)
