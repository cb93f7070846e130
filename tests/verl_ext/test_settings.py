"""verl_ext.settings: QerlSettings is a frozen verl BaseConfig, parsed once per worker or server and turned
into the engine's additional_config entries. (Parsing and checking whole configs: test_config.py.)"""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from types import SimpleNamespace

import pytest

pytest.importorskip("verl")

from verl.base_config import BaseConfig  # noqa: E402

from verl_ext import settings as settings_mod  # noqa: E402
from verl_ext.settings import QerlSettings, settings_from, settings_of  # noqa: E402

AQN = {"qerl": {"aqn": {"enable": True, "sigma_start": 1e-2, "sigma_end": 1e-4, "num_stages": 4}}}


def test_settings_are_a_frozen_verl_base_config():
    s = settings_from({"quantization": "nvfp4", "custom": AQN})
    assert isinstance(s, BaseConfig) and s["quantization"] == "nvfp4" and s.get("aqn_apply_to_actor") is False
    with pytest.raises(FrozenInstanceError):
        s.quantization = None
    assert s.nvfp4 and s.aqn_enabled and s.active and s.aqn.num_stages == 4


def test_engine_config_is_what_vllm_gets():
    assert settings_from({"quantization": "nvfp4", "custom": AQN}).engine_config() == {"qerl_aqn": True}
    assert settings_from({"quantization": None, "custom": AQN}).engine_config() == {"qerl_aqn": True}
    assert settings_from({"quantization": "nvfp4"}).engine_config() == {}
    assert QerlSettings().engine_config() == {} and not QerlSettings().active


def test_settings_of_parses_once_per_owner(monkeypatch):
    calls = []
    parse = settings_mod.settings_from
    monkeypatch.setattr(settings_mod, "settings_from", lambda *a: calls.append(a) or parse(*a))
    server = SimpleNamespace()
    first = settings_of(server, {"quantization": "nvfp4", "custom": AQN})
    again = settings_of(server, {"quantization": None})  # kept: the owner's settings do not change
    assert again is first and len(calls) == 1
    other = settings_of(SimpleNamespace(), {"quantization": None})
    assert not other.active and len(calls) == 2
