"""Configuration from the environment (`BACKFILL_` prefix).

Unset means the embedded defaults: SQLite, a local directory as object store, a broker
that needs no server and the simulated fleet. Production sets the URLs explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# State of the embedded mode (database, objects, broker folders, the simulated fleet, logs):
# under the user's home, never the working directory.
DEFAULT_HOME = Path("~/.backfill")


def parse_urls(text: str) -> list[str]:
    """'http://a/v1, http://b/v1/' -> ['http://a/v1', 'http://b/v1']."""
    return [u.strip().rstrip("/") for u in text.split(",") if u.strip()]


METRICS_ROLES = ("frontend", "agg", "prefill", "decode")


@dataclass(frozen=True)
class MetricsEndpoint:
    """One Prometheus endpoint of a fleet deployment: its frontend, or a worker of a role."""

    role: str  # "frontend" | "agg" | "prefill" | "decode"
    url: str
    # The model a worker serves (a frontend's: the one model its per-model series are read for);
    # None: the deployment's only model, or all of them.
    model: str | None = None


def parse_metrics_endpoints(spec: str) -> list[list[MetricsEndpoint]]:
    """`role=url,role=url;role=url,...`: deployments separated by `;`, endpoints by `,`.

    A bare URL (no `role=`) is taken as a frontend. `role@model=url` names the model a worker
    serves: a deployment whose workers are named so gets a capacity controller per model."""
    deployments: list[list[MetricsEndpoint]] = []
    for chunk in spec.split(";"):
        eps = []
        for item in chunk.split(","):
            item = item.strip()
            if not item:
                continue
            role, sep, url = item.partition("=")
            if not sep:
                role, url = "frontend", item
            role, at, model = role.partition("@")
            role = role.strip().lower()
            if role not in METRICS_ROLES:
                raise ValueError(f"unknown metrics endpoint role {role!r} in {item!r}")
            eps.append(MetricsEndpoint(role, url.strip(), model.strip() or None if at else None))
        if eps:
            deployments.append(eps)
    return deployments


def parse_fleet_models(spec: str) -> dict[str, list[str]]:
    """`url=modelA|modelB;url=modelC` -> {url: [modelA, modelB], url: [modelC]} (URLs as in
    `parse_urls`, without a trailing slash)."""
    out: dict[str, list[str]] = {}
    for item in spec.split(";"):
        if not item.strip():
            continue
        url, sep, models = item.partition("=")
        names = [m.strip() for m in models.split("|") if m.strip()]
        if not sep or not url.strip() or not names:
            raise ValueError(f"fleet models entry {item.strip()!r} is not `url=model|model`")
        out[url.strip().rstrip("/")] = names
    return out


_CONFIG = SettingsConfigDict(env_prefix="BACKFILL_", env_file=".env", extra="ignore")


class Core(BaseSettings):
    """Where state lives: the embedded defaults, or the production services."""

    model_config = _CONFIG

    # "production" unless said otherwise: a deployment that forgets to set it must not accept
    # the well-known development keys. `backfill up` (the embedded mode) sets "development".
    environment: str = "production"
    home: Path = DEFAULT_HOME
    database_url: str = ""
    broker_url: str = ""
    # Redis for capacity leases and the control loop's shared state; empty = database leases.
    redis_url: str = ""
    s3_endpoint_url: str = ""
    s3_bucket: str = "backfill"
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_region: str = "us-east-1"
    # Prometheus multiprocess files of every backfill process on this host (empty: HOME/metrics);
    # the API's /metrics adds up what the API, worker and scheduler processes wrote there.
    metrics_dir: str = ""
    # Bounds on every Postgres connection, so no caller waits on the database for ever: the
    # connect, one statement, one lock wait (a dead peer is noticed by TCP keepalives).
    db_connect_timeout_s: float = 10.0
    db_statement_timeout_s: float = 300.0
    db_lock_timeout_s: float = 30.0


class FleetSettings(BaseSettings):
    """The fleet: its deployments, how batch lines are sent, its telemetry."""

    model_config = _CONFIG

    # Comma-separated OpenAI-compatible base URLs of the fleet (e.g. a Dynamo frontend).
    fleet_urls: Annotated[list[str], NoDecode] = []
    fleet_api_key: str = ""
    fleet_timeout_s: float = 600.0
    # Deprecated name of max_attempts, honoured when max_attempts is not set.
    fleet_max_retries: int = 6
    models_cache_s: float = 30.0
    # How batch requests are marked lowest priority for the fleet: nvext (Dynamo), vllm, none.
    fleet_priority_hint: str = "nvext"
    # Capacity controller (runs in the scheduler process when capacity_control is on).
    # Prometheus endpoints of the fleet: `role=url` items, role frontend|agg|prefill|decode,
    # deployments separated by `;`. Empty: the frontend's /metrics beside each fleet URL.
    fleet_metrics_urls: Annotated[list[list[MetricsEndpoint]], NoDecode] = []
    # The models a deployment serves, for deployments whose own /v1/models is not to be trusted:
    # `url=modelA|modelB;url=modelC` (a fleet or overflow base URL). A deployment not named here
    # serves what its /v1/models lists (asked every `models_cache_s`).
    fleet_models: Annotated[dict[str, list[str]], NoDecode] = {}

    @field_validator("fleet_models", mode="before")
    @classmethod
    def _fleet_models(cls, v: Any) -> Any:
        return parse_fleet_models(v) if isinstance(v, str) else v

    @field_validator("fleet_urls", mode="before")
    @classmethod
    def _fleet_urls(cls, v: Any) -> Any:
        return parse_urls(v) if isinstance(v, str) else v

    @field_validator("fleet_metrics_urls", mode="before")
    @classmethod
    def _metrics_urls(cls, v: Any) -> Any:
        return parse_metrics_endpoints(v) if isinstance(v, str) else v

    @property
    def fleet_metrics(self) -> list[list[MetricsEndpoint]]:
        """Each deployment's metrics endpoints, in the order of `fleet_urls` (deployment i's lease
        pool is i): as `BACKFILL_FLEET_METRICS_URLS` lists them (`;` between deployments), else
        each deployment's frontend `/metrics` beside its URL."""
        if self.fleet_metrics_urls:
            return self.fleet_metrics_urls
        return [[MetricsEndpoint("frontend", url.removesuffix("/v1") + "/metrics")] for url in self.fleet_urls]


