"""The MoE decode kernels compile for a Hopper GPU (sm_90), checked on the CPU
(``tests/support/hopper_compile.py``): the per-pair gate/up and down GEMVs at the tiles gemv_config
gives Qwen3-30B-A3B's and Mixtral-8x7B's shapes at batch 1 and 2 (down with and without the
residual add of ``moe_residual``), the router's top-k at their expert
counts and top-k, the expert-load counter, the router's GEMV (plain ``linear``) and the residual add
after the experts; with and without PDL."""

from __future__ import annotations

from kiln.kernels import elementwise, gemv, moe_gemm, moe_routing
from kiln.kernels.config import DEFAULTS
from kiln.kernels.gemv import gemv_config
from tests.support.hopper_compile import compile_for_hopper, run_compile_module

_POINTER_TYPES = {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "y_ptr": "*bf16", "ids_ptr": "*i32",
                  "route_ptr": "*fp32", "logits_ptr": "*bf16", "weights_ptr": "*fp32", "counts_ptr": "*i64",
                  "slots_ptr": "*i32", "a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
                  "nw_ptr": "*bf16", "r_ptr": "*bf16"}
# (hidden, expert intermediate, top-k) of Qwen3-30B-A3B and Mixtral-8x7B.
_SHAPES = [(2048, 768, 8), (4096, 14336, 2)]
H100_SMS = 132


def compile_all() -> None:
    # (kernel, its constants) for each tile the two shapes take at one and two tokens.
    variants = set()
    for hidden, inter, top_k in _SHAPES:
        for tokens in (1, 2):
            up = gemv_config(1, 2 * inter, hidden, -(-H100_SMS // (tokens * top_k)), DEFAULTS)
            down = gemv_config(1, hidden, inter, -(-H100_SMS // tokens), DEFAULTS)
            variants.add((moe_gemm._pair_gate_up_kernel, (("BLOCK_N", up.block_n), ("BLOCK_K", up.block_k))))
            for residual in (False, True):
                variants.add((moe_gemm._pair_down_sum_kernel, (
                    ("BLOCK_N", down.block_n), ("BLOCK_K", down.block_k), ("TOP_K_POW2", top_k),
                    ("HAS_RESIDUAL", residual))))
    for pdl in (True, False):
        for kernel, constants in sorted(variants, key=str):
            compile_for_hopper(kernel, dict(constants, PDL=pdl), _POINTER_TYPES,
                               not_divisible=frozenset({"top_k", "expert_offset"}))
        for experts, top_k in ((128, 8), (8, 2)):
            compile_for_hopper(moe_routing._router_topk_kernel, dict(
                TOP_K=top_k, RENORMALIZE=top_k > 2, E_POW2=experts, K_POW2=top_k, PDL=pdl), _POINTER_TYPES,
                num_warps=1)
        compile_for_hopper(moe_routing._count_experts_kernel, dict(E_POW2=128, CHUNK=64, PDL=pdl), _POINTER_TYPES,
                           not_divisible=frozenset({"pairs", "top_k"}))
        router = gemv_config(1, 128, 2048, H100_SMS, DEFAULTS)
        compile_for_hopper(gemv._gemv_kernel, dict(
            PROLOGUE=0, HAS_BIAS=False, HAS_RESIDUAL=False, USE_DOT=False, DOT_F32=False, BLOCK_T=1,
            BLOCK_N=router.block_n, BLOCK_K=router.block_k, ONE_TILE=True, NORM_BLOCK_K=2048, PDL=pdl), _POINTER_TYPES,
            not_divisible=frozenset({"T"}))
        compile_for_hopper(elementwise._rows_kernel, dict(OP=1, BLOCK=1024, PDL=pdl), _POINTER_TYPES)


def test_moe_decode_kernels_compile_for_hopper(tmp_path):
    run_compile_module("tests.kernels.test_moe_compiles", tmp_path)


if __name__ == "__main__":
    compile_all()
