"""``minipic eval``: its metrics against hand-computed values, and a real small run.

Metrics: KL of identical distributions is 0, a known pair gives its closed form, EM / F1 follow
SQuAD's normalisation, the paired bootstrap CI covers the true mean in a simulation. The run:
the tiny model, fresh random items; the report has every field, ``prefix`` (span opt-in) agrees
with full attention (stock path, same tokens) to KL ~ 0, and bad JSONL lines are per-line errors
while the run goes on. The built-in set: fanoutqa, then SQuAD 1.1 dev, the same for a seed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from minipic.eval import metrics

pytestmark = pytest.mark.shares("tiny_orchestrator")

VOCAB = ["river", "stone", "lamp", "cedar", "harbor", "violet", "ember", "falcon", "tundra"]


@pytest.mark.fast
def test_kl_of_identical_distributions_is_zero(seed) -> None:
    rng = random.Random(seed)
    raw = [rng.random() for _ in range(20)]
    total = sum(raw) * 1.3  # 20 listed tokens, the rest of the mass elsewhere
    p = {i: math.log(x / total) for i, x in enumerate(raw)}
    kl, rest = metrics.kl_topk(p, p)
    assert kl == pytest.approx(0.0, abs=1e-12) and rest == pytest.approx(1 - 1 / 1.3)


@pytest.mark.fast
def test_kl_of_a_known_pair_is_its_closed_form() -> None:
    p = {0: math.log(0.7), 1: math.log(0.3)}
    q = {0: math.log(0.4), 1: math.log(0.6)}
    kl, rest = metrics.kl_topk(p, q)
    assert kl == pytest.approx(0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6))
    assert rest == pytest.approx(0.0, abs=1e-12)
    # a tail bucket: p lists 0.5 / 0.3 (rest 0.2), q lists 0.2 / 0.2 (rest 0.6)
    p = {0: math.log(0.5), 1: math.log(0.3)}
    q = {0: math.log(0.2), 1: math.log(0.2)}
    expected = (0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.2)
                + 0.2 * math.log(0.2 / 0.6))
    assert metrics.kl_topk(p, q)[0] == pytest.approx(expected)
    # a token q does not list is charged at most q's smallest listed probability
    q_missing = {0: math.log(0.5), 2: math.log(0.4)}
    kl_missing, _ = metrics.kl_topk({0: math.log(0.5), 1: math.log(0.5)}, q_missing)
    assert kl_missing >= 0.5 * math.log(0.5 / 0.1) - 1e-9  # q_1 <= q's unlisted mass 0.1


@pytest.mark.fast
def test_exact_match_and_f1_use_squad_normalisation() -> None:
    assert metrics.exact_match("The  Eiffel Tower!", "eiffel tower") == 1.0
    assert metrics.exact_match("an apple", "Apple.") == 1.0
    assert metrics.exact_match("Paris, France", "Paris") == 0.0
    assert metrics.f1("Paris France", "Paris") == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert metrics.f1("the", "a") == 1.0  # both normalise to nothing
    assert metrics.f1("London", "Paris") == 0.0
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.fast
def test_bootstrap_ci_covers_the_true_mean(seed) -> None:
    rng = np.random.default_rng(seed)
    trials, covered = 200, 0
    for t in range(trials):
        sample = rng.normal(1.0, 2.0, size=60)
        _, low, high = metrics.bootstrap_ci(sample, resamples=1000, seed=seed + t)
        covered += low <= 1.0 <= high
    assert 0.88 <= covered / trials <= 0.99, covered / trials
    # paired: the same indices for two series give the CI of their difference's mean
    a = rng.normal(0, 1, 80)
    idx = metrics.bootstrap_indices(80, 500, seed)
    mean, low, high = metrics.bootstrap_ci(a - a, indices=idx)
    assert mean == low == high == 0.0


@pytest.mark.fast
def test_jsonl_lines_with_problems_are_reported_not_fatal(tmp_path: Path) -> None:
    from minipic.eval.datasets import load_jsonl

    path = tmp_path / "mine.jsonl"
    path.write_bytes(b'{"question": "q?", "documents": ["a"], "answer": "a"}\n'
                     b'{"question": "q?"}\n'
                     b'{"question": "q?", "documents": []}\n'
                     b'\xff\xfe not utf-8\n'
                     b'not json\n'
                     b'{"question": "", "documents": ["a"]}\n'
                     b'{"question": "ok", "documents": ["b", "c"]}\n')
    loaded = load_jsonl(path)
    assert [i.question for i in loaded.items] == ["q?", "ok"]
    assert [e["line"] for e in loaded.errors] == [2, 3, 4, 5, 6]
    assert "documents" in loaded.errors[1]["error"] and "UTF-8" in loaded.errors[2]["error"]


@pytest.mark.fast
def test_builtin_set_is_fanoutqa_then_squad_dev(seed) -> None:
    from minipic.eval.datasets import builtin_items
    from minipic.span_contract.errors import BadInputError

    n = random.Random(seed).randint(80, 120)
    items = builtin_items("builtin", n, seed)
    fanoutqa = builtin_items("fanoutqa", 1000, seed)
    assert len(items) == n and 0 < len(fanoutqa) < n
    assert items[: len(fanoutqa)] == fanoutqa  # same seed, same draw: fanoutqa comes first
    assert all(i.id.startswith("fanoutqa-") and i.source == "fanoutqa" for i in fanoutqa)
    squad = items[len(fanoutqa):]
    assert all(i.id.startswith("squad-dev-") and i.source == "squad" for i in squad)
    assert len({i.id for i in items}) == n
    for item in items:
        assert 3 <= len(item.documents) <= 10, item.id
        assert item.answer and item.gold_index is not None
        assert item.answer.lower() in item.documents[item.gold_index].lower(), item.id
    assert builtin_items("builtin", n, seed) == items
    with pytest.raises(BadInputError, match="squad"):
        builtin_items("cpkc", n, seed)


@pytest.mark.engine
def test_small_real_run_has_every_field(tiny_orchestrator, tmp_path: Path, seed) -> None:
    from minipic.eval import evaluate, write
    from minipic.eval.datasets import EvalItem, load_jsonl

    rng = random.Random(seed)
    items = []
    for i in range(3):
        docs = [" ".join(rng.choice(VOCAB) for _ in range(rng.randint(20, 50)))
                for _ in range(rng.randint(2, 4))]
        items.append(EvalItem(id=f"r{i}", question=" ".join(rng.sample(VOCAB, 4)) + "?",
                              documents=docs, answer=rng.choice(VOCAB)))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"question": "q"}\n\xff\n')
    errors = load_jsonl(bad).errors
    modes = ("prefix", "block_attention", "boundary_recompute", "boundary_recompute@40",
             "block_attention/no-sink")
    report = tiny_orchestrator.submit(evaluate(
        tiny_orchestrator.aio, items, modes, max_tokens=4, errors=errors, progress=False,
        concurrency=2)).result()
    assert [e["line"] for e in report["errors"]] == [1, 2]
    summary = report["summary"]
    assert summary["n"] == 3 and set(summary["modes"]) == set(modes)
    for m in summary["modes"].values():
        for key in ("kl_mean", "kl_p95", "top1_agreement", "exact_match_full", "em", "f1",
                    "em_minus_full", "f1_minus_full", "ttft_p50_ms", "hit_rate", "p_rest_mean"):
            assert key in m, key
        assert len(m["kl_mean"]["ci95"]) == 2
    # prefix with span opt-in vs full attention on the stock path: the same computation
    assert summary["modes"]["prefix"]["kl_mean"]["mean"] < 1e-4
    assert summary["modes"]["prefix"]["top1_agreement"]["mean"] == 1.0
    assert {"boundary_recompute_minus_block_attention",
            "boundary_recompute@40_minus_block_attention"} <= set(summary["comparisons"])
    assert [r["id"] for r in report["items"]] == ["r0", "r1", "r2"]  # item order kept
    assert report["verdict"]
    for record in report["items"]:
        assert set(record["modes"]) == set(summary["modes"])
        assert record["modes"]["block_attention"]["cached_tokens"] > 0  # spans were reused
        assert record["modes"]["block_attention/no-sink"]["cached_tokens"] > 0
    write(report, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["summary"]["n"] == 3
    assert (tmp_path / "out" / "eval.png").stat().st_size > 0
    assert "block_attention" in (tmp_path / "out" / "eval.md").read_text()


def _random_items(rng: random.Random, n: int) -> list:
    from minipic.eval.datasets import EvalItem

    return [EvalItem(id=f"r{i}", question=f"{' '.join(rng.sample(VOCAB, 4))} {i}?",
                     documents=[" ".join(rng.choice(VOCAB) for _ in range(rng.randint(5, 20)))
                                for _ in range(rng.randint(1, 3))],
                     answer=rng.choice(VOCAB)) for i in range(n)]


def _write_jsonl(path: Path, items: list) -> Path:
    path.write_text("".join(json.dumps({"id": i.id, "question": i.question,
                                        "documents": i.documents, "answer": i.answer}) + "\n"
                            for i in items))
    return path


@contextmanager
def _fake_vllm(cards: object) -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server in a thread that answers ``GET /v1/models`` as vLLM's OpenAI server
    does (``cards``: its ``data``) and 404s everything else: enough to check what eval reads
    before it scores anything. Yields its URL and the paths it was asked for."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            asked.append(self.path)
            if self.path != "/v1/models":
                self.send_error(404)
                return
            body = json.dumps({"object": "list", "data": cards}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _card(root: object) -> dict:
    """One ``/v1/models`` entry as vLLM writes it (``root``: the path it loaded)."""
    card = {"id": "minipic", "object": "model", "created": 0, "owned_by": "vllm",
            "parent": None, "max_model_len": 2048, "permission": []}
    return card if root is None else {**card, "root": root}


def _tuned_folder(path: Path, tuned: list) -> Path:
    """A model folder as far as eval reads one: the manifest ``minipic tune`` writes."""
    from minipic.tune.data import question_digest

    path.mkdir()
    (path / "minipic_tune.json").write_text(json.dumps(
        {"data": {"train_question_digests": sorted(question_digest(i.question)
                                                   for i in tuned)}}))
    return path


@pytest.mark.fast
def test_a_served_tuned_model_is_not_scored_on_its_tuning_items(tmp_path: Path, capsys,
                                                                seed) -> None:
    """With ``--url`` the model folder is the one the server says it loaded: its tuning items
    are dropped exactly as for the embedded engine; a served folder without a manifest (an
    untuned model) drops nothing, and an unreadable manifest stops eval."""
    from minipic.eval.cli import served_model_dir, untuned_items

    rng = random.Random(seed)
    items = _random_items(rng, rng.randint(6, 12))
    tuned = rng.sample(items, rng.randint(1, len(items) - 1))
    folder = _tuned_folder(tmp_path / "model", tuned)
    args = argparse.Namespace(url=None, model=None, unchecked_model=False)
    with _fake_vllm([_card(str(folder))]) as (url, asked):
        assert served_model_dir(url) == folder
        args.url = url + "/"
        kept = untuned_items(args, items)
    assert asked == ["/v1/models", "/v1/models"]
    assert [i.id for i in kept] == [i.id for i in items if i not in tuned]
    assert f"{len(tuned)} item(s) dropped: the model was tuned on them" in capsys.readouterr().out
    # the embedded engine on the same folder: the same items, the same message
    embedded = untuned_items(argparse.Namespace(url=None, model=str(folder)), items)
    assert [i.id for i in embedded] == [i.id for i in kept]
    assert f"{len(tuned)} item(s) dropped" in capsys.readouterr().out

    untuned = tmp_path / "untuned"
    untuned.mkdir()
    with _fake_vllm([_card(str(untuned))]) as (url, _):
        args.url = url
        assert untuned_items(args, items) == items
    assert "dropped" not in capsys.readouterr().out
    (folder / "minipic_tune.json").write_text("{not json")
    with _fake_vllm([_card(str(folder))]) as (url, _):
        args.url = url
        assert untuned_items(args, items) is None
    assert "unreadable" in capsys.readouterr().out


@pytest.mark.fast
def test_eval_over_url_refuses_a_model_it_cannot_check(tmp_path: Path, capsys, seed) -> None:
    """When the served model's folder cannot be read here (server unreachable, no ``root``, a
    folder on another machine, a relative path, several models), ``minipic eval --url`` stops
    with exit 2 before scoring anything, says why and names ``--unchecked-model``; with that
    flag the items pass unchecked, after a warning."""
    from minipic.cli import main
    from minipic.eval.cli import untuned_items

    rng = random.Random(seed)
    items = _random_items(rng, rng.randint(3, 8))
    data = _write_jsonl(tmp_path / "mine.jsonl", items)
    out = tmp_path / "eval"
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    gone = str(tmp_path / f"gone-{rng.randrange(10**6)}")
    cases = [(None, "cannot read"), ([_card(None)], "no 'root'"),
             ([_card(gone)], f"{gone} is not on this machine"),
             ([_card("runs/smol/model")], "relative path 'runs/smol/model'"),
             ([_card(gone), {**_card(gone), "id": "lora"}], "not one model")]
    for cards, reason in cases:
        with _fake_vllm(cards if cards is not None else []) as (url, asked):
            url = closed if cards is None else url
            assert main(["eval", "--url", url, "--data", str(data), "--out", str(out)]) == 2
            printed = capsys.readouterr().out
            assert "cannot check which items the served model was tuned on" in printed, reason
            assert reason in printed and "--unchecked-model" in printed, printed
            assert asked == ([] if cards is None else ["/v1/models"])  # nothing scored
            assert not out.exists()
            args = argparse.Namespace(url=url, model=None, unchecked_model=True)
            assert untuned_items(args, items) == items
            printed = capsys.readouterr().out
            assert "warning" in printed and reason in printed and "--unchecked-model" in printed
