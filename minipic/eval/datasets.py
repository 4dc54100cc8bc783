"""What ``minipic eval`` asks: built-in multi-document QA that installs offline, or your JSONL.

Built-in (``--data builtin``: fanoutqa first, then BIG-bench up to ``--n``):

* ``fanoutqa``: the fanoutqa dev sub-questions whose answer is in their evidence page's lead
  section in the offline Wikipedia set (69; ``orchestrator.corpus.load_qa_items``);
* ``cpkc``: BIG-bench ``contextual_parametric_knowledge_conflicts`` (17,528 items): a real
  Wikipedia paragraph with its answer entity *substituted*, and the question — the answer must
  come from the passage, the model's own knowledge points elsewhere. Read from BIG-bench's PyPI
  sdist (sha256-pinned, only that task's file kept, cached under the minipic cache): the
  package itself does not install (it declares a direct-URL dependency PyPI refuses).

Each item gets its gold passage plus distractors (BM25 neighbours of the question in the offline
corpus: passages that look relevant), 3-10 passages in all by default, shuffled, each cut to
``max_words`` so that prompts fit the default 2048-token engines.

``--data FILE.jsonl``: one ``{"question", "documents", "answer"?, "system"?}`` object per line.
A line that is not UTF-8, not JSON, or misses a field is reported with its line number and
skipped; the run goes on.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import tarfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minipic.orchestrator.errors import BadInputError

BIGBENCH_VERSION = "1.0.0"
BIGBENCH_URL = ("https://files.pythonhosted.org/packages/95/f8/"
                "c019b3579df548a04cac12342cfcb878e50ddf6cfcd7fddba8cfc721c157/bigbench-1.0.0.tar.gz")
BIGBENCH_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
CPKC_MEMBER = ("bigbench-1.0.0/bigbench/benchmark_tasks/"
               "contextual_parametric_knowledge_conflicts/task.json")
_CPKC = re.compile(r"Question:\s*(?P<q>.*?)\s*Context:\s*(?P<c>.*)", re.S)


@dataclass(frozen=True)
class EvalItem:
    id: str
    question: str
    documents: list[str]
    answer: str | None = None
    system: str | None = None
    source: str = "jsonl"
    gold_index: int | None = None  # which document holds the answer (built-in sets)


@dataclass
class LoadReport:
    items: list[EvalItem] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)  # {"line", "error"}


def load_jsonl(path: str | Path) -> LoadReport:
    """Items of a JSONL file; every bad line is an error entry, never an exception."""
    report = LoadReport()
    raw = Path(path).read_bytes()
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            report.errors.append({"line": number, "error": f"not UTF-8 ({exc.reason} at byte "
                                                           f"{exc.start})"})
            continue
        try:
            report.items.append(_item(json.loads(text), number))
        except (ValueError, BadInputError) as exc:
            report.errors.append({"line": number, "error": str(exc)})
    return report


def _item(obj: Any, number: int) -> EvalItem:
    if not isinstance(obj, dict):
        raise BadInputError(f"expected a JSON object, got {type(obj).__name__}")
    question = obj.get("question")
    if not isinstance(question, str) or not question.strip():
        raise BadInputError("missing or empty \"question\" (a string)")
    docs = obj.get("documents")
    if not isinstance(docs, list) or not docs:
        raise BadInputError("\"documents\" must be a non-empty list of strings")
    if not all(isinstance(d, str) for d in docs):
        raise BadInputError("every document must be a string")
    answer = obj.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise BadInputError("\"answer\" must be a string when given")
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise BadInputError("\"system\" must be a string when given")
    return EvalItem(id=str(obj.get("id", f"line{number}")), question=question,
                    documents=list(docs), answer=answer, system=system)


def _cut(text: str, max_words: int) -> str:
    words = text.split()
    return " ".join(words[:max_words])


def _with_distractors(rng: random.Random, corpus: Any, question: str, gold: str,
                      passages: tuple[int, int], max_words: int) -> tuple[list[str], int]:
    count = rng.randint(*passages)
    hits = [p.as_document for p in corpus.search(question, k=count + 3)]
    distractors = [h for h in hits if h[:60] != gold[:60]][: count - 1]
    docs = [_cut(d, max_words) for d in distractors]
    gold_index = rng.randrange(len(docs) + 1)
    docs.insert(gold_index, _cut(gold, max_words))
    return docs, gold_index


def fanoutqa_items(rng: random.Random, corpus: Any, passages: tuple[int, int],
                   max_words: int) -> list[EvalItem]:
    from minipic.orchestrator.corpus import load_passages, load_qa_items

    by_title = {p.title: p for p in load_passages()}
    out = []
    for i, qa in enumerate(load_qa_items()):
        gold = by_title[qa.evidence_title]
        text = gold.as_document
        if qa.answer.lower() not in _cut(text, max_words).lower():
            continue  # the cut would lose the answer
        docs, gold_index = _with_distractors(rng, corpus, qa.question, text, passages,
                                             max_words)
        out.append(EvalItem(id=f"fanoutqa-{i}", question=qa.question, documents=docs,
                            answer=qa.answer, source="fanoutqa", gold_index=gold_index))
    return out


def cpkc_path(cache: Path | None = None) -> Path:
    """BIG-bench's contextual_parametric_knowledge_conflicts task file (fetched once)."""
    from minipic.span_contract.models import cache_root, exclusive, sha256_of

    root = (cache or cache_root()) / "bigbench" / BIGBENCH_VERSION
    target = root / "contextual_parametric_knowledge_conflicts.json"
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root / ".lock"):
        if target.is_file():
            return target
        sdist = root / "bigbench.tar.gz.part"
        try:
            with urllib.request.urlopen(BIGBENCH_URL, timeout=300) as resp, sdist.open("wb") as f:
                shutil.copyfileobj(resp, f)
        except OSError as exc:
            sdist.unlink(missing_ok=True)
            raise BadInputError(f"could not download BIG-bench {BIGBENCH_VERSION}'s sdist from "
                                f"PyPI ({exc}); use --data fanoutqa or a JSONL file") from exc
        if sha256_of(sdist) != BIGBENCH_SHA256:
            sdist.unlink()
            raise BadInputError("BIG-bench sdist: sha256 mismatch")
        with tarfile.open(sdist) as tar:
            member = tar.extractfile(CPKC_MEMBER)
            assert member is not None
            target.with_suffix(".part").write_bytes(member.read())
        target.with_suffix(".part").rename(target)
        sdist.unlink()
    return target


