"""Sampling: per-row parameters, penalties, filters and seeded noise, on the worker's device.

`SamplingState` keeps each request row's parameters and penalty state in tensors indexed by
row and samples a batch without a loop over rows. A draw depends only on (seed, position, vocab
id, stream), so a request's tokens do not depend on its batch; speculative acceptance shares
these functions to draw exactly what plain decoding draws.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from aerie.messages import GREEDY_EPS, SamplingParams

# Noise streams: independent randomness for the same (seed, position). Speculative decoding
# draws from the token stream too, so that it emits what plain decoding would.
STREAM_TOKEN = 0  # the sampled token

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2^31: a 32-bit value times one stays below 2^63 (no int64 overflow).
_MUL_A = 0x7FEB352D
_MUL_B = 0x5BD1E995
_SALT = 0x27D4EB2D


# --------------------------------------------------------------------------------------------
# Counter-based noise


def hash32(x: Tensor) -> Tensor:
    """Mix int64 values in [0, 2^32) into well-spread values in [0, 2^32). Shape-preserving."""
    x = (x ^ (x >> 16)) * _MUL_A & _MASK32
    x = (x ^ (x >> 15)) * _MUL_B & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds: Tensor, positions: Tensor, stream: int) -> Tensor:
    """[bs] int64 keys in [0, 2^32) from (seed, position, stream), on the inputs' device.

    seeds may be any int64; positions below 2^32.
    """
    seeds = seeds.long()
    stream_salt = (_SALT + stream * _MUL_B) & _MASK32
    key = hash32((seeds & _MASK32) ^ stream_salt)
    key = hash32(key ^ ((seeds >> 32) & _MASK32))
    return hash32(key ^ (positions.long() & _MASK32))


def column_hashes(token_ids: Tensor) -> Tensor:
    """The per-token half of the noise's counter: [n] int64 for token ids [n]. A draft whose
    vocabulary is a subset of the target's hashes its tokens' target ids, so that its noise
    for a token is the target's (`gumbel_from_keys`)."""
    return hash32(token_ids.long() ^ _SALT)


@functools.lru_cache(maxsize=16)
def _index_hashes(num: int, device: torch.device) -> Tensor:
    """column_hashes(arange(num)), cached per size and device (never mutate it)."""
    return column_hashes(torch.arange(num, device=device, dtype=torch.int64))


def uniform_from_keys(keys: Tensor, columns: Tensor) -> Tensor:
    """Uniforms in (0, 1): [bs, n] float32 on the device of keys [bs] (from `row_keys`), one
    per `column_hashes` columns [n]. Element (b, i) depends only on keys[b] and the token
    columns[i] hashes. Values are odd multiples of 2^-24, so never 0 or 1 exactly and exactly
    representable in float32.
    """
    bits = hash32(keys[:, None] ^ columns[None, :])  # [bs, n]
    return ((bits >> 9) * 2 + 1).float() * (2.0**-24)


def gumbel_from_keys(keys: Tensor, columns: Tensor) -> Tensor:
    """Gumbel noise [bs, n] float32 for row keys [bs] and `column_hashes` [n]: what plain
    sampling adds to the logit of the token each column hashes."""
    return -torch.log(-torch.log(uniform_from_keys(keys, columns)))


def sample_with_noise(
    logits: Tensor, seeds: Tensor, positions: Tensor, stream: int = STREAM_TOKEN
) -> Tensor:
    """Draw one token per row from softmax(logits) by an exponential race: [bs] int64.

    argmax(logits - log(E)) with E = -log(u) exponential is an exact sample of softmax(logits)
    (the Gumbel-max trick). logits [bs, V] float32 may hold -inf for filtered tokens. seeds and
    positions [bs] live on one device (keys move to the logits' device).
    """
    keys = row_keys(seeds, positions, stream).to(logits.device)  # [bs]
    columns = _index_hashes(logits.shape[-1], logits.device)  # [V]
    return torch.argmax(logits + gumbel_from_keys(keys, columns), dim=-1)


