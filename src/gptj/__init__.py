"""gptj: an exact, fast GPT-J 6B in PyTorch."""

__version__ = "0.1.0"
