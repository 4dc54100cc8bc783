"""Where RoPE is applied: position-free attention, worker side.

Keys reach the KV cache unrotated (``unrotated_keys``) and are rotated inside attention at
their logical position (``cpu_backend`` on CPU, ``cuda_backend`` with the Triton kernel on
GPUs); ``step_plan`` plans each step once for every layer; ``span_isolation`` and
``span_segments`` keep a span's tokens from attending outside it; ``cpu_kv_layout`` measures
where vLLM's CPU kernel puts each key element; ``key_shadow`` holds keys moved to the slot a
block is read at.
"""
