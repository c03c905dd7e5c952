"""Continuous batching engine: requests, KV slots, and the schedule -> run -> update step."""

from gptj.engine.core import Engine, EngineConfig, Request
from gptj.engine.loop import EngineLoop, RequestHandle

__all__ = ["Engine", "EngineConfig", "EngineLoop", "Request", "RequestHandle"]