class SecuritySettings(BaseSettings):
    """Who may call, how often, and where the service may connect on a user's behalf."""

    model_config = _CONFIG

    # The one configured key of each kind: setting a new value revokes the previous one.
    bootstrap_api_key: str = ""
    admin_api_key: str = ""
    # Per-key request rate on the API ("600/minute", "10/second"; "off" disables), counted in
    # Redis when redis_url is set (shared by every API process), in memory otherwise.
    rate_limit: str = "600/minute"
    # Requests with a key that fails authentication, per client address ("off" disables): past
    # it the address gets 429 without a key lookup until the window moves on.
    auth_failure_limit: str = "30/minute"
    # Proxies whose X-Forwarded-For / X-Forwarded-Proto uvicorn believes (`backfill api`): IPs or
    # CIDRs, comma-separated, "*" for any. Set it to the ingress's address range so the API (the
    # failed-auth limit, the access log) sees each client's own address, not the proxy's. Empty:
    # uvicorn's default (loopback only, or its FORWARDED_ALLOW_IPS variable).
    forwarded_allow_ips: str = ""
    # Bearer token /metrics asks for (empty: open, for a scraper on a private network).
    metrics_token: str = ""
    # Webhook targets allowed although not public (comma-separated host names, addresses or
    # CIDRs, e.g. "hooks.internal,10.20.0.0/16"): in production a webhook may otherwise only go
    # to public addresses; outside production loopback is allowed too (jobs.webhooks.targets).
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = []

    @field_validator("webhook_allowed_hosts", mode="before")
    @classmethod
    def _allowed_hosts(cls, v: Any) -> Any:
        return [h.strip() for h in v.split(",") if h.strip()] if isinstance(v, str) else v


