"""Every message that crosses a socket, grouped by edge (`docs/architecture.md`, "Processes and
messages"). Definitions only, no logic.

Each message is a frozen dataclass; token arrays travel as int32 bytes, log-probabilities as
float32 bytes (`aerie.codec`). `MESSAGE_TYPES` at the bottom is the codec's registry: a type
not listed there cannot be sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# --------------------------------------------------------------------------------------------
# Shared value types


GREEDY_EPS = 1e-5  # temperatures below this are greedy


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping parameters, already validated by the tokenizer."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None  # drawn by the frontend when absent; sampled rows need one
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def draws(self) -> bool:
        """Whether tokens are drawn from the distribution, not its argmax."""
        return self.temperature >= GREEDY_EPS and self.top_k != 1

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended. type: "stop" | "length" | "abort".

    matched: the stop token id or stop string that ended it (None for EOS-less finishes);
    message: a human-readable reason for aborts (e.g. "prompt does not fit in the KV cache").
    """

    type: str
    matched: int | str | None = None
    message: str | None = None


# --------------------------------------------------------------------------------------------
# tokenizer -> scheduler


@dataclass(frozen=True)
class TokenizedRequest:
    """frontend: the index of the frontend process that owns the request (its outputs go
    there)."""

    rid: str
    input_ids: bytes  # int32 LE [prompt_len]
    sampling: SamplingParams
    return_logprob: bool = False
    frontend: int = 0


@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class DebugQuery:
    """Where is each unfinished request? (GET /debug/requests, --enable-debug-info only.)
    flush_cache: first drop every cached prefix no running request uses (POST /flush_cache)."""

    query_id: int
    flush_cache: bool = False
    frontend: int = 0  # who asked: the report goes there


# --------------------------------------------------------------------------------------------
# scheduler -> gpu worker


@dataclass(frozen=True)
class RequestStart:
    """Sent the first time a request runs on a request row (and again after a retraction).

    The worker keeps it per row until the row is started again by another request.
    prompt_ids: int32 LE, the request's full fill (prompt + outputs so far after a retraction),
    so the worker can build penalty state; output_len: how many of those are outputs.
    """

    row: int
    sampling: SamplingParams
    return_logprob: bool
    prompt_ids: bytes
    output_len: int = 0


@dataclass(frozen=True)
class ForwardPlan:
    """One scheduler step, columnar: every array is int32 LE bytes with one entry per request
    of the step (its row), in the order the StepResult answers.

    mode: "extend" (prefill chunks) or "decode".
    rows: [bs] request rows (indices into each runner's req_to_token).
    slot_starts, slot_lens: [bs] KV slots assigned this step cover positions
        [slot_starts[i], slot_starts[i] + slot_lens[i]) of row i; slots: [sum(slot_lens)] their
        ids, back to back. A decode step assigns only the positions no earlier plan assigned
        (often none), including the speculative headroom.
    Extend only (a decode step reads each row's last token and committed length on the
    device, so it needs neither):
    committed_lens: [bs] committed KV length before the chunk; extend_lens: [bs] chunk lengths;
    input_ids: [sum(extend_lens)] the chunks, back to back, at positions committed_len, +1, ...;
    sample: [bs] 1 when the chunk is the last of the request's fill (it samples a token);
    next_input_ids: [bs] the fill token right after a non-final chunk (the draft's prefill
        rotation needs it as the chunk's tail), -1 otherwise.
    starts: the rows (re)started by this step.
    speculate: decode only, with speculation: False runs the step as plain decoding, one token
        per request (adaptive speculation chose it; see `scheduler_proc.adaptive`).
    """

    plan_id: int
    mode: str
    rows: bytes
    slot_starts: bytes = b""
    slot_lens: bytes = b""
    slots: bytes = b""
    committed_lens: bytes = b""
    extend_lens: bytes = b""
    input_ids: bytes = b""
    sample: bytes = b""
    next_input_ids: bytes = b""
    starts: list[RequestStart] = field(default_factory=list)
    speculate: bool = True


# --------------------------------------------------------------------------------------------
# gpu worker -> scheduler


@dataclass(frozen=True)
class StepResult:
    """Tokens produced by one ForwardPlan, in the plan's request order.

    num_tokens: int32 LE [num_requests], new tokens per request (0 for a non-final chunk,
        1 for a plain decode, the accept length with speculation).
    token_ids: int32 LE [sum(num_tokens)].
    logprobs: float32 LE [sum(num_tokens)] when any request asked for them, else empty.
    num_verify: int32 LE [num_requests] verify forwards per request this step (0 without
        speculation), for spec_verify_ct.
    """

    plan_id: int
    num_tokens: bytes
    token_ids: bytes
    logprobs: bytes = b""
    num_verify: bytes = b""


# --------------------------------------------------------------------------------------------
# scheduler -> frontend


