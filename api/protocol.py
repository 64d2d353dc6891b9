"""The wire schemas, in one place: OpenAI's Files, Batches, Models and Webhooks objects, the one
error envelope, the organization API (projects, API keys, prices, quotas, usage and costs), and
backfill's extensions (a batch's cost so far, the fleet's batch throughput, the dashboard's).

Routes declare these as response models, so the app's own OpenAPI document says what it
returns; a test holds that document to OpenAI's published schemas. Fields follow OpenAI's
schemas (and the official SDK's types): a property OpenAI marks optional is `X | None = None`
here, because OpenAI's live API sends null for it and the SDK reads null and absence alike.
Field order is the order on the wire. Conversions from ORM rows live in `api.wire`.
"""

from __future__ import annotations

from typing import Generic, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from backfill.jobs.files import FilePurpose
from backfill.jobs.models import BatchStatus
from backfill.jobs.webhooks.events import EVENT_TYPES, MAX_NAME_CHARS, MAX_URL_CHARS

Item = TypeVar("Item", bound=BaseModel)


class ListPage(BaseModel, Generic[Item]):
    """OpenAI's cursor page: `first_id` and `last_id` are null when the page is empty."""

    object: Literal["list"]
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, data: list[Item], *, has_more: bool = False) -> Self:
        # Some listed objects (quotas) have no id: their pages carry null cursors.
        first, last = (getattr(data[0], "id", None), getattr(data[-1], "id", None)) if data else (None, None)
        return cls(object="list", data=data, first_id=first, last_id=last, has_more=has_more)


# -- Errors -----------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The one error envelope, `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# -- Files ------------------------------------------------------------------------------------


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: FilePurpose
    # Deprecated by OpenAI; every stored file is "processed".
    status: Literal["uploaded", "processed", "error"]
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class FileList(ListPage[FileObject]):
    pass


# -- Uploads (a file sent in parts) -------------------------------------------------------------
# OpenAI's published batch spec leaves them out: these follow the official SDK's types
# (`openai.types.Upload`, `openai.types.uploads.UploadPart`), which a test holds them to.


class Upload(BaseModel):
    id: str
    object: Literal["upload"]
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: str
    status: Literal["pending", "completed", "cancelled", "expired"]
    file: FileObject | None = None


class UploadPart(BaseModel):
    id: str
    object: Literal["upload.part"]
    created_at: int
    upload_id: str


# -- Batches ----------------------------------------------------------------------------------


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] | None = None
    data: list[BatchError] | None = None


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    # The window as the client sent it: one of the configured set (BACKFILL_COMPLETION_WINDOWS),
    # which OpenAI's schema, knowing only "24h", types as any string here.
    completion_window: str = Field(description="The window the batch was created with, as sent.")
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts | None = None
    usage: BatchUsage | None = None
    metadata: dict[str, str] | None = None


class BatchList(ListPage[Batch]):
    # Optional in OpenAI's ListBatchesResponse (required in its ListFilesResponse).
    first_id: str | None = None
    last_id: str | None = None


# -- Models -----------------------------------------------------------------------------------


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


# -- Organization: projects (teams), API keys, prices, quotas ----------------------------------


class Project(BaseModel):
    id: str
    object: Literal["organization.project"]
    name: str
    created_at: int
    archived_at: int | None
    status: Literal["active", "archived"]
    weight: int  # backfill's own: the team's weight in the fair share across teams


class ProjectApiKey(BaseModel):
    id: str
    object: Literal["organization.project.api_key"]
    name: str
    redacted_value: str
    project_id: str
    admin: bool
    created_at: int
    revoked_at: int | None


class CreatedProjectApiKey(ProjectApiKey):
    value: str  # the raw key, shown once at creation; only its hash is stored


class ProjectApiKeyDeleted(BaseModel):
    object: Literal["organization.project.api_key.deleted"]
    id: str
    deleted: bool


