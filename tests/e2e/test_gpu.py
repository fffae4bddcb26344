"""On the GPU: the triton backend with decode and prefill CUDA graphs against HF transformers on the
same random weights (a Llama-3-8B shape cut to 2 layers, and the SmolLM2-135M shape), and graph replay
against eager execution for every decode bucket and for prefill buckets, and an idle core's prefill
warm-up. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kiln.compiler.compile import compile_model
from kiln.compiler.options import CompileOptions
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler.batch import StepLists
from tests.support.hf_models import hf_greedy
from tests.support.stepping import PagedRun, pages_for, step_lists

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = pytest.mark.gpu
BUCKETS = (1, 2, 4, 8)
NEW_TOKENS = 16


def compile_random(shape: str, layers: int | None, dtype: torch.dtype, tmp_path: Path, backend: str = "triton"):
    from models import random_model

    model, source = random_model(shape, dtype, layers)
    artifact = compile_model(source, tmp_path / "m.kiln", CompileOptions(
        dtype="fp32" if dtype == torch.float32 else "bf16", backend=backend, max_batch_tokens=512,
        max_batch_size=8, max_logit_rows=512, max_seq_len=256, page_size=16))
    return model, artifact


def build(shape: str, layers: int | None, dtype: torch.dtype, tmp_path: Path):
    model, artifact = compile_random(shape, layers, dtype, tmp_path)
    core = EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=4096, decode_buckets=BUCKETS))
    return model, core


def generate(core: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    out = [[] for _ in prompts]
    while core.has_work():
        for event in core.step():
            out[int(event.rid[1:])].extend(event.token_ids)
    return out


@pytest.mark.parametrize("shape, layers", [("llama3-8b", 2), ("smollm2-135m", None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_with_graphs_matches_hf(tmp_path, shape, layers, dtype):
    model, core = build(shape, layers, dtype, tmp_path)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in (5, 17, 33, 64)]
    # Prefill of the whole batch (the extend kernel), logits at every position against HF.
    run = PagedRun(core.runner.executor, num_pages=64)
    run.add_sequences(len(prompts))
    logits = run.step(prompts, all_logits=True)
    row = 0
    for prompt in prompts:
        with torch.no_grad():
            expected = model(torch.tensor([prompt], device="cuda")).logits[0].float()
        got = logits[row:row + len(prompt)]
        row += len(prompt)
        scale = expected.std().item()
        assert (got - expected).abs().max().item() < (1e-3 if dtype == torch.float32 else 0.1) * scale
    outputs = generate(core, prompts)
    # Most decode steps ran overlapped, their input ids the previous graph's argmax in place.
    assert core.overlapped_steps >= NEW_TOKENS // 2
    for prompt, tokens in zip(prompts, outputs):
        if dtype == torch.float32:
            assert tokens == hf_greedy(model, prompt, NEW_TOKENS)
            continue
        # bf16: rounding differs between any two implementations, so greedy paths may part at a near
        # tie. Teacher-forced instead: each kiln token is HF's argmax there within the noise the
        # prefill check above allows (0.1 std; two bf16 ulps of a logit near 10 are 0.05 std).
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
        for i, token in enumerate(tokens):
            row = logits[len(prompt) - 1 + i]
            assert row[token] >= row.max() - 0.1 * row.std(), (i, token, int(row.argmax()))


def test_overlapped_graph_steps_equal_eager_steps(tmp_path):
    # The graphs' overlapped chain against the same engine without graphs (every step eager, its
    # tokens read before the next is scheduled): greedy rows finishing at different lengths (the
    # batch moves down the buckets), a seeded sampled request and a greedy one with a logit bias
    # (their tokens are not the graph's argmax: copied into the next step's input ids), and a late
    # arrival that breaks the chain. Every output must be the eager engine's.
    _, artifact = compile_random("smollm2-135m", 2, torch.float32, tmp_path)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (7, 20, 33, 12, 9)]
    requests = {
        "g0": (prompts[0], SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)),
        "g1": (prompts[1], SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True)),
        "g2": (prompts[2], SamplingParams(temperature=0, max_new_tokens=15, ignore_eos=True)),
        "s": (prompts[3], SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_new_tokens=20, ignore_eos=True)),
        "b": (prompts[4], SamplingParams(temperature=0, logit_bias={11: 5.0}, max_new_tokens=12, ignore_eos=True)),
    }
    late = ("late", prompts[0][:5], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    results = []
    for options in (dict(decode_buckets=(), prefill_graphs=False), dict(decode_buckets=BUCKETS)):
        core = EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=4096, **options))
        for rid, (prompt, params) in requests.items():
            core.add_request(rid, prompt, params)
        outputs: dict[str, list[int]] = {}
        steps = 0
        while core.has_work():
            for event in core.step():
                outputs.setdefault(event.rid, []).extend(event.token_ids)
            steps += 1
            if steps == 6:
                core.add_request(*late)
        results.append((outputs, core.overlapped_steps))
    (eager, eager_overlapped), (graphs, graphs_overlapped) = results
    assert eager_overlapped == 0 and graphs_overlapped >= 10
    assert graphs == eager


def test_torch_backend_runs_eagerly_on_gpu(tmp_path):
    # Its attention reference reads the lengths on the host, which capture forbids: the engine leaves
    # graphs off by default, refuses them when asked, and still generates HF's tokens.
    model, artifact = compile_random("smollm2-135m", 2, torch.float32, tmp_path, backend="torch")
    with pytest.raises(ValueError, match="torch.rope_kv_attention"):
        EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=4096, decode_buckets=BUCKETS))
    core = EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=4096))
    assert core.runner.decode_graphs is None and core.runner.prefill_graphs is None
    prompts = [[5, 9, 200, 7], list(range(100, 131))]
    for prompt, tokens in zip(prompts, generate(core, prompts)):
        assert tokens == hf_greedy(model, prompt, NEW_TOKENS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager_for_every_bucket(tmp_path, dtype):
    _, core = build("smollm2-135m", 4, dtype, tmp_path)
    runner = core.runner
    page = core.page_size
    for bucket in BUCKETS:
        for n in {bucket, max(1, bucket - 1)}:
            # n sequences, each with a 20-token context on its own pages, decoding one token.
            lists = StepLists(token_ids=[7 + i for i in range(n)], positions=[19] * n,
                              slots=[(2 + 2 * i) * page + 19 - page for i in range(n)], q_start=list(range(n)),
                              q_len=[1] * n, kv_len=[20] * n, page_table=[[1 + 2 * i, 2 + 2 * i] for i in range(n)],
                              logits_index=list(range(n)), requests=[])
            graph_logits = runner.decode_graphs.run(lists).logits
            graph_logits = graph_logits.clone()
            eager_logits = runner.forward_eager(lists).logits
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(graph_logits, eager_logits, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphs_of_several_tokens_a_sequence_equal_eager(tmp_path, dtype):
    """Decode graphs of 4 tokens a sequence (a verification step): every bucket's replay gives the
    eager step's logits for every row, and the in-graph argmax their greedy tokens."""
    from kiln.runtime.worker.decode_graphs import DecodeGraphs

    _, core = build("smollm2-135m", 4, dtype, tmp_path)
    runner, k = core.runner, 4
    graphs = DecodeGraphs(runner.executor, runner.kv_views, [1, 2, 4, 8], runner.executor.bounds["P"],
                          tokens_per_sequence=k)
    page = core.page_size
    for n in (1, 3, 8):
        # n sequences with 20 tokens of context on their own pages, each bringing k tokens.
        cached = [20] * n
        pages = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(n)]
        lists = step_lists([k] * n, cached, [], pages, page_size=page, every_token=tuple(range(n)))
        assert graphs.fits(lists)
        result = graphs.run(lists)
        replayed, greedy = result.logits.clone(), result.greedy.clone()
        eager = runner.forward_eager(lists).logits
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(replayed, eager, atol=tol, rtol=tol)
        assert torch.equal(greedy.long(), replayed.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_graph_replay_equals_eager(tmp_path, dtype):
    _, core = build("smollm2-135m", 4, dtype, tmp_path)
    runner = core.runner
    page = core.page_size
    # Looser than the decode replay check in f32: a prefill's GEMMs are cuBLAS's, which may pick
    # another algorithm under capture (measured: one logit of 49k off by 1.1e-5 at 128 tokens).
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # (new tokens, cached tokens, sequences with logits): one prompt; prompts of mixed lengths; a
    # chunk after a cached prefix beside a middle chunk; decode rows mixed with a prefill.
    for new_tokens, cached, logits_rows in [([128], [0], [0]), ([5, 17, 33, 64], [0] * 4, [0, 1, 2, 3]),
                                            ([40, 100], [60, 0], [0]), ([1, 1, 50], [20, 30, 0], [0, 1, 2])]:
        page_rows = pages_for([n + c for n, c in zip(new_tokens, cached)], page)
        with_context = [i for i, c in enumerate(cached) if c]
        if with_context:
            runner.forward_eager(step_lists([cached[i] for i in with_context], [0] * len(with_context), [],
                                            [page_rows[i] for i in with_context], page))
        lists = step_lists(new_tokens, cached, logits_rows, page_rows, page)
        first = runner.prefill_graphs.run(lists).logits.clone()  # captures this bucket's graph, then replays it
        replayed = runner.prefill_graphs.run(lists).logits.clone()
        eager = runner.forward_eager(lists).logits
        torch.testing.assert_close(first, eager, atol=tol, rtol=tol)
        torch.testing.assert_close(replayed, eager, atol=tol, rtol=tol)
    assert len(runner.prefill_graphs._graphs) == 4


def test_idle_warm_up_captures_every_decode_and_prefill_bucket_and_changes_no_output(tmp_path):
    """A core captures its largest decode bucket at start-up, the others at first use (the cold core
    below) or ahead of it: EngineCore.warm_up_idle (an idle server's) captures each decode bucket,
    smallest first, then each prefill bucket, with steps that store nothing. The prompts after it
    replay those graphs (no capture of their own) and generate the tokens the cold core generates."""
    _, core = build("smollm2-135m", 4, torch.bfloat16, tmp_path)
    assert core.runner.decode_graphs.uncaptured() == list(BUCKETS[:-1])
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(length)] for i, length in enumerate((20, 3, 45, 130))]
    cold = generate(core, prompts)
    _, core = build("smollm2-135m", 4, torch.bfloat16, tmp_path / "warm")
    decode, prefill = core.runner.decode_graphs, core.runner.prefill_graphs
    warmed = []
    while core.warm_up_idle():
        warmed.append((decode.uncaptured(), len(prefill.uncaptured())))
    assert warmed[0] == (list(BUCKETS[1:-1]), len(prefill.warm_up_buckets()))  # the smallest decode bucket first
    assert len(warmed) == len(BUCKETS) - 1 + len(prefill.warm_up_buckets())
    assert decode.uncaptured() == [] and prefill.uncaptured() == []
    assert generate(core, prompts) == cold
    assert len(prefill._graphs) == len(prefill.warm_up_buckets())  # every prefill step replayed a warmed graph


