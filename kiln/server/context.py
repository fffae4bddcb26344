"""What the routes share: the tokenizer manager, server state, metrics and per-server settings."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import APIError, invalid
from .gate import ServerState
from .metrics import ServerMetrics
from .tokenizer_manager import TokenizerManager


@dataclass(frozen=True)
class ServerContext:
    manager: TokenizerManager
    state: ServerState
    metrics: ServerMetrics
    max_n: int
    tool_call_parser: str = "hermes"  # how tool calls read in this model's output (--tool-call-parser)

    @property
    def model_name(self) -> str:
        return self.manager.info.name

    def check_model(self, name: str | None) -> None:
        """Requests may leave ``model`` out; one that names another model is a 404, as OpenAI answers."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`)",
                           param="model", code="model_not_found")

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise invalid("n", f"n must be at most {self.max_n} (got {n})")
