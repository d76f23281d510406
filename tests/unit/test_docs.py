"""The user's documents hold no dead link, no command or flag the CLI lacks, and no development
history; the README stays a page a newcomer reads in minutes."""
from __future__ import annotations

import argparse
import glob
import os
import re
import shlex

import pytest

from moeflow.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USER_DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
ALL_DOCS = USER_DOCS + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "results", "**",
                                                                                            "*.md"), recursive=True))
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)
_REPO_PATH = re.compile(r"^(?:docs|configs|moeflow|tests|verify)/[\w./*{},-]*(?:\.\w+|/)$")  # a file or a folder


def _read(doc: str) -> str:
    with open(os.path.join(ROOT, doc)) as f:
        return f.read()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for a in parser._actions for opt in a.option_strings}


def _moeflow_commands(text: str) -> list[str]:
    """Every ``moeflow ...`` command line in code spans and blocks (continuation lines joined)."""
    spans = []
    for block, inline in _CODE.findall(text):
        spans += block.replace("\\\n", " ").splitlines() if block else [inline]
    out = []
    for span in spans:
        for m in re.finditer(r"(?:^|[\s(;&|])moeflow ([a-z][\w-]*(?=\s|$)(?: [^#;|&`]*)?)", span):
            before = span[:m.start()].split()
            if before and before[-1] in ("from", "import"):  # Python, not a command line
                continue
            if ":" in " ".join(m.group(1).split()[:2]):  # a command's printed header, not a command line
                continue
            out.append(m.group(1).strip())
    return out


def _check_command(parser: argparse.ArgumentParser, words: list[str], whole: bool = False) -> str | None:
    """None when ``words`` (after ``moeflow``) names a command the parser has, with flags it knows;
    ``whole``: a complete command line to copy, which must also hold every required flag."""
    subs = _subparsers(parser)
    if subs:
        if not words:  # the group itself ("`moeflow bench` commands")
            return None
        if words[0] not in subs:
            return f"no command {words[0] if words else ''!r} (commands: {sorted(subs)})"
        return _check_command(subs[words[0]], words[1:], whole)
    known, given = _flags(parser), {w.split("=")[0] for w in words if w.startswith("--")}
    bad = sorted(given - known)
    if bad:
        return f"unknown flags {bad}"
    missing = [a.option_strings[0] for a in parser._actions if a.required and a.option_strings
               and not set(a.option_strings) & given]
    return f"missing required flags {missing}" if whole and missing else None


@pytest.mark.parametrize("doc", ALL_DOCS)
def test_every_link_and_named_file_exists(doc):
    text, here = _read(doc), os.path.dirname(os.path.join(ROOT, doc))
    dead = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+://|^#|^mailto:", target):
            continue
        path = target.split("#")[0]
        if path and not os.path.exists(os.path.join(here, path)):
            dead.append(target)
    for block, inline in _CODE.findall(text):
        token = inline.strip()
        if inline and _REPO_PATH.match(token) and not any(c in token for c in "*{"):
            if not (os.path.exists(os.path.join(ROOT, token)) or os.path.exists(os.path.join(here, token))):
                dead.append(token)
    assert not dead, f"{doc}: dead links or paths {dead}"


@pytest.mark.parametrize("doc", ALL_DOCS)
def test_every_command_shown_is_one_the_cli_has(doc):
    parser, wrong = build_parser(), []
    for line in _moeflow_commands(_read(doc)):
        try:
            words = shlex.split(line.replace("...", " "))
        except ValueError:
            words = line.split()
        words = [w for w in words if not re.match(r"^[\[\]|]+$", w)]
        words = [w.strip("[]") for w in words]
        # a line with two flags or more and no "..." is one to copy as it stands (one flag: prose naming it)
        whole = "..." not in line and "…" not in line and sum(w.startswith("--") for w in words) >= 2
        problem = _check_command(parser, words, whole)
        if problem:
            wrong.append(f"moeflow {line}: {problem}")
    assert not wrong, f"{doc}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("doc", USER_DOCS)
def test_user_docs_carry_no_development_history(doc):
    text = _read(doc)
    history = re.findall(r".{0,40}(?:\bsessions? \d|session-\d|\.\./shared).{0,40}", text)
    assert not history, f"{doc} speaks of development history or paths outside the repository: {history}"


def test_the_readme_is_short_and_starts_with_the_two_commands():
    text = _read("README.md")
    assert len(text.encode()) <= 8192, f"README.md is {len(text.encode())} bytes; move detail to docs/"
    first_block = text.split("```")[1]
    assert "make run" in first_block and "make test" in first_block
