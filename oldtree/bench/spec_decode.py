"""Speculative decoding's cost and gain at batch 1 on a random model (issue 24's GPU figures), kiln only.

- Verify step cost: the mean step of a run where every step verifies ``k`` drafts, over a plain
  decode step (the bar: at most 1.15x for k = 4 and 8 on Llama-3-8B's shape).
- Tokens/s with an oracle draft (``OracleDrafter``: it proposes the target's own greedy tokens, read
  off a plain run first, so every draft is accepted: the machinery's ceiling) and with n-gram drafts,
  against non-speculative decoding (the bar: the oracle at least 3x at batch 1).

Every speculative run's tokens are compared with the plain run's: on the CPU (f32) they must be
identical; in bf16 on the GPU a verify step (extend attention over k + 1 rows) and a decode step sum
in other orders, so a near tie of random weights may flip one token and the two continuations part
there. Each row records where its tokens first differ from the plain run's (``first_difference``,
None when identical). An oracle whose run parted from its answer is run again with that run's own
tokens as the answer (up to three rounds), so the timed run accepts every draft. The oracle takes
the n-gram drafter's place in an n-gram speculator (its one proposal method), so the verify path,
the scheduler and the graphs are the ones n-gram and EAGLE use.

    python bench/spec_decode.py --shape llama3-8b --draft-tokens 4 8 --new-tokens 256 --out spec.json

``--profile N`` also prints, for each run, the GPU kernels of N engine steps in mid-decode
(``bench/experiments/step_breakdown.py``'s table) beside the steps' wall time: whether a verify
step's extra cost is kernels or host work.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "experiments")]
from models import SHAPES, random_model  # noqa: E402

from kiln.cli_compile import add_tuning_options, tuning_options  # noqa: E402
from kiln.compiler.compile import compile_model  # noqa: E402
from kiln.compiler.options import CompileOptions  # noqa: E402
from kiln.runtime.engine_core import EngineCore  # noqa: E402
from kiln.runtime.engine_options import EngineOptions  # noqa: E402
from kiln.runtime.sampling import SamplingParams  # noqa: E402


class OracleDrafter:
    """Drafts the continuation a plain greedy run produced (``sequences``: prompt + output each): for
    tokens that begin one of them, the tokens that followed. Test and bench only: it knows the answer."""

    def __init__(self, sequences: Sequence[Sequence[int]], num_draft_tokens: int) -> None:
        self.sequences = [list(s) for s in sequences]
        self.num_draft_tokens = num_draft_tokens

    def propose(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        limit = self.num_draft_tokens if limit is None else min(limit, self.num_draft_tokens)
        for sequence in self.sequences:
            if sequence[:len(tokens)] == list(tokens):
                return sequence[len(tokens):len(tokens) + max(limit, 0)]
        return []


def timed_run(core: EngineCore, prompts: list[list[int]], new_tokens: int) -> dict:
    """Runs the prompts greedily; the decode phase (after every request's first token) timed."""
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
    outputs = {str(i): [] for i in range(len(prompts))}
    started, steps = None, 0
    while core.has_work():
        events = core.step()
        if started is not None:
            steps += 1
        for event in events:
            outputs[event.rid] += event.token_ids
        if started is None and all(outputs.values()):
            if core.runner.device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
    seconds = time.perf_counter() - started
    decoded = sum(len(o) - 1 for o in outputs.values())
    return {"tokens": [outputs[str(i)] for i in range(len(prompts))], "decode_steps": steps,
            "step_ms": 1000 * seconds / max(steps, 1), "tokens_per_s": decoded / seconds}


def profile_steps(core: EngineCore, prompts: list[list[int]], label: str, steps: int) -> None:
    """Prints the GPU kernels of ``steps`` engine steps in mid-decode and the steps' wall time."""
    from step_breakdown import kernel_table, trace

    params = SamplingParams(temperature=0, max_new_tokens=4 * steps + 16, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"profile{i}", prompt, params)
    for _ in range(4):
        core.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    events = trace(core.step, steps)
    wall_ms = 1000 * (time.perf_counter() - start) / steps
    print(f"== {label}: {wall_ms:.3f} ms a step (wall, profiled)\n{kernel_table(events, steps, 14)}")
    while core.has_work():
        core.step()


def measure(artifact: Path, prompts: list[list[int]], new_tokens: int, draft_tokens: Sequence[int], device: str,
            drafters: Sequence[str], profile: int = 0) -> list[dict]:
    options = dict(device=device, kv_cache_tokens=len(prompts) * (len(prompts[0]) + new_tokens + 64),
                   enable_prefix_cache=False)

    def run(drafter: str, k: int | None, answer: list[list[int]] | None) -> tuple[dict, list[list[int]]]:
        spec = {} if drafter == "plain" else dict(speculative_algorithm="ngram", speculative_num_draft_tokens=k)
        core = EngineCore(str(artifact), EngineOptions(**options, **spec))
        rounds = 0
        while True:
            rounds += 1
            if drafter == "oracle":
                core.speculator.drafter = OracleDrafter([p + t for p, t in zip(prompts, answer)], k)
            timed_run(core, prompts, min(new_tokens, 8))  # warm-up: graphs captured, kernels compiled
            result = timed_run(core, prompts, new_tokens)
            if drafter != "oracle" or result["tokens"] == answer or rounds == 3:
                break
            answer = result["tokens"]
        if profile:
            profile_steps(core, prompts, f"{drafter} k={k}", profile)
        stats = core.stats()
        row = {"drafter": drafter, "draft_tokens": k, **{key: result[key] for key in
                                                          ("decode_steps", "step_ms", "tokens_per_s")}}
        if drafter != "plain":
            row["mean_accept_length"] = stats["spec_mean_accept_length"]
        if drafter == "oracle":
            row["oracle_rounds"] = rounds
        core.close()
        del core
        gc.collect()  # the core's reference cycles hold its weights (16 GB at Llama-3-8B) until collected
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        return row, result["tokens"]

    plain, expected = run("plain", None, None)
    rows = [plain]
    for drafter in drafters:
        for k in draft_tokens:
            row, tokens = run(drafter, k, expected)
            row["first_difference"] = first_difference(tokens, expected)
            if device == "cpu" and row["first_difference"] is not None:
                raise AssertionError(f"{drafter} k={k}: speculative greedy tokens differ from plain decoding in f32")
            row["step_vs_plain"] = row["step_ms"] / plain["step_ms"]
            row["speedup"] = row["tokens_per_s"] / plain["tokens_per_s"]
            rows.append(row)
    return rows


def first_difference(tokens: list[list[int]], expected: list[list[int]]) -> int | None:
    """The first output position where any request's tokens differ from ``expected``'s; None if none."""
    positions = [next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None if got == want
                      else min(len(got), len(want))) for got, want in zip(tokens, expected)]
    differing = [p for p in positions if p is not None]
    return min(differing) if differing else None


