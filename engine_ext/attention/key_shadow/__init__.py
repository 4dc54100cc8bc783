"""The key shadow: keys of cached blocks moved to the slot they are read at (a span reused at a
new offset), in pages shaped like the KV cache (``pages``), indexed and bounded by a budget
carved out of the configured KV memory (``pool``)."""
