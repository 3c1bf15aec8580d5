"""`ridge router`: one OpenAI-compatible endpoint in front of N ridge servers of the same model.

cache-aware (the default): a request goes to the replica its prompt's leading characters hash to on a consistent
hash ring (cluster/hash_ring.py), so that requests sharing a system prompt or a conversation land where its KV is
cached; unless that replica has `balance_abs` more requests in flight than the least busy one and `balance_rel`
times as many, when the least busy one takes it (SGLang's router balances the same way). round-robin: each
replica in turn, the baseline.

A replica whose /health fails `unhealthy_after` times in a row leaves the ring (its keys go to the next replicas
on it, the others' stay) and comes back when it answers again; one that refuses a connection is taken out at
once. A request that never reached a replica (the connection refused, or a 503 before any work) is retried on
the next one; one that reached a replica which then failed is not (it may have run): it gets HTTP 502, or an error
event on a stream, naming the replica. Replicas are added and removed at run time (POST / DELETE /replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from ridge.cluster.hash_ring import HashRing, prefix_key
from ridge.cluster.router_config import POLICIES, RouterConfig  # noqa: F401 (the router's API)

log = logging.getLogger("ridge")



@dataclass
class Replica:
    url: str
    in_flight: int = 0
    healthy: bool = True
    failed_checks: int = 0  # health checks failed in a row
    sent: int = 0  # requests sent to it, retries included


@dataclass
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("ridge_router:requests", "Requests sent to a replica, by how it was chosen "
                                "(prefix: the prefix's ring owner; load: the least busy instead; round-robin; "
                                "retry: the next one after a replica that could not take it).",
                                ["replica", "routed"], registry=r)
        self.in_flight = Gauge("ridge_router:in_flight", "Requests in flight on a replica.", ["replica"], registry=r)
        self.healthy = Gauge("ridge_router:replica_healthy", "1 while the replica is in the ring.", ["replica"],
                             registry=r)
        self.retries = Counter("ridge_router:retries", "Requests a replica could not take, sent on to another.",
                               ["replica"], registry=r)
        self.failures = Counter("ridge_router:failures", "Requests that ended in an error the router returned.",
                                ["reason"], registry=r)
        self.prefix_routed = Gauge("ridge_router:prefix_routed_ratio", "Share of requests sent to their prefix's "
                                   "owner (cache-aware routing's hit routing rate).", registry=r)
        self.kv_bytes = Counter("ridge_router:kv_transfer_bytes", "KV bytes prefill servers pushed to decode servers "
                                "(disaggregated prefill), as they reported them.", registry=r)


class NotStarted(Exception):
    """A replica did not take the request: no work was done, another replica may run it."""


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.replicas = {url.rstrip("/"): Replica(url.rstrip("/")) for url in config.replicas}
        self.ring = HashRing(list(self.replicas))
        self.prefills = {url.rstrip("/"): Replica(url.rstrip("/")) for url in config.prefill}
        self.prefill_ring = HashRing(list(self.prefills))
        self.metrics = RouterMetrics()
        self.model: str | None = None
        self._turn = itertools.count()
        self._routed = {"prefix": 0, "all": 0}
        self.client: httpx.AsyncClient | None = None

    # ---- replicas ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """A client in this event loop; each replica answers /v1/models with the same model, or ValueError
        naming the replica."""
        if self.client is not None:
            await self.client.aclose()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.request_timeout_s, connect=5.0))
        self.model = None
        try:
            for url in [*self.replicas, *self.prefills]:
                self._same_model(url, await self._models(url))
                self.metrics.healthy.labels(url).set(1)
        except ValueError:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    async def _models(self, url: str) -> list[str]:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        try:
            response = await self.client.get(f"{url}/v1/models", headers=headers, timeout=10.0)
            response.raise_for_status()
            return sorted(m["id"] for m in response.json()["data"])
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise ValueError(f"replica: {url} does not answer /v1/models ({type(exc).__name__}: {exc})") from exc

    def _same_model(self, url: str, models: list[str]) -> None:
        if self.model is None:
            self.model = models[0] if models else None
        if models != [self.model]:
            raise ValueError(f"replica: {url} serves {', '.join(models) or 'no model'}, the others {self.model}; "
                             "every replica must serve the same model")

    async def add(self, url: str) -> None:
        url = url.rstrip("/")
        self._same_model(url, await self._models(url))
        self.replicas.setdefault(url, Replica(url))
        self._set_health(self.replicas[url], True)

    def remove(self, url: str) -> None:
        url = url.rstrip("/")
        if url not in self.replicas:
            raise KeyError(url)
        self.ring.remove(url)
        del self.replicas[url]
        self.metrics.healthy.remove(url)

    def _set_health(self, replica: Replica, healthy: bool) -> None:
        ring = self.prefill_ring if replica.url in self.prefills else self.ring
        if healthy:
            replica.failed_checks = 0
            ring.add(replica.url)
        else:
            ring.remove(replica.url)
        if healthy != replica.healthy:
            log.warning("ridge router: replica %s %s", replica.url, "is back" if healthy else "left the ring")
        replica.healthy = healthy
        self.metrics.healthy.labels(replica.url).set(int(healthy))

    async def health_loop(self) -> None:
        while True:
            for replica in [*self.replicas.values(), *self.prefills.values()]:
                try:
                    ok = (await self.client.get(f"{replica.url}/health", timeout=5.0)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                replica.failed_checks = 0 if ok else replica.failed_checks + 1
                if ok != replica.healthy and (ok or replica.failed_checks >= self.config.unhealthy_after):
                    self._set_health(replica, ok)
            await asyncio.sleep(self.config.health_interval_s)

    # ---- routing ----------------------------------------------------------------------------------
    def choose(self, body: dict, tried: set[str]) -> tuple[Replica, str]:
        """The replica for a request, and how it was chosen; LookupError where none is left to try."""
        healthy = [r for r in self.replicas.values() if r.healthy and r.url not in tried]
        if not healthy:
            raise LookupError("no healthy replica is left to take the request")
        if self.config.policy == "round-robin":
            ordered = sorted(healthy, key=lambda r: r.url)
            return ordered[next(self._turn) % len(ordered)], "round-robin"
        owner = next((self.replicas[u] for u in self.ring.owners(prefix_key(body, self.config.prefix_chars))
                      if u not in tried and u in self.replicas), healthy[0])
        least = min(healthy, key=lambda r: r.in_flight)
        busier = owner.in_flight - least.in_flight
        if busier > self.config.balance_abs and owner.in_flight > self.config.balance_rel * least.in_flight:
            return least, "load"
        return owner, "prefix"

    async def forward(self, request: Request, path: str, disaggregates: bool = True) -> Response:
        """Send the request to the replica its prompt's prefix hashes to (retrying another where one never took
        it); with prefill servers and `disaggregates`, through one of them first."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):  # the replicas answer a bad body as they do; any replica will do
            body = {}
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        tried: set[str] = set()
        while True:
            try:
                replica, how = self.choose(body, tried)
            except LookupError as exc:
                self.metrics.failures.labels("no_replica").inc()
                return _error(503, f"{exc} (tried {', '.join(sorted(tried)) or 'none'})")
            if tried:
                how = "retry"
            try:
                if (disaggregates and self.prefills
                        and (failed := await self._prefill(body, path, headers, replica)) is not None):
                    return failed
            except LookupError as exc:
                self.metrics.failures.labels("no_prefill").inc()
                return _error(503, str(exc))
            try:
                self._count(replica, how)
                return await self._send(replica, path, raw, headers, bool(body.get("stream")))
            except NotStarted as exc:
                log.warning("ridge router: %s did not take a request (%s); trying another", replica.url, exc)
                self.metrics.retries.labels(replica.url).inc()
                tried.add(replica.url)

    async def _prefill(self, body: dict, path: str, headers: dict, decode: Replica) -> Response | None:
        """Have a prefill server compute the prompt and push its KV to `decode` (None when it did; its error
        response, passed on, when it refused the request). LookupError where no prefill server could take it."""
        prefill = {**body, "max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": {"push_to": decode.url}}
        for name in ("stream_options", "min_tokens", "max_completion_tokens", "best_of"):
            prefill.pop(name, None)
        tried: set[str] = set()
        for url in self.prefill_ring.owners(prefix_key(body, self.config.prefix_chars)):
            replica = self.prefills[url]
            self.metrics.requests.labels(url, "prefill").inc()
            try:
                response = await self._send(replica, path, json.dumps(prefill).encode(), headers, stream=False)
            except NotStarted:
                tried.add(url)
                continue
            if response.status_code != 200:
                return response
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self.metrics.kv_bytes.inc(json.loads(response.body)["kv_transfer_params"]["bytes"])
            return None
        raise LookupError(f"no prefill server could take the request (tried {', '.join(sorted(tried)) or 'none'})")

    def _count(self, replica: Replica, how: str) -> None:
        self.metrics.requests.labels(replica.url, how).inc()
        replica.sent += 1
        self._routed["all"] += 1
        self._routed["prefix"] += how == "prefix"
        self.metrics.prefix_routed.set(self.prefix_routed_share)

    @property
    def prefix_routed_share(self) -> float:
        """The share of requests sent to their prefix's owner (cache-aware's hit routing rate)."""
        return self._routed["prefix"] / max(self._routed["all"], 1)

    async def _send(self, replica: Replica, path: str, raw: bytes, headers: dict, stream: bool) -> Response:
        self._enter(replica)
        try:
            response = await self.client.send(self.client.build_request("POST", replica.url + path, content=raw,
                                                                        headers=headers), stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached it
            self._leave(replica)
            self._set_health(replica, False)
            raise NotStarted(type(exc).__name__) from exc
        except httpx.HTTPError as exc:
            self._leave(replica)
            self.metrics.failures.labels("replica_failed").inc()
            return _error(502, f"replica {replica.url} failed while taking the request ({type(exc).__name__}); it "
                               "may have started it, so it was not retried")
        if response.status_code == 503:  # shutting down or not accepting: it did no work
            await response.aclose()
            self._leave(replica)
            raise NotStarted("HTTP 503")
        if not stream or response.status_code != 200:
            try:
                content = await response.aread()
            except httpx.HTTPError as exc:
                self.metrics.failures.labels("replica_failed").inc()
                return _error(502, f"replica {replica.url} failed mid-response ({type(exc).__name__}); not retried "
                                   "(it had started the request)")
            finally:
                await response.aclose()
                self._leave(replica)
            return Response(content, response.status_code, media_type=response.headers.get("content-type"))
        return StreamingResponse(self._relay(replica, response), media_type="text/event-stream")

    async def _relay(self, replica: Replica, response: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            self.metrics.failures.labels("replica_failed").inc()
            event = {"error": {"message": f"replica {replica.url} failed mid-stream ({type(exc).__name__}); not "
                                          "retried (it had started the request)", "type": "server_error",
                               "code": 502}}
            yield f"data: {json.dumps(event)}\n\n".encode()
        finally:
            await response.aclose()
            self._leave(replica)

    def _enter(self, replica: Replica) -> None:
        replica.in_flight += 1
        self.metrics.in_flight.labels(replica.url).set(replica.in_flight)

    def _leave(self, replica: Replica) -> None:
        replica.in_flight -= 1
        self.metrics.in_flight.labels(replica.url).set(replica.in_flight)


@contextlib.contextmanager
def serving_in_thread(router: Router, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """The router's app served from a background thread (tests, benchmarks): its base URL."""
    import socket
    import threading
    import time

    import uvicorn

    if not port:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_router_app(router), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="ridge-router", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the router did not start on {host}:{port}")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _error(status: int, message: str) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def build_router_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        task = asyncio.create_task(router.health_loop())
        yield
        task.cancel()
        await router.stop()

    app = FastAPI(title="ridge router", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        if router.prefills:  # a prefill server's push rides on completions and chat bodies only
            log.warning("ridge router: /v1/responses is served whole by the decode replica, without a prefill server")
        return await router.forward(request, "/v1/responses", disaggregates=False)

    def pooling_route(path: str) -> Callable[[Request], Awaitable[Response]]:
        async def forward(request: Request) -> Response:  # prompts and no decode: nothing to disaggregate
            return await router.forward(request, path, disaggregates=False)
        return forward

    for path in ("/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/classify"):
        app.post(path)(pooling_route(path))  # a pooling runner's endpoints

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": router.model, "object": "model",
                                                         "owned_by": "ridge"}]})

    @app.get("/health")
    async def health() -> Response:
        up = any(r.healthy for r in router.replicas.values())
        return JSONResponse({"healthy_replicas": sum(r.healthy for r in router.replicas.values())},
                            status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/replicas")
    async def replicas() -> JSONResponse:
        return JSONResponse({"policy": router.config.policy, "replicas": [
            {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight} for r in router.replicas.values()],
            "prefill": [{"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight}
                        for r in router.prefills.values()]})

    @app.post("/replicas")
    async def add_replica(request: Request) -> Response:
        url = (await request.json()).get("url")
        if not isinstance(url, str):
            return _error(400, "url: give the replica's URL, {\"url\": \"http://host:port\"}")
        try:
            await router.add(url)
        except ValueError as exc:
            return _error(400, str(exc))
        return JSONResponse({"added": url.rstrip("/")})

    @app.delete("/replicas")
    async def remove_replica(request: Request) -> Response:
        url = (await request.json()).get("url")
        try:
            router.remove(str(url))
        except KeyError:
            return _error(404, f"url: {url!r} is not a replica of this router")
        return JSONResponse({"removed": str(url).rstrip("/")})

    return app
