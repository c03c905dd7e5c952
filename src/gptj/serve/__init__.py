"""gptj's model server: OpenAI's completions API over the engine (see gptj.serve.app)."""

from gptj.serve.registry import ServerConfig

__all__ = ["ServerConfig"]
