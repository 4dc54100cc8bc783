"""Helpers the tests share: references, drivers of the engine and its attention backends, test
documents, servers, seeds, tolerances, and the suite's own machinery (shared resources, lanes,
per-file timing)."""