class LimitSettings(BaseSettings):
    """What one request, upload, file or batch may take."""

    model_config = _CONFIG

    # Uploads held open at once (each holds a store writer): beyond these, 429 + Retry-After.
    max_concurrent_uploads: int = 8
    max_concurrent_uploads_per_key: int = 4
    # Partial-output downloads streaming at once per API key, in each API process: beyond, 429.
    max_partial_downloads_per_key: int = 2
    # An upload that sends nothing for this long is dropped (408).
    upload_idle_timeout_s: float = 60.0
    max_file_bytes: int = 200 * 1024 * 1024
    max_requests_per_batch: int = 50_000
    max_line_bytes: int = 10 * 1024 * 1024
    max_reported_errors: int = 100
    # Processes that validate one large input file (past 32 MB) together; 0: one per CPU, up to 8.
    validation_processes: int = 0
    file_expiry_default_s: int = 30 * 24 * 3600
    # What one upload of the Uploads API (a file sent in parts of up to 64 MiB) may hold in all.
    max_upload_bytes: int = 8 * 1024**3


class WindowSettings(BaseSettings):
    """Completion windows a batch may ask for and what each costs."""

    model_config = _CONFIG

    # The completion windows a batch may ask for (units s, m, h, d); OpenAI's 24h is always in.
    completion_windows: Annotated[dict[str, int], NoDecode] = Field(default="1h,4h,24h,72h,7d", validate_default=True)
    # What a window costs against a model's general price when it has no price of its own
    # (`prices set --window`): its rates times this; a window not listed costs 1x.
    window_price_multipliers: Annotated[dict[str, Decimal], NoDecode] = Field(
        default="1h=2.0,4h=1.5,24h=1.0,72h=0.8,7d=0.6", validate_default=True
    )

    @field_validator("completion_windows", mode="before")
    @classmethod
    def _windows(cls, v: Any) -> Any:
        return parse_windows(v) if isinstance(v, str) else v

    @field_validator("window_price_multipliers", mode="before")
    @classmethod
    def _multipliers(cls, v: Any) -> Any:
        return parse_multipliers(v) if isinstance(v, str) else v


class CapacitySettings(BaseSettings):
    """How much of the fleet batch work may hold: the fixed bound and the capacity controller."""

    model_config = _CONFIG

    # Fixed admission bound, used until the capacity controller publishes a limit.
    max_inflight: int = 64
    # Capacity control (telemetry-driven leases). `auto` (the default): the controller runs on
    # the fleet's metrics, and while they have never answered the fixed bound above applies
    # (logged as a warning); `on`: the controller only, failing closed to the floor without
    # telemetry; `off`: the fixed bound by choice. true/false are read as on/off.
    capacity_control: Literal["auto", "on", "off"] = "auto"
    capacity_floor: int = 0
    # The interactive SLO the controller protects: time to first token, mean inter-token latency.
    slo_ttft_s: float = 1.0
    slo_itl_s: float = 0.05
    control_period_s: float = 0.25
    # Upper bound of the published limit (0: max_inflight).
    capacity_ceiling: int = 0
    # KV cache model of a decoder: bytes per token of the cache format (576 FP8 MLA, 352 NVFP4)
    # and the cache's byte budget; 0 takes the capacity the frontend reports.
    kv_bytes_per_token: int = 0
    kv_budget_bytes: int = 0
    # With no interactive request in flight, the latency target may stretch to this multiple
    # of the SLO (the first interactive arrival sheds back); 1.0 keeps the SLO target always.
    capacity_idle_target: float = 1.0
    # Split fleets: the mean requests (running + waiting) on each prefill engine the batch may
    # bring it to; 0 leaves the signal out. Suits a fleet whose prefill is short against the
    # TTFT SLO (0.4 on the simulated split fleet); see docs/scheduling.md.
    capacity_prefill_busy_target: float = Field(default=0.0, ge=0.0)
    # The fleet's engines run vLLM's priority scheduling (`--scheduling-policy priority`) and
    # batch lines go out marked lowest (fleet_priority_hint): the law then does not cut for
    # interactive bursts and lets the mean TTFT reach the SLO (docs/scheduling.md).
    capacity_engine_priority: bool = False
    # Share of releases guaranteed to batches forecast to miss their completion window.
    deadline_guaranteed_share: float = 0.5


