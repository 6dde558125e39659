"""The triton backend against the torch_native reference, for every mode, page size and GQA
shape: decode (split-K), extend over a prefix in the pool, tree verify and multi-step draft
decode through tree-local masks, fixed query windows (the few-query kernel) and the batches
that kernel leaves to the extend kernel. CPU runs the kernels in Triton's interpreter
(float32, small sizes); CUDA adds bfloat16 and longer sequences."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from gpu_worker.attention import RopeArgs, create_attention_backend
from gpu_worker.attention.triton import ExtendMetadata, FewQueryMetadata, TritonBackend
from gpu_worker.kernels import batch_invariant
from gpu_worker.kernels import decode_attention as decode_attention_module
from gpu_worker.kernels import extend_attention as extend_module
from gpu_worker.kernels import few_query_attention as few_query_module
from gpu_worker.kv_cache import KVPool, ReqToTokenPool
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.speculative.draft_layout import draft_decode_mask
from gpu_worker.step.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from tests.devices import triton_devices


@dataclasses.dataclass
class Layer:
    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


def setups():
    cases = []
    for device in triton_devices():
        dtypes = (torch.float32,) if device == "cpu" else (torch.float32, torch.bfloat16)
        cases += [(device, dt) for dt in dtypes]
    return cases


SHAPES = [(4, 4, 16), (4, 2, 16), (9, 3, 64), (8, 2, 32)]  # heads, kv heads, head dim


class Pools:
    """A random KV pool (every slot filled) and a req_to_token table of shuffled pages."""

    def __init__(self, device, dtype, heads, kv_heads, head_dim, page_size, seed, max_len=160):
        gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.device, self.dtype, self.page_size = device, dtype, page_size
        num_rows, num_slots = 4, 4 * max_len + 64
        num_slots -= num_slots % page_size
        self.req = ReqToTokenPool(num_rows, max_len, device)
        self.kv = KVPool(num_slots, page_size, 2, kv_heads, head_dim, dtype, device)
        for layer in range(2):
            for buffer in self.kv.get_kv(layer):
                buffer.copy_(torch.randn(buffer.shape, generator=gen).to(dtype))
        pages = list(range(1, num_slots // page_size + 1))
        self.rng.shuffle(pages)
        per_row = max_len // page_size
        for row in range(1, num_rows + 1):
            own = pages[(row - 1) * per_row : row * per_row]
            slots = [p * page_size + j for p in own for j in range(page_size)]
            self.req.req_to_token[row, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        self.layer = Layer(1, heads, kv_heads, head_dim, head_dim**-0.5)
        self.gen = gen
        self.backends = {}
        cache = RotaryEmbedding(head_dim, 10000.0).build_cos_sin_cache(max(512, max_len), device)
        self.rope = RopeArgs(cache)

    def with_qk_norm(self) -> Pools:
        d = self.layer.head_dim
        norms = [torch.randn(d, generator=self.gen).to(self.device, self.dtype) for _ in range(2)]
        self.rope = RopeArgs(self.rope.cos_sin_cache, *norms, 1e-6)
        return self

    def qkv(self, num_tokens: int) -> torch.Tensor:
        width = (self.layer.num_heads + 2 * self.layer.num_kv_heads) * self.layer.head_dim
        return torch.randn(num_tokens, width, generator=self.gen).to(self.device, self.dtype)

    def run_metadata(self, batch: ForwardBatch):
        """The triton backend's metadata for batch (the launch shape it chooses)."""
        self.run("triton", batch, self.qkv(batch.num_tokens))  # creates the backend
        return self.backends["triton"].init_forward_metadata(batch)

    def run(self, name: str, batch: ForwardBatch, qkv: torch.Tensor) -> torch.Tensor:
        """One backend per name for the pools' life, so a second launch sees the split-K
        counters the first one left (they must be back at zero)."""
        if name not in self.backends:
            self.backends[name] = create_attention_backend(
                name, self.req, self.kv, self.layer.num_heads
            )
        backend = self.backends[name]
        batch = dataclasses.replace(
            batch, attn_backend=backend, attn_metadata=backend.init_forward_metadata(batch)
        )
        return backend.attend(qkv, self.layer, batch, self.rope).float()


