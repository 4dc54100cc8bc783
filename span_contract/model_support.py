"""Whether the engine's model reads keys position-free: the verdict every front-end acts on.

Only the worker knows, once the model is built, whether every attention layer got position-free
keys (``engine_ext/attention/unrotated_keys.py``, ``engine_ext/vllm_surface/integration_guard.py``).
Every front-end needs the answer before a span request reaches that worker, because a span request
on a model that is not position-free cannot be answered correctly, and the worker would have to
stop the engine to avoid a wrong answer. So the verdict travels up as this small record, by name
(``MODEL_SUPPORT_UTILITY``, an EngineCore utility), and each front-end does what its users
expect with it:

* a raw opted-in request (``vllm_xargs.minipic_spans``) gets a 400 naming the layer and the
  reason (``engine_ext/vllm_surface/request_gate.py``);
* documents (the server's route, the SDK) are served as the plain prompt: stock prefix caching,
  answers exact, the response says so;
* ``minipic serve``, ``Orchestrator.embedded()`` and the cluster say it at start and in
  ``GET /minipic/config``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MODEL_SUPPORT_UTILITY = "minipic_model_support"


@dataclass(frozen=True)
class ModelSupport:
    """``position_free``: every attention layer stores unrotated keys and hides layout tokens.
    ``reason``: why not (the first refused layer and what refused it); ``layers`` /
    ``converted``: attention layers in the model and how many were made position-free."""

    position_free: bool
    reason: str | None = None
    layers: int = 0
    converted: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ModelSupport | None:
        if not isinstance(data, dict) or "position_free" not in data:
            return None
        return cls(position_free=bool(data["position_free"]), reason=data.get("reason"),
                   layers=int(data.get("layers") or 0), converted=int(data.get("converted") or 0))

    @staticmethod
    def combine(ranks: list[ModelSupport]) -> ModelSupport:
        """One verdict for the engine from its workers' (tensor-parallel ranks): the first
        refusal wins."""
        for rank in ranks:
            if not rank.position_free:
                return rank
        return ranks[0] if ranks else ModelSupport(False, "the engine reported no worker")

    def refusal(self) -> str:
        """The message a refused span request gets."""
        return (f"this model is not position-free, so minipic cannot serve span-opted-in "
                f"requests on it ({self.reason}); send a plain prompt (no "
                f"vllm_xargs.minipic_spans), or send documents, which are then answered as a "
                f"plain prompt. Supported families: docs/models.md")

    def summary(self) -> str:
        """One line for start-up logs."""
        if self.position_free:
            return f"position-free ({self.converted}/{self.layers} attention layers)"
        return (f"NOT position-free: {self.reason}; documents are answered as plain prompts, "
                f"span-opted-in requests get HTTP 400")
