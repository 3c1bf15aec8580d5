"""The router's settings (cluster/router.py), apart from its server so that `ridge --help` and the CLI's parser
need neither fastapi nor httpx."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("cache-aware", "round-robin")


@dataclass(frozen=True)
class RouterConfig:
    replicas: list[str]
    policy: str = "cache-aware"
    prefix_chars: int = 1024  # the leading characters a request is hashed by (~256 tokens)
    balance_abs: int = 32  # SGLang router's default
    balance_rel: float = 1.5
    health_interval_s: float = 5.0
    unhealthy_after: int = 2
    request_timeout_s: float = 600.0
    api_key: str | None = None  # sent to the replicas on the router's own checks
    # disaggregated prefill: servers started with --role prefill; the replicas are then --role decode servers
    prefill: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("replica: name at least one replica URL (--replica http://host:port)")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.prefix_chars < 1:
            raise ValueError(f"prefix_chars: must be at least 1, got {self.prefix_chars}")
