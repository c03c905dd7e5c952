"""gptj's model server: OpenAI's completions API over the engine (see gptj.serve.app)."""

from gptj.serve.registry import ServerConfig

__all__ = ["ServerConfig", "ray_api"]


def ray_api():  # noqa: ANN201 - the module gptj.serve.ray_serve
    """gptj.serve.ray_serve, or a one-line GptjError if Ray Serve is not installed."""
    try:
        from gptj.serve import ray_serve as module
    except ImportError as e:
        if (e.name or "").split(".")[0] != "ray":
            raise
        from gptj.errors import GptjError

        raise GptjError("Ray Serve is not installed: pip install -e \".[ray]\" (or pip install \"ray[serve]\")") from None
    return module
