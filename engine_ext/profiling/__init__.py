"""Wall-clock profile of engine steps across vLLM's processes (``step_profile``), behind
``MINIPIC_PROFILE_DIR``: where a cached final's milliseconds go."""
