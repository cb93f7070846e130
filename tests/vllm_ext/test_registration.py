"""``nvfp4`` reaches vLLM through the real entry point, cheaply and idempotently (fresh processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")


def _run(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("qerl") == "vllm_ext:register"


def test_import_vllm_ext_is_free():
    out = _run(
        """
        import json, sys
        import vllm_ext
        print(json.dumps({"torch": "torch" in sys.modules, "vllm": "vllm" in sys.modules}))
        """
    )
    assert out == {"torch": False, "vllm": False}


def test_real_plugin_loading_registers_nvfp4_once_and_lazily():
    out = _run(
        """
        import json, sys
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        heavy = [m for m in (
            "vllm_ext.nvfp4_linear",
            "vllm_ext.nvfp4_load",
            "vllm_ext.nvfp4_backends",
            "vllm_ext.nvfp4_reload",
            "vllm.model_executor.layers.linear",
            "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
            "vllm.model_executor.layers.quantization.utils.marlin_utils_fp4",
            "vllm.lora.layers",
        ) if m in sys.modules]
        import vllm_ext, vllm_ext.quant
        vllm_ext.register(); vllm_ext.quant.register(); vllm_ext.quant.register()
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
        cls = get_quantization_config("nvfp4")
        from vllm.platforms import current_platform
        print(json.dumps({
            "heavy": heavy,
            "cls": f"{cls.__module__}.{cls.__qualname__}",
            "count": QUANTIZATION_METHODS.count("nvfp4"),
            "platform_ok": (not current_platform.supported_quantization) or "nvfp4" in current_platform.supported_quantization,
        }))
        """,
        VLLM_PLUGINS="qerl",
    )
    assert out == {"heavy": [], "cls": "vllm_ext.quant.NVFP4Config", "count": 1, "platform_ok": True}


def test_registration_on_cuda_names_the_lora_wrapper_without_importing_it():
    """On CUDA, register() names qerl's punica wrapper; vLLM's LoRA code loads only when an engine builds it."""
    out = _run(
        """
        import json, sys
        from vllm.platforms import current_platform
        platform = type(current_platform)
        is_cuda = platform.is_cuda
        platform.is_cuda = lambda self: True  # register()'s CUDA branch, on this CPU machine
        import vllm_ext
        vllm_ext.register()
        heavy = [m for m in ("vllm_ext.lora_dense_wrapper", "vllm.lora.punica_wrapper.punica_gpu", "vllm.lora.layers")
                 if m in sys.modules]
        platform.is_cuda = is_cuda  # vLLM's LoRA code takes CUDA-only paths at import on a "CUDA" platform
        from vllm.utils.import_utils import resolve_obj_by_qualname
        wrapper = resolve_obj_by_qualname(current_platform.get_punica_wrapper())
        print(json.dumps({"heavy": heavy, "wrapper": f"{wrapper.__module__}.{wrapper.__qualname__}"}))
        """
    )
    assert out == {"heavy": [], "wrapper": "vllm_ext.lora_dense_wrapper.QerlPunicaWrapper"}


def test_without_the_plugin_nvfp4_is_unknown():
    """The name comes from our registration, not from vLLM (guards against a future in-tree 'nvfp4')."""
    out = _run(
        """
        import json
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
        print(json.dumps({"nvfp4": "nvfp4" in QUANTIZATION_METHODS}))
        """,
        VLLM_PLUGINS="none-of-ours",
    )
    assert out == {"nvfp4": False}


def test_qerl_variables_that_change_the_traced_model_key_vllms_compile_cache(monkeypatch):
    """vLLM keys its compile cache by vllm.envs.compile_factors(): after registration a qerl variable that changes
    the traced model is one of those factors, so two values get two cache entries (§4ag: an engine started with
    QERL_LORA_SPLIT_ADD=0 loaded the graph compiled with the default)."""
    import vllm.envs as envs
    from vllm.config.utils import hash_factors

    import vllm_ext
    from qerl_plugin import options
    from vllm_ext import nvfp4_backends

    vllm_ext.register_compile_env()
    hashes = {}
    for value in ("1", "0"):
        monkeypatch.setenv(options.LORA_SPLIT_ADD_ENV, value)
        factors = envs.compile_factors()
        assert factors[options.LORA_SPLIT_ADD_ENV] == value
        hashes[value] = hash_factors(factors)
    assert hashes["1"] != hashes["0"]
    monkeypatch.delenv(options.LORA_SPLIT_ADD_ENV)
    assert envs.compile_factors()[options.LORA_SPLIT_ADD_ENV] is None
    # every variable the nvfp4 backends read when the model is built is among them
    for name in (nvfp4_backends.BACKEND_ENV, nvfp4_backends.FP32_REDUCE_ENV, nvfp4_backends.DECODE_GEMV_ENV,
                 nvfp4_backends.HUMMING_BATCH_INVARIANT_ENV):
        assert name in options.COMPILE_ENV and name in envs.compile_factors()
