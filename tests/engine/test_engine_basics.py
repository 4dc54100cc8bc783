"""The foundation, end to end: the real default model answers through real vLLM on CPU, and
vLLM's prefix cache reports cached tokens on a repeated prompt."""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.shares("smol_pic", "smol_stock")]


def test_smollm2_answers_grounded_question(engines):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engines.get("smol_pic")
    tokenizer = llm.get_tokenizer()
    rng = random.Random()
    # invented names, so the answer can only come from the context
    city, country = rng.choice([("Quillhaven", "Norvania"), ("Brindlemoor", "Estavia"),
                                ("Tarrowdale", "Kelmaria"), ("Karsk", "Duvania")])
    messages = [
        {"role": "system",
         "content": "Answer the question using only the context. Reply with the name only."},
        {"role": "user", "content": f"Context: {city} is the capital city of {country}.\n\n"
                                    f"Question: What is the capital city of {country}?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                       SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)[0]
    assert city.lower() in out.outputs[0].text.lower(), out.outputs[0].text


def test_prefix_cache_reports_cached_tokens_on_repeat(engines):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engines.get("smol_stock")
    ids = [random.randrange(100, 40000) for _ in range(150)]
    params = SamplingParams(max_tokens=1)
    first = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    second = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (150 - 1) // 32 * 32  # full blocks before the last token