@dataclass(frozen=True)
class DrawNoise:
    """Per-row inputs of a draft's coupled proposal (`coupled_reference`): the draft proposes
    argmax(logits * scale + noise) with the noise plain sampling adds at the same (seed,
    position), so it proposes the target's own draw whenever their distributions agree.
    scale [n] float32 (1 / temperature); keys [n] int64 (`row_keys` of the token drawn);
    noisy [n] bool (False: a greedy row, plain argmax); columns [V] int64 (`column_hashes`
    of the head's tokens in the target's vocabulary)."""

    scale: Tensor
    keys: Tensor
    noisy: Tensor
    columns: Tensor


def coupled_reference(logits: Tensor, noise: DrawNoise) -> Tensor:
    """argmax of logits [n, V] * scale + Gumbel noise on noisy rows, plain argmax elsewhere:
    [n] int64 head indices."""
    scores = logits.float() * noise.scale[:, None] + gumbel_from_keys(noise.keys, noise.columns)
    return torch.where(noise.noisy, scores.argmax(-1), logits.float().argmax(-1))


# --------------------------------------------------------------------------------------------
# Per-batch-row parameters


@dataclass(frozen=True)
class SamplingRows:
    """Sampling parameters gathered for one batch: each tensor [bs] on the device.

    top_k is resolved: a value in [1, V] (V when off). The `use_*` flags are host booleans that
    are False only when no row needs that stage, so it can be skipped without a device sync.
    """

    temperature: Tensor  # float32
    top_k: Tensor  # int64
    top_p: Tensor  # float32
    min_p: Tensor  # float32
    repetition: Tensor  # float32
    frequency: Tensor  # float32
    presence: Tensor  # float32
    seed: Tensor  # int64
    use_penalty: bool = True
    use_sampling: bool = True
    use_top_k: bool = True
    use_top_p: bool = True
    use_min_p: bool = True

    @property
    def greedy(self) -> Tensor:
        """[bs] bool: rows that take the argmax."""
        return (self.temperature < GREEDY_EPS) | (self.top_k == 1)

    def repeat_interleave(self, n: int) -> SamplingRows:
        """Each row repeated n times ([bs] -> [bs * n]), e.g. for the nodes of a verify tree."""
        values = {}
        for f in fields(self):
            v = getattr(self, f.name)
            values[f.name] = v.repeat_interleave(n) if isinstance(v, Tensor) else v
        return SamplingRows(**values)


# --------------------------------------------------------------------------------------------
# Pure logit processing


def apply_penalties(
    logits: Tensor, counts: Tensor, prompt_mask: Tensor, rows: SamplingRows
) -> Tensor:
    """Penalised copy of logits [bs, V] (the input is not mutated).

    counts [bs, V] int32: each token's occurrences among the outputs; prompt_mask [bs, V] bool:
    tokens in the prompt. First the repetition penalty (HF) over tokens seen in prompt or
    outputs (positive logits divided, others multiplied), then OpenAI's frequency
    (minus penalty * count) and presence (minus penalty if count > 0) penalties. Identity
    parameters (1, 0, 0) leave a row bit-for-bit unchanged.
    """
    in_output = counts > 0  # [bs, V]
    seen = prompt_mask | in_output
    rep = rows.repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - rows.frequency[:, None] * counts.to(logits.dtype)
    return logits - rows.presence[:, None] * in_output.to(logits.dtype)


