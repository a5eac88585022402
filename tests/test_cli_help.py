"""Every flag of every ``aiolayer`` command says what it does, and --help shows its default."""

from __future__ import annotations

import argparse

import pytest

import aiolayer
from aiolayer import cli


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