def cpkc_items(rng: random.Random, corpus: Any, n: int, passages: tuple[int, int],
               max_words: int) -> list[EvalItem]:
    examples = json.loads(cpkc_path().read_text())["examples"]
    order = list(range(len(examples)))
    rng.shuffle(order)
    out = []
    for i in order:
        if len(out) >= n:
            break
        match = _CPKC.search(examples[i]["input"])
        answer = examples[i]["target"]
        if match is None:
            continue
        question, context = match["q"].strip(), match["c"].strip()
        if answer.lower() not in _cut(context, max_words).lower():
            continue
        docs, gold_index = _with_distractors(rng, corpus, question, context, passages,
                                             max_words)
        out.append(EvalItem(id=f"cpkc-{i}", question=question, documents=docs, answer=answer,
                            source="cpkc", gold_index=gold_index))
    return out


def builtin_items(name: str, n: int, seed: int, passages: tuple[int, int] = (3, 10),
                  max_words: int = 80) -> list[EvalItem]:
    """``name``: builtin (fanoutqa, then cpkc up to n), fanoutqa, or cpkc."""
    from minipic.orchestrator.corpus import default_corpus

    rng = random.Random(seed)
    corpus = default_corpus()
    items: list[EvalItem] = []
    if name in ("builtin", "fanoutqa"):
        items += fanoutqa_items(rng, corpus, passages, max_words)[:n]
    if name in ("builtin", "cpkc") and len(items) < n:
        items += cpkc_items(rng, corpus, n - len(items), passages, max_words)
    if name not in ("builtin", "fanoutqa", "cpkc"):
        raise BadInputError(f"unknown data set {name!r}: builtin, fanoutqa, cpkc or a .jsonl")
    return items[:n]
