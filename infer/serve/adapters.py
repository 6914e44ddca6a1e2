"""Adapters served as models of their own (vLLM's shapes): each LoRA adapter is listed in /v1/models
with its base model as `parent`, and a request that names it in `model` runs on the base model's
engine with that adapter, in the same steps as the base model's requests.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}  (+ "model": its base)
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Both are behind --api-key, and answer 404 unless the server was started with
--allow-runtime-lora-updating. A load reads the adapter's folder in the engine's process, so a bad one
is a 400 that names the problem, before any request runs with it. An unloaded adapter's requests
still running finish; those that name it afterwards get a 404, as for any model not served.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from infer.api.adapters import LoRARequest
from infer.serve.errors import APIError

if TYPE_CHECKING:
    from infer.serve.served import ServedModel

__all__ = ["install", "LoadLoRAAdapter", "UnloadLoRAAdapter"]

FLAG = "--allow-runtime-lora-updating"


class LoadLoRAAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    model: str | None = None  # the base model it runs on; None: the only one served


class UnloadLoRAAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; the name alone decides


class AdapterNames:
    """The adapters served, by name (`Models.adapters`), and the ids given to them."""

    def __init__(self) -> None:
        self.served: dict[str, ServedModel] = {}
        self.pending: set[str] = set()  # names being loaded now: a second load of one is refused
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        """An id no adapter served here has had (preloaded ones took theirs from --lora-modules)."""
        taken = {m.lora.lora_int_id for m in self.served.values() if m.lora is not None}
        while (i := next(self._ids)) in taken:
            pass
        return i


def add_adapter(lora: LoRARequest, engine: Any) -> None:
    """On the engine's thread (module-level: it crosses to the engine's process)."""
    engine.add_adapter(lora)


def remove_adapter(name: str, engine: Any) -> bool:
    return engine.remove_adapter(name)


async def replay(models: Any, engine: Any) -> list[str]:
    """After `engine` was built again (--restart-engine): serve there the adapters the server lists for it
    (those of --lora-modules are served already, those loaded at runtime not). One that cannot be read
    now stops being listed; returns their names."""
    dropped = []
    for name, served in list(models.adapters.served.items()):
        if served.engine is not engine or served.lora is None:
            continue
        try:
            await engine.call(functools.partial(add_adapter, served.lora))
        except Exception:  # its folder went: requests naming it get the 404 of a model not served
            del models.adapters.served[name]
            dropped.append(name)
    return dropped


def install(app: FastAPI, models: Any, guarded: list[Any], allowed: bool, errors: dict[int | str, Any]) -> None:
    """The two routes over `models` (the app's `Models`, whose `adapters` they change)."""

    def check_allowed() -> None:
        if not allowed:
            raise APIError(
                404,
                f"loading and unloading adapters at runtime is off on this server: start it with {FLAG}",
                "not_found_error",
                code="not_enabled",
            )

    done = {200: {"description": "vLLM's success line", "content": {"text/plain": {"schema": {"type": "string"}}}}}

    @app.post("/v1/load_lora_adapter", dependencies=guarded, response_model=None, responses={**done, **errors})
    async def load_lora_adapter(req: LoadLoRAAdapter) -> PlainTextResponse:
        check_allowed()
        base = models.named(req.model)
        if base.lora is not None:
            raise APIError(400, f"{req.model!r} is an adapter: name its base model ({base.parent})", param="model")
        name = req.lora_name
        if name in models or name in models.adapters.served or name in models.adapters.pending:
            raise APIError(
                400,
                f"a model named {name!r} is served already: unload it first, or pick another name",
                param="lora_name",
            )
        lora = LoRARequest(name, models.adapters.next_id(), req.lora_path)
        models.adapters.pending.add(name)
        try:
            await base.engine.call(functools.partial(add_adapter, lora))
        finally:
            models.adapters.pending.discard(name)
        models.adapters.served[name] = base.adapter(lora)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=guarded, response_model=None, responses={**done, **errors})
    async def unload_lora_adapter(req: UnloadLoRAAdapter) -> PlainTextResponse:
        check_allowed()
        served = models.adapters.served.get(req.lora_name)
        if served is None:
            raise APIError(
                404,
                f"no adapter named {req.lora_name!r} is served here: GET /v1/models lists them",
                "not_found_error",
                param="lora_name",
                code="model_not_found",
            )
        del models.adapters.served[req.lora_name]  # new requests for it are refused from now on
        await served.engine.call(functools.partial(remove_adapter, req.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
