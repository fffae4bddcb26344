"""LoRA adapters over HTTP, in vLLM's shapes: ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``,
``POST /v1/unload_lora_adapter {"lora_name"}`` (behind the API key like every route), and the
adapters a request may name as its ``model`` (``ServerAdapters``).

The HTTP process checks an adapter itself (``load_adapter`` against the artifact's LoRA layout), so
a bad one is a 400 naming what is wrong before any scheduler sees it; then every replica's
scheduler loads it (``LORA_LOAD``; a scheduler takes the loads among the messages waiting for it
before their requests, so a request sent after the answer finds it loaded, also through another API
server). With several API servers (``--api-server-count``) the one asked tells the others, and
answers once every one of them lists the adapter. Unloading an unknown name is a 404; requests in
flight with an unloaded adapter finish (``runtime.lora.registry``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from kiln.lora_layout import LoraLayout

from . import ipc
from .errors import APIError, invalid
from .peers import Peers
from .tokenizer_manager import TokenizerManager


class LoadLoraRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients may send it; names identify adapters here


@dataclass
class ServerAdapters:
    """The adapters this server serves, by name (their PEFT directories), and the layout they must fit."""

    layout: LoraLayout | None
    paths: dict[str, str] = field(default_factory=dict)

    def check(self, name: str, path: str) -> None:
        if self.layout is None:
            raise invalid("lora_path", "this artifact has no LoRA slots; compile or serve it with --max-loras N")
        if name in self.paths:
            raise invalid("lora_name", f"an adapter named {name!r} is already loaded; unload it first")
        # Imported here: the adapter reader needs torch, which the HTTP process otherwise never loads.
        import torch

        from kiln.runtime.lora.adapter import AdapterError, load_adapter

        try:
            load_adapter(path, self.layout, torch.float32)
        except AdapterError as exc:
            raise invalid("lora_path", str(exc)) from None

    def unknown(self, name: str, base: str) -> APIError:
        served = ", ".join([base, *self.paths])
        return APIError(404, f"The model `{name}` does not exist (this server serves {served})", param="model",
                        code="model_not_found")


def add_lora_routes(app: FastAPI, manager: TokenizerManager, adapters: ServerAdapters, base: str,
                    peers: Peers) -> None:
    peers.answer(ipc.LORA_LOAD, adapters.paths.__setitem__)
    peers.answer(ipc.LORA_UNLOAD, lambda name: adapters.paths.pop(name, None))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest) -> JSONResponse:
        if not body.lora_name or body.lora_name == base:
            raise invalid("lora_name", f"lora_name must be a name other than the base model's ({base!r})")
        adapters.check(body.lora_name, body.lora_path)
        adapters.paths[body.lora_name] = body.lora_path
        manager.broadcast([ipc.LORA_LOAD, body.lora_name, body.lora_path])
        await peers.ask_all(ipc.LORA_LOAD, body.lora_name, body.lora_path)
        return JSONResponse({"status": "ok", "message": f"Success: LoRA adapter '{body.lora_name}' added successfully."})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest) -> JSONResponse:
        if body.lora_name not in adapters.paths:
            raise adapters.unknown(body.lora_name, base)
        del adapters.paths[body.lora_name]
        manager.broadcast([ipc.LORA_UNLOAD, body.lora_name])
        await peers.ask_all(ipc.LORA_UNLOAD, body.lora_name)
        return JSONResponse({"status": "ok", "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully."})
