"""The patch table against the installed verl/vLLM: fails when upstream moves or changes a target.

Every target resolves with :func:`pkgutil.resolve_name`, has the parameters the wrapper expects, and gets
wrapped exactly once; the pinned versions are the ones installed; wrappers pass through when qerl is off.
"""

from __future__ import annotations

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


def test_pinned_versions_are_installed():
    import verl
    import vllm

    assert verl.__version__ == patches.VERL_VERSION, f"qerl's verl patches target verl {patches.VERL_VERSION}"
    assert vllm.__version__ == patches.VLLM_VERSION, f"qerl targets vLLM {patches.VLLM_VERSION}"


@pytest.mark.parametrize("t", patches._PATCH_TARGETS, ids=lambda t: t.target)
def test_target_resolves_with_expected_signature(t):
    obj = pkgutil.resolve_name(t.target)
    original = inspect.unwrap(obj)
    assert callable(original)
    params = list(inspect.signature(original).parameters)
    assert params[: len(t.params)] == list(t.params), (
        f"{t.target} now takes {params}; qerl's wrapper ({t.factory}) expects {list(t.params)} first"
    )
    assert callable(pkgutil.resolve_name(t.factory))


@pytest.mark.parametrize("t", patches._PATCH_TARGETS, ids=lambda t: t.target)
def test_target_is_wrapped_once(t, applied):
    assert applied[t.target] == "applied", applied[t.target]
    obj = pkgutil.resolve_name(t.target)
    assert patches.is_patched(obj)
    inner = obj.__wrapped__
    assert not patches.is_patched(inner), f"{t.target} is wrapped twice"
    assert inspect.iscoroutinefunction(obj) == inspect.iscoroutinefunction(inner)


def test_scoped_targets_resolve():
    for target, where, _ in patches._SCOPED_TARGETS:
        assert callable(pkgutil.resolve_name(target)), target
        assert callable(pkgutil.resolve_name(where)), where


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


def test_apply_quantization_routes_nvfp4_and_passes_others_through(monkeypatch):
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    # setenv first so that monkeypatch records QERL_AQN's state before the test (set or not) and restores
    # exactly that at teardown; delenv alone records nothing when the variable is unset, and the "1" that
    # _apply_quantization writes below would stay for the rest of the test run
    monkeypatch.setenv("QERL_AQN", "0")
    monkeypatch.delenv("QERL_AQN")
    assert vLLMHttpServer._apply_quantization(_server("nvfp4")) == ("nvfp4", {})
    assert vLLMHttpServer._apply_quantization(_server(None)) == (None, {})  # verl's own code path
    with pytest.raises(ValueError, match="Currently only support"):  # verl's own error for unknown methods
        vLLMHttpServer._apply_quantization(_server("int3"))

    assert "QERL_AQN" not in os.environ
    aqn = {"qerl": {"aqn": {"enable": True}}}
    assert vLLMHttpServer._apply_quantization(_server("nvfp4", aqn)) == ("nvfp4", {})
    assert os.environ["QERL_AQN"] == "1"


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
