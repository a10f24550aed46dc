"""The gateway's one typed config: TOML file, then environment, then CLI flags, validated in one step.

``load_config`` raises :class:`ConfigError` naming every bad key (``carriers[1].bind: ...``); only the CLI
turns that into an exit code. ``deploy/hk-gateway.example.toml`` is the annotated reference.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from routing.config import DEFAULT_ROUTING_SECTION, RoutingConfig
from service import configfile
from service.configfile import invalid
from service.logs import LoggingConfig

ENV_PREFIX = "HKGW_"
ConfigError = configfile.ConfigError
"""What :func:`load_config` raises: every bad key with its message (the agent raises the same error)."""
SecurityMode = Literal["curve", "plaintext"]
DEFAULT_MODELS_DIR = "var/models"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CarrierBgpConfig(_Section):
    """What ``hk-gateway bgp-announcer --carrier NAME`` tells ExaBGP to announce to this carrier's peer."""

    neighbor: str  # the carrier's BGP peer address, as in ExaBGP's config; commands are scoped to it
    local_as: int = Field(ge=1, le=4_294_967_295)  # our AS, repeated on the AS path to prepend
    prefixes: tuple[str, ...] = Field(min_length=1)  # the service prefix(es) carrying this carrier's ingress
    next_hop: str = "self"
    communities: tuple[str, ...] = ()  # always attached, e.g. the carrier's region-scoping communities
    degraded_prepend: int = Field(default=3, ge=0, le=16)  # extra copies of local_as while DEGRADED
    degraded_communities: tuple[str, ...] = ()  # added while DEGRADED (e.g. the carrier's lower-local-pref)
    interval_s: float = Field(default=1.0, gt=0, le=60)  # health is read this often
    timeout_s: float = Field(default=0.5, gt=0, le=30)  # per health request; no answer counts as DOWN
    rise: int = Field(default=3, ge=1, le=100)  # consecutive better readings before announcing (more)
    fall: int = Field(
        default=2, ge=1, le=100
    )  # consecutive worse readings before de-preferring / withdrawing

    @field_validator("neighbor")
    @classmethod
    def _address(cls, value: str) -> str:
        ipaddress.ip_address(value)
        return value

    @field_validator("prefixes")
    @classmethod
    def _networks(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(str(ipaddress.ip_network(v, strict=True)) for v in values)

    @field_validator("communities", "degraded_communities")
    @classmethod
    def _communities(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            parts = value.split(":")
            if len(parts) != 2 or not all(p.isdigit() and int(p) < 65536 for p in parts):
                raise ValueError(f"community {value!r} is not ASN:VALUE (two 16-bit numbers)")
        return values

    @field_validator("next_hop")
    @classmethod
    def _next_hop(cls, value: str) -> str:
        if value != "self":
            ipaddress.ip_address(value)
        return value


class CarrierConfig(_Section):
    """One carrier uplink: its name (a metric label) and the ZeroMQ endpoint its ROUTER binds."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,31}$")
    bind: str
    bgp: CarrierBgpConfig | None = None  # route health injection (hk-gateway bgp-announcer, deploy/bgp)

    @field_validator("bind")
    @classmethod
    def _tcp_endpoint(cls, bind: str) -> str:
        parts = urlsplit(bind.replace(":*", ":0"))
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "tcp" or not parts.hostname or port is None:
            raise ValueError("must be tcp://HOST:PORT (PORT may be * for any free port)")
        return bind

    @property
    def host(self) -> str:
        return urlsplit(self.bind.replace(":*", ":0")).hostname or ""

    def is_loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"


class SecurityConfig(_Section):
    """CurveZMQ with ZAP authentication of agents (default), or plaintext on loopback binds only."""

    mode: SecurityMode = "curve"
    server_secret_key: Path | None = None  # zmq certificate with the gateway's key pair (hk-gateway keygen)
    authorized_agents: Path | None = None  # directory of agent public certificates (<agent_id>.key)

    @model_validator(mode="after")
    def _curve_needs_keys(self) -> Self:
        if self.mode == "curve" and (self.server_secret_key is None or self.authorized_agents is None):
            raise ValueError("mode 'curve' needs server_secret_key and authorized_agents")
        return self


class HttpConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=9102, ge=0, le=65535)
    # A file holding the bearer token the /admin routes require (Authorization: Bearer <token>); None =
    # no token (then bind host to a management address only). Read at start, like the key files; never
    # logged.
    admin_token_file: Path | None = None


class LimitsConfig(_Section):
    max_header_bytes: int = Field(default=1024, ge=64)
    max_frame_bytes: int = Field(default=8 << 20, ge=1024)
    max_decompressed_bytes: int = Field(default=32 << 20, ge=1024)
    max_records: int = Field(default=1024, ge=1)
    max_parameters: int = Field(default=16, ge=0)
    # A zstd payload declaring at least this many bytes is inflated on a thread of its own, not on the event
    # loop (gateway/ingress/inflate.py); 0 = always on the loop. Above the agents' batching.max_bytes
    # (1 MiB), so only frames no agent's batching sends (and decompression bombs) take the hop.
    inflate_off_loop_bytes: int = Field(default=2 << 20, ge=0)
    inflate_off_loop_max_pending: int = Field(default=4, ge=1)  # beyond it, inflated on the loop
    # Request frames not marked realtime wait here once read, served in turns, so the reader goes on to
    # find realtime frames behind them (gateway/ingress/backlog.py); 0 frames: each served as it is read.
    backlog_frames: int = Field(default=1024, ge=0)
    backlog_bytes: int = Field(default=256 << 20, ge=0)


class ZmqConfig(_Section):
    """Socket options set on every carrier ROUTER."""

    rcvhwm: int = Field(default=20_000, ge=1)
    sndhwm: int = Field(default=20_000, ge=1)
    heartbeat_ivl_ms: int = Field(default=1000, ge=0)
    heartbeat_timeout_ms: int = Field(default=5000, ge=0)
    heartbeat_ttl_ms: int = Field(default=10_000, ge=0)
    linger_ms: int = Field(default=2000, ge=0)
    max_messages_per_wakeup: int = Field(default=256, ge=1)


class DedupeConfig(_Section):
    """Request ids seen recently, shared by all carriers: a resend after failover is not served twice."""

    window_s: float = Field(default=600.0, gt=0)
    max_entries: int = Field(default=2_000_000, ge=1000)
    response_cache_bytes: int = Field(default=64 << 20, ge=0)  # re-deliver answers to resent requests


class RepliesConfig(_Section):
    """Responses that could not be delivered (agent between carriers) wait here, bounded."""

    pending_per_agent: int = Field(default=10_000, ge=0)
    pending_agents: int = Field(default=1024, ge=1)
    retry_after_ms: int = Field(default=500, ge=0)  # told to agents on OVERLOADED / DRAINING
    # An Ack to an agent that reads Acks in a ResponseBatch waits at most this long for answers to ride
    # with (one reply frame instead of two); 0: only to the end of the loop tick that read the frame.
    ack_hold_us: int = Field(default=2000, ge=0, le=100_000)


class BreakerConfig(_Section):
    failure_threshold: int = Field(default=5, ge=1)
    open_s: float = Field(default=5.0, gt=0)
    half_open_calls: int = Field(default=1, ge=1)


class PoolDispatch(_Section):
    """How one routing pool is served: its backend and its dynamic batcher (Triton's semantics)."""

    backend: str
    max_batch_size: int = Field(default=32, ge=1)
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = Field(default=2000, ge=0)
    realtime_queue_delay_us: int = Field(default=0, ge=0)  # the wait when a realtime request is queued
    # A batch of realtime requests takes less urgent ones only up to this much more backend time, by the
    # pool's observed time per request (and never past cpu.inline_max_requests in all); small frames'
    # requests go apart from larger frames' where a batch would cost more (dispatch/lanes.py take_batch).
    realtime_fill_us: int = Field(default=2000, ge=0)
    # While a request of a frame marked realtime is queued, batches of its queue's realtime lane (alone) may
    # be in flight past routing's concurrency by this many (a flood's batches holding every slot do not
    # make them wait).
    realtime_reserve: int = Field(default=2, ge=0)
    batching: bool = True  # off for backends that batch themselves (Triton dynamic_batching)
    # Batch padded requests (text) only with others of their size bucket, so padding stays small.
    group_by_size: bool = True
    # With group_by_size: texts estimated at up to this many tokens share one queue, their batch padded to
    # its longest (at most this length's bucket), instead of one queue per length bucket (4, 6, 8, 12,
    # 16): a frame's short queries in one backend call instead of four or five. For a GPU pool, where a
    # batch of short sequences costs about what a smaller one does; a CPU model's time grows with the
    # tokens it pads. 0: every bucket apart.
    short_text_tokens: int = Field(default=0, ge=0, le=128)

    @model_validator(mode="after")
    def _preferred_within_max(self) -> Self:
        if any(p < 1 or p > self.max_batch_size for p in self.preferred_batch_sizes):
            raise ValueError("preferred_batch_sizes must lie in [1, max_batch_size]")
        return self


class CpuConfig(_Section):
    """The CPU stage (pre/post-processing): worker processes, so the event loop never waits on the GIL."""

    mode: Literal["process", "thread"] = "process"
    workers: int = Field(default=0, ge=0)  # 0 = every core but one, at least one
    # Smaller batches skip the IPC round trip. 32: a worker round trip costs the loop about what the
    # pipeline of such a batch of short texts or small ranking requests costs there, and the worker's CPU
    # on top (bench/frame_path.py's frames: 291-321 us of gateway CPU per record with 4, 234-241 with 32,
    # the loop's own share within 20 us).
    inline_max_requests: int = Field(default=32, ge=0)
    # Shared memory for prepared tensors (process mode): slots x slot_mb; 0 slots = through the pipe.
    arena_slots: int = Field(default=8, ge=0, le=256)
    arena_slot_mb: int = Field(default=8, ge=1, le=256)
    # A task (one batch's pre- or post-processing) running longer gets its worker killed and replaced, and
    # its batch answered INTERNAL; 0 = never (process mode only: a thread cannot be stopped).
    task_timeout_s: float = Field(default=30.0, ge=0)


class HealthConfig(_Section):
    interval_s: float = Field(default=0.5, gt=0)
    rise: int = Field(default=2, ge=1)  # consecutive good evaluations before a carrier is UP again
    fall: int = Field(default=2, ge=1)  # consecutive bad evaluations before it is DOWN
    stall_s: float = Field(default=2.0, gt=0)  # a carrier with unread input this long is not passing traffic


class CaptureConfig(_Section):
    """Traffic capture (docs/CAPTURE.md): rotating compressed files of received messages, off the hot path."""

    enabled: bool = False  # on from start; else only for a bounded time via POST /admin/capture
    directory: str = "var/capture"
    max_file_bytes: int = Field(default=64 << 20, ge=1 << 16)  # compressed size that rotates a file
    max_file_age_s: float = Field(default=600.0, gt=0)
    max_total_bytes: int = Field(default=1 << 30, ge=1 << 16)  # oldest files deleted beyond this
    max_files: int = Field(default=1000, ge=2)
    queue_records: int = Field(default=10_000, ge=1)  # messages waiting for the writer thread
    queue_bytes: int = Field(default=64 << 20, ge=1 << 16)  # their bytes; beyond either, drop and count
    flush_interval_s: float = Field(default=1.0, gt=0)  # a reader sees records at most this old
    retry_after_s: float = Field(default=5.0, gt=0)  # after a write error, the pause before a new file
    max_enable_s: float = Field(default=3600.0, gt=0)  # longest capture the admin endpoint switches on
    level: int = Field(default=3, ge=1, le=19)  # zstd level
    redact: bool = False  # replace ranking user/session ids by keyed hashes
    redact_key_file: str | None = None  # >= 16 bytes; without one a random key per process


MIN_HELD_READS_PER_S = 100.0
"""The slowest pace of held connections' frames (``budget.held_reads_per_s``): a pause of 10 ms at most."""


class BudgetConfig(_Section):
    """Each agent's cost budget at ingest (gateway/ingress/budget.py): two token buckets per agent, one
    over the bytes its frames decompress to, one over the event loop's time spent decoding them. A frame
    the budget does not cover is refused before decompression, ``over_budget`` with a retry-after.

    The defaults never refuse an honest agent at production rates: frames of 100 requests at 20k
    records/s of the synthetic mix decompress to about 45 MB/s and take about 0.1 s/s to decode
    (docs/GATEWAY.md section 5). A flood of 32 MiB decompression bombs gets one frame every 16 s.
    """

    enabled: bool = True
    bytes_per_s: int = Field(default=256 << 20, ge=1)  # decompressed bytes per second, per agent
    burst_bytes: int = Field(default=256 << 20, ge=1)  # bucket size; a new agent starts full
    # A zstd frame decompressing to more costs size x size / large_frame_bytes: at least the agents'
    # batching.max_bytes (1 MiB), so that only frames no agent sends pay more than their size.
    large_frame_bytes: int = Field(default=1 << 20, ge=1)
    decode_s_per_s: float = Field(default=0.5, gt=0)  # decode CPU seconds per second, per agent
    burst_decode_s: float = Field(default=0.5, gt=0)
    max_agents: int = Field(default=4096, ge=1)  # agents tracked; the least recently seen go first
    # Frames a carrier reads per second from connections held for ignoring their retry-after (beyond a
    # burst of 32): past it the carrier's reader pauses. 0: read them as fast as they come. A ROUTER reads
    # its connections in turn, so during an attack every other one is read about as often as the held one.
    held_reads_per_s: float = Field(default=5000.0, ge=0)

    @field_validator("held_reads_per_s")
    @classmethod
    def _held_pace(cls, value: float) -> float:
        # Each held frame past the burst pauses the carrier 1 / this, every other connection on it with it.
        if 0 < value < MIN_HELD_READS_PER_S:
            raise ValueError(
                f"0 (not paced) or at least {MIN_HELD_READS_PER_S:g}: each pause (1 / this) holds every "
                "connection of the carrier"
            )
        return value


class ModelPipelineConfig(_Section):
    """A model's CPU-stage pipeline declared on the gateway, over what its backend's model config says.

    For models whose ``config.pbtxt`` the operator does not control (a Triton or Ray Serve model of another
    team): ``[pipelines.<model>] pipeline = "text"`` and ``parameters = { tokenizer = "...", ... }``.
    """

    pipeline: Literal["ranking", "text", "image", "tensor"] | None = None  # None: keep the backend's
    parameters: dict[str, str] = {}  # merged over the model's own parameters


def _backend_section(section: dict[str, Any]) -> dict[str, Any]:
    """A ``[backends.<name>]`` table checked by the options model its ``type`` registered; each bad option
    is reported at its own key (``backends.<name>.<option>``). The table is kept as written: it is what
    the backend's factory takes at start."""
    import gateway.backends.builtin  # noqa: F401  (registers the built-in types and their options)
    from inference.backends.base import create, registered_types
    from inference.backends.options import option_types, options_model

    known = sorted({*option_types(), *registered_types()})
    kind = section.get("type")
    if not isinstance(kind, str):
        raise invalid("backend", [(("type",), f"required: one of {', '.join(known)}")])
    options = {k: v for k, v in section.items() if k != "type"}
    try:
        model = options_model(kind)
    except LookupError:
        if kind not in known:
            raise invalid(
                "backend", [(("type",), f"unknown type {kind!r}; known: {', '.join(known)}")]
            ) from None
        # A factory registered without an options model (gateway.testing's fault-injecting wrapper) is
        # checked by building it, which reads its options and connects to nothing.
        create(kind, kind, options)
        return section
    model.model_validate(options)
    return section


BackendSection = Annotated[dict[str, Any], AfterValidator(_backend_section)]
"""A backend's config table: ``type`` and the options that type takes (inference.backends.options)."""


class GatewayConfig(_Section):
    """Everything ``hk-gateway`` needs; built by :func:`load_config`."""

    instance: str = "hk-gw-1"
    # Ingest shards: processes each with its own event loop, pools and dedupe window, behind the same
    # carrier addresses (gateway/shards). 0: from the cores (placement.default_shards); 1: one process.
    # Read at start only: a reload that changes it is refused until a restart.
    shards: int = Field(default=0, ge=0, le=64)
    carriers: tuple[CarrierConfig, ...] = Field(min_length=1)
    security: SecurityConfig  # required: CurveZMQ unless a config says plaintext (loopback only)
    http: HttpConfig = HttpConfig()
    limits: LimitsConfig = LimitsConfig()
    zmq: ZmqConfig = ZmqConfig()
    dedupe: DedupeConfig = DedupeConfig()
    replies: RepliesConfig = RepliesConfig()
    breaker: BreakerConfig = BreakerConfig()
    health: HealthConfig = HealthConfig()
    cpu: CpuConfig = CpuConfig()
    logging: LoggingConfig = LoggingConfig()
    capture: CaptureConfig = CaptureConfig()
    budget: BudgetConfig = BudgetConfig()
    drain_timeout_s: float = Field(default=20.0, gt=0)
    # After health turns DRAINING, keep serving what is queued for this long before handing the rest
    # back, so GeoDNS and BGP health checkers see DRAINING (and move traffic) before the listener goes.
    drain_grace_s: float = Field(default=2.0, ge=0)
    dictionaries: Path | None = None  # directory of <dict_id>.zdict files
    backends: dict[str, BackendSection]  # name -> {type = "...", the options of that type}
    pools: dict[str, PoolDispatch]
    pipelines: dict[str, ModelPipelineConfig] = {}  # model name -> gateway-side pipeline declaration
    routing: RoutingConfig

    @field_validator("carriers")
    @classmethod
    def _distinct_carriers(cls, carriers: tuple[CarrierConfig, ...]) -> tuple[CarrierConfig, ...]:
        names = [c.name for c in carriers]
        binds = [c.bind for c in carriers if not c.bind.endswith(":*")]
        if len(set(names)) != len(names):
            raise ValueError("carrier names must be distinct")
        if len(set(binds)) != len(binds):
            raise ValueError("carrier bind addresses must be distinct")
        return carriers

    @model_validator(mode="after")
    def _cross_references(self) -> Self:
        """Keys that name each other (a pool's backend, a pipeline's model), each reported at its key."""
        problems: list[tuple[tuple[int | str, ...], str]] = []
        if self.security.mode == "plaintext":
            for i, carrier in enumerate(self.carriers):
                if not carrier.is_loopback():
                    problems.append((("carriers", i, "bind"), "plaintext is allowed only on loopback binds"))
        routing_pools = {p.name for p in self.routing.pools}
        for name in sorted(routing_pools - set(self.pools)):
            problems.append((("pools", name), "routing pool has no [pools.<name>] dispatch section"))
        for name in sorted(set(self.pools) - routing_pools):
            problems.append((("pools", name), "not a pool of the routing section"))
        for name, pool in self.pools.items():
            if pool.backend not in self.backends:
                problems.append((("pools", name, "backend"), f"no backend named {pool.backend!r}"))
        for name in sorted(set(self.pipelines) - set(self.routing.models)):
            problems.append((("pipelines", name), "not a model of the routing section ([routing.models])"))
        if problems:
            raise invalid("GatewayConfig", problems)
        return self


def default_section() -> dict[str, Any]:
    """The no-argument gateway: three loopback carriers, plaintext, the embedded ONNX demo models."""
    pools = {
        "cpu": {
            "backend": "embedded",
            "max_batch_size": 32,
            "preferred_batch_sizes": [8, 16, 32],
            "max_queue_delay_us": 2000,
        },
        "gpu-a100-mig": {"backend": "embedded", "max_batch_size": 8, "max_queue_delay_us": 500},
        "gpu-a100": {
            "backend": "embedded",
            "max_batch_size": 64,
            "preferred_batch_sizes": [32, 64],
            "max_queue_delay_us": 5000,
        },
        "gpu-v100": {"backend": "embedded", "max_batch_size": 32, "max_queue_delay_us": 3000},
    }
    routing = {**DEFAULT_ROUTING_SECTION}
    # The embedded demo runs every pool on this machine's CPU: equal speeds keep calibration honest.
    routing["pools"] = [{**p, "speed": 1.0} for p in DEFAULT_ROUTING_SECTION["pools"]]
    return {
        "carriers": [
            {"name": "hgc", "bind": "tcp://127.0.0.1:5555"},
            {"name": "pccw", "bind": "tcp://127.0.0.1:5556"},
            {"name": "tgt", "bind": "tcp://127.0.0.1:5557"},
        ],
        "backends": {"embedded": {"type": "onnx", "repository": DEFAULT_MODELS_DIR, "threads": 2}},
        "pools": pools,
        "routing": routing,
    }


def validate(raw: Mapping[str, Any]) -> GatewayConfig:
    """Validate a merged mapping; raises ConfigError naming each bad key."""
    return configfile.validate(GatewayConfig, raw)


def load_config(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Defaults, then the TOML file, then ``HKGW_*`` environment variables, then CLI overrides.

    A file that names its own carriers, backends, pools or routing replaces the defaults wholesale. Only
    the no-argument local gateway is plaintext by default; a config file gets CurveZMQ unless it says
    otherwise.
    """
    defaults = {**default_section(), "security": {"mode": "plaintext" if path is None else "curve"}}
    return configfile.load_config(
        GatewayConfig,
        defaults=defaults,
        path=path,
        env_prefix=ENV_PREFIX,
        environ=environ,
        overrides=overrides,
        file_replaces=("carriers", "backends", "pools", "routing"),
    )
