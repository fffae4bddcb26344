"""Every Triton kernel launch the engine makes compiles for a Hopper GPU (sm_90), checked on the CPU.

The interpreter runs a kernel's Python, not Triton's compiler: a kernel can pass every interpreted
test and still be refused by the compiler on the GPU (on 2026-12-05 the LoRA expand's per-slice loop
broke Triton 3.6's layout pass with "operand does not dominate this use" at three slices and 16
rows). So the workloads below run under the interpreter with their launches recorded
(``tests/support/triton_launches.py``: kernel, argument dtypes and specialization, constexprs and
options, as the GPU would choose them), and each distinct launch is compiled for sm_90, down to PTX
and the cubin, in processes of their own (``tests/support/hopper_compile.py``).

The workloads run in bf16, the GPU's dtype, not the f32 of the numeric tests: pointer dtypes and the
launchers' dtype-driven choices are then the GPU's own, with no rewriting of recorded types. The tiny
MoE and LoRA workloads run in f32 instead, as the GPU's MoE and LoRA tests do (their products take
the f32 variants), their bf16 variants coming from the real-widths workloads. The engine workloads are
tiny one-layer models of each architecture path (dense with bias, q/k norm, sliding window, MoE, each
quantization, LoRA, an FP8 KV cache), run for real. Tiny widths give small blocks, so two more engine
workloads have a real layer's widths and decode steps at every CUDA-graph bucket, 256 rows down to 1,
as the GPU's start-up captures them (with two LoRA adapters, where the 2026-12-05 failure shows and
is caught; with FP8 weights; with experts), their kernels recorded but not run; so
are the sampler's and the library-GEMM helpers' (on torch or cuBLAS in a CPU engine), launched at a
real vocabulary and real widths.

A kernel no workload launches would be checked by nothing: ``test_the_workloads_launch_every_kernel``
finds every launch site in kiln and fails naming the kernels no workload reached.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.ir.weights import SCHEMES
from kiln.kernels.bitmask import allocate_bitmask
from kiln.kernels.gemm_quantized import dequantize_weight, quantize_rows
from kiln.kernels import KernelConfig
from kiln.kernels.gemv import GEMV_MAX_ROWS
from kiln.kernels.linear_fused import triton_linear_residual, triton_rmsnorm_linear, triton_silu_mul_linear_residual
from kiln.kernels.quantize import quantize
from kiln.kernels.triton_support import INTERPRET
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import DEFAULT_DECODE_BUCKETS, EngineOptions
from kiln.runtime.sampling import SamplerKernels, SamplingBatch, SamplingParams, SamplingRow, sample
from tests.support.hf_models import make_hf_model
from tests.support.hopper_compile import compile_records
from tests.support.lora import make_peft_adapter
from tests.support.triton_launches import LaunchRecorder, describe, record_launches

pytestmark = pytest.mark.skipif(not INTERPRET, reason="records launches of the Triton interpreter")

KILN = Path(__file__).resolve().parents[2] / "kiln"

# A prompt longer than GEMV_MAX_ROWS (its prefill takes the GEMM paths) beside a short one whose
# request ends first, so decode steps run at two rows, then one.
PROMPTS = [[1, 5, 9, 3, 7], list(range(2, 3 + GEMV_MAX_ROWS + 4))]
NEW_TOKENS = [2, 3]


def _serve(source: Path, directory: Path, prompts: list[list[int]] = PROMPTS, new_tokens: list[int] = NEW_TOKENS,
           adapters: dict[str, Path] | None = None, engine: dict[str, Any] | None = None, **options: Any) -> None:
    """Compiles the HF model at ``source`` for the triton backend (bf16 unless ``options`` say) into
    ``directory`` and serves ``prompts`` to the end (``engine``: EngineOptions), the even ones on
    ``adapters`` in turn when there are any, the odd ones on the base model."""
    options = {"dtype": "bf16", "backend": "triton", "page_size": 4, "max_batch_tokens": 64, "max_batch_size": 4,
               "max_seq_len": 64, **options}
    artifact = compile_model(source, directory, CompileOptions(**options))
    core = EngineCore(str(artifact), EngineOptions(device="cpu", **(engine or {"kv_cache_tokens": 256})))
    names = list(adapters or {})
    for name in names:
        core.load_lora(name, str(adapters[name]))
    for i, (prompt, tokens) in enumerate(zip(prompts, new_tokens)):
        lora = names[i // 2 % len(names)] if names and i % 2 == 0 else None
        core.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True),
                         lora=lora)
    while core.has_work():
        core.step()


def _tiny(kind: str, **options: Any) -> Callable[[Path], None]:
    """A workload: a tiny one-layer ``kind`` model served with ``options``."""
    return lambda tmp: _serve(make_hf_model(kind, tmp / "src", num_hidden_layers=1), tmp / "m.kiln", **options)


def _tiny_lora(tmp: Path) -> None:
    source = make_hf_model("llama3", tmp / "src", num_hidden_layers=1)
    _serve(source, tmp / "m.kiln", adapters={"a": make_peft_adapter(source, tmp / "a", rank=8)}, dtype="fp32",
           max_loras=2, max_lora_rank=8)


# A real layer's widths (Llama 3.2 1B's, with 128-dim heads) and a small vocabulary (the sampler has
# its own workload), served as a GPU serves: page size 16, decode steps padded to the GPU's CUDA-graph
# buckets, prefill padded as its graphs are. The requests end one wave after another so that the decode
# steps run every bucket once, as the GPU's start-up does when it captures them: request i decodes
# while a bucket larger than i remains.
REAL_LAYER = dict(num_hidden_layers=1, vocab_size=1024, hidden_size=2048, intermediate_size=8192,
                  num_attention_heads=16, num_key_value_heads=4)
_BUCKETS = DEFAULT_DECODE_BUCKETS
REAL_BATCH = dict(prompts=[[1 + i % 7, 2] for i in range(_BUCKETS[-1])],
                  new_tokens=[1 + sum(b > i for b in _BUCKETS) for i in range(_BUCKETS[-1])],
                  engine=dict(kv_cache_tokens=32 * 1024, decode_buckets=_BUCKETS, prefill_graphs=True,
                              overlap_schedule=False),
                  page_size=16, max_batch_tokens=2 * _BUCKETS[-1], max_batch_size=_BUCKETS[-1], max_seq_len=4096)


def _real_widths(tmp: Path) -> None:
    """Two LoRA adapters; FP8 weights and activations."""
    source = make_hf_model("llama3", tmp / "src", **REAL_LAYER)
    adapters = {"a": make_peft_adapter(source, tmp / "a", rank=16, seed=1),
                "b": make_peft_adapter(source, tmp / "b", rank=8, seed=2)}
    _serve(source, tmp / "lora.kiln", adapters=adapters, max_loras=2, max_lora_rank=16, **REAL_BATCH)
    _serve(source, tmp / "fp8.kiln", quantization="fp8", **REAL_BATCH)


def _real_widths_moe(tmp: Path) -> None:
    """Qwen3-MoE's experts at Qwen3-30B-A3B's widths (8 of them here)."""
    _serve(make_hf_model("qwen3_moe", tmp / "src", **REAL_LAYER, head_dim=128, moe_intermediate_size=768),
           tmp / "m.kiln", **REAL_BATCH)


def _sample(tmp: Path) -> None:
    """The GPU engine's sampler at Llama 3's vocabulary: greedy, masked by a grammar's bitmask, into a
    decode graph's int32 ids and host mirror, and sampled with each filter."""
    vocab = 128256
    kernels = SamplerKernels.for_device("cuda")  # the Triton kernels (launched on CPU tensors here)
    for rows in (1, 16):
        logits = torch.zeros(rows, vocab, dtype=torch.bfloat16)
        bitmask = allocate_bitmask(rows, vocab)
        kernels.argmax_rows(logits)
        kernels.argmax_rows(logits, bitmask=bitmask)
        kernels.argmax_rows(logits, torch.empty(rows, dtype=torch.int32), mirror=torch.empty(rows, dtype=torch.int32))
        for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_k=50),
                       SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05)):
            batch = SamplingBatch.pack([SamplingRow(params, seed=i, step=0) for i in range(rows)], vocab)
            sample(logits, batch, bitmask, kernels)


