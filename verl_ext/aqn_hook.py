"""AQN on schedule: the per-step noise RPC next to verl's weight sync, the optional actor-side noise, metrics.

After each ``ActorRolloutRefWorker.update_weights(g)`` the rollout engine gets the noise of
``AQNSchedule.setting(g)`` (``qerl_set_noise``) and drops its prefix cache; sigma and the vectors are pure
functions of (config, g, seed), so a resumed run continues the schedule exactly. ``aqn.apply_to_actor``
adds the same vectors to the actor's norms; the driver's ``Tracking`` logs ``qerl/aqn_sigma`` and
``qerl/aqn_stage``. Design: docs/design.md, "AQN".
"""

from __future__ import annotations

import logging
import time
from typing import Any

from qerl_plugin.aqn import AQNSchedule, is_aqn_target, noise_vector, noisy_weight, normalize_module_name, rms_normalize
from verl_ext.config import get
from verl_ext.settings import QerlSettings, current, settings_from, settings_of

logger = logging.getLogger("qerl.verl.aqn")


# ---------------------------------------------------------------------------------------------------------
# schedule


def schedule_for(settings: QerlSettings, total_steps: Any):
    """The AQNSchedule of a run: ``aqn.total_steps`` if set, else the run's ``total_steps``."""
    cfg = settings.aqn
    if cfg is None:
        return None
    if cfg.total_steps is None:
        if total_steps is None or int(total_steps) < 1:
            raise ValueError(
                "AQN needs the number of training steps: set actor_rollout_ref.rollout.custom.qerl.aqn.total_steps "
                f"or trainer.total_training_steps (got {total_steps!r} from the trainer)"
            )
        cfg = cfg.with_total_steps(int(total_steps))
    return AQNSchedule(cfg)


def rollout_setting(schedule, global_steps: int):
    """The noise the rollouts of training step ``global_steps + 1`` use (set by ``update_weights(global_steps)``)."""
    return schedule.setting(int(global_steps))


# ---------------------------------------------------------------------------------------------------------
# actor-side noise (aqn.apply_to_actor)


