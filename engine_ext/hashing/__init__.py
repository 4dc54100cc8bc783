"""Where the block hash is changed: SSEP / PDEP aware hashing of vLLM's prefix-cache blocks, so
a span's blocks hash the same at any offset (``span_hashing``)."""