class DrainSettings(BaseSettings):
    """The scheduler loop and the drains: leases, ticks, attempts, stopping."""

    model_config = _CONFIG

    # Concurrent drain loops kept alive across all workers (each holds many requests in flight).
    drains: int = 2
    lease_ttl_s: float = 15.0
    drain_slice_s: float = 30.0
    tick_interval_s: float = 1.0
    # The scheduler replicas' leader lease: one replica runs the loop and the controllers; a
    # standby takes over within this TTL (plus a second) of the leader's death.
    scheduler_leader_ttl_s: float = 6.0
    # Tries of one line, counting every way a try can end unfinished (a 429/5xx/timeout answer,
    # a worker that died holding it, a result that could not be recorded); past it the line
    # goes to the error file (max_attempts_exceeded or the fleet's last answer).
    max_attempts: int = 6
    # On SIGTERM a drain stops claiming at once and lets its in-flight requests finish for this
    # long; the rest go back to pending without spending an attempt.
    drain_grace_s: float = 20.0
    # How long a drain holds the replies it has while the database is unreachable (sending
    # nothing new meanwhile) before it gives them up; their lines are then reclaimed.
    db_outage_patience_s: float = 120.0
    # A batch with work left that makes no progress for this long, with no live drain on its
    # lines, is resumed by the scheduler's reconciler (which logs what it did).
    stall_after_s: float = 30.0
    # The leading scheduler renews its lease only while its loop finishes a step within this
    # long; a loop stuck longer (a database wait, a hung call) lets the lease lapse to a standby.
    scheduler_progress_timeout_s: float = 20.0


class EscalationSettings(BaseSettings):
    """What a batch about to miss its window gets: extra slots, then the overflow deployments."""

    model_config = _CONFIG

    # Escalation (scheduler.drain.escalation): a batch whose forecast finish passes its deadline minus
    # escalation_margin x its window may take escalation_inflight leases per pool (a deployment's,
    # or its model's on a deployment serving several) beyond the controller's limit (a bounded
    # part of the interactive SLO budget, for its lines only);
    # the lines that would still miss go to the overflow deployments (comma-separated
    # OpenAI-compatible base URLs, a circuit breaker each, overflow_max_inflight in flight
    # each), and every line left in the last overflow_margin x its window does.
    escalation_margin: float = 0.2
    escalation_inflight: int = 8
    overflow_urls: Annotated[list[str], NoDecode] = []
    overflow_api_key: str = ""
    overflow_max_inflight: int = 32
    overflow_margin: float = 0.1

    @field_validator("overflow_urls", mode="before")
    @classmethod
    def _overflow_urls(cls, v: Any) -> Any:
        return parse_urls(v) if isinstance(v, str) else v


class RetentionSettings(BaseSettings):
    """What backfill keeps, and for how long."""

    model_config = _CONFIG

    # Retention (run by the scheduler loop every retention_interval_s): objects without a file
    # row are removed after orphan_grace_s; response bodies leave the database this long after
    # their batch's result files were written (< 0 keeps them).
    retention_interval_s: float = 60.0
    orphan_grace_s: float = 3600.0
    result_body_retention_s: float = 3600.0