def is_aqn_norm(name: str, module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and is_aqn_target(name) and hasattr(module, "weight")


class ActorNoise:
    """fp32 noise on the actor's RMSNorm weights: ``out = normalize(x) * (w.float() + z)``, via forward hooks.

    The norm's own output is recomputed from its input (``variance_epsilon`` / ``eps``), so the result does
    not depend on how the norm rounds internally; the noise vectors are :func:`qerl_plugin.aqn.noise_vector`
    of the canonical module name, identical to vLLM's.
    """

    def __init__(self, module):
        self.norms = [(n, m) for n, m in module.named_modules() if is_aqn_norm(n, m)]
        self.noise: dict[int, Any] = {}
        self.setting = None
        self._handles = [m.register_forward_hook(self._hook) for _, m in self.norms]

    def _hook(self, module, inputs, output):
        z = self.noise.get(id(module))
        if z is None:
            return output
        x = inputs[0]
        eps = getattr(module, "variance_epsilon", None)
        if eps is None:
            eps = getattr(module, "eps", 1e-6)
        xn = rms_normalize(x.float(), eps)
        w = module.weight
        w = w.full_tensor() if hasattr(w, "full_tensor") else w
        # HF rounds normalize(x) to the input dtype before the weight multiply; so does this hook
        out = xn.to(x.dtype).float() * noisy_weight(w, z.to(w.device))
        return out.to(output.dtype)

    def set(self, setting) -> int:
        self.setting = setting
        self.noise.clear()
        if setting is None or not setting.active:
            return 0
        for name, m in self.norms:
            w = m.weight  # a DTensor's shape is the full one: no gather needed for the size
            self.noise[id(m)] = noise_vector(
                normalize_module_name(name), int(w.shape[-1]), setting.sigma, setting.seed, setting.key, device=w.device
            )
        return len(self.noise)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.noise.clear()


# ---------------------------------------------------------------------------------------------------------
# the per-step hook on ActorRolloutRefWorker.update_weights


def _worker_total_steps(worker) -> Any:
    return get(getattr(worker, "config", None), "actor.optim.total_training_steps")


def _worker_state(worker) -> dict:
    state = getattr(worker, "_qerl_aqn", None)
    if state is None:
        cfg = getattr(worker, "config", None)
        if cfg is not None and get(cfg, "rollout") is not None:
            settings = settings_of(worker, get(cfg, "rollout"), get(cfg, "model"))  # init_model parsed them
        else:
            settings = current()
        state = {"settings": settings, "schedule": None, "actor_noise": None, "last": None}
        worker._qerl_aqn = state
    return state


async def apply_step_noise(worker, global_steps) -> dict | None:
    """Set the noise for the rollouts after ``update_weights(global_steps)``; returns what was set."""
    state = _worker_state(worker)
    settings: QerlSettings = state["settings"]
    if not settings.aqn_enabled or "rollout" not in str(getattr(worker, "role", "actor_rollout")):
        return None
    if state["schedule"] is None:
        state["schedule"] = schedule_for(settings, _worker_total_steps(worker))
        logger.info("qerl: %r, sigmas per stage %s", state["schedule"], state["schedule"].sigmas())
    if global_steps is None:
        setting = state["last"]  # a re-sync without a step (e.g. validation): keep the current noise
        if setting is None:
            return None
    else:
        setting = rollout_setting(state["schedule"], global_steps)
    t0 = time.perf_counter()
    rollout = worker.rollout
    results = await rollout._execute_method(
        "qerl_set_noise", kwargs={"sigma": float(setting.sigma), "seed": int(setting.seed), "stage": int(setting.key)}
    )
    # collective_rpc answers once per vLLM worker (tensor-parallel rank): each rank's noise checksum
    ranks = [
        {k: r.get(k) for k in ("rank", "norms", "checksum")}
        for r in (results if isinstance(results, (list, tuple)) else [])
        if isinstance(r, dict)
    ]
    if rollout._ensure_server_handle():
        await rollout.server_handle.clear_kv_cache.remote()
    if settings.aqn_apply_to_actor:
        if state["actor_noise"] is None:
            state["actor_noise"] = ActorNoise(worker.actor.engine.module)
        state["actor_noise"].set(setting)
    state["last"] = setting
    info = {
        "step": global_steps,
        "stage": setting.stage,
        "sigma": setting.sigma,
        "seed": setting.seed,
        "key": setting.key,
        "rpc_s": time.perf_counter() - t0,
        "ranks": ranks,
    }
    if len({r["checksum"] for r in ranks}) > 1:
        logger.warning("qerl AQN: the vLLM ranks hold different noise (checksums %s); they must agree", ranks)
    if getattr(rollout, "_has_server", True):
        logger.info("qerl AQN: %s", info)
        sums = ", ".join(f"rank {r['rank']} {r['checksum']:.6g}" for r in ranks if isinstance(r.get("checksum"), (int, float)))
        print(f"[qerl] AQN after update_weights({global_steps}): stage {setting.stage} sigma {setting.sigma:.3e}"
              + (f" (noise checksums: {sums})" if sums else ""), flush=True)
    return info


def wrap_update_weights(original, target: str):
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        result = await original(self, global_steps=global_steps, mode=mode)
        await apply_step_noise(self, global_steps)
        return result

    return update_weights


# ---------------------------------------------------------------------------------------------------------
# metrics in the driver's logger


def driver_schedule(config: Any):
    """The AQNSchedule of a run from the full (resolved) config the trainer gives ``Tracking``; None if AQN is off."""
    rollout = get(config, "actor_rollout_ref.rollout")
    if rollout is None:
        return None
    settings = settings_from(rollout, None)
    if not settings.aqn_enabled:
        return None
    total = get(config, "actor_rollout_ref.actor.optim.total_training_steps")
    if total is None or int(total) < 1:
        total = get(config, "trainer.total_training_steps")
    return schedule_for(settings, total)


def step_metrics(schedule, step: int) -> dict:
    """Metrics for the logged training step ``step`` (its rollouts used ``setting(step - 1)``)."""
    s = rollout_setting(schedule, max(int(step) - 1, 0))
    return {"qerl/aqn_sigma": s.sigma, "qerl/aqn_stage": s.stage}


def wrap_tracking_init(original, target: str):
    def __init__(self, project_name, experiment_name, default_backend="console", config=None, *args, **kwargs):
        original(self, project_name, experiment_name, default_backend, config, *args, **kwargs)
        try:
            self._qerl_aqn_schedule = driver_schedule(config) if config is not None else None
        except Exception as e:  # metrics must not stop a run
            logger.warning("qerl: no AQN metrics: %s", e)
            self._qerl_aqn_schedule = None

    return __init__


def wrap_tracking_log(original, target: str):
    def log(self, data, step, *args, **kwargs):
        schedule = getattr(self, "_qerl_aqn_schedule", None)
        if schedule is not None and isinstance(data, dict) and step is not None:
            if any(str(k).startswith(("actor/", "training/", "timing_s/")) for k in data):
                data = {**data, **step_metrics(schedule, step)}
        return original(self, data, step, *args, **kwargs)

    return log
