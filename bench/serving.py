"""Online serving benchmark for any OpenAI-compatible server (kiln, vLLM, SGLang, ...).

Sends streaming chat or completion requests with Poisson arrivals (``--request-rate inf`` sends all
at once), optionally capped at ``--max-concurrency`` in flight, and measures per request the time
to first token (TTFT), the gaps between streamed chunks (ITL), the time per output token after the
first (TPOT) and the end-to-end latency. Reports request and token throughput and p50/p90/p99 of each
latency, as a short table and as JSON (``--out``).

Datasets (fixed ``--seed``): ``random`` prompts of about ``--input-len`` tokens drawn from a word
list, and ``shared-prefix``: ``--num-groups`` long prefixes of ``--prefix-len`` tokens, each
shared by its group's requests (a system prompt for chat), followed by a unique ``--input-len``
part. Lengths are calibrated with the server's ``/tokenize`` when it has one (kiln and vLLM do),
else counted in words. Token counts come from the streamed ``usage`` when the server sends it.

    python bench/serving.py --base-url http://127.0.0.1:30000 --model smollm2-135m-instruct \\
        --dataset shared-prefix --num-prompts 200 --request-rate 8 --max-concurrency 64 --out serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education").split()


@dataclass
class Prompt:
    prefix: str  # shared part ("" for the random dataset)
    text: str    # unique part


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, count)))


async def tokens_per_word(client: httpx.AsyncClient, rng: random.Random) -> float:
    """The server's tokens per word of this word list, or 1.0 when it has no /tokenize."""
    sample = words(rng, 400)
    try:
        response = await client.post("/tokenize", json={"prompt": sample, "add_special_tokens": False})
        response.raise_for_status()
        return max(0.1, len(response.json()["tokens"]) / 400)
    except (httpx.HTTPError, KeyError, ValueError):
        return 1.0


def make_prompts(args: argparse.Namespace, rng: random.Random, ratio: float) -> list[Prompt]:
    def length(tokens: int) -> int:
        low = int(tokens * (1 - args.range_ratio))
        return max(1, round(rng.randint(max(1, low), tokens) / ratio))

    if args.dataset == "random":
        return [Prompt("", words(rng, length(args.input_len))) for _ in range(args.num_prompts)]
    prefixes = [words(rng, round(args.prefix_len / ratio)) for _ in range(args.num_groups)]
    return [Prompt(prefixes[i % args.num_groups], words(rng, length(args.input_len))) for i in range(args.num_prompts)]


def request_body(args: argparse.Namespace, prompt: Prompt, output_len: int) -> dict:
    body = {"model": args.model, "max_tokens": output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True  # an extension kiln, vLLM and SGLang accept: fixed output lengths
    if args.endpoint == "chat":
        messages = [{"role": "system", "content": prompt.prefix}] if prompt.prefix else []
        body["messages"] = messages + [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = f"{prompt.prefix}\n\n{prompt.text}" if prompt.prefix else prompt.text
    return body


async def send(client: httpx.AsyncClient, path: str, body: dict) -> Result:
    start = time.perf_counter()
    result = Result(ok=False)
    last = None
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                if data.get("usage"):
                    result.prompt_tokens = data["usage"]["prompt_tokens"]
                    result.output_tokens = data["usage"]["completion_tokens"]
                if not any(_content(c) for c in data.get("choices", [])):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = last is not None
    return result


def _content(choice: dict) -> str:
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits) as client:
        prompts = make_prompts(args, rng, await tokens_per_word(client, rng))
        path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def one(prompt: Prompt, output_len: int) -> Result:
            async with gate:
                return await send(client, path, request_body(args, prompt, output_len))

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            low = max(1, int(args.output_len * (1 - args.range_ratio)))
            tasks.append(asyncio.create_task(one(prompt, rng.randint(low, args.output_len))))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, results, duration)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:  # nearest rank
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1000

    return {"mean": statistics.fmean(ordered) * 1000, "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(args: argparse.Namespace, results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        # JSON has no infinity: an unlimited rate is written "inf".
        "config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                   for k, v in vars(args).items() if k != "api_key"},
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_throughput": len(done) / duration,
        "input_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "output_throughput": output_tokens / duration,
        "ttft_ms": percentiles([r.ttft for r in done]),
        "itl_ms": percentiles([gap for r in done for gap in r.itl]),
        "tpot_ms": percentiles([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "e2e_ms": percentiles([r.e2e for r in done]),
    }


def table(summary: dict) -> str:
    lines = [f"requests: {summary['completed']} ok, {summary['failed']} failed in {summary['duration_s']:.1f} s",
             f"throughput: {summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s",
             f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name in ("ttft", "itl", "tpot", "e2e"):
        row = summary[f"{name}_ms"]
        lines.append(f"{name.upper():<14}" + "".join(f"{row[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines + [f"error: {e}" for e in summary["errors"]])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", required=True, help="the model name the server serves")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="completions")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256, help="tokens per prompt (the unique part)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn from [len*(1-r), len]")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens in each shared prefix")
    p.add_argument("--num-groups", type=int, default=8, help="shared-prefix: distinct prefixes")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length (an extension)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or not 0 <= args.range_ratio < 1:
        p.error("--num-prompts, --input-len and --output-len must be >= 1 and --range-ratio in [0, 1)")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = asyncio.run(run(args))
    print(table(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
