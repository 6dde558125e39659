"""Kernels compile for the H100 (sm_90) here, with no GPU: the interpreter CI runs the kernels
in does not type-check them, and some programs it runs the CUDA compiler refuses (a runtime
branch that retypes a tensor, for one). Compiling needs Triton out of interpreter mode, so it
runs in a subprocess without TRITON_INTERPRET."""

from __future__ import annotations

from tests.devices import compile_outside_the_interpreter

SCRIPT = r"""
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gpu_worker.kernels.decode_attention import _decode_kernel
from gpu_worker.kernels.few_query_attention import _few_query_kernel
from gpu_worker.kernels.small_m_linear import _small_m_linear_kernel


def compile_for_sm90(fn, types, const):
    # with and without PDL; with it, the PTX must wait on the grid (griddepcontrol.wait)
    for pdl in (False, True):
        full = {**const, "USE_PDL": pdl}
        signature = {**types, **{name: "constexpr" for name in full}}
        constexprs = {(fn.arg_names.index(name),): value for name, value in full.items()}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32),
                                options={"launch_pdl": pdl})
        waits = kernel.asm["ptx"].count("griddepcontrol.wait")
        assert (waits > 0) == pdl, (fn.__name__, pdl, waits)


types = {"q_ptr": "*bf16", "positions_ptr": "*i64", "cache_ptr": "*bf16", "q_norm_ptr": "*bf16",
         "k_norm_ptr": "*bf16", "loc_ptr": "*i64", "k_ptr": "*bf16", "v_ptr": "*bf16",
         "o_ptr": "*bf16", "req_to_token_ptr": "*i32", "rows_ptr": "*i64",
         "seq_lens_ptr": "*i64", "mask_ptr": "*u8", "partial_o_ptr": "*fp32",
         "partial_lse_ptr": "*fp32", "counter_ptr": "*i32", "q_stride": "i32",
         "req_to_token_stride": "i32", "mask_batch_stride": "i32", "scale_log2": "fp32",
         "eps": "fp32"}
# 8B-shaped heads; the query tile (32 rows) and the new-key tile (16) differ in size.
for fused, width, norm in [(True, 0, False), (True, 8, True), (False, 24, False)]:
    const = dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_HALF=64, NUM_QUERIES=8,
                 BLOCK_M=32, BLOCK_Q=16, BLOCK_N=64, NUM_SPLITS=16, MIN_BLOCKS_PER_SPLIT=4,
                 MASK_WIDTH=width,
                 FUSED=fused, HAS_NORM=norm, DOT_PRECISION="tf32")
    compile_for_sm90(_few_query_kernel, types, const)
decode_types = {**{k: v for k, v in types.items() if k not in ("q_ptr", "mask_ptr",
                                                                "q_stride", "mask_batch_stride")},
                "qkv_ptr": "*bf16", "qkv_stride": "i32"}
for norm, block_n in ((False, 64), (True, 256)):
    compile_for_sm90(_decode_kernel, decode_types, dict(
        NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_HALF=64, BLOCK_H=16, BLOCK_N=block_n,
        NUM_SPLITS=16, MIN_BLOCKS_PER_SPLIT=2, HAS_NORM=norm, DOT_PRECISION="tf32"))
# The few-row projections: one tile (the weight read before the wait; one row, and two rows
# per program as 2-4 rows run) and the loop over K (all rows in each program).
for prologue, block_k, rows, block_n, one_tile in ((2, 1024, 1, 4, True), (3, 2048, 1, 4, True),
                                                   (2, 1024, 2, 8, True), (3, 2048, 2, 8, True),
                                                   (0, 512, 4, 4, False)):
    compile_for_sm90(_small_m_linear_kernel, {
        "x_ptr": "*bf16", "res_ptr": "*bf16", "sum_ptr": "*bf16", "norm_w_ptr": "*bf16",
        "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
        "K": "i32", "x_stride": "i32", "res_stride": "i32", "out_stride": "i32", "eps": "fp32",
    }, dict(PROLOGUE=prologue, HAS_BIAS=False, BLOCK_M=rows, BLOCK_N=block_n, BLOCK_K=block_k,
            ONE_TILE=one_tile))
# Greedy acceptance (no PDL: it follows a library argmax): a chain and a tree.
from gpu_worker.kernels.greedy_accept import _greedy_accept_kernel
accept_types = {name: "*i64" for name in ("tokens_ptr", "target_ptr", "next_token_ptr",
                                          "next_sibling_ptr", "predict_ptr", "accept_index_ptr",
                                          "accept_lens_ptr", "emitted_ptr")}
accept_types.update(features_ptr="*bf16", out_features_ptr="*bf16", kids_stride="i32",
                    siblings_stride="i32", feature_stride="i32", feature_width="i32",
                    out_feature_stride="i32")
for nd, steps, topk in ((4, 3, 1), (8, 4, 4)):
    const = dict(ND=nd, ND_P2=nd, STEPS=steps, WIDTH_P2=8, TOPK=topk, BLOCK_F=512)
    fn = _greedy_accept_kernel
    triton.compile(ASTSource(fn=fn, signature={**accept_types, **{k: "constexpr" for k in const}},
                             constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}),
                   target=GPUTarget("cuda", 90, 32))
# The end of an EAGLE iteration: a chain's state and a tree's.
from gpu_worker.kernels.row_commit import _commit_rows_kernel
commit_types = {name: "*i64" for name in ("committed_lens_ptr", "newest_ptr", "rows_ptr",
                                          "accept_lens_ptr", "tokens_ptr", "topk_index_ptr",
                                          "new_topk_index_ptr", "last_ptr")}
commit_types.update(topk_p_ptr="*fp32", new_topk_p_ptr="*fp32", hidden_ptr="*bf16",
                    new_hidden_ptr="*bf16", tokens_stride="i32", new_topk_p_stride="i32",
                    new_topk_index_stride="i32", new_hidden_stride="i32", hidden_width="i32")
for topk in (1, 4):
    const = dict(TOPK=topk, TOPK_P2=topk, BLOCK_H=1024)
    fn = _commit_rows_kernel
    triton.compile(ASTSource(fn=fn, signature={**commit_types, **{k: "constexpr" for k in const}},
                             constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}),
                   target=GPUTarget("cuda", 90, 32))
# The peer all-reduce: system-scope signals (release) and waits (acquire), 16-byte accesses.
from gpu_worker.kernels.peer_all_reduce import _one_shot_kernel, _two_shot_kernel
for fn, dtype, pdl in ((_one_shot_kernel, "*bf16", True), (_two_shot_kernel, "*fp32", False)):
    names = ("x_ptr", "n", "span", "part", "slot")
    types = {"x_ptr": dtype, "n": "i32", "part": "i32", "span": "i32", "slot": "i32",
             "bufs_ptr": "*i64", "pad_ptrs_ptr": "*i64", "counts_ptr": "*i64", "rank": "i32"}
    types = {k: v for k, v in types.items() if k in fn.arg_names}
    const = dict(WORLD=4, MAX_RANKS=8, BLOCK=1024, USE_PDL=pdl)
    index = fn.arg_names.index
    ptx = triton.compile(
        ASTSource(fn=fn, signature={**types, **{k: "constexpr" for k in const}},
                  constexprs={(index(k),): v for k, v in const.items()},
                  attrs={(index(k),): [["tt.divisibility", 16]] for k in names if k in types}),
        target=GPUTarget("cuda", 90, 32), options={"launch_pdl": pdl}).asm["ptx"]
    assert "atom.global.sys.release.exch.b64" in ptx and "ld.global.sys.acquire.b64" in ptx
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, fn.__name__
    assert ("griddepcontrol.wait" in ptx) == pdl
# The deterministic mode's attention: whole rows, causal and a tree node per program.
from gpu_worker.kernels.extend_attention import _extend_kernel as fn
types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16",
         "req_to_token_ptr": "*i32", "rows_ptr": "*i64", "seq_lens_ptr": "*i64",
         "extend_seq_lens_ptr": "*i64", "extend_start_loc_ptr": "*i64", "mask_ptr": "*u8",
         "req_to_token_stride": "i32", "scale_log2": "fp32", "mask_batch_stride": "i32",
         "mask_width": "i32", "partial_o_ptr": "*fp32", "partial_lse_ptr": "*fp32",
         "min_split_keys": "i32"}
for tree in (False, True):
    const = dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16,
                 BLOCK_N=64, HAS_MASK=tree, DOT_PRECISION="tf32", NUM_SPLITS=1,
                 INVARIANT=True, ONE_QUERY=tree, WIDTH_P2=16,
                 QUERIES=1 if tree else 4)
    triton.compile(ASTSource(fn=fn, signature={**types, **{k: "constexpr" for k in const}},
                             constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}),
                   target=GPUTarget("cuda", 90, 32))
# The deterministic mode's projection: bf16 on the tensor cores, float32 in full precision, at
# each launch shape config_for gives the 135M and 8B shapes.
from gpu_worker.kernels.batch_invariant import _invariant_linear_kernel as fn, config_for
numerics = (("*bf16", "tf32", 2), ("*fp32", "ieee", 4))
weights = ((960, 576), (576, 1536), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
for (dtype, precision, size), (n, k) in itertools.product(numerics, weights):
    cfg = config_for(n, k, size)
    types = {"x_ptr": dtype, "w_ptr": dtype, "b_ptr": dtype, "out_ptr": dtype, "M": "i32",
             "N": "i32", "K": "i32", "x_stride": "i32", "out_stride": "i32"}
    const = dict(HAS_BIAS=True, BLOCK_M=64, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 DOT_PRECISION=precision, USE_PDL=size == 2)
    triton.compile(ASTSource(fn=fn, signature={**types, **{k: "constexpr" for k in const}},
                             constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}),
                   target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
print("compiled")
"""


def test_kernels_compile_for_sm90_with_and_without_pdl():
    compile_outside_the_interpreter(SCRIPT)