def compile_random(shape: str, layers: int | None, vocab_size: int | None, device: str, out: Path, batch: int,
                   prompt_len: int, new_tokens: int, max_draft: int, **tuning) -> Path:
    on_gpu = device.startswith("cuda")
    _, source = random_model(shape, dtype=torch.bfloat16 if on_gpu else torch.float32, layers=layers,
                             device="cuda" if on_gpu else "cpu", vocab_size=vocab_size)
    return compile_model(source, out, CompileOptions(
        dtype="bf16" if on_gpu else "fp32", backend="triton" if on_gpu else "torch",
        max_batch_tokens=max(512, batch * prompt_len), max_batch_size=batch,
        max_logit_rows=max(batch * (max_draft + 1), batch), max_seq_len=prompt_len + new_tokens + max_draft + 16,
        **tuning))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="cut the shape to this many layers")
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--drafters", nargs="+", default=["oracle", "ngram"], choices=["oracle", "ngram"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    add_tuning_options(parser)  # --kernel-config NAME=VALUE (e.g. gemv_few_rows_max=8), --skip-pass NAME
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also print each run's GPU kernels over this many mid-decode steps (CUDA only)")
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    vocab = args.vocab_size or SHAPES[args.shape]["vocab_size"]
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=generator).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        artifact = compile_random(args.shape, args.layers, args.vocab_size, args.device, Path(tmp) / "m.kiln",
                                  args.batch, args.prompt_len, args.new_tokens, max(args.draft_tokens),
                                  **tuning_options(args))
        rows = measure(artifact, prompts, args.new_tokens, args.draft_tokens, args.device, args.drafters,
                       args.profile)
    for row in rows:
        print(json.dumps(row))
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
