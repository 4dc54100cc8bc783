"""Where minipic meets vLLM: every change it makes to vLLM, and the proof that they run.

* ``patches`` — the patch table: each vLLM callable minipic wraps and each method it adds to a
  vLLM class, with the vLLM version it was checked against; installing checks it first.
* ``patch_sources`` — the same table checked against a vLLM wheel that is not installed.
* ``integration_guard`` — proof, at an opted-in request's first step, that the worker's
  wrappers are on vLLM's code path (a wrapper can be installed and never called).
* ``added_names`` — every attribute minipic sets on vLLM's objects.
* ``parent_watch`` — an EngineCore minipic started stops once the process that started it is
  gone (vLLM's EngineCore outlives a parent killed before its finalizer ran).
"""