def _library_gemm_inputs(tmp: Path) -> None:
    """What the quantized linears run before cuBLAS's GEMMs at more rows on a GPU: activations
    quantized per row (after each prologue), weights dequantized (per channel and MXFP4)."""
    x = torch.zeros(32, 2 * 4096, dtype=torch.bfloat16)
    for act_quant in ("fp8_per_token", "int8_per_token"):
        quantize_rows(x[:, :4096], act_quant)
        quantize_rows(x[:, :4096], act_quant, norm_weight=x[0, :4096], eps=1e-5)
        quantize_rows(x, act_quant, gated=True)
    for scheme in ("fp8_channel", "int8_channel", "mxfp4"):
        stored, scales = quantize(torch.zeros(512, 4096), SCHEMES[scheme])
        dequantize_weight(stored, scales[0], SCHEMES[scheme], torch.bfloat16)


def _few_rows_gemv(tmp: Path) -> None:
    """The few-row GEMV (off by default, so no engine workload reaches it) at Llama-3-8B's layer widths
    and a verify step's 5 rows a sequence, beside 2 and 8 rows: each prologue and epilogue."""
    config = KernelConfig(gemv_few_rows_max=8)
    hidden, intermediate = 4096, 14336
    for rows in (2, 5, 8):
        x, norm = torch.zeros(rows, hidden, dtype=torch.bfloat16), torch.zeros(hidden, dtype=torch.bfloat16)
        triton_rmsnorm_linear(x, norm, torch.zeros(6144, hidden, dtype=torch.bfloat16), out=torch.empty(rows, 6144,
                              dtype=torch.bfloat16), eps=1e-5, config=config)
        triton_linear_residual(x, torch.zeros(hidden, hidden, dtype=torch.bfloat16), torch.zeros_like(x), out=x,
                               config=config)
        triton_silu_mul_linear_residual(torch.zeros(rows, 2 * intermediate, dtype=torch.bfloat16),
                                        torch.zeros(hidden, intermediate, dtype=torch.bfloat16),
                                        torch.zeros_like(x), out=x, config=config)