def batch_of(pools: Pools, mode, rows, committed_lens, extend_lens, custom_mask=None):
    ids = [[1] * n for n in extend_lens]
    slots = [
        pools.req.req_to_token[r, p : p + n].tolist()
        for r, p, n in zip(rows, committed_lens, extend_lens, strict=True)
    ]
    return build_forward_batch(
        mode, ids, committed_lens, slots, rows, pools.device, custom_mask=custom_mask
    )


def random_trees(rng: random.Random, bs: int, nd: int) -> torch.Tensor:
    """[bs, nd, nd] ancestor masks of random trees: node k's parent is an earlier node."""
    masks = torch.zeros(bs, nd, nd, dtype=torch.bool)
    for b in range(bs):
        parents = [-1] + [rng.randrange(k) for k in range(1, nd)]
        for k in range(nd):
            node = k
            while node != -1:
                masks[b, k, node] = True
                node = parents[node]
    return masks


@pytest.fixture(autouse=True)
def captured_launches(monkeypatch):
    """Launches as in a CUDA graph capture, where a batch of equal short chunks always takes
    the few-query kernel (eagerly, only at one request's split count: tested below)."""
    monkeypatch.setattr(TritonBackend, "_capturing", lambda self: True)


def check(pools: Pools, batch: ForwardBatch) -> None:
    """Both backends from the same pool: the same outputs and the same K/V stored."""
    qkv = pools.qkv(batch.num_tokens)
    layer_kv = pools.kv.get_kv(pools.layer.layer_id)
    before = [b.clone() for b in layer_kv]
    out = pools.run("triton", batch, qkv)
    after_triton = [b.clone() for b in layer_kv]
    for buffer, saved in zip(layer_kv, before, strict=True):
        buffer.copy_(saved)
    ref = pools.run("torch_native", batch, qkv)
    tol = 1e-4 if pools.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for got, want in zip(after_triton, layer_kv, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("device, dtype", setups())
@pytest.mark.parametrize("heads, kv_heads, head_dim", [*SHAPES, (4, 2, 80)])  # 80: no power of 2
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_decode(device, dtype, heads, kv_heads, head_dim, page_size, qk_norm):
    """The fused decode kernel: RoPE (and q/k norm), the K/V store, split-K attention."""
    pools = Pools(device, dtype, heads, kv_heads, head_dim, page_size, seed=heads + page_size)
    if qk_norm:
        pools.with_qk_norm()
    seq_lens = [1, 37, 64, 150]  # one key; a partial block; a whole block; several blocks
    batch = batch_of(pools, ForwardMode.DECODE, [1, 2, 3, 4], [n - 1 for n in seq_lens], [1] * 4)
    check(pools, batch)


@pytest.mark.parametrize("device, dtype", setups())
@pytest.mark.parametrize("min_keys, block_n", [(1, 64), (128, 64), (512, 64), (64, 32), (256, 256)])
def test_decode_split_policies(device, dtype, min_keys, block_n, monkeypatch):
    """However many keys a split must cover at least, and however many a loop iteration
    reads: requests served by one split (written directly) and by several (combined), uneven
    runs of blocks included; twice, since the combining program resets its counter."""
    monkeypatch.setattr(decode_attention_module, "MIN_KEYS_PER_SPLIT", min_keys)
    monkeypatch.setattr(decode_attention_module, "choose_launch", lambda *_: (block_n, 4))
    pools = Pools(device, dtype, 9, 3, 64, page_size=4, seed=min_keys, max_len=320)
    seq_lens = [1, 150, 300, 64]
    batch = batch_of(pools, ForwardMode.DECODE, [1, 2, 3, 4], [n - 1 for n in seq_lens], [1] * 4)
    check(pools, batch)
    check(pools, batch)


def test_few_query_launches_read_a_power_of_two_keys_per_iteration():
    for head_dim in (16, 48, 64, 80, 96, 128, 256):
        for block_m in (16, 32, 64):
            block_n = few_query_module.choose_launch(block_m, head_dim).block_n
            assert 32 <= block_n <= 256 and block_n & (block_n - 1) == 0


def test_decode_launches_read_a_power_of_two_keys_per_iteration():
    """tl.arange needs a power of 2: head dims such as 80 or 96 must not give 204 or 170."""
    for head_dim in (16, 48, 64, 80, 96, 100, 128, 256):
        for bs in (1, 8, 64, 512):
            block_n, warps = decode_attention_module.choose_launch(bs, 8, head_dim)
            assert 32 <= block_n <= 256 and block_n & (block_n - 1) == 0 and warps in (2, 4)


@pytest.mark.parametrize("device, dtype", setups())
@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_over_a_prefix(device, dtype, heads, kv_heads, head_dim, page_size):
    pools = Pools(device, dtype, heads, kv_heads, head_dim, page_size, seed=7 * heads)
    # a fresh prompt, a chunk after a prefix, one token after a long prefix, a long chunk
    batch = batch_of(pools, ForwardMode.EXTEND, [2, 1, 4, 3], [0, 21, 90, 5], [13, 30, 1, 70])
    check(pools, batch)


@pytest.mark.parametrize("device, dtype", setups())
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, page_size, min_keys",  # min_keys: a split per key block, 64
    [(4, 2, 16, 4, 1), (9, 3, 64, 1, 64), (4, 2, 16, 1, None)],  # keys, or the default
)
def test_few_new_tokens_over_a_long_prefix_split_the_keys(
    device, dtype, heads, kv_heads, head_dim, page_size, min_keys, monkeypatch
):
    """A prompt reusing a cached prefix: too few query blocks to fill the SMs (64 here), so
    the keys are split and the partials combined. Causal, and through a tree-local mask too
    wide for the few-query kernel; with ranges of one split and of several."""
    if min_keys is not None:
        monkeypatch.setattr(extend_module, "MIN_SPLIT_KEYS", min_keys)
    pools = Pools(device, dtype, heads, kv_heads, head_dim, page_size, seed=11 * heads)
    monkeypatch.setattr(TritonBackend, "__init__", with_sms(TritonBackend.__init__, 64))
    one = batch_of(pools, ForwardMode.EXTEND, [3], [150], [1])
    few = batch_of(pools, ForwardMode.EXTEND, [1, 4], [120, 33], [5, 2])
    width = 40  # 40 x (heads / kv heads) rows: more than a few-query tile
    mask = (torch.rand(1, width, width, generator=pools.gen) < 0.5) | torch.eye(width).bool()
    tree = batch_of(pools, ForwardMode.TARGET_VERIFY, [2], [100], [width], mask)
    for batch in (one, few, tree):
        meta = pools.run_metadata(batch)
        assert isinstance(meta, ExtendMetadata) and meta.num_splits > 1
        check(pools, batch)


