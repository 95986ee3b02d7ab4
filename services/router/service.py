"""The router's HTTP API: OpenAI-compatible endpoints plus /health and /metrics, thin routes over the serving
object (`serving`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmesh.wire.errors import Forbidden, InvalidRequest, MeshError, ModelNotFound
from llmesh.wire.messages import ROLES, Detokenized, DetokenizeTokens, LoraCommand, Tokenized

from .asgi import BodyLimit, BodyRoute, CountedRequests
from .auth import ApiKey, KeyRing
from .dispatch import Dispatcher
from .metrics import RouterMetrics
from .parsed_output import OutputParsers
from .registry import WorkerRegistry
from .responses import ResponsesRequest, ResponseStore, page
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    validation_error,
)
from .serving import OpenAIServing

UNCOUNTED = ("/health", "/metrics")  # probes' and scrapers' paths, left out of the request count (as vLLM's)


def create_app(
    dispatcher: Dispatcher,
    registry: WorkerRegistry,
    metrics: RouterMetrics,
    request_timeout_s: float,
    keys: KeyRing | None = None,
    output_parsers: OutputParsers | None = None,
    max_request_bytes: int = 16 * 2**20,
    response_store: ResponseStore | None = None,
    admin_keys: KeyRing | None = None,
) -> FastAPI:
    """The router's app; with `keys`, every /v1 endpoint needs one of them (/health and /metrics,
    for probes and scrapers, do not: bind them to a private address, as vLLM's server does).
    `output_parsers`: the catalogue's parsers of tool calls and reasoning (none: tool_choice "auto" is refused);
    a body over `max_request_bytes` is a 413; `response_store`: where /v1/responses keeps responses (none: not
    kept); `admin_keys`: the admin endpoints' (none: they are closed)."""
    app = FastAPI(title="llmesh router", version="0.1.0")
    keyring = keys or KeyRing(())
    stored = response_store or ResponseStore("", 0)
    serving = OpenAIServing(
        dispatcher, registry, metrics, request_timeout_s, output_parsers or OutputParsers((), Path()), stored
    )

    async def api_key(request: Request) -> ApiKey | None:  # async: FastAPI runs a plain def in its thread pool
        return keyring.admit(request.headers.get("authorization"))

    async def admin_key(request: Request) -> ApiKey | None:
        if admin_keys is None or not admin_keys.enabled:
            raise Forbidden(
                "The admin endpoints are closed: give the router admin keys (MESH_ADMIN_API_KEYS, or the "
                "secrets' admin-api-keys)."
            )
        return admin_keys.admit(request.headers.get("authorization"))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return serving.refused(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = InvalidRequest(str(exc.detail))
        err.http_status = exc.status_code
        return serving.refused(err)

    @app.exception_handler(MeshError)
    async def on_mesh_error(request: Request, exc: MeshError) -> JSONResponse:
        return serving.refused(exc)

    app.add_middleware(BodyLimit, limit=max_request_bytes, refused=serving.refused)
    # outside the body limit: it counts its refusals too
    app.add_middleware(CountedRequests, requests=metrics.requests, routes=app.router.routes, uncounted=UNCOUNTED)

    # the generation routes first (the fewest routes a request's path is matched against), without FastAPI's
    # generic dependency solving (`BodyRoute`)
    generating = APIRouter(route_class=BodyRoute)

    @generating.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, key: ApiKey | None = Depends(api_key)) -> Response:
        return await serving.generate(request, body, key)

    @generating.post("/v1/chat/completions")
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, key: ApiKey | None = Depends(api_key)
    ) -> Response:
        return await serving.generate(request, body, key)

    @generating.post("/v1/responses")
    async def create_response(
        body: ResponsesRequest, request: Request, key: ApiKey | None = Depends(api_key)
    ) -> Response:
        """OpenAI's Responses API, over the chat path (`responses`)."""
        return await serving.respond(request, body, key)

    app.include_router(generating)

    @app.get("/health")
    async def health() -> JSONResponse:
        counts = {role: len(registry.live(role)) for role in ROLES}
        ok = bool(registry.served())
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "workers": counts, "models": registry.models()},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        for role in ROLES:
            metrics.workers.labels(role).set(len(registry.live(role)))
        metrics.set_request_states(registry.models())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(api_key)])
    async def models() -> dict[str, Any]:
        """vLLM's model cards; `max_model_len` where a live worker has told it (null: none serves it now)."""
        context: dict[str, int] = {}
        for worker in registry.live():
            context[worker.model] = min(context.get(worker.model, worker.max_model_len), worker.max_model_len)
        cards = [
            {"id": m, "object": "model", "created": 0, "owned_by": "llmesh", "root": m, "max_model_len": context.get(m)}
            for m in registry.models()
        ]
        cards += [  # (vLLM's cards of LoRA adapters: their folder as `root`, their model as `parent`)
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "llmesh",
                "root": adapter.path,
                "parent": model,
                "max_model_len": context.get(model),
            }
            for name, (model, adapter) in sorted(registry.adapters().items())
        ]
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(admin_key)])
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        """vLLM's: load a LoRA adapter on every live worker of its model (the mesh's only one, unless
        `base_model_name` names it), which serve it from then on (as does any that gets a request for it)."""
        model = model_named(body.base_model_name)
        if registry.knows(body.lora_name) or body.lora_name in registry.adapters():
            raise InvalidRequest(f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
        await dispatcher.command_adapter(model, LoraCommand(op="load", adapter=body.adapter()))
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(admin_key)])
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        adapted = registry.adapters().get(body.lora_name)
        if adapted is None:
            raise ModelNotFound(f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name")
        model, adapter = adapted
        await dispatcher.command_adapter(model, LoraCommand(op="unload", adapter=adapter))
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    def model_named(name: str | None) -> str:
        """A request's model (a LoRA adapter's: the model it adapts); where it names none (vLLM's tokenizer
        endpoints allow that), the mesh's only one."""
        if name is not None:
            return registry.resolve(name)[0]
        if len(known := registry.models()) != 1:
            raise InvalidRequest(f"`model` is required: the mesh has {', '.join(known) or 'none'}", param="model")
        return known[0]

    @app.post("/tokenize", dependencies=[Depends(api_key)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """The prompt's token ids as a generation of the same fields gets them (vLLM's /tokenize): a worker
        of the model renders and tokenizes it."""
        tokenized = await dispatcher.ask_tokenizer(body.query(model_named(body.model)), Tokenized)
        return {
            "count": len(tokenized.tokens),
            "max_model_len": tokenized.max_model_len,
            "tokens": tokenized.tokens,
            "token_strs": tokenized.token_strs,
        }

    @app.post("/detokenize", dependencies=[Depends(api_key)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        query = DetokenizeTokens(model=model_named(body.model), tokens=body.tokens)
        detokenized = await dispatcher.ask_tokenizer(query, Detokenized)
        return {"prompt": detokenized.text}

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, key: ApiKey | None = Depends(api_key)) -> dict[str, Any]:
        response: dict[str, Any] = (await stored.record(response_id, key.name if key else ""))["response"]
        return response

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        key: ApiKey | None = Depends(api_key),
    ) -> dict[str, Any]:
        """A stored response's input items (OpenAI's list, newest first by default)."""
        items = (await stored.record(response_id, key.name if key else ""))["input_items"]
        return page(items, after, limit, order)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, key: ApiKey | None = Depends(api_key)) -> dict[str, Any]:
        await stored.delete(response_id, key.name if key else "")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return app
