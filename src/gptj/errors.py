"""User-facing errors.

A `GptjError` is something the user can act on (a bad path, a bad tensor, a bad
flag). The CLI prints its message as one line and exits non-zero; tracebacks are
shown only with --debug.
"""


class GptjError(Exception):
    """An error caused by user input: printed as one line, no traceback."""


class CheckpointError(GptjError):
    """A checkpoint is missing, malformed, or does not match the config."""


class ConfigError(GptjError):
    """A config is not a GPT-J config, or has invalid values."""


class UsageError(GptjError):
    """A flag or setting that can never work (an empty secret): one line, exit code 2 as argparse's."""
