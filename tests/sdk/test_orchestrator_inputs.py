"""Whatever a caller passes, every question of ``answer_many`` ends as its own ``Answer`` or
``BadInputError`` (issue 14 items 1 and 13), on a real in-process engine (tiny Llama).

Items are fuzzed with hypothesis over arbitrary unicode (lone surrogates included), bytes, None,
numbers, nested lists and mappings, in every place an item can hold them.
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipic.orchestrator import Answer, BadInputError, SyncOrchestrator

pytestmark = [pytest.mark.engine, pytest.mark.shares("tiny_orchestrator")]


def doc(name: str, words: int = 20) -> str:
    return f"{name}: " + " ".join(f"{name.lower()}{i}" for i in range(words))


GOOD = [doc("Good1"), doc("Good2")]


def salt() -> str:
    return uuid.uuid4().hex


def test_one_bad_string_does_not_lose_the_batch(tiny_orchestrator: SyncOrchestrator) -> None:
    """A lone surrogate in one document, question or system prompt: before, a ``TypeError`` from
    the tokenizer ended the whole call; now only its own question fails."""
    results = tiny_orchestrator.answer_many([
        ("fine?", GOOD),
        ("bad document?", [GOOD[0], "broken \ud800 text"]),
        ("bad \udfff question?", GOOD),
        {"question": "bad system?", "documents": GOOD, "system": "sys \ud800"},
        {"question": "bad salt?", "documents": GOOD, "cache_salt": "\ud800"},
        (b"question as bytes?", GOOD),
        ("documents as one string?", "one string"),
        ("fine again?", GOOD),
    ], cache_salt=salt(), max_tokens=2)
    assert [type(r) for r in results] == [Answer] + [BadInputError] * 6 + [Answer]
    assert [r.question_index for r in results[1:-1]] == [1, 2, 3, 4, 5, 6]
    assert all("not valid Unicode" in str(r) for r in results[1:5]), results[1:5]


def test_blank_question_is_refused_and_blank_document_skipped(
    tiny_orchestrator: SyncOrchestrator,
) -> None:
    """Item 13, one rule: no content, no use. A blank question cannot be left out, so it is an
    error; a blank document (a retriever's empty hit) is left out and named in the answer."""
    orc, s = tiny_orchestrator, salt()
    for blank in ("", "  ", "\n\t "):
        with pytest.raises(BadInputError, match="question is empty"):
            orc.answer(blank, GOOD, cache_salt=s, max_tokens=2)
    a = orc.answer("q?", [GOOD[0], "   \n", "", GOOD[1]], cache_salt=s, max_tokens=2)
    assert a.cache_ok
    assert [(k.index, k.reason) for k in a.skipped_spans] == [(1, "whitespace only"),
                                                              (2, "empty")]
    assert [sp.index for sp in a.spans if sp.kind == "span"] == [0, 3]
    plain = orc.answer("q?", GOOD, cache_salt=s, max_tokens=2)
    assert plain.text == a.text and plain.prompt_tokens == a.prompt_tokens
    assert not plain.skipped_spans and plain.prefills_sent == 0  # the same prompt, warm
    only_blank = orc.answer("q?", [" "], cache_salt=s, max_tokens=2)
    assert [k.reason for k in only_blank.skipped_spans] == ["whitespace only"]
    results = orc.answer_many([("  ", GOOD), ("q?", ["\n", GOOD[0]])], cache_salt=s,
                              max_tokens=2)
    assert isinstance(results[0], BadInputError) and isinstance(results[1], Answer)
    assert [k.index for k in results[1].skipped_spans] == [0]


# -- the fuzz ----------------------------------------------------------------------------------

surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
any_text = st.lists(st.one_of(st.text(max_size=12), surrogates, st.sampled_from(
    [" ", "\n", "\x06", "<file_sep>", "<|im_start|>", "</s>"])), max_size=4).map("".join)
scalars = st.one_of(any_text, st.binary(max_size=8), st.none(), st.booleans(),
                    st.integers(-(2**70), 2**70), st.floats(allow_nan=True))
FIELDS = ["question", "documents", "system", "mode", "cache_salt", "text", "token_ids", "id",
          "score"]
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner),
        st.dictionaries(st.sampled_from(FIELDS), inner, max_size=3)),
    max_leaves=8,
)
documents = st.one_of(
    st.lists(st.one_of(any_text, st.sampled_from(GOOD), values), max_size=3), values)
items = st.one_of(
    any_text, values,
    st.tuples(st.one_of(any_text, values), documents),
    st.fixed_dictionaries({"question": st.one_of(any_text, values), "documents": documents},
                          optional={"system": st.one_of(st.none(), any_text, values),
                                    "cache_salt": st.one_of(st.none(), any_text, values),
                                    "mode": st.sampled_from(["prefix", "block_attention", 3])}),
)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(questions=st.lists(items, max_size=4), default_docs=st.one_of(st.none(), documents))
def test_answer_many_ends_every_item_as_answer_or_bad_input(
    tiny_orchestrator: SyncOrchestrator, questions: list, default_docs: object,
) -> None:
    results = tiny_orchestrator.answer_many(questions, documents=default_docs,
                                            cache_salt="fuzz", max_tokens=1)
    assert len(results) == len(questions)
    for i, result in enumerate(results):
        assert isinstance(result, (Answer, BadInputError)), (questions[i], result)
        if isinstance(result, BadInputError):
            assert result.question_index == i


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(questions=values)
def test_answer_many_with_no_list_at_all_is_one_bad_input(
    tiny_orchestrator: SyncOrchestrator, questions: object,
) -> None:
    try:
        results = tiny_orchestrator.answer_many(questions, max_tokens=1)
    except BadInputError:
        return
    assert isinstance(questions, (list, tuple)) and len(results) == len(questions)
    assert all(isinstance(r, (Answer, BadInputError)) for r in results)