def with_sms(init, num_sms: int):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.num_sms = num_sms

    return patched


@pytest.mark.parametrize("device, dtype", setups())
@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES[1:3])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("min_keys", [1, None])  # a split per key block; the default
def test_tree_verify_with_a_tree_local_mask(
    device, dtype, heads, kv_heads, head_dim, page_size, min_keys, monkeypatch
):
    if min_keys:  # narrow key blocks, so that requests span several and are combined
        monkeypatch.setattr(decode_attention_module, "MIN_KEYS_PER_SPLIT", min_keys)
        monkeypatch.setattr(
            few_query_module, "choose_launch", lambda *_: few_query_module.Knobs(32)
        )
    pools = Pools(device, dtype, heads, kv_heads, head_dim, page_size, seed=11)
    nd, committed_lens = 8, [0, 17, 64, 100]
    masks = random_trees(pools.rng, len(committed_lens), nd)
    batch = batch_of(
        pools, ForwardMode.TARGET_VERIFY, [3, 1, 4, 2], committed_lens, [nd] * 4, custom_mask=masks
    )
    assert isinstance(few_query_metadata(pools, batch), FewQueryMetadata)
    check(pools, batch)


@pytest.mark.parametrize("device, dtype", setups())
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("step", [0, 2])
def test_draft_decode_over_branch_local_keys(device, dtype, page_size, step):
    """topk rows per request over seq + topk*S keys; each row sees the prefix and its own
    branch's drafts so far (the layout of speculative.draft_layout)."""
    pools = Pools(device, dtype, 8, 2, 32, page_size, seed=step)
    topk, steps, seq = 4, 3, [9, 40, 71]
    mask = draft_decode_mask(len(seq), topk, steps, step, device)  # [bs, topk, topk*S], shared
    width = topk * steps
    batch = batch_of(
        pools,
        ForwardMode.DRAFT_DECODE,
        [2, 3, 1],
        [s + width - topk for s in seq],
        [topk] * 3,
        custom_mask=mask,
    )
    assert isinstance(few_query_metadata(pools, batch), FewQueryMetadata)
    check(pools, batch)


