"""`tandem serve`: starts the engine core processes (one per data-parallel replica), then the HTTP
front end (uvicorn)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 16 << 20
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # requests in flight get this long after SIGTERM (server/drain.py)
GRACEFUL_SHUTDOWN_S = 5  # then uvicorn's own close of the connections


@dataclass(frozen=True)
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the model path (or "tandem-demo")
    # Requests sent to the engine with no token back yet; None: the default (serving.default_queue_limit),
    # 0: unlimited.
    max_queued_requests: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    log_level: str = "INFO"
    tool_call_parser: str | None = None  # structured/tool_parsers.FORMATS; None: from the chat template
    load_balance_method: str = "cache_aware"  # data parallelism: server/replicas.LOAD_BALANCE_METHODS

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535] (got {self.port})")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0 (got {self.max_queued_requests}; 0: unlimited)")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1 (got {self.max_request_bytes})")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds (got {self.shutdown_timeout})")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")


def run_server(args: ServerArgs, engine_kwargs: dict) -> int:
    """Serves until SIGTERM / Ctrl-C; returns the exit status."""
    import uvicorn

    from tandem.demo import is_demo, with_demo_pair
    from tandem.engine.engine import EngineArgs
    from tandem.named_models import named_model, with_named_model
    from tandem.server.app import build_app
    from tandem.server.drain import Drain, DrainingServer
    from tandem.server.replicas import ReplicaSet
    from tandem.tokenizer import load_tokenizer

    model_path = engine_kwargs.get("model_path")
    model_name = args.served_model_name or ("tandem-demo" if is_demo(model_path) else model_path)
    if is_demo(model_path):
        # The bundled pair: the target with its EAGLE-3 head, as Engine() does.
        engine_kwargs = dict(vars(with_demo_pair(EngineArgs(**engine_kwargs))))
        model_path = engine_kwargs["model_path"]
        logger.info("serving the bundled demo pair (%s)", model_path)
    elif named_model(model_path) is not None:  # pulled once here, before the replicas start, not by each
        engine_kwargs = dict(vars(with_named_model(EngineArgs(**engine_kwargs))))
        model_path = engine_kwargs["model_path"]

    dp_size = engine_kwargs.get("dp_size", 1)
    replicas = ReplicaSet.spawn(engine_kwargs, args.log_level,  # ValueError before any process starts
                                args.load_balance_method)
    logger.info("starting %s for %s", f"{dp_size} engine core replicas" if dp_size > 1 else "the engine core",
                model_path)
    replicas.launch()
    try:
        logger.info("loading the tokenizer")
        tokenizer = load_tokenizer(engine_kwargs.get("tokenizer_path") or model_path)
        url = f"http://{args.host}:{args.port}"

        def on_ready(info) -> None:
            for replica in replicas.replicas:
                i = replica.info
                logger.info("%s ready (pid %d): context length %d, %d KV pages of %d tokens%s", replica.name, i.pid,
                            i.max_model_len, i.num_pages, i.page_size,
                            f", speculative {i.speculative_algorithm}" if i.speculative_algorithm else "")
            logger.info("serving %r at %s/v1 (OpenAI-compatible; /health, /metrics)%s", model_name, url,
                        "; API key required" if args.api_key else "")

        drain = Drain(args.shutdown_timeout)
        app = build_app(replicas, tokenizer, model_name, api_key=args.api_key,
                        max_queued_requests=args.max_queued_requests, max_request_bytes=args.max_request_bytes,
                        on_ready=on_ready, drain=drain, tool_call_parser=args.tool_call_parser)
        logger.info("waiting for the engine core to load the model")
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        server = DrainingServer(config, drain)
        server.run()
        return 0 if server.started else 1
    finally:
        replicas.kill()  # no-op after a normal shutdown; otherwise no orphaned engine cores
