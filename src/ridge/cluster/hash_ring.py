"""Consistent hashing of prompt prefixes onto replicas: where a prefix was sent before, its KV is cached.

Each replica holds VIRTUAL_NODES points on a 64-bit ring; a key belongs to the first point at or after its own
hash. Adding a replica takes over only the keys that now fall before its points (about 1/N of them, spread over
every other replica), removing one hands only its own keys on: the caches the other replicas built stay useful.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Any

VIRTUAL_NODES = 160  # points per replica: the share of keys each owns stays within a few percent of 1/N


def stable_hash(text: str) -> int:
    """The same 64-bit number in every process (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, members: list[str] = ()) -> None:
        self._points: list[tuple[int, str]] = []
        for member in members:
            self.add(member)

    @property
    def members(self) -> list[str]:
        return sorted({member for _, member in self._points})

    def add(self, member: str) -> None:
        if member in self.members:
            return
        for i in range(VIRTUAL_NODES):
            bisect.insort(self._points, (stable_hash(f"{member}#{i}"), member))

    def remove(self, member: str) -> None:
        self._points = [p for p in self._points if p[1] != member]

    def owners(self, key: str) -> list[str]:
        """The members in the order the key falls to them: its owner first, then whom it falls to were each one
        before removed (the retry order)."""
        if not self._points:
            return []
        start = bisect.bisect_left(self._points, (stable_hash(key), ""))
        order: list[str] = []
        for i in range(len(self._points)):
            member = self._points[(start + i) % len(self._points)][1]
            if member not in order:
                order.append(member)
                if len(order) == len(self.members):
                    break
        return order


def _part_key(part: dict[str, Any]) -> str:
    """A content part's share of the key: its text, or for an image (chat's image_url, the Responses API's
    input_image) a digest of its URL: the replica that read an image holds the blocks it made."""
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if part.get("type") in ("image_url", "input_image") and isinstance(url, str):
        return f"<image {hashlib.blake2b(url.encode(), digest_size=8).hexdigest()}>"
    return part.get("text", "") if isinstance(part.get("text"), str) else ""


def prefix_key(body: dict[str, Any], chars: int) -> str:
    """The leading `chars` characters of a completion's prompt, a chat's messages (role and text, in order), a
    response's instructions and input items, or an embedding's input (a score's text_1, a rerank's query); or the
    leading chars // 4 token ids of a tokenized prompt: the part requests of one tenant or conversation share. A
    request's prompt_cache_key (OpenAI's hint that requests share a cache, whatever their text) is its key where it
    sets one."""
    if isinstance(body.get("prompt_cache_key"), str) and body["prompt_cache_key"]:
        return f"prompt_cache_key:{body['prompt_cache_key']}"
    messages = body.get("messages")
    if messages is None and ("instructions" in body or isinstance(body.get("input"), list)
                             and any(isinstance(item, dict) for item in body["input"])):  # a Responses request
        given = body.get("input")
        items = given if isinstance(given, list) else [{"role": "user", "content": given}]
        messages = ([{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []) + items
    if messages is not None:
        parts = []
        for message in messages or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # content parts: their text, and a digest of each image's URL
                content = "".join(_part_key(p) for p in content if isinstance(p, dict))
            parts.append(f"{message.get('role', '') if isinstance(message, dict) else ''}:{content or ''}\n")
        return "".join(parts)[:chars]
    prompt = next((body[k] for k in ("prompt", "input", "text_1", "query") if k in body), "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):  # a batch: its first prompt
        prompt = prompt[0]
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt[: chars // 4])
    return str(prompt)[:chars]