@pytest.mark.parametrize("device, dtype", setups())
def test_an_eager_batch_runs_few_query_only_with_one_requests_split_count(
    device, dtype, monkeypatch
):
    """The split count is a constexpr: an eager batch of equal short chunks (a draft pass over
    prompts or a catch-up) whose batch size would split differently from one request takes the
    extend kernel, not a few-query variant the warm-up never compiled; same attention."""
    monkeypatch.undo()  # an eager launch
    pools = Pools(device, dtype, 9, 3, 64, page_size=1, seed=11)
    backend = create_attention_backend("triton", pools.req, pools.kv, pools.layer.num_heads)
    backend.num_sms = 12  # one request splits 8 ways, four 2 ways
    batch = batch_of(pools, ForwardMode.DRAFT_EXTEND, [1, 2, 3, 4], [5, 40, 9, 70], [2] * 4)
    assert isinstance(backend.init_forward_metadata(batch), ExtendMetadata)
    one = batch_of(pools, ForwardMode.DRAFT_EXTEND, [3], [9], [2])
    assert isinstance(backend.init_forward_metadata(one), FewQueryMetadata)
    check(pools, batch)


def test_an_eager_batch_runs_few_query_only_where_it_takes_pdl_as_one_request_does(monkeypatch):
    """PDL is a constexpr too, on for launches of up to pdl.MAX_ROWS rows: an eager batch of
    short chunks whose rows pass that limit (three requests of two tokens) would need the
    variant without PDL, which one request of two tokens never compiles; it takes the extend
    kernel. Chunks past the limit alone (five tokens) are without PDL either way."""
    from gpu_worker.kernels import pdl

    monkeypatch.undo()  # an eager launch
    pools = Pools("cpu", torch.float32, 9, 3, 64, page_size=1, seed=11)
    backend = create_attention_backend("triton", pools.req, pools.kv, pools.layer.num_heads)
    backend.num_sms = 1  # one split at every batch size
    monkeypatch.setattr(pdl, "enabled", lambda device: True)  # as on an H100
    kinds = {}
    for n, bs in [(2, 1), (2, 2), (2, 3), (5, 1), (5, 2)]:
        batch = batch_of(
            pools, ForwardMode.DRAFT_EXTEND, list(range(1, bs + 1)), [40] * bs, [n] * bs
        )
        kinds[n, bs] = type(backend.init_forward_metadata(batch))
    assert kinds == {
        (2, 1): FewQueryMetadata,
        (2, 2): FewQueryMetadata,
        (2, 3): ExtendMetadata,
        (5, 1): FewQueryMetadata,
        (5, 2): FewQueryMetadata,
    }


def few_query_metadata(pools: Pools, batch: ForwardBatch):
    backend = create_attention_backend("triton", pools.req, pools.kv, pools.layer.num_heads)
    return backend.init_forward_metadata(batch)