@dataclass(frozen=True)
class StepOutputs:
    """What a step produced for the requests of one frontend, column by column (the writer and
    reader are `aerie.outputs`): request `rids[i]` got `num_tokens[i]` new output tokens, the
    next ones of `token_ids`.

    num_tokens, spec_verify_ct, cached_tokens: int32 LE [n]; spec_verify_ct counts the request's
        verify forwards so far, cached_tokens its prompt tokens taken from the prefix cache
        (either empty when it is 0 for every request).
    token_ids: int32 LE [sum(num_tokens)], already cut at a stop.
    logprobs: float32 LE, the tokens' logprobs of the requests that asked for them, back to
        back (num_tokens[i] each); return_logprob: uint8 [n], 1 for those requests (both empty
        when none of them asked).
    finishes: rid -> finish reason, for the requests this step ended (aborts included).
    """

    frontend: int
    rids: list[str]
    num_tokens: bytes
    token_ids: bytes
    spec_verify_ct: bytes
    cached_tokens: bytes
    logprobs: bytes = b""
    return_logprob: bytes = b""
    finishes: dict[str, FinishReason] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    avg_accept_length: float
    accepted_per_position: list[int] = field(default_factory=list)
    num_retractions: int = 0  # requests retracted since start (KV ran out)
    num_requests: int = 0  # requests received since start
    replica: int = 0  # the data-parallel replica whose scheduler reports
    num_plain_steps: int = 0  # decode steps a speculative server ran plainly (adaptive)
    num_decode_steps: int = 0  # decode steps run: plain steps and speculative iterations
    # Adaptive speculation's last choice (-1: none yet), the accept length it expected of the
    # batch, that estimate's standard error, and the break-even it compared their sum with
    # (0: unknown).
    speculating: int = -1
    expected_accept_length: float = 0.0
    expected_accept_error: float = 0.0
    break_even_accept_length: float = 0.0
    # Prefix cache: prompt tokens admitted since start and how many of them were cached; what
    # the cache holds and, of that, what no running request uses (0 without a cache).
    prefill_tokens: int = 0
    cached_prefill_tokens: int = 0
    prefix_cache_tokens: int = 0
    prefix_cache_evictable_tokens: int = 0


@dataclass(frozen=True)
class DebugReport:
    """The answer to a DebugQuery: the scheduler's state (`Scheduler.describe`) and one
    entry per request it holds (waiting, running, or finished and still held by a plan)."""

    query_id: int
    replica: int
    summary: dict[str, int | bool]
    requests: list[dict[str, int | str | bool]]


# --------------------------------------------------------------------------------------------
# frontend -> frontend


@dataclass(frozen=True)
class FrontendMetrics:
    """A frontend's own request counts so far (`Metrics.snapshot`: Prometheus samples, as
    names, labels and values), shared with the other frontends so that each reports the sums."""

    frontend: int
    names: list[str]
    labels: list[dict[str, str]]
    values: list[float]


# --------------------------------------------------------------------------------------------
# launcher <-> children


@dataclass(frozen=True)
class ProcessReady:
    name: str
    pid: int
    info: dict[str, int | float | str] = field(default_factory=dict)


@dataclass(frozen=True)
class ProcessFailed:
    name: str
    pid: int
    error: str  # formatted traceback


@dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@dataclass(frozen=True)
class EngineReady:
    """launcher -> tokenizer: every process is up; server_info is the resolved config.

    pids: the launcher and every child by name; the tokenizer answers /health with 503 as soon
    as one of them is gone (it checks them on every health request, not on a timer)."""

    server_info: dict[str, int | float | str | bool | None]
    pids: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FrontendReady:
    """tokenizer -> launcher: EngineReady taken. Once every frontend has sent it, the launcher
    opens the server (the flag every frontend reads), so no frontend answers /health with 200
    while another would still refuse a request as not ready."""

    name: str


@dataclass(frozen=True)
class BeginDrain:
    """launcher -> tokenizer: refuse new requests with 503, report DrainDone when idle."""

    timeout_s: float


@dataclass(frozen=True)
class DrainDone:
    num_unfinished: int


@dataclass(frozen=True)
class Heartbeat:
    """launcher -> every child's heartbeat socket, periodically: answered by the child's
    heartbeat thread (`aerie.process.HeartbeatThread`), whatever its loop is doing."""

    seq: int


@dataclass(frozen=True)
class HeartbeatAck:
    """What the child's loop was doing when the heartbeat was answered.

    doing: the unit of work it is on ("step 17 (extend, 7,000 tokens, 1 request) on the
        host"), "" when it waits for messages.
    busy_s: how long it has been on that unit (0.0 when idle).
    progress: a count that moves whenever the loop starts, advances or ends a unit of work.
    """

    name: str
    seq: int
    doing: str = ""
    busy_s: float = 0.0
    progress: int = 0


MESSAGE_TYPES: tuple[type, ...] = (
    SamplingParams,
    FinishReason,
    TokenizedRequest,
    AbortRequest,
    DebugQuery,
    RequestStart,
    ForwardPlan,
    StepResult,
    StepOutputs,
    SchedulerStats,
    FrontendMetrics,
    DebugReport,
    ProcessReady,
    ProcessFailed,
    Shutdown,
    EngineReady,
    BeginDrain,
    DrainDone,
    Heartbeat,
    HeartbeatAck,
    FrontendReady,
)
