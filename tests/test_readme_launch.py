"""The README's launch line, and each speculation mode's flags put in place of NGRAM's, parse with
SGLang 0.5.17's own argument parser (the plugin's backend among its choices, no abbreviations): a
misspelt flag, or a value outside a flag's choices, fails here rather than on a user's server.
Values without choices (backend names of the draft, warm-up names) are asserted as well."""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.server_args", reason="SGLang is not installed")

import sm120_workbook.patches as plugin  # noqa: E402
from sm120_workbook.patches import warmup  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
LAUNCHER = ["python", "-m", "sglang.launch_server"]
NGRAM_FLAGS = ("--speculative-algorithm", "--speculative-num-draft-tokens")


def _after(text: str, marker: str) -> str:
    assert marker in text, f"README.md no longer has {marker!r}; update tests/test_readme_launch.py"
    return text[text.index(marker):]


def launch_line() -> list[str]:
    """The arguments of the first launch command under "Using the backend in SGLang"."""
    text = _after(_after(README.read_text(), "## Using the backend in SGLang"), " ".join(LAUNCHER))
    command = []
    for line in text.splitlines():   # up to the first line without a continuation
        line = line.rstrip()
        command.append(line.removesuffix("\\"))
        if not line.endswith("\\"):
            break
    words = shlex.split(" ".join(command), comments=True)
    assert words[:3] == LAUNCHER, words
    return words[3:]


def speculation_lines() -> dict[str, list[list[str]]]:
    """Each bullet after "Other speculation goes in place of NGRAM's two flags": its name (up to
    the first colon) and its flag sets, the first backticked span alone and then with each later
    one (an option the bullet adds, e.g. a Llama head's draft backend)."""
    text = _after(README.read_text(), "Other speculation goes in place of NGRAM's two flags")
    bullets = re.split(r"\n- ", text[:text.index("\n\n")])[1:]
    lines = {}
    for b in bullets:
        spans = [shlex.split(s) for s in re.findall(r"`([^`]+)`", b) if s.startswith("--")]
        assert spans, f"no flags in the README bullet {b[:60]!r}"
        lines[b.split(":")[0]] = [spans[0]] + [spans[0] + extra for extra in spans[1:]]
    return lines


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
    assert ns.warmups == warmup.WARMUP_NAME


def test_each_speculation_modes_flags_parse_in_place_of_ngrams(parser):
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    lines = speculation_lines()
    base = without_ngram(launch_line())
    parsed = [parser.parse_args(base + flags) for variants in lines.values() for flags in variants]
    assert sorted({ns.speculative_algorithm for ns in parsed}) == ["DFLASH", "EAGLE", "EAGLE3"], lines
    for ns in parsed:   # a draft backend has no argparse choices: it must be one SGLang knows
        assert ns.speculative_draft_attention_backend in (None, *ATTENTION_BACKEND_CHOICES), ns
    eagle3 = [ns for ns in parsed if ns.speculative_algorithm == "EAGLE3"]
    assert [ns.speculative_draft_attention_backend for ns in eagle3] == [None, "flashinfer"]   # + a Llama head's