@pytest.mark.parametrize("device, dtype", setups())
@pytest.mark.parametrize("heads, kv_heads, head_dim", SHAPES)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fixed_windows_run_the_few_query_kernel(
    device, dtype, heads, kv_heads, head_dim, page_size, qk_norm, monkeypatch
):
    """The same number of queries per request, causal (the draft extend's fixed S+1 windows):
    RoPE (and q/k norm) and the K/V store in the kernel, split-K over the keys, GQA grouped;
    twice in a row, since the last program of each (request, KV head) resets its counter
    (a split per narrow key block, so that the splits are combined)."""
    monkeypatch.setattr(decode_attention_module, "MIN_KEYS_PER_SPLIT", 1)
    monkeypatch.setattr(few_query_module, "choose_launch", lambda *_: few_query_module.Knobs(32))
    pools = Pools(device, dtype, heads, kv_heads, head_dim, page_size, seed=3 * heads)
    if qk_norm:
        pools.with_qk_norm()
    batch = batch_of(pools, ForwardMode.DRAFT_EXTEND, [4, 2, 3, 1], [0, 17, 64, 100], [4] * 4)
    assert isinstance(few_query_metadata(pools, batch), FewQueryMetadata)
    check(pools, batch)
    check(pools, batch)


@pytest.mark.parametrize("device, dtype", setups())
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("block_n, min_keys", [(32, 1), (128, None), (256, None), (256, 512)])
def test_few_query_launch_knobs(device, dtype, tree, block_n, min_keys, monkeypatch):
    """Whatever keys a loop iteration reads and a split covers at least: one split written
    directly (few keys, or two blocks that one program reads faster than two combined),
    several combined (1,004 keys: two splits for every knob on CPU), and a request alone,
    whose 196 keys in 32-key blocks make seven splits, the last holding only the new keys;
    causal windows and tree-local masks; twice, since the combine resets counters."""
    knobs = few_query_module.Knobs(block_n, min_keys, 4)
    monkeypatch.setattr(few_query_module, "choose_launch", lambda *_: knobs)
    pools = Pools(device, dtype, 9, 3, 64, page_size=4, seed=block_n, max_len=1024)
    nd, committed_lens = 4, [0, 64, 252, 1000]
    masks = None
    if tree:  # node 1 and 2 children of the root, node 3 of node 1
        parents = [-1, 0, 0, 1]
        masks = torch.zeros(len(committed_lens), nd, nd, dtype=torch.bool)
        for k in range(nd):
            node = k
            while node != -1:
                masks[:, k, node], node = True, parents[node]
    mode = ForwardMode.TARGET_VERIFY if tree else ForwardMode.DRAFT_EXTEND
    alone = None if masks is None else masks[:1]
    for batch in (
        batch_of(pools, mode, [3, 1, 4, 2], committed_lens, [nd] * 4, custom_mask=masks),
        batch_of(pools, mode, [2], [192], [nd], custom_mask=alone),
    ):
        assert isinstance(few_query_metadata(pools, batch), FewQueryMetadata)
        check(pools, batch)
        check(pools, batch)


@pytest.mark.parametrize("device, dtype", setups())
def test_batches_the_few_query_kernel_does_not_take(device, dtype):
    """Ragged query counts, and more queries than one tile holds, run the extend kernel."""
    pools = Pools(device, dtype, 8, 2, 32, 1, seed=5)
    ragged = batch_of(pools, ForwardMode.DRAFT_EXTEND, [1, 2], [10, 30], [3, 4])
    wide = batch_of(pools, ForwardMode.DRAFT_EXTEND, [1, 2], [10, 30], [17, 17])  # 68 rows
    prefill = batch_of(pools, ForwardMode.EXTEND, [1, 2], [10, 30], [4, 4])
    for batch in (ragged, wide, prefill):
        assert isinstance(few_query_metadata(pools, batch), ExtendMetadata)
        check(pools, batch)


