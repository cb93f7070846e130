"""verl's replay buffer polls for finished rollouts every 2 s; qerl makes that 0.1 s.

verl 0.9.1's V1 trainer waits for a step's rollouts in ``ReplayBuffer.sample``, which checks the transfer queue
and then sleeps ``poll_interval`` (2.0 s, not settable from the YAML). A rollout that ends just after a check
waits up to 2 s more, which rounds ``timing_s/gen`` up to a multiple of 2 s (docs/gpu-runs/2026-11-23). The
wrapper passes ``poll_interval=0.1`` unless the caller gave one; on for every verl run that loads qerl.
"""

from __future__ import annotations

POLL_INTERVAL_S = 0.1


def wrap_replay_buffer_init(original, target: str):
    def __init__(self, *args, **kwargs):
        if len(args) < 6 and "poll_interval" not in kwargs:  # poll_interval is the sixth parameter after self
            kwargs["poll_interval"] = POLL_INTERVAL_S
        original(self, *args, **kwargs)

    return __init__
