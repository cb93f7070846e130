"""One weight-transfer socket per Ray cluster: verl runs side by side on one host no longer share it.

verl 0.9.1 sends each weight (or adapter) sync from the actor to its co-located vLLM worker over a ZMQ socket
named ``/tmp/rl-colocate-zmq-{job}-replica-{r}-rank-{k}.sock``. The sender (``ServerAdapter.__init__``, in the
actor's process) and the receiver (``vLLMColocateWorkerExtension._get_zmq_handle``, in the vLLM worker, from the
``VERL_RAY_JOB_ID`` that ``vLLMHttpServer.__init__`` exports) take ``{job}`` from Ray's job id, which is unique
inside one Ray cluster only: every ``python -m verl.trainer.main_ppo`` that starts its own local Ray cluster is
job ``01000000``. Several such runs on one host then bind and connect the same socket file; a sender whose file
another run re-bound waits for ever (a run stops right after an adapter sync), and a receiver may connect to the
other run's sender. Seen on the H100 on 2026-11-24 with five SmolLM2 runs side by side (two stalled).

qerl appends a tag of the Ray session (one per cluster, the same in every process of it) to the job id on both
sides: the sender's socket name and the ``VERL_RAY_JOB_ID`` the vLLM workers inherit. On for every verl run that
loads qerl, like the adapter-extraction fix. Design: docs/design.md, "Weight sync".
"""

from __future__ import annotations

import hashlib
import logging
import os

logger = logging.getLogger("qerl.verl.weight_socket")

ENV_JOB_ID = "VERL_RAY_JOB_ID"  # read by verl's receiver (vllm_rollout/utils.py, _get_zmq_handle)
TAG_CHARS = 8  # hex digits of the session hash; the socket path stays far below the 107-byte AF_UNIX limit


def session_tag(session_name: str) -> str:
    """A short, filename-safe tag of a Ray session name (``session_2026-11-24_01-44-00_046123_1569``)."""
    if not session_name:
        raise ValueError("an empty Ray session name: call this inside a process of a running Ray cluster")
    return hashlib.sha1(session_name.encode()).hexdigest()[:TAG_CHARS]


def current_tag() -> str:
    """The tag of the Ray cluster this process belongs to (driver, actor or task)."""
    import ray

    return session_tag(ray.get_runtime_context().get_session_name())


def qualified_job_id(job_id: str, tag: str) -> str:
    """``{job_id}-{tag}``; idempotent (a job id that already ends in the tag is returned as is)."""
    job_id = str(job_id)
    return job_id if job_id.endswith(f"-{tag}") else f"{job_id}-{tag}"


def qualified_handle(handle: str, job_id: str, tag: str) -> str:
    """verl's sender socket name with ``{job_id}`` replaced by :func:`qualified_job_id`; unchanged (and logged)
    when the name does not have verl 0.9.1's shape."""
    plain = f"-zmq-{job_id}-replica-"
    qualified = f"-zmq-{qualified_job_id(job_id, tag)}-replica-"
    if qualified in handle:
        return handle
    if plain not in handle:
        logger.warning(
            "qerl: verl's weight-transfer socket %r does not contain %r; left as is (runs side by side on one host "
            "may share it)", handle, plain,
        )
        return handle
    return handle.replace(plain, qualified, 1)


def wrap_server_init(original, target: str):
    """``vLLMHttpServer.__init__``: export the qualified job id to the vLLM workers it launches later."""

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        job_id = os.environ.get(ENV_JOB_ID)
        if job_id is None:  # a verl without the export: its receiver uses "0"; leave both sides alone
            return
        os.environ[ENV_JOB_ID] = qualified_job_id(job_id, current_tag())

    return __init__


def wrap_server_adapter_init(original, target: str):
    """``ServerAdapter.__init__`` (the actor's side of the rollout): the sender's socket name, qualified."""

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        handle = getattr(self, "zmq_handle", None)
        if not isinstance(handle, str):
            return
        import ray

        self.zmq_handle = qualified_handle(handle, ray.get_runtime_context().get_job_id(), current_tag())

    return __init__
