"""The FastAPI app: routes, API key, body size limit, and errors in the OpenAI shape.

Request bodies are read and validated here (not by FastAPI's automatic parsing) so that every
failure is a 400/413 in the OpenAI error shape naming the field.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import tandem
from tandem.server import protocol
from tandem.server.drain import Drain, shutting_down
from tandem.server.errors import OpenAIError, bad_request, from_validation_error
from tandem.server.json_body import parse_body
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tandem.server.replicas import ReplicaSet
from tandem.server.serving import OpenAIServing

logger = logging.getLogger(__name__)


def build_app(replicas: ReplicaSet, tokenizer, model_name: str, api_key: str | None = None,
              max_queued_requests: int | None = None, max_request_bytes: int = 16 << 20,
              on_ready=None, drain: Drain | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """`replicas` are started by the app's lifespan (and shut down with it); `on_ready(info)` is
    called once every engine core is up; `drain` (server/drain.py) is set off by the server's signal
    handler."""
    drain = drain or Drain(0.0)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        info = await replicas.start()
        metrics = ServerMetrics(replicas.statuses, info.speculative_algorithm is not None)
        state["metrics"] = metrics
        state["serving"] = OpenAIServing(replicas, metrics, tokenizer, model_name, max_queued_requests, drain,
                                         tool_call_parser)
        if on_ready is not None:
            on_ready(info)
        try:
            yield
        finally:
            logger.info("shutting down: stopping the engine core%s", "s" if len(replicas.replicas) > 1 else "")
            await replicas.shutdown()

    # With an API key, the schema and docs pages are served by the key-checked router below.
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="tandem", lifespan=lifespan, **docs)
    app.router.route_class = CatchAllRoute

    def key_ok(request: Request) -> bool:
        if api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())

    async def check_api_key(request: Request) -> None:
        if not key_ok(request):
            raise OpenAIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request, model: type[BaseModel]):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_bytes:
            raise _too_large(int(length), max_request_bytes)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                raise _too_large(size, max_request_bytes)
            chunks.append(chunk)
        # Parsing and validating a large body takes a while: off the event loop, like tokenising.
        return await asyncio.to_thread(_parse_and_validate, b"".join(chunks), model)

    @app.get("/health")
    async def health(request: Request):
        # 200 while any replica serves (a load balancer must not take out a server that still
        # answers), "degraded" when some are gone; 503 only when none is left. Without the API key
        # (when one is set) only the status: process ids, reasons and queues are not for anyone.
        if drain.started:
            raise shutting_down()
        states = replicas.states()
        serving = [s for s in states if s["state"] == "serving"]
        if not serving:
            detail = f": {replicas.dead_reason}" if key_ok(request) else ""
            raise OpenAIError(503, f"the engine is not available{detail}", code="engine_unavailable")
        status = "ok" if len(serving) == len(states) else "degraded"
        if not key_ok(request):
            return {"status": status, "replicas": [{"replica": s["replica"], "state": s["state"]} for s in states]}
        pids = replicas.pids
        return {"status": status, "model": model_name, "engine_pid": pids[0], "engine_pids": pids,
                "queued_requests": replicas.num_queued, "replicas": states}

    api = APIRouter(dependencies=[Depends(check_api_key)], route_class=CatchAllRoute)

    @api.get("/metrics")
    async def metrics():
        return Response(state["metrics"].render(), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(model_name, replicas)]}

    @api.get("/v1/models/{model:path}")
    async def model(model: str):
        state["serving"].check_model(model)
        return _model_card(model_name, replicas)

    @api.post("/v1/completions")
    async def completions(request: Request):
        req = await read_body(request, CompletionRequest)
        return await state["serving"].completions(req, request)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_body(request, ChatCompletionRequest)
        return await state["serving"].chat(req, request)

    if api_key is not None:
        @api.get("/openapi.json", include_in_schema=False)
        async def openapi():
            return JSONResponse(app.openapi())

        @api.get("/docs", include_in_schema=False)
        async def swagger():
            return get_swagger_ui_html(openapi_url="/openapi.json", title="tandem")

        @api.get("/redoc", include_in_schema=False)
        async def redoc():
            return get_redoc_html(openapi_url="/openapi.json", title="tandem")

    @api.post("/tokenize")
    async def tokenize(request: Request):
        return await state["serving"].tokenize(await read_body(request, TokenizeRequest))

    @api.post("/detokenize")
    async def detokenize(request: Request):
        return await state["serving"].detokenize(await read_body(request, DetokenizeRequest))

    @api.get("/version")
    async def version():
        return {"version": tandem.__version__}

    @api.post("/flush_cache")  # SGLang's name
    @api.post("/reset_prefix_cache")  # vLLM's
    async def flush_cache():
        return await state["serving"].flush_cache()

    app.include_router(api)
    app.openapi = lambda: _openapi(app)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        err = bad_request(str(e.errors()[0].get("msg", e)) if e.errors() else str(e))
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(OpenAIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    return app


class CatchAllRoute(APIRoute):
    """The last resort: an exception no handler expected becomes a 500 in the OpenAI shape here, inside
    the route. (An `exception_handler(Exception)` answers too, but Starlette re-raises the exception
    after it, and uvicorn then drops the keep-alive connection, so the client's next request on it
    fails as well.)"""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request):
            try:
                return await handler(request)
            except (OpenAIError, StarletteHTTPException, RequestValidationError):
                raise  # answered by their exception handlers
            except Exception as e:  # noqa: BLE001
                logger.exception("unhandled error on %s", request.url.path)
                return JSONResponse(internal_error(e).body(), status_code=500)

        return guarded


def internal_error(e: Exception) -> OpenAIError:
    return OpenAIError(500, f"internal server error: {type(e).__name__}")


# Request bodies are read by hand (read_body), so FastAPI cannot see their models: the schema names
# them here, from the same pydantic models that validate them.
REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
# And what they answer (non-streamed; a stream is text/event-stream of chunks in the same shapes).
RESPONSE_BODIES = {("/v1/completions", "post"): protocol.CompletionResponse,
                   ("/v1/chat/completions", "post"): protocol.ChatCompletionResponse,
                   ("/tokenize", "post"): protocol.TokenizeResponse, ("/detokenize", "post"): protocol.DetokenizeResponse,
                   ("/v1/models", "get"): protocol.ModelList, ("/v1/models/{model}", "get"): protocol.ModelCard,
                   ("/version", "get"): protocol.VersionResponse}


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=tandem.__version__, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})

    def ref(model) -> dict:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"description": "an error in OpenAI's shape, naming the field", "content": {
        "application/json": {"schema": ref(protocol.ErrorResponse)}}}
    stream = {"schema": {"type": "string", "description": "server-sent events: `data: {chunk}` lines, then "
                                                          "`data: [DONE]`"}}
    for (path, method), model in RESPONSE_BODIES.items():
        op = schema["paths"].get(path, {}).get(method)
        if op is not None:
            content = {"application/json": {"schema": ref(model)}}
            if path.startswith("/v1/") and method == "post":
                content["text/event-stream"] = stream  # "stream": true
            op["responses"] = {"200": {"description": "OK", "content": content},
                               "400": error, "401": error, "404": error, "503": error}
    for path, model in REQUEST_BODIES.items():
        schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                        "content": {"application/json": {"schema": ref(model)}}}
    metrics = schema["paths"].get("/metrics", {}).get("get")
    if metrics is not None:
        metrics["responses"] = {"200": {"description": "Prometheus text format",
                                        "content": {"text/plain": {"schema": {"type": "string"}}}}}
    app.openapi_schema = schema
    return schema


def _parse_and_validate(raw: bytes, model: type[BaseModel]):
    data = parse_body(raw)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None
    except RecursionError:  # (parse_body bounds the depth; this is the last line of defence)
        raise bad_request("the request body is nested too deeply") from None


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"the request body has {size} bytes or more; the limit is {limit} bytes "
                            "(--max-request-bytes)", code="request_too_large")


def _model_card(model_name: str, replicas: ReplicaSet) -> dict:
    return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "tandem",
            "max_model_len": replicas.info.max_model_len if replicas.info else None}