def _keep_top_k_top_p(probs: Tensor, rows: SamplingRows) -> Tensor:
    """[bs, V] bool mask of tokens inside top-k, then inside top-p of the renormalised rest."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [bs, V]
    rank = torch.arange(probs.shape[-1], device=probs.device)
    keep_sorted = rank[None, :] < rows.top_k[:, None]  # [bs, V]
    if rows.use_top_p:
        kept = sorted_probs * keep_sorted
        cum = torch.cumsum(kept, dim=-1)
        mass = cum[:, -1:]  # top-k mass, the renormaliser
        # NOTE: keep a token while the mass strictly before it is below top_p; rank 0 always
        # stays. Rows with top_p >= 1 skip the test so rounding in cumsum cannot drop tokens.
        in_nucleus = (cum - kept) < rows.top_p[:, None] * mass
        keep_sorted &= in_nucleus | (rows.top_p[:, None] >= 1.0)
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def process_logits(logits: Tensor, rows: SamplingRows) -> Tensor:
    """Processed logits [bs, V] float32: temperature applied, filtered tokens at -inf.

    softmax of the result is the distribution a sampled row draws from (top-k, top-p, min-p
    applied and renormalised). Greedy rows come back unscaled and unfiltered (their softmax is
    the raw distribution). Penalties are not applied here (see `apply_penalties`).
    """
    greedy = rows.greedy[:, None]  # [bs, 1]
    temperature = torch.where(greedy, 1.0, rows.temperature[:, None])
    scaled = logits.float() / temperature  # [bs, V]
    if not (rows.use_top_k or rows.use_top_p or rows.use_min_p):
        return scaled
    probs = torch.softmax(scaled, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if rows.use_min_p:
        keep &= probs >= probs.amax(dim=-1, keepdim=True) * rows.min_p[:, None]
    if rows.use_top_k or rows.use_top_p:
        keep &= _keep_top_k_top_p(probs, rows)
    return torch.where(keep | greedy, scaled, float("-inf"))


def fixed_flags(sort: bool, penalties: bool = True) -> tuple[bool, ...]:
    """Stage flags (`_FLAG_COLUMNS` order) that serve any batch, so that one captured graph
    serves many: every stage on, the sort behind top-k / top-p only where asked for (and the
    penalties only where asked for). Stages a row does not need leave it unchanged (identity
    penalties, min_p 0, top_k V, top_p 1), so each row gets the token and logprob of its
    batch's own flags."""
    return (penalties, True, sort, sort, True)


# --------------------------------------------------------------------------------------------
# Per-row state

# Columns of SamplingState._float_params (SamplingRows field, SamplingParams field) and
# _int_params.
_FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition", "frequency", "presence")
_FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
_INT_COLUMNS = ("top_k", "seed")
# Columns of SamplingState._flags_cpu.
_FLAG_COLUMNS = ("use_penalty", "use_sampling", "use_top_k", "use_top_p", "use_min_p")


def _wrap_int64(value: int) -> int:
    """Any Python int folded into the int64 range (two's complement)."""
    return (value + 2**63) % 2**64 - 2**63


