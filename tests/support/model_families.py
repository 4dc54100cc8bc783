"""One seeded tiny random model per model family, and what minipic must do with each.

Each family is built like ``tiny-llama`` (SmolLM2's tokenizer, 2 layers, fp32) from its
transformers config class, with the features that decide position-freedom switched on (q/k norms
with non-trivial weights, Granite's multipliers, GLM-4's partial rotary, Gemma's windows and
soft-capping, GPT-OSS's sinks, DeepSeek's MLA, Llama 4's NoPE layers). ``expect`` is the verdict
``docs/models.md`` publishes: ``"position-free"`` (equal to the layout-rule reference in
``tests/engine/test_model_families_*.py``) or the words the refusal must contain.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minipic.span_contract.models import _is_complete, _models_dir, _publish, default_model_dir

BASE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
            tie_word_embeddings=False)


@dataclass(frozen=True)
class Family:
    name: str  # what users call it (docs/models.md's first column)
    architecture: str  # the HF architecture vLLM dispatches on
    config_cls: str
    model_cls: str
    overrides: dict[str, Any] = field(default_factory=dict)
    expect: str = "position-free"  # or a phrase the refusal reason must contain
    # vLLM 0.32's CPU build answers this family's plain requests (False: its own kernels fail on
    # the tiny config, e.g. CPU MLA decode at block size 32; the refusal is still checked)
    plain_runs_on_cpu: bool = True
    # max |engine - reference| per logprob (``support.pic_reference.REFERENCE_TOL``, 1e-4) where
    # fp32 rounding allows it; a family whose activations run larger needs more (Gemma 3)
    reference_tol: float = 1e-4
    # engine arguments this family's tiny model needs on every CPU this suite meets
    engine_extra: dict[str, Any] = field(default_factory=dict)

    @property
    def position_free(self) -> bool:
        return self.expect == "position-free"


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)

FAMILIES: tuple[Family, ...] = (
    Family("Mistral", "MistralForCausalLM", "MistralConfig", "MistralForCausalLM",
           dict(sliding_window=None)),
    Family("Qwen2", "Qwen2ForCausalLM", "Qwen2Config", "Qwen2ForCausalLM",
           dict(use_sliding_window=False)),
    Family("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", "Qwen3ForCausalLM"),
    Family("Phi-3", "Phi3ForCausalLM", "Phi3Config", "Phi3ForCausalLM",
           dict(pad_token_id=None)),
    Family("Qwen2-MoE", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
           dict(MOE, shared_expert_intermediate_size=64, use_sliding_window=False)),
    Family("Qwen3-MoE", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE),
    Family("Mixtral", "MixtralForCausalLM", "MixtralConfig", "MixtralForCausalLM",
           dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    Family("Granite", "GraniteForCausalLM", "GraniteConfig", "GraniteForCausalLM",
           dict(attention_multiplier=0.09, embedding_multiplier=3.0, residual_multiplier=0.6,
                logits_scaling=2.0)),
    Family("GLM-4", "Glm4ForCausalLM", "Glm4Config", "Glm4ForCausalLM",
           dict(partial_rotary_factor=0.5)),
    Family("OLMo 2", "Olmo2ForCausalLM", "Olmo2Config", "Olmo2ForCausalLM",
           expect="calls no rotary module"),
    Family("Gemma 2", "Gemma2ForCausalLM", "Gemma2Config", "Gemma2ForCausalLM",
           dict(sliding_window=64, query_pre_attn_scalar=64, attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0, tie_word_embeddings=True)),
    Family("Gemma 3", "Gemma3ForCausalLM", "Gemma3TextConfig", "Gemma3ForCausalLM",
           dict(sliding_window=64, query_pre_attn_scalar=64, tie_word_embeddings=True,
                layer_types=["sliding_attention", "full_attention"]),
           # Gemma scales embeddings by sqrt(hidden) = 16 and has no final soft-capping, so fp32
           # rounding moves its logprobs ~16x further than a Llama's: over 40 seeds the stock
           # path was within 2.2e-5 of the reference, the span path within 6.7e-5, and the two
           # engine paths 6.3e-5 apart on the same prompt; the worst seen in CI was 1.07e-4.
           # 3e-4 is 2.8x that and still 3x under WRONG_MIN (a layout-visible reference).
           reference_tol=3e-4),
    Family("GPT-OSS", "GptOssForCausalLM", "GptOssConfig", "GptOssForCausalLM",
           dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                layer_types=["sliding_attention", "full_attention"])),
    Family("DeepSeek-V3 (MLA)", "DeepseekV3ForCausalLM", "DeepseekV3Config",
           "DeepseekV3ForCausalLM",
           dict(kv_lora_rank=256, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32,
                v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                topk_group=1, first_k_dense_replace=1, moe_intermediate_size=64,
                topk_method="noaux_tc"),
           expect="not minipic's position-free backend", plain_runs_on_cpu=False,
           # vLLM 0.32 picks its AMX MLA backend wherever the CPU has AMX tiles, and that one
           # loads only 16-bit or quantised weights: the fp32 tiny model failed at load on an
           # Intel Xeon with AMX (it passed on AMD). The reference CPU backend runs fp32 on both.
           engine_extra=dict(attention_backend="CPU_MLA")),
    Family("Llama 4", "Llama4ForCausalLM", "Llama4TextConfig", "Llama4ForCausalLM",
           dict(MOE, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=256,
                no_rope_layers=[1, 0],
                attention_chunk_size=64, interleave_moe_layer_step=2),
           expect="between RoPE and attention"),
)

BY_NAME = {f.name: f for f in FAMILIES}


def _init_random(model: Any, seed: int) -> None:
    """Seeded weights; norms at 1 + noise, so a key cached before its q/k norm would differ."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


def family_dir(family: Family, seed: int = 0) -> Path:
    """The family's tiny model folder (built once, cached under the model cache)."""
    import inspect

    import transformers

    tokenizer_dir = default_model_dir()
    config = {**BASE, **family.overrides}
    blob = json.dumps({"family": family.architecture, "config": config, "seed": seed,
                       "init": inspect.getsource(_init_random),
                       "transformers": transformers.__version__}, sort_keys=True, default=str)
    key = hashlib.sha256(blob.encode()).hexdigest()[:12]
    target = _models_dir() / f"tiny-family-{family.architecture}-{key}"
    if _is_complete(target):
        return target

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        kwargs = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        kwargs.update(config)
        model_config = getattr(transformers, family.config_cls)(**kwargs)
        torch.manual_seed(seed)
        model = getattr(transformers, family.model_cls)(model_config)
        _init_random(model, seed)
        model.config.dtype = "float32"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _publish(build, target)


def warm_model_infos(families: tuple[Family, ...] = FAMILIES) -> None:
    """Have vLLM inspect every family's model class now, in this process, into its own cache.

    Why: the first time vLLM meets an architecture it inspects the class in a fresh interpreter
    (``registry._run_in_subprocess``, to keep CUDA out of the parent), 20-30 s on 2 busy cores,
    once per family per fresh machine. On CPU there is no CUDA to keep out, so the tests do all
    families here in one go and every engine start reads vLLM's cache (``modelinfos``) instead.
    Only a speed-up: whatever this misses, vLLM inspects as it always does.
    """
    from vllm.model_executor.models import registry

    stock = registry._run_in_subprocess
    registry._run_in_subprocess = lambda fn: fn()
    try:
        for family in families:
            model = registry.ModelRegistry.models.get(family.architecture)
            if model is not None:
                model.inspect_model_cls()
    finally:
        registry._run_in_subprocess = stock
