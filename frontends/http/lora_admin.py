"""Run-time LoRA adapter loading: vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Loading an adapter reads files named by the client, so these are admin operations (vLLM calls
run-time LoRA loading "not a secure operation"): the routes exist only with --enable-admin, and
with --admin-api-key they need that key, exactly as the AllSpark life-cycle RPCs do
(frontends/common/access.py): a missing or wrong key is 401, the plain API key is 403. The path
must lie under --model-root (the engine refuses anything else: 403).

Bodies and success answers are vLLM's: `{"lora_name", "lora_path"}` → 200 text
"Success: LoRA adapter 'X' added successfully."; `{"lora_name", "lora_int_id"?}` → 200 text
"Success: LoRA adapter 'X' removed successfully." (`lora_int_id` is accepted and unused, as in
vLLM: names identify adapters). Errors go through the app's one mapping (OpenAI envelope): a
missing field or a malformed adapter 400, an unknown adapter 404, a name already loaded 409, no
free slot 429, a path outside --model-root 403.
"""
from __future__ import annotations

import logging
from typing import Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse

from frontends.common.access import AccessPolicy
from frontends.http.openai_schema import _Strict, field_error
from jax_engine.api import EngineAPI
from jax_engine.errors import AlreadyExists, EngineError, NotFound, PermissionDenied

log = logging.getLogger("xlaserve.http")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


class LoadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_path: str
    load_inplace: bool = False    # vLLM: replace an adapter of that name; refused unless false


class UnloadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_int_id: Optional[int] = None   # vLLM accepts it and identifies the adapter by name


_RESPONSES: dict = {
    400: {"description": "a missing or empty field, or not a usable PEFT adapter (names why)"},
    401: {"description": "missing or wrong (admin) API key"},
    403: {"description": "needs the admin API key, or the path is outside --model-root"},
    404: {"description": "unknown adapter (unload)"},
    409: {"description": "an adapter of that name is already loaded"},
    429: {"description": "every adapter slot is in use (--max-loras)"},
}


def add_lora_admin_routes(app: FastAPI, *, api_key: Optional[str] = None, admin_api_key: Optional[str] = None) -> None:
    """Mount the two routes (the caller does so only with --enable-admin)."""
    app.state.lora_admin_policy = AccessPolicy(api_key=api_key, admin_api_key=admin_api_key, enable_admin=True)
    app.include_router(router)


async def _require_admin(request: Request) -> None:
    """The admin rule of the gRPC front and the JSON mirror (AccessPolicy), for these routes;
    a dependency, so it is decided before the body is validated."""
    refusal = request.app.state.lora_admin_policy.check(request.url.path, request.headers.get("authorization"), admin=True)
    if refusal is not None:
        raise refusal


router = APIRouter(prefix="/v1", tags=["admin: LoRA adapters"], dependencies=[Depends(_require_admin)])


def _named(err: EngineError, param: str) -> EngineError:
    err.param = param  # type: ignore[attr-defined]
    return err


def _engine(request: Request) -> EngineAPI:
    return request.app.state.engine


@router.post("/load_lora_adapter", response_class=PlainTextResponse, responses=_RESPONSES)
async def load_lora_adapter(request: Request, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
    """Load the PEFT adapter folder `lora_path` (under --model-root) as `lora_name` onto the
    default generation model; requests then name it as their `model`."""
    if not body.lora_name.strip():
        raise field_error("lora_name", "lora_name must not be empty")
    if not body.lora_path.strip():
        raise field_error("lora_path", "lora_path must not be empty")
    if body.load_inplace:
        raise field_error("load_inplace", "load_inplace=true is not supported: unload the adapter, then load it")
    try:
        info = await _engine(request).load_adapter(body.lora_name, body.lora_path)
    except AlreadyExists as e:
        raise _named(e, "lora_name") from None
    except PermissionDenied as e:  # outside --model-root
        raise _named(e, "lora_path") from None
    log.info("LoRA adapter %s loaded from %s onto %s (rank %d)", info.name, info.path, info.model, info.rank)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=_RESPONSES)
async def unload_lora_adapter(request: Request, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
    """Unload adapter `lora_name`: new requests for it are refused at once (404), the ones
    already running finish first, then its slot is free."""
    if not body.lora_name.strip():
        raise field_error("lora_name", "lora_name must not be empty")
    try:
        await _engine(request).unload_adapter(body.lora_name)
    except NotFound as e:
        raise _named(e, "lora_name") from None
    log.info("LoRA adapter %s unloaded", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