# Each workload, and whether its kernels run (else only their launches are recorded: the host reads
# no kernel's output but the sampled tokens, any of which will do).
WORKLOADS: dict[str, tuple[Callable[[Path], None], bool]] = {
    "qwen2": (_tiny("qwen2"), True),  # q/k/v bias
    "qwen3": (_tiny("qwen3"), True),  # q/k norm: the generated rope_kv_store kernel
    "mistral_window": (_tiny("mistral_window"), True),
    "qwen3_moe": (_tiny("qwen3_moe", dtype="fp32"), True),  # f32 as the GPU's MoE test
    "fp8_kv_cache": (_tiny("llama3", kv_cache_dtype="fp8_e4m3"), True),
    **{method: (_tiny("llama3", quantization=method), True) for method in ("fp8", "w8a8_int8", "w8a16_int8", "mxfp4")},
    "lora": (_tiny_lora, True),  # f32 as the GPU's LoRA test
    "real_widths": (_real_widths, False),
    "real_widths_moe": (_real_widths_moe, False),
    "sampler": (_sample, False),
    "library_gemm_inputs": (_library_gemm_inputs, False),
    "few_rows_gemv": (_few_rows_gemv, False),
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The distinct launches of every workload, by their record's key."""
    recorder = LaunchRecorder()
    for name, (workload, execute) in WORKLOADS.items():
        with record_launches(recorder, execute=execute):
            workload(tmp_path_factory.mktemp(name))
    return recorder.records


def test_every_recorded_launch_compiles_for_hopper(recorded, tmp_path):
    records = list(recorded.values())
    results = compile_records(records, tmp_path)
    failures = [f"{describe(record)}:\n{result['error']}" for record, result in zip(records, results)
                if not result["ok"]]
    assert not failures, f"{len(failures)} of {len(records)} launches do not compile for sm_90:\n\n" + \
        "\n\n".join(failures)


def _launch_sites() -> set[str]:
    """``module.kernel`` of every ``kernel[grid](...)`` in kiln whose ``kernel`` is a ``@triton.jit``
    function of kiln (of the launching module, else of the one module defining that name)."""
    trees = {".".join(path.relative_to(KILN.parent).with_suffix("").parts): ast.parse(path.read_text())
             for path in KILN.rglob("*.py")}
    defined: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
                defined.setdefault(node.name, set()).add(module)
    launched = set()
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in defined:
                homes = defined[node.func.value.id]
                home = module if module in homes else min(homes)
                launched.add(f"{home}.{node.func.value.id}")
    return launched


def test_the_workloads_launch_every_kernel(recorded):
    # A kernel no workload launches is compiled by nothing here: give it a workload (a model option
    # that reaches it, or a dry launch at real widths).
    seen = {f"{record['module']}.{record['kernel']}" for record in recorded.values()}
    assert _launch_sites() - seen == set()
