"""``kiln generate`` and ``kiln chat``: text from a model on the command line.

``generate`` completes one prompt; ``chat`` renders the chat template and is interactive on a
terminal (each turn extends the conversation) or one-shot with ``--prompt`` / piped stdin.
"""

from __future__ import annotations

import argparse
import sys


def add_parsers(commands) -> None:
    gen = commands.add_parser("generate", help="complete a prompt")
    gen.add_argument("model", help="artifact directory, HF model directory, .gguf file or alias")
    gen.add_argument("--prompt", required=True)
    _add_common(gen)
    gen.set_defaults(run=_run_generate)

    chat = commands.add_parser("chat", help="chat with a model (interactive on a terminal)")
    chat.add_argument("model", help="artifact directory, HF model directory, .gguf file or alias")
    chat.add_argument("--prompt", default=None, help="one user turn; without it, read turns from the terminal")
    chat.add_argument("--system", default=None, help="a system message")
    _add_common(chat)
    chat.set_defaults(run=_run_chat)


def _add_common(p: argparse.ArgumentParser) -> None:
    from kiln.cli_compile import add_compile_options
    from kiln.cli_speculative import add_speculative_arguments

    add_compile_options(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--reference-fallback", action="store_true",
                   help="on a GPU that cannot run the model's FP8 (compute capability < 8.9), run the torch "
                        "reference kernels (slow) instead of refusing")
    add_speculative_arguments(p)


def _engine(args: argparse.Namespace):
    from kiln.cli_compile import compile_options_from
    from kiln.cli_speculative import speculative_keywords
    from kiln.engine import Engine

    options = compile_options_from(args)
    return Engine(args.model, dtype=options.dtype, backend=options.backend, max_batch_tokens=options.max_batch_tokens,
                  max_batch_size=options.max_batch_size, max_seq_len=options.max_seq_len, page_size=options.page_size,
                  device=args.device, kv_cache_tokens=args.kv_cache_tokens, quantization=options.quantization,
                  kv_cache_dtype=options.kv_cache_dtype, tp=options.tp, pp=options.pp,
                  reference_fallback=args.reference_fallback, **speculative_keywords(args))


def _params(args: argparse.Namespace):
    from kiln.runtime.sampling import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=list(args.stop))


def _stream(engine, prompt, params) -> str:
    text = []
    for delta in engine.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        text.append(delta.text)
    sys.stdout.write("\n")
    return "".join(text)


def _run_generate(args: argparse.Namespace) -> int:
    params = _params(args)
    params.validate()
    with _engine(args) as engine:
        _stream(engine, args.prompt, params)
    return 0


def _run_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    params.validate()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    one_shot = args.prompt is not None or not sys.stdin.isatty()
    turn = (args.prompt if args.prompt is not None else sys.stdin.read().strip()) if one_shot else None
    if one_shot and not turn.strip():
        # Nothing to say (an empty --prompt, or stdin at its end): no empty turn is sent.
        print("kiln chat: no message to send (empty prompt or stdin)", file=sys.stderr)
        return 0
    with _engine(args) as engine:
        if one_shot:
            messages.append({"role": "user", "content": turn})
            _stream(engine, engine.chat_prompt_ids(messages), params)
            return 0
        print("kiln chat: type a message; an empty line or Ctrl-D ends the chat.", file=sys.stderr)
        while True:
            try:
                turn = input("> ")
            except EOFError:
                return 0
            if not turn.strip():
                return 0
            messages.append({"role": "user", "content": turn})
            reply = _stream(engine, engine.chat_prompt_ids(messages), params)
            messages.append({"role": "assistant", "content": reply})
