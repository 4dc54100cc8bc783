"""The one source of truth shared by the client (prompt builder) and the engine (vLLM plugin).

Why it is separate: the two halves run in different processes, often on different machines. The
client places SSEP/PDEP/PAD ids and pads spans to ``block_size``; the engine's block hasher reacts
to exactly those ids at block starts. If the two disagree, nothing breaks loudly — spans just stop
hitting the cache, or worse, hit where they should not. So both read the same pydantic model, the
engine receives it through one environment variable that minipic itself sets, and the server
states it (log line + ``GET /minipic/config``) so a client can check for a mismatch.
"""

from __future__ import annotations

import json
import os

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minipic.span_contract.env import CKPT_CONFIG_ENV, ENABLE_ENV, FEATURES_ENV, SPAN_CONFIG_ENV

ENABLE_ENV = ENABLE_ENV
SPAN_CONFIG_ENV = SPAN_CONFIG_ENV
FEATURES_ENV = FEATURES_ENV
# Settings of the ``ckpt`` feature (JSON of ``engine_ext.recurrent.policy.CheckpointConfig``).
CKPT_CONFIG_ENV = CKPT_CONFIG_ENV
# What the plugin does when enabled. ``hash``: SSEP/PDEP block hashing (EngineCore).
# ``rope``: unrotated keys + RoPE inside attention + span isolation (worker). ``holes``: the
# lookup continues past misses and computes only the holes (EngineCore; needs hash + rope).
# All three by default; tests and benchmarks switch them separately to show what each is for.
ALL_FEATURES = ("hash", "rope", "holes")
# Known but not on by default: ``ckpt`` = sparse recurrent-state checkpoints for hybrid models
# (EngineCore; ``engine_ext/recurrent/checkpoints.py``). Hybrid models run with it *instead of*
# ``hash``, which refuses them.
KNOWN_FEATURES = (*ALL_FEATURES, "ckpt")


class SpanConfig(BaseModel):
    """Block size, the three special token ids that mark span structure, and the sink.

    ``sink_ids``: the model's own opening (its chat template's head with the default system
    prompt, rendered with a fixed date so that it never changes, or its BOS), copied after every
    span's SSEP so that the span's tokens sink where they would in full attention, not into
    their first token (docs/design.md §2). Only the span sees its copy: the engine recognises it
    by these ids right after an SSEP at a block start. Empty: spans carry no sink.

    ``sink_gap``: how many positions lie between a span's sink and its first token (0: right
    before it). A span's own tokens see the sink as the plain prompt's tokens see the opening,
    which sits a prefix's length before them, not right before; a gap is one constant of the
    layout, so spans stay position-independent (RoPE is relative). It changes the engine's
    positions only, never the tokens the client lays out, and it names the KV a span computes
    (the span store's fingerprint holds it). Measured in transformers on 300 items (issue 55):
    KL 0.317 at 0, 0.287 at 64, 0.286 at 128, 0.308 at 256 (``results/layout_levers/gap``).
    """

    model_config = ConfigDict(frozen=True)

    block_size: int = Field(32, gt=0, description="KV block size the engine runs with")
    ssep_id: int = Field(..., ge=0, description="span separator: block hash chain restarts")
    pdep_id: int = Field(..., ge=0, description="prompt dependent: block hash covers the prefix")
    pad_id: int = Field(..., ge=0, description="filler that aligns the next marker to a block")
    sink_ids: tuple[int, ...] = Field(
        (), description="the model's opening, copied after each span's SSEP, seen only by it")
    sink_gap: int = Field(
        0, ge=0, description="positions between a span's sink and its first token (0: none)")

    @model_validator(mode="after")
    def _distinct(self) -> SpanConfig:
        if len({self.ssep_id, self.pdep_id, self.pad_id}) != 3:
            raise ValueError(
                f"ssep_id, pdep_id and pad_id must be three different tokens, got "
                f"{self.ssep_id}, {self.pdep_id}, {self.pad_id}"
            )
        markers = {self.ssep_id, self.pdep_id, self.pad_id}.intersection(self.sink_ids)
        if markers:
            raise ValueError(f"sink_ids must not hold a marker id, got {sorted(markers)}")
        if any(t < 0 for t in self.sink_ids):
            raise ValueError("sink_ids must be token ids >= 0")
        return self

    def to_env(self, features: tuple[str, ...] = ALL_FEATURES) -> dict[str, str]:
        """Environment that turns the vLLM plugin on with this configuration."""
        unknown = set(features) - set(KNOWN_FEATURES)
        if unknown:
            raise ValueError(
                f"unknown minipic features {sorted(unknown)}; known: {KNOWN_FEATURES}"
            )
        return {
            ENABLE_ENV: "1",
            SPAN_CONFIG_ENV: self.model_dump_json(),
            FEATURES_ENV: ",".join(features),
        }

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> SpanConfig | None:
        """The configuration the plugin was started with, or None when the plugin is off."""
        env = os.environ if environ is None else environ
        if env.get(ENABLE_ENV, "0") not in ("1", "true", "yes"):
            return None
        raw = env.get(SPAN_CONFIG_ENV)
        if not raw:
            raise RuntimeError(f"{ENABLE_ENV}=1 but {SPAN_CONFIG_ENV} is not set")
        return cls.model_validate(json.loads(raw))


def enabled_features(environ: dict[str, str] | None = None) -> frozenset[str]:
    """Plugin features switched on in this process (empty when the plugin is off)."""
    env = os.environ if environ is None else environ
    if env.get(ENABLE_ENV, "0") not in ("1", "true", "yes"):
        return frozenset()
    raw = env.get(FEATURES_ENV, ",".join(ALL_FEATURES))
    return frozenset(f.strip() for f in raw.split(",") if f.strip())


# Span semantics are opt-in per request: ``SamplingParams(extra_args={SPANS_OPT_IN_KEY: True})``,
# or ``"vllm_xargs": {"minipic_spans": true}`` on the OpenAI routes. A request without it gets
# stock vLLM hashing and attention whatever its text contains (a plain client whose prompt
# happens to contain ``<file_sep>`` must not change how its tokens attend or hit).
SPANS_OPT_IN_KEY = "minipic_spans"
# Body field a client may add to a span prefill sent to a cluster (`minipic serve --replicas`):
# the token ids of the final prompt the prefill serves, so the router sends the prefill where
# that final will go. The cluster's ingress removes it before vLLM sees the body.
ROUTE_AS_KEY = "minipic_route_as"


def spans_opted_in(sampling_params: object) -> bool:
    """Whether a request asked for span semantics (SSEP/PDEP hashing, lookup and isolation)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    value = extra.get(SPANS_OPT_IN_KEY) if isinstance(extra, dict) else None
    return value is True or value == 1 or (isinstance(value, str) and value.lower() == "true")
