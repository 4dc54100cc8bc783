"""Span caching for any OpenAI client: documents on the standard routes, laid out by the server.

A client that knows nothing of minipic sends its retrieved documents in vLLM's own ``documents``
field of ``/v1/chat/completions`` (or a ``minipic`` object on ``/v1/completions``). The server
lays the prompt out exactly as the SDK would (``prompt_builder`` through the SDK's own
``Orchestrator.build``: the system message is the system span, each document a span, the
conversation after them the PDEP-led part), runs the span prefills with the SDK's scheduler
(one shared prefill per cold span, however many requests need it; ``orchestrator.scheduler``),
and hands the laid-out ids to vLLM's own route, which answers as for any request: streaming,
``n``, logprobs, stop, usage with ``cached_tokens``. A ``minipic`` object is added to the
response for clients that want the cache evidence; strict clients ignore it.

* ``bodies``: what a request may carry, checked; every bad item is an OpenAI-format 400 naming it;
* ``server_side``: the layout and the prefills (one ``Orchestrator`` over the server's engine);
* ``middleware``: the ASGI layer on the two routes (request rewrite, ``minipic`` in the response);
* ``chat_render``: the one vLLM hook, where a chat request's rendered prompt becomes the layout.

A request without documents never enters any of this: stock vLLM semantics.
"""
