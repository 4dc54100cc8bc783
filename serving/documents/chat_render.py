"""The one vLLM hook of the documents routes: a chat request's rendered prompt becomes the span
layout (a row of ``engine_ext/vllm_surface/patches.py``, feature ``documents``).

vLLM's chat route renders the messages with the chat template and runs whatever ids come out;
no extension point takes token ids for a chat request. The middleware
(``serving/documents/middleware.py``) lays the request out, parks the ids under a one-use key and
names the key in the request's ``vllm_xargs``; this wrapper lets vLLM render as usual (model
check, conversation for the response) and then puts the parked ids in place of the rendered
ones. Everything after (sampling params, streaming, ``n``, logprobs, usage) is vLLM's own.
A request without the key is untouched.
"""

from __future__ import annotations

import functools
from typing import Any

TARGET = ("vllm.entrypoints.openai.chat_completion.serving:"
          "OpenAIServingChat.render_chat_request")
LAYOUT_KEY = "minipic_layout"  # in vllm_xargs: which parked layout to use
LAYOUTS: dict[str, list[int]] = {}  # key -> prompt ids; the middleware removes its entry


def _with_layout(result: Any, ids: list[int]) -> Any:
    conversation, engine_inputs = result
    replaced = []
    for engine_input in engine_inputs:
        laid_out = {k: v for k, v in dict(engine_input).items() if k != "prompt"}
        laid_out["prompt_token_ids"] = list(ids)
        replaced.append(laid_out)
    return conversation, replaced


def install() -> None:
    """Wrap the chat route's render step (API-server process; idempotent)."""
    from minipic.engine_ext.vllm_surface import patches

    def factory(stock: Any) -> Any:
        @functools.wraps(stock)
        async def render_chat_request(self: Any, request: Any) -> Any:
            xargs = getattr(request, "vllm_xargs", None)
            key = xargs.pop(LAYOUT_KEY, None) if isinstance(xargs, dict) else None
            result = await stock(self, request)
            if key is None or not isinstance(result, tuple):
                return result  # not ours, or vLLM's own error response
            ids = LAYOUTS.get(str(key))
            if ids is None:
                return self.create_error_response(
                    f"minipic: no laid-out prompt under {LAYOUT_KEY}={key!r} (the key is set "
                    f"by the server for documents requests, not by clients)")
            return _with_layout(result, ids)

        return render_chat_request

    patches.apply("documents", {TARGET: factory})
