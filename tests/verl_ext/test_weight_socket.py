"""verl_ext.weight_socket: the actor->vLLM weight-transfer socket is one per Ray cluster.

Two separate local Ray clusters (two subprocesses, as two `python -m verl.trainer.main_ppo` runs side by side
are) each build verl's real sender (``ServerAdapter``) and the real receiver path (``vLLMHttpServer.__init__``'s
export, then ``vLLMColocateWorkerExtension._get_zmq_handle``): verl alone gives both clusters the same socket,
qerl's wrappers give each its own, and inside one cluster sender and receiver agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from verl_ext import patches
from verl_ext.weight_socket import qualified_handle, qualified_job_id, session_tag

TESTS = Path(__file__).resolve().parents[1]

_CLUSTER = textwrap.dedent(
    """
    import json, os, sys, types
    sys.path.insert(0, {tests!r})
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    from verl_ext import patches
    patches.apply_all()
    from helpers import make_tiny_qwen2
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter
    from verl_ext.weight_socket import current_tag

    os.environ.update(RANK="0", RAY_LOCAL_WORLD_SIZE="1")
    out = {{"job": ray.get_runtime_context().get_job_id(), "tag": current_tag()}}

    @ray.remote(num_cpus=1)
    def tag_in_a_worker():
        from verl_ext.weight_socket import current_tag
        return current_tag()

    out["worker_tag"] = ray.get(tag_in_a_worker.remote())

    def receiver():  # what a vLLM worker of this server computes, from the environment it inherits
        return vLLMColocateWorkerExtension._get_zmq_handle(types.SimpleNamespace(model_runner=None, local_rank=0))

    model = HFModelConfig(path=str(make_tiny_qwen2({model!r})))
    for label, adapter_init, server_init in (
        ("verl", ServerAdapter.__init__.__wrapped__, vLLMHttpServer.__init__.__wrapped__),
        ("qerl", ServerAdapter.__init__, vLLMHttpServer.__init__),
    ):
        sender = ServerAdapter.__new__(ServerAdapter)
        adapter_init(sender, RolloutConfig(name="vllm"), None, None)
        server = vLLMHttpServer.__new__(vLLMHttpServer)
        server_init(server, RolloutConfig(name="vllm"), model, RolloutMode.COLOCATED, [], 0, 0, 1, 1, "0")
        out[label] = {{"sender": sender.zmq_handle, "receiver": receiver()}}
    print("RESULT " + json.dumps(out))
    ray.shutdown()
    """
)


def test_session_tag_and_qualified_names():
    tag = session_tag("session_2026-11-24_01-44-00_046123_1569")
    assert len(tag) == 8 and int(tag, 16) >= 0
    assert tag != session_tag("session_2026-11-24_01-44-01_046123_1570")
    assert qualified_job_id("01000000", tag) == f"01000000-{tag}"
    assert qualified_job_id(f"01000000-{tag}", tag) == f"01000000-{tag}"  # idempotent
    verl = "ipc:///tmp/rl-colocate-zmq-01000000-replica-0-rank-0.sock"
    ours = qualified_handle(verl, "01000000", tag)
    assert ours == f"ipc:///tmp/rl-colocate-zmq-01000000-{tag}-replica-0-rank-0.sock"
    assert qualified_handle(ours, "01000000", tag) == ours
    assert len(ours.removeprefix("ipc://").encode()) < 107  # AF_UNIX path limit
    with pytest.raises(ValueError, match="empty Ray session name"):
        session_tag("")


def test_an_unknown_socket_name_is_left_alone(caplog):
    odd = "tcp://127.0.0.1:5555"
    with caplog.at_level("WARNING", logger="qerl.verl.weight_socket"):
        assert qualified_handle(odd, "01000000", "abcdef01") == odd
    assert "left as is" in caplog.text


def test_verls_sender_and_server_are_wrapped():
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    patches.apply_all()
    assert patches.is_patched(ServerAdapter.__init__)
    assert patches.is_patched(vLLMHttpServer.__init__)


def test_two_ray_clusters_on_one_host_get_two_sockets(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CLUSTER.format(tests=str(TESTS), model=str(tmp_path / f"model{i}"))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"cluster process failed (rc {p.returncode}):\n{err[-3000:]}"
        results.append(json.loads(lines[-1][len("RESULT "):]))
    a, b = results
    # the trap: every local cluster's first job has the same id, so verl alone names one socket for both runs
    assert a["job"] == b["job"]
    assert a["verl"]["sender"] == b["verl"]["sender"]
    # qerl: one tag per cluster, the same in the driver and in a worker process of it
    for r in results:
        assert r["tag"] == r["worker_tag"]
        assert r["qerl"]["sender"] == r["qerl"]["receiver"], r  # sender and receiver still meet
        assert r["tag"] in r["qerl"]["sender"]
        assert r["verl"]["sender"] == r["verl"]["receiver"]
    assert a["tag"] != b["tag"]
    assert a["qerl"]["sender"] != b["qerl"]["sender"]
