"""``import verl`` loads qerl's verl extension (entry point ``verl.plugins: qerl = verl_ext``), cheaply.

verl's loader swallows import errors at DEBUG, so a broken plugin would be silent: each test runs a fresh
interpreter and checks the registration marker and the patch hook.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points


def _run(code: str, **env) -> dict:
    full_env = {**os.environ, **env}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )
    assert out.returncode == 0, f"child failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    last = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert last, f"no RESULT line in:\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}"
    return json.loads(last[-1][len("RESULT ") :])


def test_entry_point_points_at_verl_ext():
    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "qerl"]
    assert len(eps) == 1, "qerl-plugin's verl.plugins entry point is not installed (pip install -e .)"
    assert eps[0].value == "verl_ext"


def test_import_verl_registers_without_importing_vllm():
    r = _run(
        """
        import json, sys
        import verl
        mod = sys.modules.get("verl_ext")
        from verl_ext import patches
        print("RESULT " + json.dumps({
            "loaded": mod is not None,
            "registered": getattr(mod, "REGISTERED", None),
            "installed": getattr(mod, "PATCHES_INSTALLED", None),
            "vllm_imported": "vllm" in sys.modules,
            "finder_on_meta_path": any(type(f).__name__ == "_PostImportFinder" for f in sys.meta_path),
            "status": patches.STATUS,
        }))
        """
    )
    assert r["loaded"] and r["registered"] is True and r["installed"] is True
    assert r["vllm_imported"] is False, "registering qerl must not import vLLM on every `import verl`"
    assert r["finder_on_meta_path"], "the patch hook waits for verl's modules on sys.meta_path"
    assert set(r["status"].values()) <= {"pending", "applied"}, r["status"]


def test_targets_are_patched_when_verl_imports_them():
    """The hook patches a module as it is imported: the first importer already sees the wrapper."""
    r = _run(
        """
        import json, sys
        import verl
        from verl.utils.tracking import Tracking
        from verl.utils.config import validate_config       # bound by name, as main_ppo does
        print("RESULT " + json.dumps({
            "log": getattr(Tracking.log, "__qerl_patch__", None),
            "init": getattr(Tracking.__init__, "__qerl_patch__", None),
            "validate_config": getattr(validate_config, "__qerl_patch__", None),
        }))
        """
    )
    assert r["log"] == "verl.utils.tracking:Tracking.log"
    assert r["init"] == "verl.utils.tracking:Tracking.__init__"
    assert r["validate_config"] == "verl.utils.config:validate_config"


def test_plugins_none_skips_qerl_and_env_opt_out_installs_nothing():
    r = _run(
        """
        import json, sys
        import verl
        print("RESULT " + json.dumps({"loaded": "verl_ext" in sys.modules}))
        """,
        VERL_USE_EXTERNAL_PLUGINS="none",
    )
    assert r["loaded"] is False
    r = _run(
        """
        import json, sys
        import verl
        import verl_ext
        from verl.utils.tracking import Tracking
        print("RESULT " + json.dumps({"installed": verl_ext.PATCHES_INSTALLED,
                                      "patched": hasattr(Tracking.log, "__qerl_patch__")}))
        """,
        QERL_VERL_PATCHES="0",
    )
    assert r == {"installed": False, "patched": False}


def test_importing_verl_ext_twice_is_harmless():
    r = _run(
        """
        import importlib, json, sys
        import verl, verl_ext
        from verl_ext import patches
        patches.install(); patches.install()
        from verl.utils.tracking import Tracking
        first = Tracking.log
        patches.apply_all()
        print("RESULT " + json.dumps({
            "same": Tracking.log is first,
            "depth": sum(1 for _ in iter(lambda f=[Tracking.log]: (f.__setitem__(0, getattr(f[0], "__wrapped__", None)) or f[0]), None)),
            "finders": sum(type(f).__name__ == "_PostImportFinder" for f in sys.meta_path),
        }))
        """
    )
    assert r["same"] is True
    assert r["depth"] == 1, "Tracking.log must be wrapped exactly once"
    assert r["finders"] == 0, "the hook removes itself once every target is patched"
