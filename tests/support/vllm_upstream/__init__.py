"""vLLM's own core tests, run against minipic's patched scheduler and KV-cache manager."""
