"""The load-time proof that an attention module's keys can be stored unrotated
(``engine_ext/attention/rotary_proof.py``), on vLLM 0.32's own classes and on forwards that
differ from a fitting one by one statement. No engine: the proof reads source only."""

from __future__ import annotations

import importlib

import pytest
import torch

from minipic.engine_ext.attention.rotary_proof import prove

pytestmark = pytest.mark.fast

MODELS = "vllm.model_executor.models."


def _cls(module: str, name: str) -> type:
    return getattr(importlib.import_module(MODELS + module), name)


@pytest.mark.parametrize("module,name", [
    ("llama", "LlamaAttention"), ("qwen2", "Qwen2Attention"), ("qwen3", "Qwen3Attention"),
    ("qwen2_moe", "Qwen2MoeAttention"), ("qwen3_moe", "Qwen3MoeAttention"),
    ("mixtral", "MixtralAttention"), ("glm4", "Glm4Attention"), ("gemma2", "Gemma2Attention"),
    ("gemma3", "Gemma3Attention"), ("gpt_oss", "OAIAttention"), ("olmoe", "OlmoeAttention"),
])
def test_fitting_vllm_forwards_are_proven(module: str, name: str) -> None:
    instance = object.__new__(_cls(module, name))
    shape, reason = prove(instance)
    assert reason is None and shape is not None and shape.rope_attr == "rotary_emb"


def test_flags_are_decided_per_instance() -> None:
    """Granite rotates under ``self.use_rope``; Mistral scales q under ``do_llama_4_scaling``
    between RoPE and attention: each fits only where the instance has the flag as needed."""
    granite = object.__new__(_cls("granite", "GraniteAttention"))
    for flag, fits in ((True, True), (False, False)):
        granite.__dict__["use_rope"] = flag
        assert (prove(granite)[0] is not None) == fits
    mistral = object.__new__(_cls("mistral", "MistralAttention"))
    for flag, fits in ((False, True), (True, False)):
        mistral.__dict__["do_llama_4_scaling"] = flag
        shape, reason = prove(mistral)
        assert (shape is not None) == fits, reason


@pytest.mark.parametrize("module,name,why", [
    ("llama4", "Llama4Attention", "between RoPE and attention"),  # qk_norm, NoPE temperature
    ("deepseek_v2", "DeepseekV2Attention", "between RoPE and attention"),  # keys assembled
    ("deepseek_v2", "DeepseekV2MLAAttention", "calls no rotary module"),  # MLA wrapper
])
def test_unfit_vllm_forwards_are_refused(module: str, name: str, why: str) -> None:
    shape, reason = prove(object.__new__(_cls(module, name)))
    assert shape is None and why in reason


class _Fits(torch.nn.Module):
    def forward(self, positions, hidden_states):
        q, k, v = self.qkv(hidden_states)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v)
        return self.o_proj(out)


class _NormAfterRope(torch.nn.Module):
    def forward(self, positions, hidden_states):
        q, k, v = self.qkv(hidden_states)
        q, k = self.rotary_emb(positions, q, k)
        k = self.k_norm(k)
        return self.attn(q, k, v)


class _ShiftedPositions(torch.nn.Module):
    def forward(self, positions, hidden_states):
        q, k, v = self.qkv(hidden_states)
        positions = positions + 1
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v)


class _OtherPositions(torch.nn.Module):
    def forward(self, positions, hidden_states):
        q, k, v = self.qkv(hidden_states)
        local = positions % 64
        q, k = self.rotary_emb(local, q, k)
        return self.attn(q, k, v)


class _SwappedArgs(torch.nn.Module):
    def forward(self, positions, hidden_states):
        q, k, v = self.qkv(hidden_states)
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(k, q, v)


class _TwoRotations(torch.nn.Module):
    def forward(self, positions, hidden_states):
        q, k, v = self.qkv(hidden_states)
        q, k = self.rotary_emb(positions, q, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v)


def test_one_statement_decides() -> None:
    """A fitting forward is proven; each one-statement change that would cache a key other than
    the one RoPE is removed from is refused."""
    assert prove(_Fits())[0] is not None
    for cls in (_NormAfterRope, _ShiftedPositions, _OtherPositions, _SwappedArgs, _TwoRotations):
        shape, reason = prove(cls())
        assert shape is None and reason, cls.__name__