class Price(BaseModel):
    """Prices per million tokens as exact decimal strings in currency units."""

    id: int
    object: Literal["organization.price"]
    model: str
    completion_window: str | None
    currency: str
    unit: Literal["1M tokens"]
    input: str
    cached_input: str
    output: str
    batch_discount_percent: int
    effective_from: int
    created_at: int


class Quota(BaseModel):
    object: Literal["organization.project.quota"]
    project_id: str
    model: str
    max_enqueued_tokens: int | None
    max_concurrent_batches: int | None


class ProjectList(ListPage[Project]):
    pass


class ProjectApiKeyList(ListPage[ProjectApiKey]):
    pass


class PriceList(BaseModel):
    """A list page whose cursors are integers, as price ids are."""

    object: Literal["list"]
    data: list[Price]
    first_id: int | None
    last_id: int | None
    has_more: bool


class QuotaList(ListPage[Quota]):
    pass


# -- Organization: usage and costs (OpenAI's Usage and Costs API) -------------------------------


class Amount(BaseModel):
    # The only float, because OpenAI types an amount as a number; round(value * 1e6) gives the micros back.
    value: float
    currency: str


class CompletionsUsageResult(BaseModel):
    object: Literal["organization.usage.completions.result"]
    input_tokens: int
    output_tokens: int
    input_cached_tokens: int
    input_audio_tokens: int
    output_audio_tokens: int
    num_model_requests: int
    project_id: str | None
    user_id: str | None
    api_key_id: str | None
    model: str | None
    batch: bool | None


class CostsResult(BaseModel):
    object: Literal["organization.costs.result"]
    amount: Amount
    line_item: str | None
    project_id: str | None


Result = TypeVar("Result", CompletionsUsageResult, CostsResult)


class Bucket(BaseModel, Generic[Result]):
    object: Literal["bucket"]
    start_time: int
    end_time: int
    results: list[Result]


class BucketPage(BaseModel, Generic[Result]):
    object: Literal["page"]
    data: list[Bucket[Result]]
    has_more: bool
    next_page: str | None


class CompletionsUsagePage(BucketPage[CompletionsUsageResult]):
    pass


class CostsPage(BucketPage[CostsResult]):
    pass


# -- Extensions: a batch's cost so far, the fleet's batch throughput ------------------------------
# (The price in force for a model and window is the organization's `Price` object above.)


class BatchCost(BaseModel):
    """What a batch has cost so far, from the usage ledger: executed requests only (failed,
    cancelled and expired lines cost nothing). The amount is an exact decimal string in
    currency units, as prices are."""

    object: Literal["batch.cost"]
    batch_id: str
    amount: str
    currency: str
    price_id: int | None  # the price the batch is billed at; null: none was in force (billed at zero)
    requests: int  # billed requests so far
    input_tokens: int
    cached_tokens: int
    output_tokens: int


class BatchWindowPrice(BaseModel):
    """What a batch of `model` created now in one completion window is billed at, per million
    tokens: the window's own price, or the model's general price times the window's multiplier.
    Amounts are exact decimal strings in currency units, as prices are."""

    object: Literal["batch.window_price"]
    completion_window: str
    window_seconds: int  # a batch created now expires this long after its creation
    model: str
    price_id: int  # the price row in force (what the batch's usage records)
    priced_by: Literal["window", "general"]  # the window's own row, or the model's general one
    multiplier: str  # applied to the row's rates: "1" for the window's own row
    currency: str
    unit: Literal["1M tokens"]
    input: str
    cached_input: str
    output: str
    batch_discount_percent: int


class BatchWindowPriceList(BaseModel):
    object: Literal["list"]
    data: list[BatchWindowPrice]  # every accepted window with a price in force, shortest first


