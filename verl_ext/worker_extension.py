"""The vLLM worker extension verl's rollout uses when qerl is on: verl's own plus qerl's RPCs and checks.

:class:`QerlVerlWorkerExtension` combines verl's ``vLLMColocateWorkerExtension`` (IPC weight receiver,
logits patch) with :class:`vllm_ext.worker_extension.QerlWorkerExtension` (noise and adapter RPCs). An
adapter sync is checked against the LoRA modules vLLM built and loaded in memory under verl's adapter id; a
base-weight sync under ``quantization: nvfp4`` is refused; verl's NVFP4 QAT detection and patches stay off
for qerl's ``nvfp4`` engines. Design: docs/design.md, "Weight sync".
"""

from __future__ import annotations

import contextlib
import logging
import time

from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID, VLLM_LORA_NAME, vLLMColocateWorkerExtension

from qerl_plugin import options
from verl_ext.adapter_sync import AdapterSyncError, check_adapter_for_vllm, expected_lora_modules, normalize_adapter_keys
from vllm_ext.worker_extension import QerlWorkerExtension

logger = logging.getLogger("qerl.verl.worker_extension")

def _is_qerl_quant(vllm_config) -> bool:
    model_config = getattr(vllm_config, "model_config", None)
    return getattr(model_config, "quantization", None) == options.METHOD


@contextlib.contextmanager
def _without_verl_qat_patches():
    """While verl's extension initialises, make its NVFP4 QAT / ModelOpt patch appliers no-ops (scoped; restored)."""
    import verl.utils.qat as qat

    saved = qat.apply_qat_patches
    qat.apply_qat_patches = lambda *a, **k: []
    try:
        yield
    finally:
        qat.apply_qat_patches = saved


class QerlVerlWorkerExtension(QerlWorkerExtension, vLLMColocateWorkerExtension):
    def __new__(cls, **kwargs):
        vllm_config = kwargs.get("vllm_config")
        ours = _is_qerl_quant(vllm_config)
        ctx = _without_verl_qat_patches() if ours else contextlib.nullcontext()
        with ctx:
            instance = vLLMColocateWorkerExtension.__new__(cls, **kwargs)
        if ours:
            instance._is_qat_model = False
            instance._is_modelopt_qat = False
        instance._qerl_nvfp4 = ours
        instance._qerl_last_sync = None
        return instance

    # -- weight sync ---------------------------------------------------------------------------------------

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        if getattr(self, "_qerl_nvfp4", False) and not (peft_config and base_sync_done):
            raise RuntimeError(
                "qerl quantization=nvfp4: the trainer is sending base weights to vLLM, but the NVFP4 base is loaded "
                "once from model.path and only the LoRA adapter is synced. Use rollout.load_format=auto (not dummy), "
                "LoRA (model.lora_rank > 0) without lora.merge, and checkpoint_engine.backend=naive"
            )
        return super().update_weights_from_ipc(peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)

    def _update_weights(self, weights, peft_config, base_sync_done):
        if not (peft_config and base_sync_done):
            return super()._update_weights(weights, peft_config, base_sync_done)
        t0 = time.perf_counter()
        # verl's receiver hands over its own clones of the IPC buckets, and build_lora_model copies them to the CPU
        tensors = normalize_adapter_keys(dict(weights))
        manager = self.model_runner.lora_manager._adapter_manager
        accepted, _ = expected_lora_modules(manager)
        model = getattr(manager, "model", None)
        by_module = check_adapter_for_vllm(
            tensors,
            accepted,
            weights_mapper=getattr(model, "hf_to_vllm_mapper", None),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        self.qerl_add_lora_from_tensors(VLLM_LORA_NAME, VLLM_LORA_INT_ID, dict(tensors), dict(peft_config))
        if VLLM_LORA_INT_ID not in self.list_loras():
            raise AdapterSyncError(f"the LoRA adapter (id {VLLM_LORA_INT_ID}) is not registered in vLLM after the sync")
        self._qerl_last_sync = {
            "tensors": len(tensors),
            "modules": len(by_module),
            "bytes": int(sum(t.numel() * t.element_size() for t in tensors.values())),
            "seconds": time.perf_counter() - t0,
        }
        logger.info("qerl adapter sync: %s", self._qerl_last_sync)
        if getattr(self, "rank", 0) == 0:  # one line per engine and sync, for logs and scripts/gpu checks
            s = self._qerl_last_sync
            print(
                f"[qerl] adapter sync: {s['tensors']} tensors, {s['modules']} LoRA modules, {s['bytes'] / 2**20:.2f} MiB, "
                f"{s['seconds'] * 1e3:.1f} ms",
                flush=True,
            )

    def qerl_set_noise(self, sigma, seed, stage):
        report = super().qerl_set_noise(sigma, seed, stage)
        if getattr(self, "rank", 0) == 0 and isinstance(report, dict):
            print(
                "[qerl] vLLM noise set: "
                + ", ".join(f"{k}={report[k]}" for k in ("norms", "sigma", "seed", "stage", "checksum") if k in report),
                flush=True,
            )
        return report

    def qerl_last_adapter_sync(self) -> dict | None:
        """What the last adapter sync loaded (tensors, LoRA modules, bytes, seconds), for scripts and tests."""
        return self._qerl_last_sync
