"""qerl_plugin.notices: a warning per key and process, shared by the vLLM and verl extensions."""

from __future__ import annotations

import logging

import pytest

from qerl_plugin import notices


def test_each_key_is_logged_once_until_forgotten(caplog):
    log = logging.getLogger("qerl.test.notices")
    notices.forget("test/")
    with caplog.at_level("WARNING", logger="qerl.test.notices"):
        assert notices.warn_once(log, "test/a", "first %s", "a") is True
        assert notices.warn_once(log, "test/a", "first %s", "again") is False
        assert notices.warn_once(log, "test/b", "second") is True
        notices.forget("test/a")
        assert notices.warn_once(log, "test/a", "after forget") is True
    assert [r.getMessage() for r in caplog.records] == ["first a", "second", "after forget"]
    notices.forget("test/")


def test_the_extensions_keys_do_not_silence_each_other(caplog):
    """vllm_ext.nvfp4_backends and verl_ext.verify both call their helper with bare keys; the same key in each is
    logged once in each, on each module's own logger."""
    pytest.importorskip("vllm")
    pytest.importorskip("verl")
    from verl_ext import verify
    from vllm_ext import nvfp4_backends

    key = "test shared key"
    notices.forget(nvfp4_backends.NOTICE_PREFIX + key)
    notices.forget("verify/" + key)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            nvfp4_backends.warn_once(key, "from nvfp4")
            verify.warn_once(key, "from verify")
    assert sorted((r.name, r.getMessage()) for r in caplog.records) == sorted([
        (nvfp4_backends.logger.name, "from nvfp4"), (verify.logger.name, "from verify")])
