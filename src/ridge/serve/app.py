"""The OpenAI-compatible HTTP server: FastAPI over an AsyncEngine.

Every request is tokenized and checked in the event loop, before it reaches the engine core
(serve/gateway.py); a bad one gets OpenAI's error envelope with a 4xx status and changes nothing
(serve/errors.py). The routes themselves are serve/routes.py's.
"""

from __future__ import annotations

from fastapi import FastAPI

import ridge
from ridge.engine.async_engine import AsyncEngine
from ridge.serve.errors import BearerAuth, BodyLimit, JsonOnly, answer_errors_in_the_envelope, document_errors
from ridge.serve.gateway import Gateway, ServerConfig
from ridge.serve.kv_transfer import IMPORT_PATH
from ridge.serve.metrics import EngineMetrics
from ridge.serve.routes import Routes

__all__ = ["ServerConfig", "build_app"]


def build_app(engine: AsyncEngine, metrics: EngineMetrics, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="ridge", version=ridge.__version__)
    binary = {IMPORT_PATH} if config.role == "decode" else set()  # KV blocks: raw bytes, as large as a prompt's KV
    app.add_middleware(JsonOnly, binary_paths=binary)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, unlimited_paths=binary)
    if config.api_key:  # outermost: nothing but /health (and /metrics, if asked) answers without the key
        open_paths = {"/health"} | ({"/metrics"} if config.metrics_no_auth else set())
        app.add_middleware(BearerAuth, api_key=config.api_key, open_paths=open_paths)
    answer_errors_in_the_envelope(app)
    document_errors(app)
    routes = Routes(Gateway(engine, config), metrics)
    app.state.gateway = routes.gateway  # for tests and diagnostics in the server's process
    app.get("/health")(routes.health)
    app.get("/version")(routes.version)
    app.get("/metrics")(routes.prometheus)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{model_id:path}")(routes.model)  # :path: model names may hold slashes
    app.get("/tokenizer_info")(routes.tokenizer_info)
    app.post("/tokenize")(routes.tokenize)
    app.post("/detokenize")(routes.detokenize)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.post("/v1/responses")(routes.responses)
    app.post("/v1/embeddings")(routes.embeddings)
    for path in ("/score", "/v1/score"):  # vLLM's paths
        app.post(path)(routes.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):  # Jina's, Cohere's v1 and v2
        app.post(path)(routes.rerank)
    app.post("/classify")(routes.classify)
    if config.role == "decode":
        app.post(IMPORT_PATH)(routes.kv_import)
    if config.allow_runtime_lora_updating:
        app.post("/v1/load_lora_adapter")(routes.load_lora_adapter)
        app.post("/v1/unload_lora_adapter")(routes.unload_lora_adapter)
    return app
