"""Budgeting spans into max_model_len, token counting with HF and tiktoken, offline tiktoken."""

from __future__ import annotations

import gzip
import hashlib
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipic.prompt_builder import (
    BudgetPolicy,
    HFTokenCounter,
    InvalidInputError,
    Mode,
    PromptBuilder,
    PromptTooLongError,
    Span,
    SpanTooLongError,
    TiktokenCounter,
    TokenCounter,
    as_token_counter,
    count_tokens,
    fit_texts,
)
from minipic.prompt_builder.budget import allocate, padded_span_cost
from minipic.span_contract import tiktoken_offline
from minipic.span_contract.env import CACHE_DIR_ENV
from minipic.span_contract.special_tokens import default_span_config

pytestmark = pytest.mark.fast

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from minipic.span_contract.models import ModelUnavailableError, default_model_dir

    try:
        return AutoTokenizer.from_pretrained(default_model_dir(fetch=False))
    except ModelUnavailableError as exc:
        pytest.skip(f"default model not converted: {exc}")


@pytest.fixture(scope="module")
def builder(tokenizer):
    # the budget's arithmetic on blocks of 8: spans without a sink (SSEP + text + PAD), whose
    # 24 tokens would leave these small limits no room (the sink's cost:
    # test_prompt_builder.py::test_span_cost_counts_the_sink)
    config = default_span_config(tokenizer, 8).model_copy(update={"sink_ids": ()})
    return PromptBuilder(tokenizer, config, chat_template=False)


@pytest.fixture(scope="module")
def cl100k():
    return tiktoken_offline.get_encoding("cl100k_base")


def doc(n_words: int, tag: int) -> str:
    return " ".join(f"w{tag}x{i}" for i in range(n_words))


# ---------------------------------------------------------------------------------------------
# budgeting inside build()
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    limit=st.integers(20, 200),
    max_tokens=st.integers(0, 16),
    policy=st.sampled_from([BudgetPolicy.DROP, BudgetPolicy.TRUNCATE, BudgetPolicy.SKIP]),
    mode=st.sampled_from(list(Mode)),
    scored=st.booleans(),
    data=st.data(),
)
def test_budget_never_exceeds_the_limit(builder, sizes, limit, max_tokens, policy, mode,
                                        scored, data):
    scores = data.draw(st.lists(st.floats(-5, 5), min_size=len(sizes), max_size=len(sizes)))
    spans = [Span(text=doc(n, i), id=f"d{i}", score=scores[i] if scored else None)
             for i, n in enumerate(sizes)]
    try:
        built = builder.build(system="S.", spans=spans, question="Q?", mode=mode,
                              max_model_len=limit, max_tokens=max_tokens, budget=policy)
    except PromptTooLongError:
        # only when system + question + max_tokens alone do not fit
        fixed = builder.build(system="S.", question="Q?", mode=mode)
        assert fixed.num_prompt_tokens + max_tokens > limit
        return
    report = built.budget
    assert built.num_prompt_tokens + max_tokens <= limit
    assert report.used_tokens == built.num_prompt_tokens
    dropped = [d.index for d in report.dropped]
    assert sorted(report.kept + dropped) == list(range(len(spans)))
    kept_in_prompt = [s.index for s in built.spans if s.kind == "span"]
    assert kept_in_prompt == sorted(report.kept)  # caller order is kept
    rank = (sorted(range(len(spans)), key=lambda i: (-scores[i], i)) if scored
            else list(range(len(spans))))
    position = {i: r for r, i in enumerate(rank)}
    if policy is not BudgetPolicy.SKIP:  # never keep a span ranked below a dropped one
        assert all(position[k] < position[d] for k in report.kept for d in dropped)
    if policy is BudgetPolicy.TRUNCATE:
        assert len(report.truncated) <= 1
        for t in report.truncated:
            info = next(s for s in built.spans if s.index == t.index)
            assert info.truncated_from == t.original_tokens > t.kept_tokens == info.token_count
            assert info.span_id == t.new_span_id == f"d{t.index}[:{t.kept_tokens}]"
    else:
        assert not report.truncated
    if policy is BudgetPolicy.SKIP:  # a dropped span would not fit even now
        left = limit - max_tokens - built.num_prompt_tokens
        layout_cost = {Mode.PREFIX: lambda n: n}.get(mode, padded_span_cost(8))
        for d in report.dropped:
            assert layout_cost(d.tokens) > left or mode is Mode.BOUNDARY_RECOMPUTE


