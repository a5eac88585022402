"""The spellings ``aiolayer bench`` had before its subcommands (``--scenario NAME``, ``--engine vllm`` with
``--engine-*`` options), still accepted for one release: turned into the new ones with a line on stderr."""

from __future__ import annotations

import sys

from typing import Collection

ENGINE_PREFIX = "--engine-"


def _take(words: list[str], flag: str) -> tuple[str | None, list[str]]:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``) and the words without it; None when absent."""
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return words[i + 1], words[:i] + words[i + 2:]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1], words[:i] + words[i + 1:]
    return None, words


def old_spellings(words: list[str], scenarios: Collection[str]) -> list[str]:
    """``words`` with ``--engine vllm`` or ``--scenario NAME`` (NAME one of ``scenarios``) turned into that
    subcommand; anything else is left for the parser to refuse."""
    engine, rest = _take(words, "--engine")
    if engine == "vllm":
        print("aiolayer bench: --engine vllm is deprecated, use `aiolayer bench vllm` (its options without the "
              "--engine- prefix)", file=sys.stderr)
        return ["vllm", *("--" + w[len(ENGINE_PREFIX):] if w.startswith(ENGINE_PREFIX) else w for w in rest)]
    scenario, rest = _take(words, "--scenario")
    if scenario is not None and scenario in scenarios:
        print(f"aiolayer bench: --scenario {scenario} is deprecated, use `aiolayer bench {scenario}`", file=sys.stderr)
        return [scenario, *rest]
    return words
