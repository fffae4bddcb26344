"""Online serving benchmark for any OpenAI-compatible server (kiln, vLLM, SGLang, ...).

Sends streaming chat or completion requests with Poisson arrivals (``--request-rate inf`` sends all
at once), optionally capped at ``--max-concurrency`` in flight, and measures per request the time
to first token (TTFT), the gaps between streamed chunks (ITL), the time per output token after the
first (TPOT) and the end-to-end latency. Reports request and token throughput and p50/p90/p99 of each
latency, as a short table and as JSON (``--out``).

The client is aiohttp on uvloop: every streamed token is a socket read, a chunk and a JSON parse, and
that costs aiohttp about an eighth of what it costs httpx (54 against 417 us a token on a 2-core CPU,
2026-12-07), so the load generator does not cap what it measures. One process still saturates before a
fast server does, so ``--workers N`` drives the load from N processes: the prompts are dealt
round robin, the concurrency and rate split among them, every process is started before they all begin
together (a barrier), and their raw samples are merged (``serving_stats.summarize``: percentiles over all
requests, not averages of per-process percentiles). The server's own figures (kiln's ``/metrics``:
tokens generated, TTFT, ITL and latency histograms) are read before and after and reported beside the
client's. ``--offline-shape S`` then runs ``bench/offline.py`` on random weights of shape S for the same
workload (prompts, lengths, concurrency), so the served/offline ratio comes out of one run; serve the
same weights with ``bench/offline.py --shape S --tokenizer-dir DIR --save-artifact ART`` and
``kiln serve ART``.

Datasets (fixed ``--seed``): ``random`` prompts of about ``--input-len`` tokens drawn from a word
list, and ``shared-prefix``: ``--num-groups`` long prefixes of ``--prefix-len`` tokens, each
shared by its group's requests (a system prompt for chat), followed by a unique ``--input-len``
part. Lengths are calibrated with the server's ``/tokenize`` when it has one (kiln and vLLM do),
else counted in words. Token counts come from the streamed ``usage`` when the server sends it.
``--json-schema FILE`` constrains every output to a JSON schema (OpenAI's ``response_format``), to
set structured output's TPOT beside an unconstrained run's of the same lengths.

    python bench/serving.py --base-url http://127.0.0.1:30000 --model smollm2-135m-instruct \\
        --dataset shared-prefix --num-prompts 200 --request-rate 8 --max-concurrency 64 --out serving.json
    python bench/serving.py --model m --num-prompts 512 --input-len 256 --output-len 128 --ignore-eos \\
        --max-concurrency 64 --workers 4 --offline-shape smollm2-135m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Coroutine, TypeVar

try:
    import aiohttp
except ImportError:  # a test dependency (pip install -e .[test]), not one of kiln's own
    sys.exit("bench/serving.py drives its load with aiohttp: pip install aiohttp")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_stats import Result, WorkerRun, parse_metrics, server_figures, summarize  # noqa: E402

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education").split()
T = TypeVar("T")
OFFLINE = Path(__file__).resolve().parent / "offline.py"


@dataclass
class Prompt:
    prefix: str  # shared part ("" for the random dataset)
    text: str    # unique part
    output_len: int


@dataclass
class Share:
    """One load process's part of the run."""

    prompts: list[Prompt]
    concurrency: int | None
    rate: float
    seed: int


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, count)))


async def tokens_per_word(args: argparse.Namespace, session: aiohttp.ClientSession, rng: random.Random) -> float:
    """The server's tokens per word of this word list, or 1.0 when it has no /tokenize."""
    sample = words(rng, 400)
    try:
        async with session.post(url(args, "/tokenize"), json={"prompt": sample, "add_special_tokens": False}) as response:
            response.raise_for_status()
            return max(0.1, len((await response.json())["tokens"]) / 400)
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
        return 1.0


def make_prompts(args: argparse.Namespace, rng: random.Random, ratio: float) -> list[Prompt]:
    def length(tokens: int) -> int:
        low = int(tokens * (1 - args.range_ratio))
        return max(1, rng.randint(max(1, low), tokens))

    def output_len() -> int:
        return length(args.output_len)

    if args.dataset == "random":
        return [Prompt("", words(rng, round(length(args.input_len) / ratio)), output_len())
                for _ in range(args.num_prompts)]
    prefixes = [words(rng, round(args.prefix_len / ratio)) for _ in range(args.num_groups)]
    return [Prompt(prefixes[i % args.num_groups], words(rng, round(length(args.input_len) / ratio)), output_len())
            for i in range(args.num_prompts)]


