"""gptj: an exact, fast GPT-J 6B in PyTorch."""

__version__ = "0.1.0"  # pyproject.toml reads it (one home)
# The name gptj is installed by (PyPI's `gptj` is an unrelated API client); the import package and the
# `gptj` command keep the short name.
DISTRIBUTION = "gptj-engine"
