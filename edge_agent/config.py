"""The edge agent's one typed config: TOML file, then ``EDGE_*`` environment, then CLI flags.

Loaded by the same mechanism as the gateway's (:mod:`service.configfile`): ``load_config`` raises
:class:`AgentConfigError` (the same error the gateway raises) naming every bad key, ``[routing]`` keys
included; only the CLI turns it into an exit code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgewire.codec import DEFAULT_MIN_SAVING
from routing.config import DEFAULT_ROUTING_SECTION, RoutingConfig
from routing.regions import REGIONS
from service import configfile
from service.logs import LoggingConfig

ENV_PREFIX = "EDGE_"
REGION_NAMES = tuple(r.name for r in REGIONS)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CarrierEntry(_Section):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$")
    endpoint: str = Field(pattern=r"^tcp://")


class DiscoveryConfig(_Section):
    """How the agent finds the gateway's carrier ingress addresses."""

    mode: Literal["static", "srv", "address"] = "static"
    name: str = ""  # SRV name or host name of the ingest service
    port: int = Field(default=5555, ge=1, le=65535)  # with mode "address"
    nameservers: tuple[str, ...] = ()  # "IP:PORT"; empty = the system resolver
    min_ttl_s: float = Field(default=1.0, gt=0)  # answers are re-queried no sooner than this
    max_ttl_s: float = Field(default=300.0, gt=0)  # ... and no later than this
    timeout_s: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _name_for_dns(self) -> Self:
        """What DNS discovery needs, each problem at its own key (``discovery.nameservers[1]``)."""
        from edge_agent.discovery import parse_nameserver

        problems: list[tuple[tuple[int | str, ...], str]] = []
        if self.mode != "static" and not self.name:
            problems.append((("name",), f"required with mode {self.mode!r}"))
        if self.min_ttl_s > self.max_ttl_s:
            problems.append((("min_ttl_s",), f"must not exceed max_ttl_s ({self.max_ttl_s})"))
        for i, entry in enumerate(self.nameservers):
            try:
                parse_nameserver(entry)
            except ValueError as exc:
                problems.append((("nameservers", i), str(exc)))
        if problems:
            raise configfile.invalid("DiscoveryConfig", problems)
        return self


class SecurityConfig(_Section):
    mode: Literal["curve", "plaintext"] = "plaintext"
    agent_secret_key: Path | None = None  # this agent's .key_secret (hk-gateway keygen --agent)
    gateway_public_key: Path | None = None  # the gateway's .key

    @model_validator(mode="after")
    def _curve_needs_keys(self) -> Self:
        if self.mode == "curve" and (self.agent_secret_key is None or self.gateway_public_key is None):
            raise ValueError("mode 'curve' needs agent_secret_key and gateway_public_key")
        return self


class BatchingConfig(_Section):
    linger_ms: float = Field(default=2.0, ge=0)
    max_records: int = Field(default=100, ge=1, le=1024)
    max_bytes: int = Field(default=1 << 20, ge=1024)
    # a request frame serializing to at least this many bytes is compressed on a thread of the uplink's
    # own, not the event loop (zstd lets go of the GIL); 0 = every frame on the loop
    compress_off_loop_bytes: int = Field(default=64 << 10, ge=0)


class UplinkConfig(_Section):
    """Carrier sockets, liveness, the in-flight window and the pacing of sends (docs/AGENT.md section 4)."""

    ping_interval_s: float = Field(default=0.5, gt=0)
    dead_after_s: float = Field(default=2.0, gt=0)  # no pong for this long: the carrier is down
    ack_timeout_s: float = Field(default=1.5, gt=0)  # no ack for a frame: resend on another carrier
    # requests held for Hong Kong (queued, spooled or sent) and not answered, all carriers: 5 minutes of
    # an outage at 200 req/s (docs/AGENT.md section 4, "Outages")
    max_inflight: int = Field(default=65_536, ge=1)
    reconnect_ivl_ms: int = Field(default=100, ge=1)
    reconnect_ivl_max_ms: int = Field(default=500, ge=1)
    # each socket's reconnect intervals are drawn from [1 - jitter, 1 + jitter] x the configured ones
    reconnect_jitter: float = Field(default=0.5, ge=0.0, lt=1.0)
    # a connect() not answered by then is abandoned and retried (else it sits in the kernel's SYN backoff)
    connect_timeout_ms: int = Field(default=1000, ge=1)
    tcp_maxrt_ms: int = Field(default=5000, ge=0)  # TCP_USER_TIMEOUT: unacknowledged data drops the link
    sndhwm: int = Field(default=10_000, ge=1)
    # requests the gateway may hold from this agent at first and after it restarts; the window then opens
    # by one per answer (slow start) and halves on OVERLOADED (AIMD), between send_window_min and
    # max_inflight
    send_window_initial: int = Field(default=64, ge=1)
    send_window_min: int = Field(default=8, ge=1)
    # realtime requests the gateway may hold past a full send window: a region's prefetch filling the
    # window does not hold its page renders back at the agent (the gateway's [pools] realtime_reserve);
    # also room in max_inflight (at most half) that only realtime requests take at the intake
    realtime_reserve: int = Field(default=16, ge=0)
    # a retryable refusal is resent after retry_after_ms x [1, 1 + retry_jitter]
    retry_jitter: float = Field(default=0.5, ge=0.0, le=4.0)


