"""Disaggregated prefill over HTTP: a --role prefill server pushes a prompt's cached KV blocks to a --role decode
server, which adopts them into its prefix cache (engine/kv_transfer.py); the router then sends the request itself
to the decode server, which finds the prompt cached.

The transport: one HTTP POST of the blocks (torch.save of their tensors, in the cache's own layout and dtype:
the bytes are the KV itself, 2 x layers x KV heads x head size x dtype bytes a token, plus the int8 / fp8 formats'
scales; every tensor-parallel rank's part) from the prefill server to the decode server's /kv/import, over a
connection the two keep open.
"""

from __future__ import annotations

import asyncio
import io
import time

import httpx
import torch
from fastapi import Request
from fastapi.responses import JSONResponse

from ridge.config import EngineConfig
from ridge.engine.async_engine import AsyncEngine
from ridge.engine.engine_core import ExportPrefix, ImportPrefix
from ridge.engine.kv_transfer import PrefixBlocks, check_config
from ridge.serve.protocol import KVTransferParams, RequestError

IMPORT_PATH = "/kv/import"
ROLES = ("both", "prefill", "decode")


def check_role(role: str, config: EngineConfig) -> None:
    """A prefill or decode role the engine config can serve, or ValueError naming what is missing (before loading)."""
    if role not in ROLES:
        raise ValueError(f"role: {role!r} is not one of {', '.join(ROLES)}")
    if role != "both":
        check_config(config, role)


def check_push(role: str, params: KVTransferParams | None, stream: bool) -> None:
    """A request's kv_transfer_params, refused by name where this server cannot honour them."""
    if params is None:
        return
    if role != "prefill":
        raise RequestError(f"kv_transfer_params: this server's role is {role}; only a --role prefill server pushes a "
                           "prompt's KV", "kv_transfer_params")
    if stream:
        raise RequestError("kv_transfer_params: not with stream (the prefill's reply is one token, pushed after)",
                           "kv_transfer_params")


class PrefixPusher:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0))

    async def push(self, token_ids: list[int], salt: str | None, params: KVTransferParams) -> dict:
        """Export the prompt's cached blocks and POST them to params.push_to: what moved, and how long it took."""
        start = time.perf_counter()
        reply = await asyncio.to_thread(self.engine.transfer, ExportPrefix(token_ids, salt))
        if reply.error is not None:
            raise RequestError(reply.error, "kv_transfer_params", 400)
        blocks = reply.blocks
        buffer = io.BytesIO()
        torch.save({"token_ids": blocks.token_ids, "salt": blocks.salt, "block_size": blocks.block_size,
                    "data": blocks.data, "groups": blocks.groups}, buffer)
        try:
            answer = await self.client.post(params.push_to.rstrip("/") + IMPORT_PATH, content=buffer.getvalue(),
                                            headers={"Content-Type": "application/octet-stream"})
        except httpx.HTTPError as exc:
            raise RequestError(f"kv_transfer_params: push_to {params.push_to} did not take the KV "
                               f"({type(exc).__name__}: {exc})", "kv_transfer_params", 502) from exc
        if answer.status_code != 200:
            raise RequestError(f"kv_transfer_params: push_to {params.push_to} answered {answer.status_code}: "
                               f"{answer.text[:300]}", "kv_transfer_params", 502)
        return {"pushed_to": params.push_to, "blocks": blocks.num_blocks, "tokens": len(blocks.token_ids),
                "bytes": len(buffer.getbuffer()), "seconds": time.perf_counter() - start,
                "adopted": answer.json()["adopted"]}


async def import_route(engine: AsyncEngine, request: Request) -> JSONResponse:
    """POST /kv/import on a --role decode server: a prefill server's blocks into this one's prefix cache."""
    try:
        fields = torch.load(io.BytesIO(await request.body()), weights_only=True)
        blocks = PrefixBlocks(list(fields["token_ids"]), fields["salt"], int(fields["block_size"]),
                              list(fields["data"]),
                              [list(map(int, g)) for g in fields.get("groups") or []] or None)
    except Exception as exc:  # noqa: BLE001 - whatever a malformed body raises, the client gets a 400 naming it
        raise RequestError(f"body: not the blocks a prefill server pushes ({type(exc).__name__}: {exc})",
                           "body") from exc
    reply = await asyncio.to_thread(engine.transfer, ImportPrefix(blocks))
    if reply.error is not None:
        raise RequestError(reply.error, "body")
    return JSONResponse({"adopted": reply.adopted, "blocks": blocks.num_blocks})
