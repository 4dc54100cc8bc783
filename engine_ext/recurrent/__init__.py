"""Sparse recurrent-state checkpoints for hybrid (attention + Mamba/GDN) models: where they go
(``policy``) and the EngineCore hooks that make vLLM compute and keep state exactly there
(``checkpoints``)."""
