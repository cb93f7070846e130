"""qerl_plugin.options: the one bool parser, the engine options read from additional_config, and that the
module stays free of torch, vLLM and verl (vLLM's plugin entry point reads it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qerl_plugin import options


@pytest.mark.parametrize("value, expected", [
    (True, True), (False, False), (1, True), (0, False), ("true", True), (" Yes ", True), ("ON", True), ("1", True),
    ("false", False), ("no", False), ("off", False), ("0", False),
])
def test_parse_bool(value, expected):
    assert options.parse_bool(value, "x") is expected


@pytest.mark.parametrize("value", ["maybe", "", 2, None, 1.0, [True]])
def test_parse_bool_refuses_naming_the_key(value):
    with pytest.raises(ValueError, match=r"^a\.b: expected true or false, got "):
        options.parse_bool(value, "a.b")


def test_aqn_switch_is_the_additional_config_key():
    assert options.engine_config(aqn=True) == {"qerl_aqn": True}
    assert options.engine_config(aqn=False) == {}
    assert options.aqn_enabled({"qerl_aqn": True}) and options.aqn_enabled({"qerl_aqn": "1"})
    assert not options.aqn_enabled(None) and not options.aqn_enabled({}) and not options.aqn_enabled({"qerl_aqn": False})
    assert options.aqn_enabled(json.loads('{"qerl_aqn": true}'))  # as `vllm serve --additional-config` gives it
    with pytest.raises(ValueError, match=r"additional_config\['qerl_aqn'\]: expected true or false, got 'maybe'"):
        options.aqn_enabled({"qerl_aqn": "maybe"})


def test_nvfp4_options():
    assert options.nvfp4_options(None) == {} and options.nvfp4_options({"other": 1}) == {}
    got = options.nvfp4_options({"qerl_nvfp4": {"backend": "Marlin", "fp32_reduce": "false"}})
    assert got == {"backend": "marlin", "fp32_reduce": False}
    assert options.nvfp4_options({"qerl_nvfp4": {"decode_gemv": "1"}}) == {"decode_gemv": "all"}
    with pytest.raises(ValueError,
                       match="decode_gemv: expected off, small, all or shared .or true / false., got 'often'"):
        options.nvfp4_options({"qerl_nvfp4": {"decode_gemv": "often"}})
    with pytest.raises(ValueError, match="backend='cutlass': expected auto, marlin, humming or emulation"):
        options.nvfp4_options({"qerl_nvfp4": {"backend": "cutlass"}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['tile'\]"):
        options.nvfp4_options({"qerl_nvfp4": {"tile": 64}})
    with pytest.raises(ValueError, match="expected a mapping"):
        options.nvfp4_options({"qerl_nvfp4": "marlin"})


def test_options_upstream_and_notices_import_nothing_heavy():
    code = (
        "import json, sys\n"
        "import qerl_plugin.options, qerl_plugin.upstream, qerl_plugin.notices\n"
        "print(json.dumps(sorted(m for m in ('torch', 'vllm', 'verl', 'compressed_tensors') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("value, mode", [(True, "all"), (False, "off"), ("on", "all"), ("0", "off"), (1, "all"),
                                         ("Small", "small"), (" ALL ", "all"), ("off", "off"), ("Shared", "shared")])
def test_decode_gemv_modes(value, mode):
    """decode_gemv: off / small / all / shared, or a bool as before the small mode (true: every layer the checkpoint
    layout's kernel takes)."""
    assert options.parse_decode_gemv(value, "x") == mode
    assert options.nvfp4_options({"qerl_nvfp4": {"decode_gemv": value}}) == {"decode_gemv": mode}
    assert set(options.DECODE_GEMV_MODES) == {"off", "small", "all", "shared"}
    with pytest.raises(ValueError, match=r"QERL_NVFP4_DECODE_GEMV: expected off, small, all or shared \(or true / "
                                         r"false\), "
                                         r"got 2"):
        options.parse_decode_gemv(2, "QERL_NVFP4_DECODE_GEMV")