class BatchThroughput(BaseModel):
    """The fleet's recent batch throughput and the work queued, summed over every team."""

    object: Literal["batch.throughput"]
    at: int  # Unix time of the measurement
    window_s: int  # the figures are for the last `window_s` seconds
    model: str | None  # the model the figures are for; null: every model
    requests: int  # batch requests executed in the window
    tokens: int  # their prompt + completion tokens
    requests_per_second: float  # averaged over the whole window
    tokens_per_second: float
    busy_s: int  # the part of the window in which batch results were recorded (10 s steps)
    busy_requests_per_second: float  # averaged over the busy part: the rate while batch work ran
    busy_tokens_per_second: float
    queued_requests: int  # lines of in-progress batches not finished yet
    queued_tokens: int  # their share of their batches' token estimates (prompt + max output)
    running_batches: int  # in-progress batches with lines left


# -- Webhooks ---------------------------------------------------------------------------------

EventType = Literal["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]


class WebhookEndpointObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"]
    name: str
    url: str
    event_types: list[str]
    signing_secret_hint: str | None = None
    created_at: int
    updated_at: int | None = None


class WebhookEndpointWithSecret(WebhookEndpointObject):
    """Returned on creation and rotation only: the one time the signing secret is shown."""

    signing_secret: str


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"]
    deleted: bool


class WebhookEventTypeList(BaseModel):
    object: Literal["list"]
    data: list[str]


class DeliveryAttempt(BaseModel):
    at: int
    status_code: int | None
    error: str | None


class WebhookDeliveryObject(BaseModel):
    """One event to one endpoint: where its delivery stands and its recent attempts."""

    id: str
    object: Literal["webhook_endpoint.delivery"]
    webhook_endpoint_id: str
    event_id: str
    event_type: str
    batch_id: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status_code: int | None
    last_error: str | None
    last_attempt_at: int | None
    next_attempt_at: int | None
    delivered_at: int | None
    created_at: int
    history: list[DeliveryAttempt]


class CreateEndpointBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    url: str = Field(min_length=1, max_length=MAX_URL_CHARS)
    event_types: list[EventType] = Field(min_length=1, max_length=len(EVENT_TYPES))


class UpdateEndpointBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    url: str | None = Field(default=None, min_length=1, max_length=MAX_URL_CHARS)
    event_types: list[EventType] | None = Field(default=None, min_length=1, max_length=len(EVENT_TYPES))


class RotateSecretBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keep_old_secret_active_for_24_hours: bool = False


# -- Dashboard --------------------------------------------------------------------------------


class DashboardTeam(BaseModel):
    project_id: str
    name: str


class DashboardBatch(BaseModel):
    id: str
    project_id: str
    status: str
    endpoint: str
    model: str | None
    created_at: int
    expires_at: int
    total: int
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int


class DashboardBatches(BaseModel):
    object: Literal["dashboard.batches"]
    admin: bool
    project_id: str  # the caller's own team
    teams: list[DashboardTeam]  # the caller's team, or every team for an admin key
    data: list[DashboardBatch]


class PoolLoad(BaseModel):
    """One lease pool's load: a deployment's, or one model's on a deployment serving several."""

    pool: str  # `fleet`, `fleet:1`, a model's `fleet/MODEL`
    deployment: str  # the deployment's base URL
    model: str | None  # the model whose pool it is; None: the deployment's one pool
    batch_inflight: int | None  # capacity leases held in the pool; None: unreadable
    limit: int | None  # the lease limit released to the pool now; None: unreadable
    fleet_inflight: int | None  # the model's (or deployment's) requests in flight at its frontend


class FleetLoad(BaseModel):
    """One sample of the fleet's load and the batch share of it."""

    object: Literal["dashboard.fleet_load"]
    at: float  # Unix time of the sample
    fleet_inflight: int | None  # every request in flight at the fleet's frontends; None: unreadable
    batch_inflight: int | None  # batch requests in flight (capacity leases held); None: unreadable
    interactive_inflight: int | None  # the rest of the fleet's in-flight requests
    limit: int | None  # the lease limit released to batch work now; None: unreadable
    capacity_control: bool  # whether the limit follows the fleet's telemetry (else it is fixed)
    pools: list[PoolLoad] = []  # capacity per lease pool: per deployment, and per model where one serves several
