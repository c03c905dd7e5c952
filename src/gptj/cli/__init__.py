"""The `gptj` command: subcommands map flags onto the typed configs.

One module per family of commands, each adding its own with `register(sub)` and running them with
its `cmd_*` functions (each the parser's `func`; its docstring is the command's --help
description): checkpoint (init, convert, calibrate), generate, mlperf (mlperf, submission,
evaluate), quality (quant-report, compare), serve (serve, publish, unpublish, ls), train
(prepare-data, train), tokens (tokenize, detokenize); `bench` is gptj.bench.latency's. Here: the
parser they share, and `main`, which runs a command and says how it ended.

User errors (GptjError) print one line and exit 1; --debug shows tracebacks.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
from collections.abc import Sequence

from gptj.cli import checkpoint, generate, mlperf, quality, serve, tokens, train
from gptj.cli.generate import generate_setup
from gptj.cli.mlperf import EXIT_CHECKER_ERRORS, EXIT_NOT_A_RESULT, mlperf_config
from gptj.cli.quality import EXIT_DIFFER
from gptj.cli.serve import _server_config
from gptj.errors import GptjError, UsageError

# gptj.cli's names: its entry points, its exit codes and the configs its commands build (tests use them)
__all__ = ["EXIT_BROKEN_PIPE", "EXIT_CHECKER_ERRORS", "EXIT_DIFFER", "EXIT_NOT_A_RESULT", "EXIT_USAGE",
           "EXIT_USER_ERROR", "_server_config", "build_parser", "generate_setup", "main", "mlperf_config"]

EXIT_USER_ERROR = 1
EXIT_USAGE = 2  # a flag that can never work (argparse's code too)
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command that SIGPIPE ended

# Commands that choose their own thread count (they keep cores for threads beside the compute).
_OWN_THREADS = ("mlperf", "serve", "publish")


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not hit the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default, "(default: X)", unless its help already says it or it has none
    worth showing (None; a switch that takes no value: its stored constant is no default a reader can
    use — `--no-x (default: True)` reads as if the flag were on — so its help says it in words)."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        return bool(action.option_strings) and action.default not in (None, False, argparse.SUPPRESS) \
            and action.nargs != 0 and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if self._shows_default(action) and "default" not in text and text != argparse.SUPPRESS:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump), exit code 2, and shows defaults."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - argparse's
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from gptj import __version__
    from gptj.bench.latency import add_bench_parser

    parser = _Parser(prog="gptj", description="An exact, fast GPT-J 6B.")
    parser.add_argument("--version", action="version", version=f"gptj {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    # in this order --help lists them
    for register in (checkpoint.register, generate.register, mlperf.register, add_bench_parser, quality.register,
                     serve.register, train.register, tokens.register):
        register(sub)
    return parser


def _resolve_secrets(args: argparse.Namespace) -> None:
    """--api-key and --admin-token, wherever a command has them: the flag, else its environment
    variable (gptj.serve.auth); an empty or blank one is refused here, in one line (exit 2)."""
    from gptj.serve.auth import ADMIN_TOKEN_ENV, API_KEY_ENV, secret

    for name, env in (("api_key", API_KEY_ENV), ("admin_token", ADMIN_TOKEN_ENV)):
        if name in vars(args):
            setattr(args, name, secret(getattr(args, name), f"--{name.replace('_', '-')}", env))


def _exit_now(code: int) -> None:
    """End the process now, its output flushed, without the interpreter's teardown: after a drained
    server stops, freeing the model's tensors, torch's and OpenMP's state one object at a time took
    0.9 s of a 1.1 s exit on SIGTERM for the tiny model (more for bigger ones), and there is nothing
    left to save (the drain answered every request; no file is open for writing)."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is not None and "argv" in vars(args) and args.argv is None:
        args.argv = ["gptj", *argv]  # the command a run records (run.json, a submission's README)
    try:
        _resolve_secrets(args)
        if getattr(args, "threads", None) is not None and args.command not in _OWN_THREADS:
            from gptj.threads import set_threads

            set_threads(args.threads)
        code = args.func(args)
        if argv is None and args.command == "serve" and not args.ray:
            _exit_now(code)  # the `gptj` command: a drained server ends here
        return code
    except GptjError as e:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"gptj {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, UsageError) else EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"gptj {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`gptj tokenize ... | head`): stop quietly, as `cat` does
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except MemoryError:
        print(f"gptj {args.command}: error: out of memory (try --dtype bfloat16)", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as e:  # noqa: BLE001 - a bug, not user input: one line unless --debug
        if args.debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"gptj {args.command}: internal error: {type(e).__name__}: {msg} (rerun with --debug for details)",
              file=sys.stderr)
        return 2
