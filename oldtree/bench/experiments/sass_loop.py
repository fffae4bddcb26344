"""Instruction counts of the one-row quantized GEMV's main loop (``gemv_quantized_row``), from its
sm_90 SASS, compiled on this machine (no GPU needed: Triton compiles for a target, ``cuobjdump``
disassembles the cubin).

    python bench/experiments/sass_loop.py --scheme fp8 mxfp4 --shape 4096x4096 14336x4096 \
        [--act none] [--prologue raw|norm|silu_mul] [--kernel-config NAME=VALUE ...] [--opcodes]

Shapes are N x K (Llama-3-8B's four by default). Tiles and warps are the ones the launcher picks on an
H100 (132 SMs) under the kernel config. The main loop is the longest span between a backward branch
and its target in the SASS (the x passes of the RMSNorm and W8A8 prologues are shorter loops); its
instructions are counted once, as the warp issues them each K step, and divided by the weights a
thread takes in a step (BLOCK_N * BLOCK_K / threads). Predicated-off paths inside the loop count as
issued, so the figure is an upper bound where the loop branches inside.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kiln.kernels import gemv_quantized_row as row  # noqa: E402
from kiln.kernels.act_quant_triton import ACT_KINDS  # noqa: E402
from kiln.kernels.config import DEFAULTS, KernelConfig, parse_settings  # noqa: E402
from kiln.kernels.gemv import NORM, RAW, SILU_MUL  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
H100_SMS = 132
LLAMA3_8B = ("4096x4096", "1024x4096", "14336x4096", "4096x14336")  # o, k/v, gate/up, down
# Each scheme's storage and scale pointer types and its pack (values a byte); W8A8 for fp8 by default.
SCHEMES = {"fp8": ("*fp8e4nv", "*fp32", 1, "fp8_per_token"), "int8": ("*i8", "*fp32", 1, None),
           "mxfp4": ("*u8", "*u8", 2, None)}
PROLOGUES = {"raw": RAW, "norm": NORM, "silu_mul": SILU_MUL}
# cuobjdump's instruction lines: /*0a40*/  [@P0] OPCODE[.MODS] operands ;
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def compile_sass(scheme: str, n: int, k: int, act: str | None, prologue: str, config: KernelConfig):
    """The SASS text of the row kernel as ``launch_quantized_row_gemv`` launches it, its constexprs,
    warps and registers a thread."""
    w_type, s_type, pack, _ = SCHEMES[scheme]
    constants, warps = row.row_constants(n, k, H100_SMS, pack=pack, fp8=scheme == "fp8", act_quant=act,
                                         prologue=PROLOGUES[prologue], x_bytes=2, config=config)
    constants.update(HAS_BIAS=False, HAS_RESIDUAL=False, HARDWARE=True, PDL=True)
    pointers = dict(x_ptr="*bf16", nw_ptr="*bf16", w_ptr=w_type, s_ptr=s_type, b_ptr="*bf16", r_ptr="*bf16",
                    y_ptr="*bf16")
    names = row._qgemv_row_kernel.arg_names
    signature = {name: "constexpr" if name in constants else pointers.get(name, "fp32" if name == "eps" else "i32")
                 for name in names}
    # As a launch specializes them: pointers and strides 16-divisible (K and N are, at these shapes).
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if signature[name] not in ("constexpr", "fp32")}
    compiled = triton.compile(ASTSource(row._qgemv_row_kernel, signature, constants, divisible), target=HOPPER,
                              options=dict(num_warps=warps, num_stages=config.gemv_num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        sass, usage = (subprocess.run([str(cuobjdump), flag, f.name], capture_output=True, text=True,
                                      check=True).stdout for flag in ("-sass", "-res-usage"))
    return sass, constants, warps, int(re.search(r"REG:(\d+)", usage).group(1))


def main_loop(sass: str) -> list[tuple[int, str]]:
    """(address, opcode) of each instruction of the longest backward-branch loop."""
    code = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in map(_LINE.search, sass.splitlines()) if m]
    best = (0, 0)
    for address, opcode, operands in code:
        target = re.match(r"\s*`?\(?\.?L?_?x?_?(0x[0-9a-f]+)", operands)
        if opcode.startswith("BRA") and target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            if address - start > best[1] - best[0]:
                best = (start, address)
    return [(address, opcode) for address, opcode, _ in code if best[0] <= address <= best[1]]


def report(scheme: str, shape: str, act: str | None, prologue: str, config: KernelConfig, opcodes: bool) -> None:
    n, k = map(int, shape.split("x"))
    sass, constants, warps, regs = compile_sass(scheme, n, k, act, prologue, config)
    loop = main_loop(sass)
    pack = SCHEMES[scheme][2]
    block_n, block_k = constants["BLOCK_N"], constants["BLOCK_K"]
    per_thread = block_n * block_k / (32 * warps)
    counts = collections.Counter(opcode.split(".")[0] for _, opcode in loop)
    shared = sum(counts[o] for o in ("BAR", "STS", "LDS", "LDSM", "SHFL"))
    print(f"{scheme:5} {shape:>10}  tile {block_n}x{block_k} ({block_n * block_k // pack} B) {warps} warps "
          f"{regs} regs: loop {len(loop)} instructions, {per_thread:g} weights/thread/step, "
          f"{len(loop) / per_thread:.2f} per weight; BAR/STS/LDS/LDSM/SHFL {shared}")
    if opcodes:
        print("    " + " ".join(f"{o}:{c}" for o, c in counts.most_common()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", nargs="+", choices=sorted(SCHEMES), default=sorted(SCHEMES))
    parser.add_argument("--shape", nargs="+", default=list(LLAMA3_8B), help="N x K")
    parser.add_argument("--act", choices=("default", "none", *filter(None, ACT_KINDS)), default="default",
                        help="activation quantization (default: fp8_per_token for fp8, none otherwise)")
    parser.add_argument("--prologue", choices=sorted(PROLOGUES), default="raw")
    parser.add_argument("--kernel-config", nargs="*", default=[], metavar="NAME=VALUE")
    parser.add_argument("--opcodes", action="store_true", help="print the loop's counts by opcode")
    args = parser.parse_args()
    config = DEFAULTS.with_settings(parse_settings(args.kernel_config))
    for scheme in args.scheme:
        act = SCHEMES[scheme][3] if args.act == "default" else None if args.act == "none" else args.act
        for shape in args.shape:
            report(scheme, shape, act, args.prologue, config, args.opcodes)


if __name__ == "__main__":
    main()
