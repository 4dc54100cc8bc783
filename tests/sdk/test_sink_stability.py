"""The span sink is a stable function of the model (issue 52, item 4).

``model_sink_ids`` renders the chat template's opening and every span carries it after its SSEP;
the client (prompt builder) and the engine (``SpanConfig.sink_ids``) compute it separately and
the span store's fingerprint holds it. A template that prints today's date must therefore not
change it at midnight, and builders without a template (or models without BOS) must get the sink
the engine gets. The clock is mocked where transformers' Jinja helper ``strftime_now`` reads it
(``transformers.utils.chat_template_utils.datetime``), so each test shows the template *would*
render two different days before asserting the sink does not.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import datetime
from unittest import mock

import pytest

from minipic.prompt_builder import PromptBuilder
from minipic.span_contract import special_tokens
from minipic.span_contract.special_tokens import (
    SINK_DATE,
    default_span_config,
    sink_strftime_now,
    span_config_for_model,
)

pytestmark = pytest.mark.fast

# one second before and one second after midnight: the moment a date-printing sink changed
BEFORE_MIDNIGHT = datetime(2025, 3, 1, 23, 59, 59)
AFTER_MIDNIGHT = datetime(2025, 3, 2, 0, 0, 1)

# Llama 3.x prints the date directly with strftime_now ...
STRFTIME_TEMPLATE = (
    "{{- '<|im_start|>system\\nToday Date: ' + strftime_now('%d %b %Y') + '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# ... or (Llama 3.1's template) through ``date_string``, filled from the clock when not given
DATE_STRING_TEMPLATE = (
    "{%- if not date_string is defined %}"
    "{%- if strftime_now is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- endif %}"
    "{{- '<|im_start|>system\\nCutting Knowledge Date: December 2023\\n'"
    " + 'Today Date: ' + date_string + '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture
def tokenizer(model_dir):
    """A fresh SmolLM2 tokenizer per test (tests change its template and BOS)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@contextmanager
def clock_at(moment: datetime):
    """Transformers' ``strftime_now`` (``datetime.now().strftime``) reads ``moment``."""
    from transformers.utils import chat_template_utils

    fake = mock.Mock(wraps=datetime)
    fake.now.return_value = moment
    with mock.patch.object(chat_template_utils, "datetime", fake):
        yield


def rendered_opening(tokenizer) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False,
                                         add_generation_prompt=True).split("X")[0]


@pytest.mark.parametrize("template", [STRFTIME_TEMPLATE, DATE_STRING_TEMPLATE],
                         ids=["strftime_now", "date_string"])
def test_sink_is_the_same_on_both_sides_of_midnight(tokenizer, template):
    tokenizer.chat_template = template
    sinks, openings = [], []
    for moment in (BEFORE_MIDNIGHT, AFTER_MIDNIGHT):
        with clock_at(moment):
            openings.append(rendered_opening(tokenizer))
            sinks.append(special_tokens.model_sink_ids(tokenizer))
    # the mocked clock reaches the template: a plain rendering changes at midnight ...
    assert "01 Mar 2025" in openings[0] and "02 Mar 2025" in openings[1]
    # ... the sink does not, and it holds the documented fixed date
    assert sinks[0] == sinks[1]
    text = tokenizer.decode(sinks[0])
    assert "Today Date: 26 Jul 2024" in text, text
    assert text.endswith("<|im_start|>user\n"), text


def test_engine_and_client_agree_across_midnight(tokenizer):
    """The engine's SpanConfig (``default_span_config``, what ``span_config_for_model`` runs at
    engine start) made before midnight still matches a client builder made after it."""
    tokenizer.chat_template = STRFTIME_TEMPLATE
    with clock_at(BEFORE_MIDNIGHT):
        engine = default_span_config(tokenizer, 16)
    with clock_at(AFTER_MIDNIGHT):
        client = PromptBuilder(tokenizer, PromptBuilder._pick_span_config(
            tokenizer, 16, None, None, None, None))
    client.check_engine(engine)  # raises EngineMismatchError on any field, sink_ids included
    assert client.span_config == engine and engine.sink_ids


def test_sink_clock_spells_dates_the_same_everywhere():
    """Month and weekday names in English whatever the process's locale, numbers of the fixed
    date, at 00:00 (formats used by Llama 3.x, SmolLM3, gpt-oss and Granite templates)."""
    assert SINK_DATE == datetime(2024, 7, 26)
    assert sink_strftime_now("%d %b %Y") == "26 Jul 2024"
    assert sink_strftime_now("%d %B %Y") == "26 July 2024"
    assert sink_strftime_now("%Y-%m-%d") == "2024-07-26"
    assert sink_strftime_now("%B %d, %Y") == "July 26, 2024"
    assert sink_strftime_now("%A %a %H:%M %p %%") == "Friday Fri 00:00 AM %"
    assert sink_strftime_now("%^b") == "JUL"
    assert special_tokens.sink_template_kwargs()["date_string"] == "26 Jul 2024"


def test_plain_builder_carries_the_engines_sink(model_dir):
    """``chat_template=False`` does not change the sink: it belongs to the model, and the engine
    (one SpanConfig for chat and plain prompts) recognises only that one."""
    engine = span_config_for_model(model_dir, 16)
    plain = PromptBuilder.from_pretrained(model_dir, block_size=16, chat_template=False)
    chat = PromptBuilder.from_pretrained(model_dir, block_size=16)
    assert plain.span_config.sink_ids == chat.span_config.sink_ids == engine.sink_ids
    assert len(engine.sink_ids) == 24  # SmolLM2's chat opening, default system prompt included
    plain.check_engine(engine)
    built = plain.build(spans=["Paris is in France."], question="Where is Paris?")
    ids = built.prompt_token_ids
    span = next(s for s in built.segments if s.marker == "ssep")
    assert tuple(ids[span.start + 1:span.content_start]) == engine.sink_ids
    content = [t for seg in built.segments if seg.kind != "pad"
               for t in ids[seg.content_start:seg.end]]
    assert plain.decode(content) == "Paris is in France.Where is Paris?"  # the prompt is plain


@pytest.mark.parametrize("adds_bos", [False, True], ids=["no_bos", "bos"])
def test_model_without_template_sinks_into_its_bos_or_nothing(tokenizer, adds_bos):
    """No chat template: the sink is what the tokenizer puts before text (its BOS), the same
    ids a plain prompt starts with; a tokenizer that adds none gives spans without a sink."""
    tokenizer.chat_template = None
    tokenizer.add_bos_token = adds_bos
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    expected = (bos,) if adds_bos else ()
    assert special_tokens.model_sink_ids(tokenizer) == expected
    engine = default_span_config(tokenizer, 16)
    client = PromptBuilder(tokenizer, PromptBuilder._pick_span_config(
        tokenizer, 16, None, None, None, None), chat_template=False)
    assert engine.sink_ids == client.span_config.sink_ids == expected
    client.check_engine(engine)
    built = client.build(system="Sys.", spans=["Doc one.", "Doc two."], question="Q?")
    ids = built.prompt_token_ids
    assert tuple(ids[:len(expected)]) == expected  # the plain prompt's own opening
    spans = [s for s in built.segments if s.marker == "ssep"]
    assert len(spans) == 2
    for span in spans:
        assert tuple(ids[span.start + 1:span.content_start]) == expected
