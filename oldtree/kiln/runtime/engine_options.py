"""What a user sets for an engine (``EngineOptions``) and how the unset ones resolve on a device:
the pool size on a CPU, the decode buckets and prefill graphs (``graph_settings``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineOptions:
    device: str | None = None              # default: cuda when present, else cpu
    kv_cache_tokens: int | None = None     # explicit pool size; default from mem_fraction on GPU
    mem_fraction: float = 0.85             # of device memory for weights + KV (GPU)
    max_batch_tokens: int | None = None    # step token budget; default the artifact's bound
    max_running: int | None = None         # running requests; default the artifact's bound
    schedule_policy: str = "lpm"
    enable_prefix_cache: bool = True
    # Batch sizes whose decode steps run as captured CUDA graphs; None: DEFAULT_DECODE_BUCKETS on a
    # GPU, none on a CPU (where the padded path only adds work) or where capture is impossible (see
    # graph_settings).
    decode_buckets: tuple[int, ...] | None = None
    # Run other steps (prefill, mixed) as CUDA graphs too, captured per token and sequence bucket on
    # first use; None: on a GPU, off on a CPU (where the padded path only adds work) or where capture is
    # impossible (see graph_settings).
    prefill_graphs: bool | None = None
    # Launch a greedy decode step before reading the previous one's tokens (hides the host's work
    # behind the device's); None: on whenever decode graphs are.
    overlap_schedule: bool | None = None
    # Ranks to run the artifact on: rank 0 in this process, ranks 1..N-1 in worker processes that
    # get every step by broadcast (runtime/worker/ranks.py), on the CPU or on GPUs device..device+N-1.
    # A replicated artifact runs one full copy per rank (rank 0's result is the step's); a
    # tensor-parallel artifact (compiled with tp > 1) sets it to its tp itself. With N > 1,
    # overlap_schedule is off (see WorkerGroup).
    # The worker processes are started with multiprocessing's spawn, which imports the main module:
    # a script that builds an engine with N > 1 needs an `if __name__ == "__main__":` guard.
    world_size: int = 1
    # Machines the ranks are spread over (SGLang's --nnodes / --dist-init-addr; runtime/worker/nodes.py):
    # this engine is node 0's and hosts the group's rendezvous at dist_init_addr (HOST:PORT); the other
    # nodes run `kiln serve A --nnodes N --node-rank R --dist-init-addr HOST:PORT` for their ranks.
    nnodes: int = 1
    dist_init_addr: str | None = None
    # On a GPU that cannot run the artifact's FP8 (compute capability < 8.9), run every kernel's torch
    # reference instead of refusing the artifact (runtime/device_support.py): correct, slow.
    reference_fallback: bool = False
    # Speculative decoding, under SGLang's names (checked by runtime/spec/config.SpecConfig): the
    # algorithm (None: off; "ngram": drafts looked up in the request's own tokens), drafts per step
    # (default 4), and the draft-model settings EAGLE heads take. None where not given.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_draft_model_path: str | None = None
    # The n-gram lookup's suffix lengths: the longest suffix of min..max tokens found earlier wins.
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # Fault injection for tests: a request whose prompt holds this token id raises inside the core
    # when its token is applied, which must fail that request alone (see EngineCore._apply).
    debug_fail_token_id: int | None = None

    def resolved_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))


# On CPU there is no memory fraction to size by: a pool of this many tokens unless told otherwise.
DEFAULT_CPU_KV_TOKENS = 32768
DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_settings(options: EngineOptions, device: torch.device, blockers: list[str]) -> tuple[tuple[int, ...], bool]:
    """The decode buckets and whether prefill runs as graphs: the options where set, else graphs on a
    GPU unless one of the program's kernels (``blockers``) reads device values on the host, which
    capture forbids; asking for graphs on a GPU with such kernels is an error that names them."""
    capturable = device.type == "cuda" and not blockers
    buckets = options.decode_buckets
    if buckets is None:
        buckets = DEFAULT_DECODE_BUCKETS if capturable else ()
    prefill_graphs = capturable if options.prefill_graphs is None else options.prefill_graphs
    if device.type == "cuda" and blockers and (buckets or prefill_graphs):
        raise ValueError(f"CUDA graphs cannot capture kernels that copy device values to the host mid-step: "
                         f"{', '.join(blockers)} (an artifact compiled for the torch backend?); compile for the "
                         "triton backend, or set decode_buckets=() and prefill_graphs=False")
    return tuple(buckets), prefill_graphs
