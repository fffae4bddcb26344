"""Generated rope_kv_store kernels against the torch reference (under TRITON_INTERPRET=1 on a CPU),
with fresh random inputs over several shapes: odd head counts, partial rotary dims, q/k norm on and
off, padding slots, row-strided views, f32 and bf16."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kiln.compiler.codegen.triton_fused import generated_kernel
from kiln.ir import DType, TensorType, make_node
from kiln.kernels import KernelConfig
from kiln.kernels.rope_kv_store import ref_rope_kv_store
from kiln.tensors import ir_dtype

SHAPES = [  # (heads, kv_heads, head_dim, rot, norm)
    (4, 2, 16, 16, False),
    (3, 1, 24, 24, True),
    (6, 3, 20, 12, False),
    (8, 8, 32, 32, True),
]


def load(source: str, tmp_path):
    file = tmp_path / "kernel.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location("generated_kernel_under_test", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.launch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, rot, norm", SHAPES)
def test_generated_rope_kv_store_matches_reference(tmp_path, dtype, heads, kv_heads, head_dim, rot, norm):
    torch.manual_seed(heads * 100 + head_dim)
    tokens, slots_total, max_pos = 7, 40, 64
    # q/k/v as column views of one fused projection, as the qkv split leaves them.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = torch.split(qkv, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, max_pos, (tokens,), dtype=torch.int32)
    cos_sin = torch.randn(max_pos, rot, dtype=torch.float32)
    slots = torch.randperm(slots_total)[:tokens].to(torch.int32)
    slots[3] = -1  # a padding row: nothing stored
    norms = (1 + 0.1 * torch.randn(head_dim, dtype=dtype), 1 + 0.1 * torch.randn(head_dim, dtype=dtype)) if norm \
        else ()
    eps = 1e-6 if norm else 0.0

    caches = [torch.randn(slots_total, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    expected_q, expected_kc, expected_vc = ref_rope_kv_store(q, k, v, positions, cos_sin, caches[0].clone(),
                                                             caches[1].clone(), slots, *norms, eps=eps)

    d = ir_dtype(dtype)
    types = [TensorType(("T", heads, head_dim), d), TensorType(("T", kv_heads, head_dim), d),
             TensorType(("T", kv_heads, head_dim), d), TensorType(("T",), DType.i32),
             TensorType((max_pos, rot), DType.f32), TensorType(("NS", kv_heads, head_dim), d),
             TensorType(("NS", kv_heads, head_dim), d), TensorType(("T",), DType.i32)]
    types += [TensorType((head_dim,), d)] * len(norms)
    names = ["q", "k", "v", "pos", "cs", "kc", "vc", "slots", "qn", "kn"][:len(types)]
    node = make_node("rope_kv_store", names, ["qr", "kc2", "vc2"], types, {"eps": eps})
    name, source = generated_kernel(node, types)
    launch = load(source, tmp_path)

    out = torch.full_like(q, float("nan"))
    k_cache, v_cache = caches[0].clone(), caches[1].clone()
    launch(q, k, v, positions, cos_sin, k_cache, v_cache, slots, *norms, out=out, eps=eps, config=KernelConfig())
    # The interpreter truncates f32 -> bf16 casts instead of rounding them: one bf16 ulp (~1/128
    # relative) per rounding step; f32 differs only by summation order in the norm.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=3e-2)
    torch.testing.assert_close(out, expected_q, **tol)
    torch.testing.assert_close(k_cache, expected_kc, **tol)
    torch.testing.assert_close(v_cache, expected_vc, atol=0, rtol=0)
    assert name.startswith("generated.rope_kv_store_")


def test_non_rope_nodes_are_not_generated():
    t = TensorType(("T", 8), DType.f32)
    node = make_node("add", ["a", "b"], ["c"], [t, t])
    assert generated_kernel(node, [t, t]) is None


def test_an_fp8_pool_leaves_the_store_to_the_reference(tmp_path):
    """Qwen3's normed rope + KV store into an FP8 pool: no kernel is generated (the generated one stores
    the dtype it reads), the registry's reference stores it, and the artifact runs as the torch one."""
    from kiln.compiler.compile import compile_model
    from kiln.compiler.options import CompileOptions
    from kiln.runtime.artifact import load_artifact
    from kiln.runtime.worker.executor import Executor
    from tests.support.hf_models import make_hf_model
    from tests.support.stepping import PagedRun

    source = make_hf_model("qwen3", tmp_path / "src")
    small = dict(page_size=4, max_batch_tokens=32, max_logit_rows=32, max_seq_len=64, max_batch_size=4,
                 kv_cache_dtype="fp8_e4m3")
    artifacts = [compile_model(source, tmp_path / f"{b}.kiln", CompileOptions(**small, backend=b))
                 for b in ("triton", "torch")]
    manifest = load_artifact(artifacts[0]).manifest
    assert manifest["generated_kernels"] == {} and "torch.rope_kv_store" in manifest["kernels"]
    logits = []
    for artifact in artifacts:
        run = PagedRun(Executor(load_artifact(artifact), "cpu"), num_pages=16)
        run.add_sequences(2)
        logits.append(run.step([[1, 2, 3, 4, 5], [9, 8, 7]]))
    # Triton's kernels (under the interpreter, which truncates to bf16) against torch's: measured 0.045
    # relative (0.019 with a bf16 pool: a k that differs in its last bf16 bit can round to another FP8
    # value). A pool read at the wrong scale or stored unrounded is off by far more.
    error = ((logits[0] - logits[1]).norm() / logits[1].norm()).item()
    assert error < 0.08, f"relative logit difference {error:.4f}"