class SamplingState:
    """Per-request-row sampling parameters and penalty state, on the worker's device.

    Rows are request pool rows 0..max_rows (row 0 is the padding dummy: greedy, no penalties).
    Device tensors: float params [max_rows+1, 6], int params [max_rows+1, 2], output token
    counts [max_rows+1, V] int32 and a prompt mask [max_rows+1, V] bool. Host flags per row say
    which stages a row needs, so batches that need none skip them without a device sync.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str):
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        num_rows = max_rows + 1
        self._float_params = torch.zeros(num_rows, len(_FLOAT_COLUMNS), device=self.device)
        self._float_params[:, _FLOAT_COLUMNS.index("top_p")] = 1.0
        self._float_params[:, _FLOAT_COLUMNS.index("repetition")] = 1.0
        self._int_params = torch.zeros(
            num_rows, len(_INT_COLUMNS), dtype=torch.int64, device=self.device
        )
        self._int_params[:, 0] = vocab_size
        self.counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=self.device)
        # numpy, not a CPU tensor: a step reads it once or twice, and a numpy index or any()
        # costs the host about a microsecond where the same torch call costs several.
        self._flags_cpu = np.zeros((num_rows, len(_FLAG_COLUMNS)), dtype=bool)

    def start(
        self,
        row: int,
        params: SamplingParams,
        prompt_ids: list[int] | Tensor,
        output_len: int,
    ) -> None:
        """A request (re)starts on row `row`: set its parameters and penalty state.

        prompt_ids: the full fill (prompt + outputs so far after a retraction); its last
        `output_len` ids are outputs and are counted for frequency/presence penalties.
        The repetition penalty covers every id in prompt_ids. A sampled request must carry
        its seed (the frontend gives every request one); a greedy row draws no noise, so it
        may have none. Penalty tensors are rebuilt only for rows that use penalties.
        Raises ValueError for a sampled request without a seed.
        """
        top_k = params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size
        flags = _row_flags(params, top_k, self.vocab_size)
        if params.seed is None and flags[_FLAG_COLUMNS.index("use_sampling")]:
            raise ValueError(
                f"sampled request on row {row} has no seed; requests "
                "must get their seed before they reach the worker"
            )
        seed = params.seed if params.seed is not None else 0
        floats = [float(getattr(params, name)) for name in _FLOAT_PARAMS]
        self._float_params[row] = self._upload(floats, torch.float32)
        self._int_params[row] = self._upload([top_k, _wrap_int64(seed)], torch.int64)
        self._flags_cpu[row] = flags
        if flags[0]:
            self._reset_penalty_state(row, prompt_ids, output_len)

    def _reset_penalty_state(
        self, row: int, prompt_ids: list[int] | Tensor, output_len: int
    ) -> None:
        ids = self._upload(prompt_ids, torch.int64)  # [fill_len]
        self.prompt_mask[row].zero_()
        self.prompt_mask[row].index_fill_(0, ids, True)  # (an index_put of True would sync)
        self.counts[row].zero_()
        if output_len > 0:
            outputs = ids[ids.numel() - output_len :]
            self.counts[row].index_put_(
                (outputs,), torch.ones_like(outputs, dtype=torch.int32), accumulate=True
            )

    def _upload(self, values: list[int] | list[float] | Tensor, dtype: torch.dtype) -> Tensor:
        """values on the device without waiting for it: from pinned memory, non-blocking (a
        pageable copy would wait for the step still running on the device)."""
        host = torch.as_tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def observe(
        self,
        rows: Tensor,
        token_ids: Tensor,
        weights: Tensor | None = None,
        lengths: Tensor | None = None,
        always: bool = False,
    ) -> None:
        """Count new output tokens: [n] rows and [n] ids; weights [n] (0/1) counts only some of
        them without a host-side selection. With lengths [n], token_ids is [n, W] and row i
        emitted its first lengths[i] (an accepted speculative run). Mutates `counts`; a no-op
        when no row uses penalties, unless `always` (no look at the host's flags, so that a
        CUDA graph can hold the count: every row's tokens are counted)."""
        if not always and not self._flags_cpu[:, 0].any():
            return
        rows = rows.to(self.device, torch.int64)
        ids = token_ids.to(self.device, torch.int64)
        if lengths is not None:
            width = ids.shape[1]
            weights = torch.arange(width, device=self.device)[None, :] < lengths[:, None]
            rows, ids, weights = (
                rows[:, None].expand(-1, width).flatten(),
                ids.flatten(),
                weights.flatten(),
            )
        counts = torch.ones_like(ids, dtype=torch.int32) if weights is None else weights.int()
        self.counts.index_put_((rows, ids), counts, accumulate=True)

    def gather(
        self,
        rows: Tensor,
        rows_cpu: np.ndarray | Tensor | None = None,
        flags: Sequence[bool] | None = None,
    ) -> SamplingRows:
        """Parameters of a batch's rows. flags (`_FLAG_COLUMNS` order) fix the stages that
        run; else a host copy of the rows (rows_cpu, or the indices themselves when on the
        CPU) gives exact per-batch stage flags, and without one they cover every started row.
        Never a device sync."""
        if flags is None:
            host = rows_cpu if rows_cpu is not None else None
            if host is None and rows.device.type == "cpu":
                host = rows
            flags = self.stage_flags(host)
        rows = rows.to(self.device, torch.int64)
        floats = self._float_params[rows]  # [bs, 6]
        ints = self._int_params[rows]  # [bs, 2]
        values = {name: floats[:, i] for i, name in enumerate(_FLOAT_COLUMNS)}
        values |= {name: ints[:, i] for i, name in enumerate(_INT_COLUMNS)}
        values |= dict(zip(_FLAG_COLUMNS, flags, strict=True))
        return SamplingRows(**values)

    def stage_flags(self, rows_cpu: np.ndarray | Tensor | None) -> list[bool]:
        """`_FLAG_COLUMNS` for a batch: whether any of its rows (host copy; None: any started
        row) needs each stage. Host only."""
        flags = self._flags_cpu if rows_cpu is None else self._flags_cpu[np.asarray(rows_cpu)]
        return flags.any(axis=0).tolist()

    def needs(self, rows_cpu: np.ndarray) -> tuple[bool, bool]:
        """For a batch (host only, one look at the flags): whether any row needs more than the
        argmax of unpenalised logits, and whether any needs the sort behind top-k / top-p."""
        use_penalty, use_sampling, use_top_k, use_top_p, _ = self.stage_flags(rows_cpu)
        return use_penalty or use_sampling, use_top_k or use_top_p

    def penalize(self, logits: Tensor, rows: Tensor, params: SamplingRows) -> Tensor:
        """logits [bs, V] with the rows' penalties applied (the same tensor when none apply)."""
        if not params.use_penalty:
            return logits
        index = rows.to(self.device, torch.int64)
        return apply_penalties(logits, self.counts[index], self.prompt_mask[index], params)

    def sample(
        self,
        logits: Tensor,
        rows: Tensor,
        positions: Tensor,
        want_logprobs: bool = True,
        rows_cpu: np.ndarray | None = None,
        flags: Sequence[bool] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Sample one token per row. logits [bs, V] float32 (not mutated); rows
        [bs]; positions [bs]: absolute position of the token being generated.

        Returns token_ids [bs] int64 and, when want_logprobs, logprobs [bs] float32 (else
        None), both on the device: the log-softmax of the processed distribution the token was
        drawn from (temperature and filters); for greedy rows the log-softmax of the
        (penalised) logits at temperature 1. rows_cpu: a host copy of rows (exact
        stage flags); flags: the stages to run, fixed (see `fixed_flags`; what a CUDA graph
        captures). No host synchronisation.
        """
        params = self.gather(rows, rows_cpu, flags)
        logits = self.penalize(logits.float(), rows, params)  # [bs, V]
        if not params.use_sampling:
            token_ids = logits.argmax(dim=-1)
            return token_ids, pick_logprobs(logits, token_ids) if want_logprobs else None
        processed = process_logits(logits, params)  # [bs, V]
        sampled = sample_with_noise(processed, params.seed, positions.to(self.device))
        token_ids = torch.where(params.greedy, logits.argmax(dim=-1), sampled)
        return token_ids, pick_logprobs(processed, token_ids) if want_logprobs else None


def _row_flags(params: SamplingParams, top_k: int, vocab_size: int) -> list[bool]:
    """Host flags in `_FLAG_COLUMNS` order for one request's parameters."""
    sampling = params.draws
    return [
        params.penalised,
        sampling,
        sampling and top_k < vocab_size,
        sampling and params.top_p < 1.0,
        sampling and params.min_p > 0.0,
    ]


def pick_logprobs(logits: Tensor, token_ids: Tensor) -> Tensor:
    """log_softmax(logits)[b, token_ids[b]]: [bs] float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [bs, V]
    return logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