def test_outgrown_split_scratch_stays_alive():
    """A batch larger than the scratch gets a larger one; the old one is kept, since a captured
    graph's launches may still write into it (decode's scratch is the one-query entry)."""
    if "cpu" not in triton_devices():
        pytest.skip("triton does not run on CPU here")
    pools = Pools("cpu", torch.float32, 8, 2, 32, 1, seed=1)
    backend = create_attention_backend("triton", pools.req, pools.kv, pools.layer.num_heads)
    for queries in (1, 4):
        first = backend._scratch(queries, 2)
        assert first.max_bs >= pools.req.num_rows and backend._scratch(queries, 1) is first
        grown = backend._scratch(queries, first.max_bs + 3)
        assert grown.max_bs >= first.max_bs + 3 and backend.scratch[queries] is grown
        assert any(old is first for old in backend.retired_scratch)


@pytest.mark.parametrize("device, dtype", setups())
@pytest.mark.parametrize("num_splits", [1, 4])
def test_extend_rows_of_no_request_are_zero(device, dtype, num_splits, monkeypatch):
    """Tokens past the last request's (a prefill graph's padding) get zeros, not whatever
    memory the output held: their K/V then go finite into the dummy slot. The output's block
    is first dirtied with a freed tensor of the same size, which an uninitialised allocation
    would reuse. Split, the combine writes those rows, from partials nobody wrote."""
    from gpu_worker.kernels.extend_attention import extend_attention

    monkeypatch.setattr(extend_module, "MIN_SPLIT_KEYS", 1)
    pools = Pools(device, dtype, 8, 2, 32, 1, seed=9)
    batch = batch_of(pools, ForwardMode.EXTEND, [1, 2], [0, 10], [5, 3])
    q = torch.randn(batch.num_tokens + 6, 8 * 32, generator=pools.gen).to(device, dtype)
    dirty = torch.full_like(q, float("nan"))
    del dirty
    k_buffer, v_buffer = pools.kv.get_kv(pools.layer.layer_id)
    lens = batch.extend_seq_lens
    starts = torch.cumsum(lens, 0) - lens
    o = extend_attention(
        q,
        k_buffer,
        v_buffer,
        pools.req.req_to_token,
        batch.rows,
        batch.seq_lens,
        lens,
        starts,
        5,
        32**-0.5,
        num_splits=num_splits,
    )
    assert torch.equal(o[batch.num_tokens :], torch.zeros_like(o[batch.num_tokens :]))
    assert torch.isfinite(o[: batch.num_tokens]).all()


@pytest.mark.parametrize("device, dtype", setups())
# query heads per KV head: 1, 3 (blocks of 5 queries, a row spare), 32 (wider blocks)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 16), (9, 3, 64), (32, 1, 16)])
def test_the_deterministic_launch_of_every_mode(device, dtype, heads, kv_heads, head_dim):
    """With the deterministic mode on, decode, prefill over a prefix, a chain and a tree
    verify and a draft decode all run the invariant extend launch, and it computes what
    torch_native does (its bits across modes: tests/gpu_worker/test_deterministic.py)."""
    pools = Pools(device, dtype, heads, kv_heads, head_dim, 4, seed=3 * heads + kv_heads)
    nd = 6
    tree = random_trees(pools.rng, 2, nd)
    chain = torch.ones(2, nd, nd, dtype=torch.bool).tril()
    verify = ForwardMode.TARGET_VERIFY
    batches = [
        batch_of(pools, ForwardMode.DECODE, [3, 1, 2], [0, 70, 129], [1, 1, 1]),
        batch_of(pools, ForwardMode.EXTEND, [2, 1, 4, 3], [0, 21, 90, 5], [13, 30, 1, 40]),
        batch_of(pools, verify, [4, 2], [64, 17], [nd, nd], custom_mask=chain),
        batch_of(pools, verify, [1, 3], [100, 0], [nd, nd], custom_mask=tree),
        batch_of(
            pools,
            ForwardMode.DRAFT_DECODE,
            [2, 3],
            [40 + 8, 9 + 8],
            [4, 4],
            custom_mask=draft_decode_mask(2, 4, 3, 2, device),
        ),
    ]
    batch_invariant.enable()
    try:
        for batch in batches:
            meta = pools.run_metadata(batch)
            assert isinstance(meta, ExtendMetadata) and meta.invariant, batch.mode
            check(pools, batch)
    finally:
        batch_invariant.enable(False)
