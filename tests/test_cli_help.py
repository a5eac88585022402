"""Every flag of every ``aiolayer`` command says what it does, and --help shows its default; the top-level
--help lists the commands without importing what they need to run."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import aiolayer
from aiolayer import cli

from helpers_node import node_env


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser, _ = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_version_is_printed_without_a_subcommand(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"aiolayer {aiolayer.__version__}"


def test_every_command_is_there():
    assert {"node", "bench", "proxy"} <= set(_subcommands())


@pytest.mark.parametrize("name", ["node", "bench", "proxy"])
def test_every_flag_has_help_and_help_shows_defaults(name):
    command = _subcommands()[name]
    assert command.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    silent = [a.option_strings for a in command._actions
              if a.option_strings and not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not silent, f"aiolayer {name}: flags without help: {silent}"
    text = command.format_help()
    assert "(default:" in text


def test_top_level_help_lists_every_command_without_importing_torch():
    """``aiolayer --help`` loads no command's run-time needs (the benchmark's torch took it from 0.6 s to 2.8 s)."""
    code = ("import sys\nfrom aiolayer.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=node_env())
    assert done.returncode == 0, done.stderr
    assert all(name in done.stdout for name in ("node", "doctor", "bench", "proxy")), done.stdout
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout
