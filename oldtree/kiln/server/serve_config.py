"""``ServeConfig``: what ``kiln serve`` was asked for (address, API key, limits, replicas, routing,
admission, adapters, disaggregation, API servers), passed as JSON data to the processes it starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .children import StartedProcesses, scheduler_name, start_processes
from .router import RouterOptions
from .tokenizer_manager import Admission


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str = "model"
    max_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    drain_timeout: float = 30.0
    log_level: str = "info"
    tool_call_parser: str | None = None  # None: the one the chat template implies
    grpc_port: int | None = None  # also serve kiln.proto's gRPC API on this port
    engine: dict[str, Any] = field(default_factory=dict)  # EngineOptions fields
    dp: int = 1                                            # data-parallel replicas
    router: RouterOptions = RouterOptions()
    admission: Admission = Admission()                     # the queue limit (--max-queued-requests)
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA adapters served from the start, by name
    # Prefill/decode disaggregation (server/disaggregation.py): "null" (off), "prefill" or "decode".
    disaggregation_mode: str = "null"
    bootstrap_port: int = 8998   # the prefill side's KV handoff port
    api_server_count: int = 1    # HTTP processes sharing the port (--api-server-count)
    stream_interval: int = 1     # a running sample's tokens leave the scheduler every this many (--stream-interval)

    def scheduler_name(self, replica: int) -> str:
        return scheduler_name(replica, self.dp)

    def start_processes(self, artifact: str) -> StartedProcesses | None:
        """Binds the port and starts the children (None when the port is busy; the reason logged)."""
        return start_processes(artifact, self.host, self.port, self.dp, self.engine, self.lora_modules,
                               self.log_level, self.disaggregation_mode, self.bootstrap_port, self.api_server_count,
                               self.stream_interval)

    def to_json(self) -> dict[str, Any]:
        """Everything but the API key (which must not show in a command line), as JSON data."""
        return {**asdict(self), "api_key": None}

    @staticmethod
    def from_json(data: dict[str, Any], api_key: str | None) -> "ServeConfig":
        return ServeConfig(**{**data, "api_key": api_key, "router": RouterOptions(**data["router"]),
                              "admission": Admission(**data["admission"])})
