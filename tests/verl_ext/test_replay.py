"""verl_ext.replay: verl's ReplayBuffer polls every 0.1 s unless its caller chose an interval."""

from __future__ import annotations

import inspect

from verl_ext import patches
from verl_ext.replay import POLL_INTERVAL_S, wrap_replay_buffer_init


def test_default_poll_interval_only_when_not_given():
    seen = {}

    def original(self, trainer_mode, trainer_config, a, b, c, poll_interval=2.0, **kw):
        seen["poll"] = poll_interval

    init = wrap_replay_buffer_init(original, "t")
    init(None, "sync", {}, None, "drop", {})
    assert seen["poll"] == POLL_INTERVAL_S
    init(None, "sync", {}, None, "drop", {}, poll_interval=1.5)
    assert seen["poll"] == 1.5
    init(None, "sync", {}, None, "drop", {}, 0.7)  # positional
    assert seen["poll"] == 0.7


def test_verls_replay_buffer_gets_the_short_poll():
    from verl.trainer.ppo.v1 import replay_buffer

    patches.apply_all()
    init = replay_buffer.ReplayBuffer.__init__
    assert patches.is_patched(init)
    # the wrapped constructor still has verl's parameters, poll_interval sixth after self
    params = list(inspect.signature(init.__wrapped__).parameters)
    assert params[6] == "poll_interval"
    assert issubclass(replay_buffer.ReplayBufferAsync, replay_buffer.ReplayBuffer)
