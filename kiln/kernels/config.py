"""``KernelConfig``: every tunable the Triton launchers read, as one frozen, validated object.

A config is compile-time data: ``CompileOptions.kernel_config`` carries it, the artifact's manifest
records it, and the runtime binds it to every kernel that asks for it (``register_impl(...,
wants_config=True)``), so an artifact runs with the tuning it was compiled with and says which.
Benchmarks change it with ``--kernel-config NAME=VALUE`` (``parse_settings``); a name that is no
field is an error that lists the fields.

Each field's docstring says what it tunes and why it has its default. "Measured" figures come from
an H200; ``bench/HISTORY.md`` holds the runs.
"""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping, Sequence


class KernelConfigError(ValueError):
    """A setting that names no field, or whose value has the wrong type or range."""


@dataclass(frozen=True)
class KernelConfig:
    pdl: bool = True
    """Programmatic dependent launch (Hopper and later; ignored elsewhere and under the interpreter):
    a kernel may start while the one before it in the stream finishes, and waits for it in
    ``await_previous_kernel``. Decode steps of small models are chains of ~200 kernels of a few
    microseconds, where the gap between two kernels is a large share of the step. Off only to
    measure what it gives or to rule it out."""
    side_stream: bool = True
    """Ops that may run on the step's side stream (``OpDef.side_stream``: a LoRA hook's shrink) do, on
    a CUDA device: the shrink then runs while its GEMM does instead of before it. Off: every op on one
    stream in program order, to measure what it gives or to rule it out."""

    # --- decode attention (attention_decode.py, attention_split_merge.py) ---
    decode_min_split_tokens: int = 64
    """Fewest context tokens per split of decode attention: below it the fixed cost of a program
    (loading q, the partials, the merge) outweighs the extra parallelism. SmolLM2-135M batch 1: 64
    gave 0.524 ms a step, 32 0.525, 128 0.543, one split 0.606."""
    decode_max_splits: int = 64
    """Most splits of one context (and most partials merged in one step of the merge)."""
    decode_split_programs_per_sm: int = 2
    """Splits are added until the grid has this many programs per SM. Engine step at 2 / 4 / 8:
    Llama-3-8B (8 layers) batch 64 1.627 / 1.692 / 1.724 ms, SmolLM2-135M batch 64 1.172 / 1.187 /
    1.260; more splits only cost."""
    decode_block_n: int = 64
    """Keys per loop step of decode attention. At batch 64 and 8 with 4096-token contexts 64 keys at
    4 warps and 2 stages read 4.4 TB/s; 32 keys, 8 warps or 3 stages were slower."""
    decode_num_warps: int = 4
    """Warps per decode-attention program. 8 made SmolLM2-135M's batch-1 step 0.499 ms against 0.485
    and Llama-3-8B's (8 layers) 1.266 against 1.259."""
    decode_num_stages: int = 2
    """Pipeline stages of the decode-attention key loop: one shared K and V buffer. 3-4 stages made
    Llama-3-8B batch 64 slower (1.663-1.676 ms against 1.599)."""
    decode_preload_max_programs_per_sm: int = 2
    """Decode attention loads its first key block before the PDL wait only while the grid has at most
    this many programs per SM (all resident at once: 4 warps at 255 registers fill half an SM).
    Preloading took Llama-3-8B batch 1 from 14.5 to 11.6 us a layer but slowed larger grids
    (batch 8: 12.9 -> 14.5). 0 turns the preload off."""
    decode_merge_tile: int = 8192
    """Elements of one [heads, splits, head_dim] tile of partials in the split merge: 64 f32 registers
    a thread at 4 warps, no more than the attention loop before it needs."""

    # --- decode GEMV (gemv.py, linear_fused.py) ---
    gemv_max_weight_bytes: int = 16 << 20
    """Largest weight the fused GEMV takes at 2-16 rows; larger ones go to cuBLAS with the norm and
    activation kernels around it. At 8-16 rows the GEMV's tl.dot path is slower than cuBLAS on
    weights of tens of MB; small weights are latency-bound, where one launch wins."""
    gemv_few_rows_max: int = 2
    """Most rows (2 to 8; 0: none) the few-row GEMV (``gemv_few_rows.py``: broadcast products, one
    accumulator a row) takes, at weights up to ``gemv_one_row_max_weight_bytes``, instead of the tl.dot
    GEMV or cuBLAS. Its cost grows with the rows (sm_90: 5.6, 9.7 and 14.0 instructions a weight at
    2, 5 and 8), cuBLAS's barely: on an H100 Llama-3-8B's layer took 157.7 us at 2 rows against
    cuBLAS's 171.9, but 222.6 against 173.2 at 5 (a verify step's rows at 4 drafts) and 305.0 against
    174.1 at 8 (``bench/experiments/gemv_sweep.py --tokens 2 5 8 --variant gemv_few_rows_max=8``)."""
    gemv_one_row_max_weight_bytes: int = 128 << 20
    """Largest weight the fused GEMV takes at one row: it streams Llama-3-8B's qkv, o and down
    weights faster than cuBLAS, but not the 235 MB gate/up (1.314 ms a step against 1.295)."""
    gemv_programs_per_sm: int = 2
    """The GEMV narrows its column tiles until there are at least this many per SM, so every SM
    streams weights."""
    gemv_block_n: tuple[int, int] = (4, 8)
    """Least and most weight rows (output columns) per GEMV tile."""
    gemv_block_k: tuple[int, int] = (64, 1024)
    """Least and most of K per GEMV tile: contiguous runs that load as wide vectors."""
    gemv_product_elements: int = 16384
    """Weights one one-row GEMV tile holds (128 a thread at 4 warps, twice that with the next tile in
    flight). At Llama-3-8B's shapes tiles of 8192 streamed at 2.4-3.4 TB/s, of 16384 at 3.2-3.9."""
    gemv_dot_block_k: int = 128
    """K per step of the GEMV's tl.dot path (2-16 rows). All of K in one step ran 3-10x slower."""
    gemv_one_step_max_k: int = 2048
    """Up to this K a one-row GEMV program takes all of K in one tile, all its loads in flight at
    once. At SmolLM2's shapes: 1.5-2.8 us a GEMV against 2.5-4.7 us stepping through K."""
    gemv_num_warps: int = 4
    """Warps per GEMV program."""
    gemv_num_stages: int = 1
    """Pipeline stages of the GEMV: 1, since its loop keeps the next weight tile in flight in
    registers itself."""
    gemv_norm_pass_elements: int = 4096
    """Elements the GEMV's RMSNorm prologue reads at a time (all rows together) in its first pass
    over x."""

    # --- quantized GEMMs (gemv_quantized.py, linear_quantized_triton.py) ---
    quantized_gemv_max_rows: int = 1
    """Most rows the quantized Triton GEMV takes for fp8 and w8a8_int8 weights with activations
    quantized per token; above it ``torch._scaled_mm`` / ``torch._int_mm`` run where they fit (their
    tensor-core GEMMs read the 8-bit weights once, as the GEMV does; ``_int_mm`` only past 16 rows, so
    int8 keeps the GEMV up to there). One: on an H100, Llama-3-8B's fp8 layer took the tl.dot GEMV
    315 us at 16 rows, ``_scaled_mm`` with the activation quantizer 141 us at 64 (``bench/kernel_bench.py``),
    and the one-row GEMV 122 us at one. (``_scaled_mm`` at 2-15 rows is not yet timed.) On Hopper
    ``gemv_mma`` takes these GEMMs first, up to ``mma_gemv_max_rows``."""
    quantized_weight_only_max_rows: int = 16
    """Most rows the quantized Triton GEMV takes for weight-only schemes (w8a16_int8, mxfp4): no library
    GEMM reads their bytes, so above it the weight is dequantized to the activation dtype and cuBLAS
    runs (prefill, where the GEMM is compute bound). At 64, Llama-3-8B's MXFP4 decode at batch 64 ran
    the GEMV's 64-row tiles at 153 ms a step on an H100 (bf16: 6.8 ms): a few programs a GEMM each
    walking all of K; the dequantizing path reads the 4-bit weight, writes and reads it in bf16 (about
    2.5x bf16's bytes), and is what prefill runs."""
    quantized_gemv_block_t: int = 64
    """Rows one program of the quantized GEMV holds above 16 rows (its tl.dot path pads to 16 below)."""
    quantized_gemv_product_elements: int = 16384
    """``gemv_product_elements`` for the quantized one-row GEMV, in weight values (16 KB of fp8 or int8,
    8 KB of MXFP4): 8 rows of its 2048-value K step at 8 warps, so x's prologue and rounding serve 8
    weight rows (sm_90, ``bench/experiments/sass_loop.py``: fp8 W8A8 8.1 instructions a weight at 8
    rows, 11.4 at 4; 127 registers). H100, Llama-3-8B's four layer GEMVs at one row with
    ``quantized_gemv_programs_per_sm`` 1 (``bench/kernel_bench.py``), us a layer: fp8 122 at 16384
    against 160 at 8192 values (with 2 programs an SM) and 126 at 32768 (16 rows, 217 registers);
    w8a8_int8 131 against 181; MXFP4 101.5 at 16384 values against 112.6 at 32768."""
    quantized_gemv_programs_per_sm: int = 1
    """``gemv_programs_per_sm`` for the quantized one-row GEMV: its column tiles narrow until there
    are this many per SM. One keeps 8 rows a tile at Llama-3-8B's 4096 columns (512 tiles at 4096
    columns by 8 rows, on 132 SMs), where 2 halved the tiles to 4 rows (see above)."""
    quantized_gemv_block_k: tuple[int, int] = (64, 2048)
    """``gemv_block_k`` for the quantized one-row GEMV, in weight bytes."""
    quantized_gemv_block_n: tuple[int, int] = (4, 16)
    """``gemv_block_n`` for the quantized one-row GEMV: up to 16 weight rows a tile, so that fewer
    programs re-read x. Not yet tuned."""
    quantized_gemv_dot_block_k: int = 512
    """``gemv_dot_block_k`` for the quantized GEMV's tl.dot path (2-16 rows, and W8A8 at one row):
    values of 1-byte weights, 8 KB a step at 16 columns (105 registers at 8 warps for fp8 in an sm_90
    compile). MXFP4 takes a quarter as many values: its decoded pairs and x's two strided halves
    took 171-255 registers at 256. Not yet tuned on a GPU."""
    quantized_gemv_num_warps: int = 8
    """Warps per program of the quantized GEMV up to 16 rows. The one-row GEMV's K step is at least 8
    values of x a thread times the threads (2048 at 8 warps), so fewer warps give it more rows in a
    tile of ``quantized_gemv_product_elements`` values; but 4 warps at 32768 values (16 rows) took
    Llama-3-8B's fp8 layer GEMVs 8x longer on an H100 than 8 warps (1,738 against 126 us)."""
    quantized_gemm_block_n: int = 64
    """Output columns per program of the quantized GEMV above 16 rows (weight-only schemes at large
    decode batches; W8A8 where no library GEMM fits): a GEMM tile, wide so that each program's rows of
    x (re-read from L2 by every column tile, with the prologue recomputed) serve many weight rows.
    Not yet tuned on a GPU."""
    quantized_gemm_block_k: int = 64
    """K per step of the quantized GEMV above 16 rows (values; at least 32, a block, for MXFP4): at 128
    the SiLU·mul prologue's tiles took 255 registers and spilled in an sm_90 compile."""
    quantized_gemm_num_warps: int = 8
    """Warps per program of the quantized GEMV above 16 rows (a 64 x 64 tile: 101-128 registers)."""
    quantized_gemm_num_stages: int = 1
    """Triton pipeline stages of the quantized GEMV above 16 rows: at 1 its loop keeps the next weight
    tile in flight itself (as the GEMV does); more let Triton's pipeliner stream the tiles of its
    tl.dot loop ahead. H100, MXFP4 at 64 rows (``bench/experiments/dequant_probe.py``): 1 and 3 equal."""
    mma_gemv_max_rows: int = 64
    """Most rows the W8A8 GEMMs (fp8, w8a8_int8) take through ``gemv_mma``'s tensor-core GEMV (the
    weight as wgmma's 64-row operand, no weight decoded by a thread) on Hopper, instead of the
    broadcast-product and tl.dot GEMVs or the library GEMMs; 0: never. H100, Llama-3-8B's fp8 layer
    (graph replay, ``bench/experiments/mma_gemv_probe.py``): 97-99 us at one row against the one-row
    GEMV's 127; 116 us at 64 against ``_scaled_mm``'s 143 (its decode step 1.43x bf16's at batch 64,
    1.17x before). Above 64 rows (not yet timed) the library GEMMs run."""
    mma_gemv_block_k: int = 512
    """K per step of ``gemv_mma``'s GEMV (values of one byte): a 64-row weight tile of 32 KB, halved
    where the pipelined tiles would not fit ``mma_gemv_smem_bytes``. H100, fp8 layer at one row: 96.7 us
    at 512 against 99.5 at 256."""
    mma_gemv_num_stages: int = 4
    """Weight and x tiles ``gemv_mma``'s GEMV keeps in flight through shared memory (Triton's pipeliner):
    at Llama-3-8B's 4096 columns it runs 64 programs on 132 SMs, so each one's stream must be deep."""
    mma_gemv_quantizes: bool = False
    """Whether ``gemv_mma``'s programs quantize their rows of x themselves (the prologue applied, their
    magnitude found by passes over x from L2) instead of reading rows quantized by a launch before:
    one launch a GEMM instead of two. Not yet timed on a GPU."""
    mma_gemv_smem_bytes: int = 196608
    """Shared memory ``gemv_mma``'s pipelined tiles may take (192 KB of the 227 KB an sm_90 block may
    have; the rest is Triton's layout conversions)."""
    act_quant_block_k: int = 16384
    """Widest row the per-token activation quantizer (``act_quant_triton``) holds in registers and
    reads once; wider rows are read three times. 16384 covers Llama-3-8B's down projection (14336)."""
    act_quant_num_warps: int = 8
    """Warps per row of the activation quantizer: 64 values a thread for a 16384-wide row."""

    # --- elementwise kernels (norm.py, rope.py, kv_store.py, elementwise.py) ---
    rmsnorm_elements_per_program: int = 4096
    """Elements one RMSNorm program holds: short rows (q/k norm's head_dim) are packed several to a
    program so that each still moves a useful amount of memory."""
    rope_elements_per_program: int = 4096
    """Elements one rotary-embedding program holds (heads packed per program as for the norm)."""
    kv_store_block: int = 4096
    """Most elements of one token's K (or V) row one KV-store program copies."""
    silu_mul_block: int = 1024
    """Most elements of a row one silu·mul program computes."""
    add_block: int = 1024
    """Most elements of a row one add program computes (an MoE block's residual add)."""

    # --- mixture of experts (moe_align.py, moe_gemm.py) ---
    moe_block_m: int = 16
    """(token, choice) pairs per block of the grouped MoE GEMMs; each expert's run of pairs is padded
    to a multiple of it. vLLM's default for few tokens per expert; not yet tuned here."""
    moe_block_n: int = 64
    """Output columns per tile of the grouped MoE GEMMs. Not yet tuned."""
    moe_block_k: int = 64
    """K per step of the grouped MoE GEMMs. Not yet tuned."""
    moe_decode_max_pairs: int = 16
    """Up to this many (token, choice) pairs a step takes the per-pair GEMV path (no sorting): at
    batch 1-2 with top-8 the sort and the padded blocks cost more than they save. Its GEMVs take
    their tiles from the ``gemv_*`` fields (``gemv_config``). Not yet tuned."""

    # --- multi-LoRA hooks (lora_row_triton.py, lora_tile_triton.py); none tuned on a GPU yet ---
    lora_row_block_k: int = 128
    """In-features per loop step of the one-row shrink (a step of one token)."""
    lora_norm_block: int = 2048
    """In-features per loop step of the one-row shrink's RMSNorm pass (every K split reads the row)."""
    lora_tile_block_k: int = 64
    """In-features per loop step of the tile shrink (the K of its tl.dot)."""
    lora_min_split_k: int = 256
    """Fewest in-features per K split of the tile shrink: K is split until the tiles in use fill the
    SMs, but a split shorter than this costs more in its plane than it saves."""
    lora_max_splits: int = 64
    """Most K splits of a LoRA shrink: the last split of a block of h adds every plane."""
    lora_shrink_programs_per_sm: int = 4
    """Shrink programs an SM the K split aims for (``lora_triton.split_k``): at decode a tile's
    program walks its split a few blocks in flight at a time, so more, shorter splits shorten that
    chain; each split adds a plane to the merge. (H100, Llama-3-8B 8 layers, batch 64 over 8
    adapters, with the expand settings below: 4 gave the step +15.3% over the base model's, 8 +17.7%.)"""
    lora_shrink_stages: int = 4
    """Software-pipeline stages of the tile shrink's loop over K (Triton's ``num_stages``): blocks of x
    and A in flight while one is multiplied. At decode a split is a few blocks, so with enough
    stages all of it is requested at once."""
    lora_merge_planes: int = 16
    """Planes of partial sums the merge of a split shrink loads at once (unrolled): the unit's last
    split waits one L2 round trip per this many planes."""
    lora_tile_block_n: int = 64
    """Output columns per loop step of the tile expand."""
    lora_expand_steps: int = 1
    """Column blocks an expand program walks at most: programs of rows without an adapter return at
    once, so runs keep the grid to a few programs a row or tile. One block a program: each block is
    a dependent round trip (y and B in, y out), so walking several lengthened the chain more than
    the extra programs cost (H100, Llama-3-8B 8 layers, batch 64 over 8 adapters: step +26.8% over
    the base model at 4 blocks of 128, +15.3% at 1 block of 64 with 4 shrink programs an SM)."""
    lora_expand_programs_per_sm: int = 2
    """Expand programs (over the rows or tiles in use) the column runs aim for per SM."""

    # --- the sampler's kernels (argmax.py, sample.py, bitmask.py) ---
    argmax_block: int = 2048
    """Elements per loop step of the row argmax: 16 f32 a thread at 4 warps, several vector loads in
    flight per step (the loop is not software-pipelined)."""
    argmax_programs_per_sm: int = 4
    """Programs per SM the argmax aims for when it cuts rows into chunks: with one step's loads in
    flight each, several resident programs per SM hide the memory latency. Not yet tuned on a GPU."""
    argmax_merge_block: int = 256
    """Chunk partials the argmax's last program reduces per step (chunks are at most 4 per SM)."""
    sample_chunk: int = 4096
    """Vocabulary ids per sampler program: 32 programs a row for a 128k vocabulary. Not yet tuned."""
    sample_block: int = 2048
    """Elements per loop step of the sampler's chunks and of its cut search."""
    sample_candidates: int = 16384
    """Capacity of each of a row's two candidate lists in the sampler's cut search (256 KiB a row)."""
    sample_merge_block: int = 128
    """Chunk results the sampler's last program of a row reduces per step."""
    bitmask_words_per_program: int = 32
    """Grammar-bitmask words (32 tokens each) one masking program applies. At 256 x 151936 logits
    this store-only kernel took ~66 us on a mask allowing almost nothing and ~28 us on one allowing
    almost everything; wider programs were slower on the first."""

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_value(f.name, f.type, getattr(self, f.name))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def with_settings(self, settings: Mapping[str, Any]) -> KernelConfig:
        """This config with the named fields changed; names that are no field are refused."""
        unknown = sorted(set(settings) - set(self.field_names()))
        if unknown:
            raise KernelConfigError(f"kernel config has no field {', '.join(map(repr, unknown))}; "
                                    f"fields: {', '.join(self.field_names())}")
        return replace(self, **settings)

    def changes(self) -> dict[str, Any]:
        """The fields that differ from the defaults: what a benchmark prints to label a variant."""
        return {name: value for name, value in vars(self).items() if value != getattr(DEFAULTS, name)}

    def to_json(self) -> dict[str, Any]:
        return {name: list(value) if isinstance(value, tuple) else value for name, value in asdict(self).items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KernelConfig:
        """The config a manifest recorded; fields it lacks keep their defaults, retired ones are dropped."""
        return cls().with_settings({name: tuple(value) if isinstance(value, list) else value
                                    for name, value in data.items() if name not in _RETIRED})


def parse_settings(texts: Sequence[str]) -> dict[str, Any]:
    """``NAME=VALUE`` strings (VALUE a Python literal, or true/false) as a dict for ``with_settings``."""
    settings = {}
    for text in texts:
        name, sep, value = text.partition("=")
        if not sep or not name.strip():
            raise KernelConfigError(f"kernel config setting {text!r} is not NAME=VALUE")
        settings[name.strip()] = _literal(name.strip(), value.strip())
    return settings


def _literal(name: str, text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise KernelConfigError(f"kernel config {name}={text!r}: the value is not a Python literal") from None


# Fields that no kernel reads any more, which manifests of older artifacts still record: dropped
# when a manifest is read, so those artifacts still load (name: why it went).
_RETIRED = {
    "quantized_w8a8_one_row_dot": "one row takes gemv_quantized_row's broadcast product, weights decoded by bit moves",
    "moe_gemv_block_n": "the per-pair MoE GEMVs take gemv_config's tiles",
    "moe_gemv_block_k": "the per-pair MoE GEMVs take gemv_config's tiles",
}

# Fields that become Triton block shapes (tl.arange sizes, num_warps) or are divided into them, so
# they must be powers of two; and fields where 0 means "never" (no preload, no fused GEMV).
_POWERS_OF_TWO = frozenset({
    "decode_max_splits", "decode_block_n", "decode_num_warps", "decode_merge_tile", "gemv_block_n", "gemv_block_k",
    "gemv_product_elements", "gemv_dot_block_k", "gemv_num_warps", "gemv_norm_pass_elements",
    "quantized_gemv_block_t", "quantized_gemv_product_elements", "quantized_gemv_block_n",
    "quantized_gemv_dot_block_k", "quantized_gemv_block_k", "quantized_gemm_block_n", "quantized_gemm_block_k",
    "quantized_gemv_num_warps", "quantized_gemm_num_warps",
    "mma_gemv_block_k", "act_quant_block_k", "act_quant_num_warps",
    "rmsnorm_elements_per_program", "rope_elements_per_program", "kv_store_block", "silu_mul_block", "add_block",
    "argmax_block", "argmax_merge_block", "sample_block", "sample_merge_block", "bitmask_words_per_program",
    "moe_block_m", "moe_block_n", "moe_block_k",
    "lora_row_block_k", "lora_norm_block", "lora_tile_block_k", "lora_tile_block_n",
})
_ZERO_ALLOWED = frozenset({"decode_preload_max_programs_per_sm", "gemv_max_weight_bytes", "mma_gemv_max_rows",
                           "gemv_one_row_max_weight_bytes", "gemv_few_rows_max"})
# Fields with a largest value: the few-row GEMV writes out an accumulator for each of up to 8 rows.
_MOST = {"gemv_few_rows_max": 8}


def _check_value(name: str, annotation: str, value: Any) -> None:
    least = 0 if name in _ZERO_ALLOWED else 1
    number = "a power of two" if name in _POWERS_OF_TWO else f"an int >= {least}" + \
        (f" and <= {_MOST[name]}" if name in _MOST else "")

    def fail(wanted: str) -> None:
        raise KernelConfigError(f"kernel config {name} must be {wanted}, got {value!r}")

    def number_ok(item: Any) -> bool:
        return (isinstance(item, int) and not isinstance(item, bool) and least <= item <= _MOST.get(name, item)
                and (name not in _POWERS_OF_TWO or item & (item - 1) == 0))

    if annotation == "bool":
        if not isinstance(value, bool):
            fail("a bool")
    elif annotation == "tuple[int, int]":
        if not (isinstance(value, tuple) and len(value) == 2 and all(map(number_ok, value)) and value[0] <= value[1]):
            fail(f"a pair (least, most), each {number}")
    elif not number_ok(value):
        fail(number)


# The defaults, for launchers called without a config (tests, benchmarks of a single kernel).
DEFAULTS = KernelConfig()
