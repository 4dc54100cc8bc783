"""Helpers the tests share: references, servers, seeds, tolerances, and the suite's own
machinery (shared resources, lanes, per-file timing)."""
