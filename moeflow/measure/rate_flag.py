"""``--request-rate``: the one spelling of "requests per second" on every command that takes a rate
(vLLM's, as ``bench serve`` has it). A command's older spelling (``--rps``, the demo's ``--rates``)
is still accepted, into the same place, with a one-line warning on stderr; giving both is refused."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


class DeprecatedFlag(argparse.Action):
    """An old spelling of a flag: stores what the new one would, and says so."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_request_rate(p: argparse.ArgumentParser, help: str, old: str = "--rps", type: Callable = str,
                     default: Any = None, metavar: str = "R[,R...]") -> None:
    """``--request-rate`` into ``args.request_rate``, and ``old`` as its deprecated spelling."""
    one_of = p.add_mutually_exclusive_group()
    one_of.add_argument("--request-rate", dest="request_rate", type=type, default=default, metavar=metavar, help=help)
    one_of.add_argument(old, dest="request_rate", type=type, default=default, metavar=metavar, action=DeprecatedFlag,
                        new="--request-rate", help=argparse.SUPPRESS)
