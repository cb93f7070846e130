"""``vllm_ext.nvfp4_backends``: backend options and the refusals where Marlin cannot run (CPU; the Marlin
kernel itself is tested in ``test_nvfp4_backends_gpu.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from nvfp4_layers import make_qkv, nvfp4_config  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig  # noqa: E402

from qerl_plugin.nvfp4 import NVFP4Error  # noqa: E402


def test_backend_options_from_additional_config(cpu_config, monkeypatch):
    ok = VllmConfig(device_config=DeviceConfig(device="cpu"), additional_config={"qerl_nvfp4": {"backend": "emulation"}})
    assert make_qkv(ok, nvfp4_config(ct=False)).quant_method.backend.name == "emulation"
    bad = VllmConfig(device_config=DeviceConfig(device="cpu"), additional_config={"qerl_nvfp4": {"backend": "bogus"}})
    with pytest.raises(NVFP4Error, match="backend='bogus'.*expected auto, marlin, humming or emulation"):
        make_qkv(bad, nvfp4_config(ct=False))
    monkeypatch.setenv("QERL_NVFP4_BACKEND", "marlin")  # no CUDA here: a clear error, not a crash later
    with pytest.raises(NVFP4Error, match="needs an NVIDIA GPU"):
        make_qkv(cpu_config, nvfp4_config(ct=False))


def test_gpu_below_marlin_requirement_is_refused(monkeypatch):
    """A Volta-class GPU (7.0): a clear error when the layer is built, naming the requirement and the fix."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from vllm_ext.nvfp4_backends import MarlinBackend

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda *a: True)
    monkeypatch.setattr(type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: DeviceCapability(7, 0)))
    with pytest.raises(NVFP4Error, match=r"compute capability >= 7\.5.*this GPU is 7\.0.*without --quantization"):
        MarlinBackend()


@pytest.mark.parametrize("cap, env, want", [((9, 0), None, "shared"), ((8, 9), None, "off"), ((8, 0), None, "off"),
                                           ((10, 0), None, "off"), (None, None, "off"), ((9, 0), "off", "off"),
                                           ((8, 9), "shared", "shared"), ((9, 0), "all", "all")])
def test_decode_gemv_default_is_shared_on_hopper_only(monkeypatch, cap, env, want):
    """Where neither the options nor the environment name a decode_gemv mode, a Marlin engine takes "shared" on a
    Hopper GPU (§4al's default) and "off" on any other, or where the capability is unknown; a mode that is named wins
    on every GPU."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from vllm_ext.nvfp4_backends import MarlinBackend

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda *a: True)
    monkeypatch.setattr(type(current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: None if cap is None else DeviceCapability(*cap)))
    monkeypatch.delenv("QERL_NVFP4_DECODE_GEMV", raising=False)
    if env is not None:
        monkeypatch.setenv("QERL_NVFP4_DECODE_GEMV", env)
    assert MarlinBackend().decode_gemv == want


def test_decode_gemv_default_is_off_with_tensor_parallelism(monkeypatch):
    """An engine split over several GPUs keeps decode_gemv off by default on Hopper too: shared has not run with
    tensor parallelism (§4al); named, it is taken."""
    from qerl_plugin import options
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from vllm_ext import nvfp4_backends

    assert options.decode_gemv_default(90, 2) == "off" and options.decode_gemv_default(90, 1) == "shared"
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda *a: True)
    monkeypatch.setattr(type(current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)))
    monkeypatch.delenv("QERL_NVFP4_DECODE_GEMV", raising=False)
    monkeypatch.setattr(nvfp4_backends, "_tensor_parallel_size", lambda: 2)
    assert nvfp4_backends.MarlinBackend().decode_gemv == "off"
    assert nvfp4_backends.MarlinBackend(decode_gemv="shared").decode_gemv == "shared"


def test_humming_backend_refusals_name_the_fix(cpu_config, monkeypatch):
    """backend humming without a GPU, and without the humming-kernels package: clear errors that name the fix."""
    import builtins

    from vllm.platforms import current_platform

    from vllm_ext.nvfp4_backends import HummingBackend

    monkeypatch.setenv("QERL_NVFP4_BACKEND", "humming")
    with pytest.raises(NVFP4Error, match="backend 'humming' needs an NVIDIA GPU.*Use backend 'auto'"):
        make_qkv(cpu_config, nvfp4_config(ct=False))
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda *a: True)
    real_import = builtins.__import__

    def no_humming(name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if name == "humming":
            raise ImportError("No module named 'humming'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_humming)
    with pytest.raises(NVFP4Error, match=r"pip install humming-kernels==0\.1\.6.*or use backend 'auto'"):
        HummingBackend()


@pytest.mark.parametrize("value, invariant", [(None, False), ("", False), ("0", False), ("1", True), (" On ", True)])
def test_humming_compute_mode_follows_the_environment(monkeypatch, value, invariant):
    """QERL_HUMMING_BATCH_INVARIANT (§4ae's diagnostic) turns on humming's batch-invariant compute config; unset, the
    backend runs vLLM's (split-K on, no f16 accumulation, a dense GEMM)."""
    import json

    from vllm_ext.nvfp4_backends import humming_batch_invariant, humming_compute

    if value is None:
        monkeypatch.delenv("QERL_HUMMING_BATCH_INVARIANT", raising=False)
    else:
        monkeypatch.setenv("QERL_HUMMING_BATCH_INVARIANT", value)
    assert json.loads(humming_compute(humming_batch_invariant())) == {
        "use_batch_invariant": invariant, "use_f16_accum": False, "gemm_type": "dense"}


def test_humming_compute_mode_refuses_a_value_that_is_neither_yes_nor_no(monkeypatch):
    from vllm_ext.nvfp4_backends import humming_batch_invariant

    monkeypatch.setenv("QERL_HUMMING_BATCH_INVARIANT", "maybe")
    with pytest.raises(NVFP4Error, match="QERL_HUMMING_BATCH_INVARIANT: expected true or false, got 'maybe'"):
        humming_batch_invariant()