def split(prompts: list[Prompt], args: argparse.Namespace) -> list[Share]:
    """The prompts dealt round robin among ``args.workers`` processes, with the concurrency and the
    rate divided among them (the first processes take the remainder of the concurrency)."""
    workers = min(args.workers, len(prompts))
    concurrency = args.max_concurrency
    return [Share(prompts[i::workers],
                  None if concurrency is None else max(1, concurrency // workers + (i < concurrency % workers)),
                  args.request_rate / workers, args.seed + 1 + i) for i in range(workers)]


def request_body(args: argparse.Namespace, prompt: Prompt) -> dict:
    body = {"model": args.model, "max_tokens": prompt.output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True  # an extension kiln, vLLM and SGLang accept: fixed output lengths
    if args.json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": args.json_schema}}
    if args.endpoint == "chat":
        messages = [{"role": "system", "content": prompt.prefix}] if prompt.prefix else []
        body["messages"] = messages + [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = f"{prompt.prefix}\n\n{prompt.text}" if prompt.prefix else prompt.text
    return body


async def send(session: aiohttp.ClientSession, address: str, body: dict) -> Result:
    result = Result(ok=False, start=time.monotonic())
    last = None
    chunks = 0
    finished = False  # a choice's finish_reason or [DONE] came: the request completed
    try:
        async with session.post(address, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            pending = b""
            # Whatever the socket has, split into lines here: one call a read, not one a line.
            async for data in response.content.iter_any():
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if line.endswith(b"\r"):
                        line = line[:-1]
                    if line == b"data: [DONE]":
                        finished = True
                        continue
                    if not line.startswith(b"data: "):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        result.error = str(event["error"])
                        return result
                    finished = finished or any(c.get("finish_reason") for c in event.get("choices", []))
                    if event.get("usage"):
                        result.prompt_tokens = event["usage"]["prompt_tokens"]
                        result.output_tokens = event["usage"]["completion_tokens"]
                    if not any(_content(c) for c in event.get("choices", [])):
                        continue
                    now = time.monotonic()
                    if last is None:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        result.end = time.monotonic()
    result.output_tokens = result.output_tokens or chunks
    # A request whose tokens all decode to no text (random weights emit ids the tokenizer has no
    # piece for) still completed: its tokens count, and it has no time to first text.
    result.ok = last is not None or finished
    return result


def _content(choice: dict) -> str:
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def url(args: argparse.Namespace, path: str) -> str:
    """``path`` under ``--base-url`` (which may itself have a path, e.g. a proxy's prefix)."""
    return args.base_url.rstrip("/") + path


def client(args: argparse.Namespace) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No connection limit (--max-concurrency is the limit) and a time limit per request.
    return aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=args.timeout))


def run_async(work: Coroutine[Any, Any, T]) -> T:
    """``work`` to completion on uvloop where it is installed (kiln depends on it off Windows)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(work)
    return uvloop.run(work)


async def drive(args: argparse.Namespace, share: Share, ready=None) -> WorkerRun:
    """Sends ``share``'s requests; with ``ready`` (a barrier), waits on it first, once connected."""
    rng = random.Random(share.seed)
    address = url(args, "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
    async with client(args) as session:
        gate = asyncio.Semaphore(share.concurrency or len(share.prompts))

        async def one(prompt: Prompt) -> Result:
            async with gate:
                return await send(session, address, request_body(args, prompt))

        if ready is not None:
            await asyncio.to_thread(ready.wait)
        start = time.monotonic()
        tasks = []
        for prompt in share.prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if math.isfinite(share.rate):
                await asyncio.sleep(rng.expovariate(share.rate))
        return WorkerRun(start, list(await asyncio.gather(*tasks)))


def _worker(args: argparse.Namespace, share: Share, ready, results) -> None:
    results.put(run_async(drive(args, share, ready)))


def run_load(args: argparse.Namespace, shares: list[Share]) -> list[WorkerRun]:
    """Every share's run: in this process for one, else one forked process each, started together."""
    if len(shares) == 1:
        return [run_async(drive(args, shares[0]))]
    context = multiprocessing.get_context("fork")  # kiln bench runs this file with runpy: spawn could not re-import it
    ready, results = context.Barrier(len(shares)), context.Queue()
    processes = [context.Process(target=_worker, args=(args, share, ready, results), daemon=True) for share in shares]
    for process in processes:
        process.start()
    runs = [results.get() for _ in processes]
    for process in processes:
        process.join()
    return runs


async def scrape(args: argparse.Namespace, rng: random.Random | None = None) -> tuple[dict, float | None]:
    """The server's /metrics parsed (empty when it has none) and, given ``rng``, its tokens per word."""
    async with client(args) as session:
        ratio = await tokens_per_word(args, session, rng) if rng is not None else None
        try:
            async with session.get(url(args, "/metrics")) as response:
                metrics = parse_metrics(await response.text()) if response.status == 200 else {}
        except (aiohttp.ClientError, asyncio.TimeoutError):
            metrics = {}
    return metrics, ratio


def offline(args: argparse.Namespace, summary: dict) -> dict:
    """``bench/offline.py`` on random weights of ``--offline-shape`` for this run's workload."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "offline.json"
        command = [sys.executable, str(OFFLINE), "--shape", args.offline_shape, "--workload", "random",
                   "--num-requests", str(args.num_prompts), "--input-len", str(args.input_len),
                   "--output-len", str(args.output_len), "--out", str(out)]
        if args.max_concurrency:
            command += ["--max-running", str(args.max_concurrency)]
        if args.offline_layers:
            command += ["--layers", str(args.offline_layers)]
        subprocess.run(command, check=True)
        result = json.loads(out.read_text())["results"][0]
    return {"shape": args.offline_shape, "layers": args.offline_layers, **result,
            "served_over_offline": summary["output_throughput"] / result["output_tok_s"]}


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    before, ratio = run_async(scrape(args, rng))
    prompts = make_prompts(args, rng, ratio)
    runs = run_load(args, split(prompts, args))
    after, _ = run_async(scrape(args))
    # JSON has no infinity: an unlimited rate is written "inf".
    config = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
              if k != "api_key"}
    summary = summarize(runs, config)
    summary["server"] = server_figures(before, after, summary["duration_s"])
    if args.offline_shape:
        summary["offline"] = offline(args, summary)
    return summary


def table(summary: dict) -> str:
    lines = [f"requests: {summary['completed']} ok, {summary['failed']} failed in {summary['duration_s']:.1f} s "
             f"({summary['workers']} load process{'es' if summary['workers'] > 1 else ''})",
             f"throughput: {summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s"]
    server = summary.get("server")
    if server:
        lines.append(f"server (/metrics): {server['generation_tokens']:.0f} tokens generated, "
                     f"{server['output_throughput']:.1f} tok/s")
    offline_run = summary.get("offline")
    if offline_run:
        lines.append(f"offline engine ({offline_run['shape']}): {offline_run['output_tok_s']:.1f} output tok/s; "
                     f"served/offline {offline_run['served_over_offline']:.2f}")
    lines.append(f"{'latency (ms)':<20}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "itl", "tpot", "e2e"):
        rows = [("client", summary[f"{name}_ms"])]
        if server and f"{name}_ms" in server:
            rows.append(("server", server[f"{name}_ms"]))
        for source, row in rows:
            lines.append(f"{name.upper() + ' ' + source:<20}" +
                         "".join(f"{row[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines + [f"error: {e}" for e in summary["errors"]])


def _schema_file(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read a JSON schema from {path}: {exc}") from None


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
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (over all workers)")
    p.add_argument("--workers", type=int, default=1, help="load processes (default 1)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length (an extension)")
    p.add_argument("--json-schema", type=_schema_file, default=None, metavar="FILE",
                   help="constrain every output to the JSON schema in FILE (response_format json_schema)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--offline-shape", default=None,
                   help="also run bench/offline.py on random weights of this shape (bench/models.py) for the workload")
    p.add_argument("--offline-layers", type=int, default=None, help="cut the offline shape to this many layers")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or not 0 <= args.range_ratio < 1:
        p.error("--num-prompts, --input-len and --output-len must be >= 1 and --range-ratio in [0, 1)")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    if args.workers < 1 or (args.max_concurrency is not None and args.max_concurrency < args.workers):
        p.error("--workers must be >= 1 and at most --max-concurrency")
    if args.offline_shape and args.dataset != "random":
        p.error("--offline-shape runs the random dataset's workload: use --dataset random")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    print(table(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
