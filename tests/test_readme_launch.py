"""The README's launch line, and each speculation mode's flags put in place of NGRAM's, parse with
SGLang 0.5.17's own argument parser (the plugin's backend among its choices): a misspelt flag or
value in what users copy fails here, not on their server."""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.server_args", reason="SGLang is not installed")

import sm120_workbook.patches as plugin  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
NGRAM_FLAGS = ("--speculative-algorithm", "--speculative-num-draft-tokens")


def launch_line() -> list[str]:
    """The arguments of the first `python -m sglang.launch_server` under "Using the backend"."""
    text = README.read_text()
    text = text[text.index("## Using the backend in SGLang"):]
    text = text[text.index("python -m sglang.launch_server"):]
    words = []
    for line in text.splitlines():
        code = line.split("  #")[0].rstrip()
        words += shlex.split(code.rstrip("\\"))
        if not code.endswith("\\"):
            break
    return words[3:]


def speculation_flags() -> dict[str, list[str]]:
    """Each bullet after "Other speculation goes in place of NGRAM's two flags": its name (up to
    the first colon) and the flags of its backticked spans."""
    text = README.read_text()
    start = text.index("Other speculation goes in place of NGRAM's two flags")
    bullets = re.split(r"\n- ", text[start:text.index("\n\n", start)])[1:]
    return {b.split(":")[0]: [w for span in re.findall(r"`([^`]+)`", b) if span.startswith("--")
                              for w in shlex.split(span)] for b in bullets}


def without_ngram(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in NGRAM_FLAGS:
            skip = True
        else:
            out.append(a)
    return out


@pytest.fixture
def parser():
    from sglang.srt.server_args import ServerArgs

    registered = plugin.register_backend()
    p = argparse.ArgumentParser(allow_abbrev=False)   # the README spells flags in full
    ServerArgs.add_cli_args(p)
    yield p
    if registered:
        plugin.unregister_backend()


def test_the_launch_line_parses(parser):
    ns = parser.parse_args(launch_line())
    assert (ns.attention_backend, ns.decode_attention_backend) == ("flashinfer", "sm120_mla")
    assert ns.speculative_attention_mode == "decode" and ns.speculative_algorithm == "NGRAM"
    assert ns.warmups == "sm120_long_prompt"


def test_each_speculation_modes_flags_parse_in_place_of_ngrams(parser):
    modes = speculation_flags()
    parsed = {name: parser.parse_args(without_ngram(launch_line()) + flags) for name, flags in modes.items()}
    assert sorted(ns.speculative_algorithm for ns in parsed.values()) == ["DFLASH", "EAGLE", "EAGLE3"], modes
    llama = [ns for ns in parsed.values() if ns.speculative_algorithm == "EAGLE3"][0]
    assert llama.speculative_draft_attention_backend == "flashinfer"   # the Llama head's flag
