"""The verl wrappers applied: each target is wrapped exactly once, idempotently, keeping verl's attributes;
failures are reported; the vLLM server hooks pass through when qerl is off and hand the engine its options
through additional_config. (That every target resolves with the parameters the wrappers expect is
tests/qerl_plugin/test_upstream.py.)
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pkgutil
from types import SimpleNamespace

import pytest

from verl_ext import patches

pytest.importorskip("vllm")
pytest.importorskip("verl")


@pytest.fixture(scope="module", autouse=True)
def applied():
    return patches.apply_all()


@pytest.fixture(autouse=True)
def environment_unchanged():
    """Fail a test that leaves os.environ different from how it found it (and put it back).

    Autouse, so it is set up before the test's ``monkeypatch`` and torn down after monkeypatch has undone its
    changes: what it sees at teardown is what the rest of the test run would inherit.
    """
    own = "PYTEST_CURRENT_TEST"  # pytest's own, rewritten at every phase

    def snapshot() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k != own}

    before = snapshot()
    yield
    after = snapshot()
    if after != before:
        for k in after.keys() - before.keys():
            del os.environ[k]
        os.environ.update(before)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        pytest.fail(f"the test leaked environment variables into the test run: {changed}")


@pytest.mark.parametrize("t", patches._PATCH_TARGETS, ids=lambda t: t.target)
def test_target_is_wrapped_once(t, applied):
    assert applied[t.target] == "applied", applied[t.target]
    obj = pkgutil.resolve_name(t.target)
    assert patches.is_patched(obj)
    inner = obj.__wrapped__
    assert not patches.is_patched(inner), f"{t.target} is wrapped twice"
    assert inspect.iscoroutinefunction(obj) == inspect.iscoroutinefunction(inner)


def test_verl_register_attributes_survive_wrapping():
    """verl binds worker methods through the @register attribute; our wrappers must keep it."""
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.engine_workers import ActorRolloutRefWorker

    for name in ("init_model", "update_weights"):
        meth = getattr(ActorRolloutRefWorker, name)
        assert patches.is_patched(meth)
        assert getattr(meth, MAGIC_ATTR) == getattr(meth.__wrapped__, MAGIC_ATTR)
    assert inspect.iscoroutinefunction(ActorRolloutRefWorker.update_weights)


def test_apply_is_idempotent():
    before = {t.target: pkgutil.resolve_name(t.target) for t in patches._PATCH_TARGETS}
    patches.install()
    patches.apply_all()
    after = {t.target: pkgutil.resolve_name(t.target) for t in patches._PATCH_TARGETS}
    assert before == after


def test_failures_are_reported_by_require(monkeypatch):
    monkeypatch.setitem(patches.STATUS, "verl.fake:thing", "failed: AttributeError: gone")
    with pytest.raises(RuntimeError, match=r"verl\.fake:thing: failed: AttributeError: gone") as e:
        patches.require("quantization=nvfp4")
    assert "verl 0.9.1" in str(e.value)


# ---------------------------------------------------------------------------------------------------------
# the vLLM server hooks, on verl's real functions with a stand-in `self`


def _server(quantization=None, custom=None, qat=None):
    from verl.workers.config import RolloutConfig

    cfg = RolloutConfig(name="vllm", quantization=quantization, custom=custom, qat=qat, tensor_model_parallel_size=1)
    return SimpleNamespace(config=cfg, model_config=SimpleNamespace(path="/nonexistent", hf_config=SimpleNamespace()))


def test_apply_quantization_routes_nvfp4_and_passes_others_through():
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    assert vLLMHttpServer._apply_quantization(_server("nvfp4")) == ("nvfp4", {})
    assert vLLMHttpServer._apply_quantization(_server(None)) == (None, {})  # verl's own code path
    with pytest.raises(ValueError, match="Currently only support"):  # verl's own error for unknown methods
        vLLMHttpServer._apply_quantization(_server("int3"))
    aqn = {"qerl": {"aqn": {"enable": True}}}
    assert vLLMHttpServer._apply_quantization(_server("nvfp4", aqn)) == ("nvfp4", {})


def _engine_args(monkeypatch, quantization=None, custom=None, engine_kwargs=None):
    """The engine arguments verl's own ``launch_server`` builds for a server, read back by vLLM's own parser."""
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "device_type", "cpu")  # vLLM's parser needs a device type
    cfg = RolloutConfig(name="vllm", quantization=quantization, custom=custom, tensor_model_parallel_size=1,
                        enable_sleep_mode=True, engine_kwargs={"vllm": engine_kwargs or {}})
    server = vLLMHttpServer.__new__(vLLMHttpServer)  # the Ray actor's object, without starting anything
    server.config = cfg
    server.model_config = SimpleNamespace(path="/nonexistent", local_path="/nonexistent", hf_config=SimpleNamespace(),
                                          trust_remote_code=False, lora={}, lora_rank=0)
    server.node_rank, server.replica_rank, server.nnodes, server.gpus_per_node = 0, 1, 1, 1
    server._disaggregation_role = "null"
    server._should_profile = lambda: False
    launched = {}

    async def run_server(args):  # where verl would start the engine
        launched["args"] = args

    server.run_server = run_server
    asyncio.run(vLLMHttpServer.launch_server(server))
    return AsyncEngineArgs.from_cli_args(launched["args"])


def test_aqn_reaches_the_engine_args_as_additional_config(monkeypatch):
    """AQN on: verl's launch_server gives vLLM additional_config {"qerl_aqn": true} (part of the engine's
    compile-cache key); off: no additional_config; in neither case does the environment change."""
    aqn = {"qerl": {"aqn": {"enable": True}}}
    on = _engine_args(monkeypatch, "nvfp4", aqn)
    assert on.additional_config == {"qerl_aqn": True}
    assert on.quantization == "nvfp4" and on.worker_extension_cls == "verl_ext.worker_extension.QerlVerlWorkerExtension"
    assert _engine_args(monkeypatch, None, aqn).additional_config == {"qerl_aqn": True}  # AQN on a BF16 rollout
    assert _engine_args(monkeypatch, "nvfp4").additional_config == {}
    assert _engine_args(monkeypatch, None).additional_config == {}
    kept = _engine_args(monkeypatch, "nvfp4", aqn, {"additional_config": {"mine": 1}})  # the user's own keys stay
    assert kept.additional_config == {"mine": 1, "qerl_aqn": True}
    with pytest.raises(ValueError, match=r"additional_config sets \{'qerl_aqn': False\}"):
        _engine_args(monkeypatch, "nvfp4", aqn, {"additional_config": {"qerl_aqn": False}})


def test_worker_extension_swapped_only_when_qerl_is_on():
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    stock = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"
    ours = "verl_ext.worker_extension.QerlVerlWorkerExtension"
    assert vLLMHttpServer._get_worker_extension_cls(_server(None)) == stock
    assert vLLMHttpServer._get_worker_extension_cls(_server("fp8")) == stock
    assert vLLMHttpServer._get_worker_extension_cls(_server("nvfp4")) == ours
    assert vLLMHttpServer._get_worker_extension_cls(_server(None, {"qerl": {"aqn": {"enable": True}}})) == ours
    cls = pkgutil.resolve_name(ours)
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from vllm_ext.worker_extension import QerlWorkerExtension

    assert issubclass(cls, vLLMColocateWorkerExtension) and issubclass(cls, QerlWorkerExtension)
    for rpc in ("qerl_set_noise", "qerl_clear_noise", "qerl_add_lora_from_tensors", "qerl_memory_report", "update_weights_from_ipc"):
        assert callable(getattr(cls, rpc))


def test_worker_extension_does_not_shadow_vllms_worker():
    """vLLM asserts that no extension attribute already exists on its GPU worker (vllm/v1/worker/worker_base.py)."""
    from vllm.v1.worker.gpu_worker import Worker

    from verl_ext.worker_extension import QerlVerlWorkerExtension

    clash = [a for a in dir(QerlVerlWorkerExtension) if not a.startswith("__") and hasattr(Worker, a)]
    assert clash == []
