"""A chat request made ready to submit: its prompt token ids, sampling parameters and tool calling.

Shared by ``/v1/chat/completions`` and the gRPC ``Chat`` call, so both render, constrain and check a
conversation the same way (``ToolRequest`` adds the tool-call constraint; the tokenizer manager
checks the result against the model).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.runtime.sampling import SamplingParams

from .context import ServerContext
from .protocol import ChatCompletionRequest, template_messages
from .tools.request import ToolRequest


@dataclass(frozen=True)
class PreparedChat:
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolRequest | None


async def prepare_chat(ctx: ServerContext, body: ChatCompletionRequest) -> PreparedChat:
    manager = ctx.manager
    tools = ToolRequest.of(body, ctx.tool_call_parser)
    prompt_ids = await manager.render_chat(template_messages(body.messages), tools.template_tools if tools else None)
    params = body.to_sampling_params(body.requested_max_tokens or manager.default_max_tokens(prompt_ids))
    if tools is not None:
        tools.constrain(params)
    manager.check(prompt_ids, params, "messages", body.max_tokens_param)
    return PreparedChat(prompt_ids, params, tools)
