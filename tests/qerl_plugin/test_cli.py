"""The ``qerl`` dispatcher: subcommands from a table, imported only when chosen, failing one at a time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from qerl_plugin import cli


@pytest.fixture
def fake_commands(tmp_path, monkeypatch):
    """Subcommand modules on disk: one that works, one that raises at import, one that does not exist."""
    (tmp_path / "qerl_fake_ok.py").write_text(
        textwrap.dedent(
            '''
            """A fake subcommand.

            Its docstring becomes the --help description."""
            def add_arguments(parser):
                parser.add_argument("what", choices=["ok", "value", "runtime", "interrupt", "code"])
            def run(args):
                if args.what == "value":
                    raise ValueError("bad input x.safetensors: do this instead\\nsecond line")
                if args.what == "runtime":
                    raise RuntimeError("kernel exploded")
                if args.what == "interrupt":
                    raise KeyboardInterrupt
                print("ran", args.what)
                return 3 if args.what == "code" else 0
            '''
        )
    )
    (tmp_path / "qerl_fake_broken.py").write_text("raise RuntimeError('needs a GPU library')\n")
    (tmp_path / "qerl_fake_incomplete.py").write_text("def run(args):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    table = dict(cli.SUBCOMMANDS)
    table["ok"] = ("qerl_fake_ok", "a working command", "nothing")
    table["broken"] = ("qerl_fake_broken", "a command that cannot import", "a GPU library")
    table["absent"] = ("qerl_fake_absent", "a command whose module is missing", "vLLM and a CUDA GPU")
    table["incomplete"] = ("qerl_fake_incomplete", "a module without add_arguments", "nothing")
    monkeypatch.setattr(cli, "SUBCOMMANDS", table)
    for name in ("qerl_fake_ok", "qerl_fake_broken", "qerl_fake_absent", "qerl_fake_incomplete"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_help_lists_every_command_and_imports_none(fake_commands, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("quantize", "doctor", "bench", "train", "ok", "broken", "absent"):
        assert name in out
    assert "qerl_fake_ok" not in sys.modules and "qerl_fake_broken" not in sys.modules


def test_help_does_not_import_heavy_modules():
    code = (
        "import sys, contextlib, io\n"
        "from qerl_plugin.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        "print(sorted(m for m in ('vllm', 'verl', 'vllm_ext.bench', 'verl_ext.train', 'qerl_plugin.quantize', 'torch') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_version(capsys):
    from qerl_plugin import __version__

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"qerl-plugin {__version__}"


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["frobnicate"])
    assert e.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_dispatch_and_return_code(fake_commands, capsys):
    assert cli.main(["ok", "ok"]) == 0
    assert capsys.readouterr().out == "ran ok\n"
    assert cli.main(["ok", "code"]) == 3


def test_subcommand_help_uses_the_module_docstring(fake_commands, capsys):
    with pytest.raises(SystemExit):
        cli.main(["ok", "--help"])
    out = capsys.readouterr().out
    assert "Its docstring becomes the --help description." in out and "--debug" in out


def test_value_error_is_one_line(fake_commands, capsys):
    assert cli.main(["ok", "value"]) == 1
    err = capsys.readouterr().err
    assert err == "qerl ok: error: bad input x.safetensors: do this instead\n"


def test_other_errors_name_their_type_and_point_to_debug(fake_commands, capsys):
    assert cli.main(["ok", "runtime"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["qerl ok: error: RuntimeError: kernel exploded", "(run with --debug for the traceback)"]


@pytest.mark.parametrize("argv", [["--debug", "ok", "runtime"], ["ok", "runtime", "--debug"]])
def test_debug_prints_the_traceback(fake_commands, capsys, argv):
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: kernel exploded" in err


def test_interrupt(fake_commands, capsys):
    assert cli.main(["ok", "interrupt"]) == 130
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name,module,why",
    [
        ("broken", "qerl_fake_broken", "RuntimeError: needs a GPU library"),
        ("absent", "qerl_fake_absent", "ModuleNotFoundError: No module named 'qerl_fake_absent'"),
        ("incomplete", "qerl_fake_incomplete", "lacks add_arguments(parser) / run(args)"),
    ],
)
def test_unavailable_subcommand_fails_alone(fake_commands, capsys, name, module, why):
    assert cli.main([name, "--some", "args"]) == 1
    err = capsys.readouterr().err
    assert f"qerl {name} is unavailable: module {module} could not be imported" in err and why in err
    assert "qerl doctor" in err
    with pytest.raises(SystemExit) as e:  # its --help explains the same
        cli.main([name, "--help"])
    assert e.value.code == 0 and f"module {module}" in capsys.readouterr().out
    assert cli.main(["ok", "ok"]) == 0  # the others still work
    with pytest.raises(SystemExit) as e:
        cli.main(["quantize", "--help"])
    assert e.value.code == 0 and "--max-shard-size" in capsys.readouterr().out


def test_unavailable_subcommand_with_debug_shows_the_import_traceback(fake_commands, capsys):
    assert cli.main(["broken", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and 'qerl_fake_broken.py", line 1' in err and "RuntimeError: needs a GPU library" in err


def test_real_table_points_at_the_agreed_modules():
    assert {k: v[0] for k, v in cli.SUBCOMMANDS.items()} == {
        "quantize": "qerl_plugin.quantize_cli",
        "doctor": "qerl_plugin.doctor",
        "bench": "vllm_ext.bench",
        "train": "verl_ext.train",
        "export": "verl_ext.export",
        "eval": "qerl_plugin.evaluate",
        "plot": "qerl_plugin.plot",
    }
    for name in ("quantize", "doctor", "eval", "plot", "export"):
        mod = cli._load(name)
        assert callable(mod.add_arguments) and callable(mod.run), name