def test_error_policy_names_the_problem(builder):
    long_doc = doc(200, 0)
    with pytest.raises(SpanTooLongError, match=r"span 1 \(big\) needs"):
        builder.build(spans=["short", Span(text=long_doc, id="big")], question="q",
                      max_model_len=128)
    with pytest.raises(PromptTooLongError, match="budget='drop'"):
        builder.build(spans=[doc(20, i) for i in range(10)], question="q", max_model_len=128)
    with pytest.raises(PromptTooLongError, match="before any span"):
        builder.build(system=doc(100, 1), spans=["d"], question="q", max_model_len=64)
    with pytest.raises(PromptTooLongError, match="max_tokens reserves 63"):
        builder.build(spans=["d"], question="q", max_model_len=64, max_tokens=63)
    with pytest.raises(SpanTooLongError, match="max_tokens 60"):
        builder.build(spans=["d"], question="q", max_model_len=64, max_tokens=60)


def test_drop_truncate_skip_on_a_known_case(builder):
    # sizes in 8-token blocks (SSEP + text + PAD): a=2 blocks, b=4 blocks, c=1 block
    spans = [Span(text=doc(3, 0), id="a"), Span(text=doc(9, 1), id="b"),
             Span(text=doc(1, 2), id="c")]
    sizes = [builder.prepare_span(s).token_ids for s in spans]
    costs = [padded_span_cost(8)(len(t)) for t in sizes]
    fixed = builder.build(question="q").num_prompt_tokens
    limit = fixed + costs[0] + costs[2] + 8 + 1  # room for a, c and one more block (+1 = gen)

    dropped = builder.build(spans=spans, question="q", max_model_len=limit, budget="drop")
    assert dropped.budget.kept == [0] and [d.span_id for d in dropped.budget.dropped] == ["b", "c"]

    skipped = builder.build(spans=spans, question="q", max_model_len=limit, budget="skip")
    assert skipped.budget.kept == [0, 2] and [d.span_id for d in skipped.budget.dropped] == ["b"]

    cut = builder.build(spans=spans, question="q", max_model_len=limit, budget="truncate")
    assert cut.budget.kept == [0, 1] and cut.budget.truncated[0].span_id == "b"
    assert cut.budget.truncated[0].kept_tokens == (costs[2] + 8) - 1
    assert [d.span_id for d in cut.budget.dropped] == ["c"]

    # with scores the rank is a > c > b: "drop" now keeps c (ranked above the dropped b)
    scored = [s.model_copy(update={"score": sc}) for s, sc in zip(spans, [0.9, 0.1, 0.5],
                                                                  strict=True)]
    by_score = builder.build(spans=scored, question="q", max_model_len=limit, budget="drop")
    assert by_score.budget.kept == [0, 2] and [d.span_id for d in by_score.budget.dropped] == ["b"]


def test_builder_default_max_model_len(tokenizer):
    config = default_span_config(tokenizer, 8).model_copy(update={"sink_ids": ()})
    small = PromptBuilder(tokenizer, config, max_model_len=64)
    with pytest.raises(SpanTooLongError):
        small.build(spans=[doc(100, 0)], question="q")
    built = small.build(spans=[doc(100, 0)], question="q", budget="truncate", max_tokens=8)
    assert built.num_prompt_tokens + 8 <= 64 and built.budget.truncated


def test_allocate_edge_cases():
    cost = padded_span_cost(4)
    assert allocate([], 0, cost, BudgetPolicy.DROP).kept == {}
    only = allocate([10], 9, cost, BudgetPolicy.TRUNCATE)  # 2 blocks: SSEP + 7 tokens
    assert only.kept == {0: 7} and only.used == 8
    nothing = allocate([10], 1, cost, BudgetPolicy.TRUNCATE)  # not even SSEP + 1 token fits
    assert nothing.kept == {} and nothing.dropped == (0,)


# ---------------------------------------------------------------------------------------------
# counting
# ---------------------------------------------------------------------------------------------


def test_counters(tokenizer, cl100k, builder):
    text = "Hello <|endoftext|> world <file_sep>"
    hf = as_token_counter(tokenizer)
    tk = as_token_counter(cl100k)
    assert isinstance(hf, HFTokenCounter) and isinstance(tk, TiktokenCounter)
    assert isinstance(hf, TokenCounter) and isinstance(tk, TokenCounter)
    assert hf.encode(text) == builder.encode(text)
    assert 100257 not in tk.encode(text)  # <|endoftext|> counted as text
    assert tk.decode(tk.encode(text)) == text
    assert count_tokens("cl100k_base", text) == len(tk.encode(text))
    assert count_tokens(builder.counter, text) == builder.count_tokens(text)
    with pytest.raises(InvalidInputError, match="cannot count tokens"):
        as_token_counter(42)


