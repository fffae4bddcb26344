"""What the routes share: the tokenizer manager, server state, metrics, the other API servers and
per-server settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import invalid
from .gate import ServerState
from .metrics import ServerMetrics
from .lora_routes import ServerAdapters
from .peers import Peers
from .tokenizer_manager import TokenizerManager


@dataclass(frozen=True)
class ServerContext:
    manager: TokenizerManager
    state: ServerState
    metrics: ServerMetrics
    max_n: int
    tool_call_parser: str = "hermes"  # how tool calls read in this model's output (--tool-call-parser)
    adapters: ServerAdapters = field(default_factory=lambda: ServerAdapters(None))  # LoRA adapters by name
    peers: Peers = field(default_factory=Peers)  # the server's other HTTP processes (--api-server-count)

    @property
    def model_name(self) -> str:
        return self.manager.info.name

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model, also when left out); a
        name of neither is a 404, as OpenAI answers."""
        if name is None or name == self.model_name:
            return None
        if name in self.adapters.paths:
            return name
        raise self.adapters.unknown(name, self.model_name)

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise invalid("n", f"n must be at most {self.max_n} (got {n})")
