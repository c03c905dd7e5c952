"""What every benchmark script shares: `--smoke`, a tiny size that checks the script runs (CI runs
each script so, tests/test_benchmarks.py), not a measurement. Not a script itself (the leading
underscore keeps it out of that test's list)."""

from __future__ import annotations

import argparse


def _flag_text(name: str, value: object) -> str:
    shown = " ".join(map(str, value)) if isinstance(value, list) else value
    return f"--{name.replace('_', '-')}" if value is True else f"--{name.replace('_', '-')} {shown}"


def parse_args(parser: argparse.ArgumentParser, smoke: dict, argv: list[str] | None = None) -> argparse.Namespace:
    """Add --smoke to `parser` and parse `argv`: with --smoke, `smoke`'s values are the defaults
    (flags given on the command line still win)."""
    parser.add_argument("--smoke", action="store_true",
                        help="a check that the script runs, not a measurement: "
                             + " ".join(_flag_text(k, v) for k, v in smoke.items()) + " (flags given still win)")
    if parser.parse_known_args(argv)[0].smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)