class SpoolConfig(_Section):
    directory: Path = Path("var/spool")
    segment_bytes: int = Field(default=8 << 20, ge=4096)
    max_bytes: int = Field(default=256 << 20, ge=65536)
    fsync: Literal["always", "batch", "never"] = "batch"
    when_full: Literal["block", "drop_oldest", "drop_newest"] = "drop_oldest"
    classes: tuple[Literal["interactive", "batch"], ...] = ("interactive", "batch")


class LocalTierConfig(_Section):
    enabled: bool = True
    repository: Path = Path("var/models")
    threads: int = Field(default=1, ge=1)


class HttpConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=9103, ge=0, le=65535)


class RepliesConfig(_Section):
    """Answers for local callers that could not take them (reconnecting, restarting) wait here, bounded,
    until their request's deadline (docs/AGENT.md section 9)."""

    parked_answers: int = Field(default=20_000, ge=1)
    parked_bytes: int = Field(default=64 << 20, ge=65536)


class AgentConfig(_Section):
    """Everything ``edge-agent`` needs."""

    region: Literal[REGION_NAMES]  # type: ignore[valid-type]  # the built-in region list, as a Literal
    agent_id: str = Field(default="", pattern=r"^[A-Za-z0-9._-]{0,64}$")
    intake: str = "tcp://127.0.0.1:5600"
    carriers: tuple[CarrierEntry, ...] = (
        CarrierEntry(name="hgc", endpoint="tcp://127.0.0.1:5555"),
        CarrierEntry(name="pccw", endpoint="tcp://127.0.0.1:5556"),
        CarrierEntry(name="tgt", endpoint="tcp://127.0.0.1:5557"),
    )
    discovery: DiscoveryConfig = DiscoveryConfig()
    security: SecurityConfig = SecurityConfig()
    batching: BatchingConfig = BatchingConfig()
    uplink: UplinkConfig = UplinkConfig()
    spool: SpoolConfig = SpoolConfig()
    local: LocalTierConfig = LocalTierConfig()
    http: HttpConfig = HttpConfig()
    replies: RepliesConfig = RepliesConfig()
    logging: LoggingConfig = LoggingConfig()  # to stderr; --synthetic lowers the default level to warning
    zstd_level: int = Field(default=3, ge=1, le=22)
    # a frame zstd shrinks by less than this share goes uncompressed (dense tensors, JPEG bytes)
    zstd_min_saving: float = Field(default=DEFAULT_MIN_SAVING, ge=0.0, lt=1.0)
    default_deadline_s: float = Field(default=60.0, gt=0)  # for requests that arrive without one
    dictionaries: Path | None = None
    routing: RoutingConfig

    @property
    def name(self) -> str:
        return self.agent_id or f"edge-{self.region}-1"


AgentConfigError = configfile.ConfigError
"""What :func:`load_config` raises: every bad key with its message (the gateway raises the same error)."""


def load_config(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> AgentConfig:
    """Defaults < TOML file < ``EDGE_*`` environment < CLI overrides; every bad key named at once. A file
    with a ``[routing]`` table replaces the default policy wholesale."""
    return configfile.load_config(
        AgentConfig,
        defaults={"routing": DEFAULT_ROUTING_SECTION},
        path=path,
        env_prefix=ENV_PREFIX,
        environ=environ,
        overrides=overrides,
        file_replaces=("routing",),
    )