def test_an_added_step_field_is_a_captured_graphs_input(tmp_path):
    """A per-step input added in one place (``CompileOptions.step_fields``) is among the inputs each
    decode graph is captured with, at its turn's staged device buffer, where a step's values land; an
    added output (the hidden states) comes back from a replay as from the eager path."""
    from kiln.runtime.worker.decode_graphs import DecodeGraphs
    from kiln.step_schema import SEQUENCE, StepField

    from models import random_model

    field = StepField("adapter_index", SEQUENCE, 0, "a test input")
    _, source = random_model("smollm2-135m", torch.bfloat16, 2)
    artifact = compile_model(source, tmp_path / "m.kiln", CompileOptions(
        dtype="bf16", backend="triton", max_batch_size=8, max_seq_len=256, step_fields=(field,),
        step_outputs=("hidden_states",)))
    core = EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=4096, decode_buckets=()))
    executor, captured = core.runner.executor, []
    run = executor.run

    def recording(inputs, kv_views):
        if torch.cuda.is_current_stream_capturing():
            captured.append(inputs.feeds)
        return run(inputs, kv_views)

    executor.run = recording
    graphs = DecodeGraphs(executor, core.runner.kv_views, [2], executor.bounds["P"])
    region = graphs.layout.offset[field.name]
    assert [feeds[field.name].data_ptr() for feeds in captured] == \
        [graphs._devices[turn][region:].data_ptr() for turn in range(2)]
    lists = step_lists([1, 1], [3, 2], [0, 1], pages_for([4, 3], 16), page_size=16)
    lists.adapter_index = [6, 2]
    replayed = graphs.run(lists).outputs["hidden_states"].clone()
    torch.cuda.synchronize()
    assert graphs._devices[0][region:region + 2].tolist() == [6, 2]
    eager = core.runner.forward_eager(lists).outputs["hidden_states"]
    torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)  # bf16


def test_ngram_speculation_with_verify_graphs_matches_plain_decoding(tmp_path):
    """Speculative verify steps replayed as DecodeGraphs(k) (drafts filled to a full chain) give
    plain decoding's greedy tokens (f32: the verify rows and single-token rows differ by summation
    order only, ~1e-6, far from flipping an argmax of random weights)."""
    _, artifact = compile_random("llama3-8b", 2, torch.float32, tmp_path)
    prompts = [[7, 8, 9, 7, 8, 9, 7], [100, 200, 100, 200], [5] * 9, [31, 32, 33, 34, 35, 31, 32]]
    plain = generate(EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=4096,
                                                             decode_buckets=BUCKETS)), prompts)
    core = EngineCore(str(artifact), EngineOptions(device="cuda", kv_cache_tokens=4096, decode_buckets=BUCKETS,
                                                   speculative_algorithm="ngram", speculative_num_draft_tokens=4))
    assert core.runner.verify_graphs is not None and core.runner.verify_graphs.k == 5
    assert generate(core, prompts) == plain
    assert core.stats()["spec_verify_steps"] > 0