@SETTINGS
@given(
    words=st.lists(st.integers(1, 60), min_size=1, max_size=6),
    budget=st.integers(0, 300),
    block=st.sampled_from([None, 16]),
    policy=st.sampled_from([BudgetPolicy.DROP, BudgetPolicy.TRUNCATE, BudgetPolicy.SKIP]),
    which=st.sampled_from(["cl100k", "o200k", "hf"]),
)
def test_fit_texts_with_tiktoken_and_hf(tokenizer, cl100k, words, budget, block, policy, which):
    counter = {"cl100k": cl100k, "o200k": "o200k_base", "hf": tokenizer}[which]
    tc = as_token_counter(counter)
    texts = [doc(n, i) + " é漢😀" for i, n in enumerate(words)]
    chosen = fit_texts(texts, counter, budget, block_size=block, policy=policy)

    def cost(n):
        return padded_span_cost(block)(n) if block else n

    assert sum(cost(len(tc.encode(t))) for t in chosen.texts) <= budget
    assert chosen.report.used_tokens <= budget
    for i, t in zip(chosen.indices, chosen.texts, strict=True):
        assert texts[i].startswith(t) and t  # truncated texts are true prefixes
    assert sorted(chosen.indices + [d.index for d in chosen.report.dropped]) == list(
        range(len(texts)))


# ---------------------------------------------------------------------------------------------
# offline tiktoken
# ---------------------------------------------------------------------------------------------


def test_tiktoken_offline_files_and_no_network(monkeypatch, tmp_path):
    import tiktoken.load
    import tiktoken.registry

    def no_network(*args, **kwargs):
        raise AssertionError("tiktoken tried to download")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # force a fresh load
    enc = tiktoken_offline.get_encoding("cl100k_base")
    assert enc.encode_ordinary("hello world") == [15339, 1917]
    assert "TIKTOKEN_CACHE_DIR" not in os.environ  # restored after the load
    folder = tiktoken_offline.offline_cache_dir()
    assert folder == tmp_path / "tiktoken"
    for entry in {tiktoken_offline.ENCODING_FILES[n] for n in ("cl100k_base",)}:
        data = (folder / entry.cache_name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry.sha256
        assert entry.cache_name == hashlib.sha1(entry.url.encode()).hexdigest()
    assert tiktoken_offline.get_encoding("o200k_base").n_vocab == 200019
    with pytest.raises(tiktoken_offline.OfflineEncodingError, match="available"):
        tiktoken_offline.get_encoding("p50k_base")


def test_tiktoken_offline_repairs_a_damaged_cache_file(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    entry = tiktoken_offline.ENCODING_FILES["cl100k_base"]
    folder = tmp_path / "tiktoken"
    folder.mkdir()
    (folder / entry.cache_name).write_bytes(gzip.compress(b"garbage"))
    tiktoken_offline.ensure_offline_cache(("cl100k_base",))
    data = (folder / entry.cache_name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == entry.sha256


@pytest.fixture(scope="module")
def sink_builder(tokenizer):
    builder = PromptBuilder(tokenizer, default_span_config(tokenizer, 16), chat_template=False)
    assert builder.span_config.sink_ids, "the check needs spans that carry a sink"
    return builder


@SETTINGS
@given(
    words=st.lists(st.integers(1, 80), min_size=1, max_size=5),
    budget=st.integers(0, 700),
    mode=st.sampled_from(["block_attention", "boundary_recompute", "selective@0.25",
                          "selective@0.5"]),
    policy=st.sampled_from([BudgetPolicy.DROP, BudgetPolicy.TRUNCATE, BudgetPolicy.SKIP]),
)
def test_fit_texts_charges_what_build_lays_out(sink_builder, words, budget, mode, policy):
    """With ``builder=``, a text costs what ``build`` lays out for it in ``mode`` (its SSEP, the
    model's sink, its tokens, a head's PDEP, the pads): the chosen texts, built, take exactly the
    tokens the report charged (no more than the budget where one was cut), so nothing it
    accepts fails ``build`` later. With ``block_size`` alone the sink was not charged."""
    texts = [doc(n, i) for i, n in enumerate(words)]
    chosen = fit_texts(texts, sink_builder.counter, budget, builder=sink_builder, mode=mode,
                       policy=policy)
    assert chosen.report.used_tokens <= budget
    if not chosen.texts:
        return
    built = sink_builder.build(spans=chosen.texts, question="Which?", mode=mode)
    laid_out = sum(info.end - info.start for info in built.spans if info.kind == "span")
    if chosen.report.truncated:  # a cut text is re-tokenized by build: never longer
        assert laid_out <= budget
    else:
        assert laid_out == chosen.report.used_tokens
    with pytest.raises(InvalidInputError, match="disagrees"):
        fit_texts(texts, sink_builder.counter, budget, builder=sink_builder, block_size=8)