class Settings(
    RetentionSettings,
    EscalationSettings,
    DrainSettings,
    CapacitySettings,
    WindowSettings,
    LimitSettings,
    SecuritySettings,
    FleetSettings,
    Core,
):
    """Every setting, parsed and checked once when the process starts (`get_settings`)."""

    model_config = _CONFIG

    @model_validator(mode="after")
    def _attempts_from_deprecated_name(self) -> Settings:
        if "max_attempts" not in self.model_fields_set and "fleet_max_retries" in self.model_fields_set:
            self.max_attempts = self.fleet_max_retries
        return self

    @field_validator("capacity_control", mode="before")
    @classmethod
    def _control_mode(cls, v: Any) -> Any:
        words = {"true": "on", "1": "on", "yes": "on", "false": "off", "0": "off", "no": "off"}
        if isinstance(v, bool):
            return "on" if v else "off"
        return words.get(v.strip().lower(), v.strip().lower()) if isinstance(v, str) else v

    @property
    def capacity_controlled(self) -> bool:
        """Whether the capacity controller publishes the lease limit (auto or on)."""
        return self.capacity_control != "off"

    @field_validator("home")
    @classmethod
    def _absolute_home(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @property
    def embedded(self) -> bool:
        return not self.database_url

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'backfill.db'}"

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or "filesystem://"

    @property
    def broker_folder(self) -> Path:
        return self.home / "broker"

    @property
    def objects_dir(self) -> Path:
        return self.home / "objects"

    def check_production(self) -> None:
        """Refuse well-known development secrets outside development."""
        if self.environment != "development":
            for name in ("bootstrap_api_key", "admin_api_key"):
                value = getattr(self, name)
                if value and (value.startswith("sk-dev") or len(value) < 20):
                    raise ValueError(f"BACKFILL_{name.upper()} is a development secret")


@lru_cache
def get_settings() -> Settings:
    return Settings()


# Completion windows and their price multipliers as the settings spell them.
#
# `BACKFILL_COMPLETION_WINDOWS` ("1h,4h,24h,72h,7d") is the set `completion_window` accepts, and
# `BACKFILL_WINDOW_PRICE_MULTIPLIERS` ("1h=2.0,24h=1.0,...") what a window costs relative to a
# model's general price (`jobs.billing.ledger.window_rates`). Both are parsed when the settings load, so a
# malformed value stops a process at start-up instead of failing the first request that reads it.

# OpenAI's one window: always accepted, whatever the setting says, since every OpenAI client
# (the official SDK types the parameter as Literal["24h"]) sends it.
OPENAI_WINDOW = "24h"
MAX_WINDOW_NAME = 16  # batches.completion_window and prices.completion_window are String(16)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """'90s', '30m', '4h', '7d' -> seconds: a positive integer and one unit, nothing else."""
    unit, number = text[-1:], text[:-1]
    if unit not in _UNITS or not (number.isascii() and number.isdigit()) or int(number) <= 0:
        raise ValueError(f"bad duration {text!r}: use a positive integer and one of s, m, h, d")
    return int(number) * _UNITS[unit]


def parse_windows(text: str) -> dict[str, int]:
    """'1h,4h,24h' -> {'1h': 3600, '4h': 14400, '24h': 86400}, shortest first; OpenAI's 24h is
    always in. A window is accepted by exactly the name configured ('1d' does not accept '24h')."""
    windows = {OPENAI_WINDOW: parse_duration(OPENAI_WINDOW)}
    seen: set[str] = set()
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        if name in seen:
            raise ValueError(f"completion window {name!r} is listed twice")
        if len(name) > MAX_WINDOW_NAME:
            raise ValueError(f"completion window {name!r} is longer than {MAX_WINDOW_NAME} characters")
        seen.add(name)
        windows[name] = parse_duration(name)
    return dict(sorted(windows.items(), key=lambda item: (item[1], item[0])))


def parse_multipliers(text: str) -> dict[str, Decimal]:
    """'1h=2.0,7d=0.6' -> {'1h': Decimal('2.0'), '7d': Decimal('0.6')}: positive decimals, keyed by
    window name (a name the window set does not hold is allowed and unused)."""
    multipliers: dict[str, Decimal] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise ValueError(f"bad window price multiplier {item!r}: use window=multiplier, e.g. 1h=2.0")
        parse_duration(name)
        if name in multipliers:
            raise ValueError(f"window {name!r} has two price multipliers")
        try:
            multiplier = Decimal(value)
        except InvalidOperation:
            raise ValueError(f"bad price multiplier {value!r} for window {name!r}: not a decimal") from None
        if not multiplier.is_finite() or multiplier <= 0:
            raise ValueError(f"bad price multiplier {value!r} for window {name!r}: must be positive")
        multipliers[name] = multiplier
    return multipliers
