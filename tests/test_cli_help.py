"""Every flag of every ``aiolayer`` command says what it does, and --help shows its default; the top-level
--help lists the commands without importing what they need to run."""

from __future__ import annotations

import argparse
import re
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


def _bench_subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every ``aiolayer bench`` subcommand with its options (added only to the one that runs, so here by hand)."""
    bench = _subcommands()["bench"]
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.populate(name) for name in sub.choices}


def _command(name: str) -> argparse.ArgumentParser:
    words = name.split()
    return _bench_subcommands()[words[1]] if len(words) > 1 else _subcommands()[name]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for a in parser._actions for flag in a.option_strings}


BENCHMARKS = ("transfer", "faults", "scale", "soak", "vllm")
# Flags that belong to one benchmark alone (--out, the shape flags, --decode-ranks... are shared).
# --link-gbit means the same in the two benchmarks that measure across a shaped link: transfer's two hosts
# and vllm's engine rows.
OWN_FLAGS = {"transfer": {"--modes", "--warmup", "--layer-ms", "--sweep", "--sweep-tokens", "--two-hosts",
                          "--link-gbit"},
             "faults": set(),
             "scale": {"--prefill-ranks", "--kv-layout", "--against-whole-blocks", "--no-gc-freeze"},
             "soak": {"--fault-rate"},
             "vllm": {"--rows", "--layers", "--prompts", "--concurrency", "--max-tokens", "--cores", "--eager",
                      "--link-gbit", "--prompt-lengths"}}


def test_every_command_is_there():
    assert {"node", "bench", "proxy"} <= set(_subcommands())
    assert set(_bench_subcommands()) == set(BENCHMARKS)


@pytest.mark.parametrize("name", ["node", *(f"bench {b}" for b in BENCHMARKS), "proxy"])
def test_every_flag_has_help_and_help_shows_defaults(name):
    command = _command(name)
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


@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_benchmark_has_its_own_flags_and_none_of_the_others(name):
    flags = _flags(_bench_subcommands()[name])
    others = set().union(*(own for other, own in OWN_FLAGS.items() if other != name)) - OWN_FLAGS[name]
    assert OWN_FLAGS[name] <= flags and not flags & others, sorted(flags & others)
    assert "--scenario" not in flags and "--engine" not in flags
    assert not any(flag.startswith("--engine-") for flag in flags)
    if name == "faults":   # its shape and deadlines are its own: only where to write
        assert flags == {"-h", "--help", "--out"}


def _help(*words: str) -> tuple[str, bool]:
    """``aiolayer WORDS --help``'s text, and whether it imported torch."""
    code = (f"import sys\nfrom aiolayer.cli import main\ntry:\n    main({[*words, '--help']!r})\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=node_env())
    assert done.returncode == 0, done.stderr
    *text, torch = done.stdout.strip().splitlines()
    return "\n".join(text), torch == "True"


def test_bench_help_lists_the_benchmarks_without_importing_torch():
    text, torch = _help("bench")
    assert all(f"    {name}  " in text for name in BENCHMARKS), text
    assert "--modes" not in text and "--rows" not in text and not torch


def test_a_benchmark_help_shows_its_flags_only():
    text, torch = _help("bench", "faults")
    assert "--out" in text and not re.search(r"--(rows|modes|fault-rate|prefill-ranks)\b", text), text
    assert not torch
    text, _ = _help("bench", "vllm")
    assert re.search(r"--rows\b", text) and "--engine-" not in text and "--modes" not in text, text
