"""What `minipic tune` learns from, and the guarantee that it never sees what `minipic eval`
scores.

Tuning needs no labels (the teacher is the model itself), only questions over documents: the
built-in sets or the user's JSONL (``minipic eval``'s format). The split is by content, not by
position in a file, so it survives reordering and re-drawing:

* **built-in data** (``builtin`` or ``squad``): tuning items are drawn from SQuAD 1.1's *train*
  split with their own seed, while ``minipic eval``'s default set is fanoutqa plus SQuAD's *dev*
  split, so the two never share a paragraph; on top of that, every item ``minipic eval`` scores
  by default (``builtin``, n = 300, seed 0, both sources) is removed by question, which still
  guards the split should eval's default set ever draw from train;
* **a JSONL**: a fixed share of items, chosen by a hash of the question, is held out and written
  beside the tuned model for ``minipic eval --data``;
* the tuned model's ``minipic_tune.json`` lists a digest of every question it was tuned on, and
  ``minipic eval`` drops those items (and says how many) whatever data it is given.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from minipic.eval.datasets import CPKC_GONE, EvalItem, builtin_items, load_jsonl, squad_items
from minipic.span_contract.errors import BadInputError
from minipic.span_contract.models import TUNE_MANIFEST

# what `minipic eval` scores by default: never tuned on
EVAL_DEFAULT = {"name": "builtin", "n": 300, "seed": 0, "passages": (3, 10), "max_words": 80}
HELDOUT_SHARE = 0.2  # of a user's JSONL
MIN_ITEMS = 2


def question_digest(question: str) -> str:
    """The identity of an item across files and runs: its question, whitespace- and
    case-normalised (documents are re-drawn around the same question by the built-in sets)."""
    norm = " ".join(question.lower().split())
    return hashlib.sha256(norm.encode()).hexdigest()[:16]


def is_heldout(question: str, share: float = HELDOUT_SHARE) -> bool:
    """Deterministic by content: the same question is held out in every run and file."""
    return int(question_digest(question), 16) % 1000 < share * 1000


@dataclass
class TuneData:
    train: list[EvalItem]
    heldout: list[EvalItem]  # what the closing report scores (never tuned on)
    source: str
    excluded: int  # items dropped because eval scores them
    bad_lines: list[dict]

    def manifest(self) -> dict:
        return {"source": self.source, "train_items": len(self.train),
                "heldout_items": len(self.heldout), "excluded_as_eval_items": self.excluded,
                "train_question_digests": sorted(question_digest(i.question)
                                                 for i in self.train)}


def load(data: str, n: int, seed: int, passages: tuple[int, int], max_words: int,
         report_n: int, skip_bad_lines: bool = False) -> TuneData:
    """Tuning and held-out items; ``BadInputError`` for data that cannot be tuned on."""
    if data.endswith(".jsonl"):
        return _from_jsonl(Path(data), n, seed, skip_bad_lines)
    if data == "cpkc":
        raise BadInputError(CPKC_GONE)
    if data not in ("builtin", "squad"):
        raise BadInputError(f"--data {data!r}: builtin (SQuAD 1.1 train) or a .jsonl of "
                            f"{{question, documents, answer?, system?}}")
    from minipic.orchestrator.corpus import default_corpus

    # eval's default set, and the same draw with this run's passage settings (the draw of
    # questions depends on them): neither is tuned on
    heldout = builtin_items(**EVAL_DEFAULT)
    alike = builtin_items(**{**EVAL_DEFAULT, "passages": passages, "max_words": max_words})
    banned = {question_digest(i.question) for i in heldout + alike}
    rng = random.Random(seed)
    drawn = squad_items(rng, default_corpus(), n + len(banned), passages, max_words,
                        split="train")
    kept = [i for i in drawn if question_digest(i.question) not in banned]
    return TuneData(train=kept[:n], heldout=heldout[:report_n], source="builtin (squad train)",
                    excluded=len(drawn) - len(kept), bad_lines=[])


def _from_jsonl(path: Path, n: int, seed: int, skip_bad_lines: bool) -> TuneData:
    if not path.is_file():
        raise BadInputError(f"--data {path}: no such file")
    loaded = load_jsonl(path)
    if loaded.errors and not skip_bad_lines:
        shown = "\n".join(f"  line {e['line']}: {e['error']}" for e in loaded.errors[:10])
        more = f"\n  ... and {len(loaded.errors) - 10} more" if len(loaded.errors) > 10 else ""
        raise BadInputError(f"{path}: {len(loaded.errors)} bad line(s); fix them or pass "
                            f"--skip-bad-lines:\n{shown}{more}")
    train = [i for i in loaded.items if not is_heldout(i.question)]
    heldout = [i for i in loaded.items if is_heldout(i.question)]
    random.Random(seed).shuffle(train)
    if len(train) < MIN_ITEMS:
        raise BadInputError(f"{path}: {len(train)} usable tuning item(s) after holding out "
                            f"{len(heldout)} for evaluation; need at least {MIN_ITEMS}")
    return TuneData(train=train[:n], heldout=heldout, source=str(path), excluded=0,
                    bad_lines=list(loaded.errors))


def write_heldout(items: list[EvalItem], path: Path) -> None:
    """The held-out items as a JSONL that ``minipic eval --data`` reads."""
    with path.open("w") as fh:
        for item in items:
            row = {k: v for k, v in asdict(item).items()
                   if k in ("id", "question", "documents", "answer", "system") and v is not None}
            fh.write(json.dumps(row) + "\n")


def tuned_question_digests(model_dir: str | Path) -> set[str]:
    """The questions a model folder written by ``minipic tune`` was tuned on (empty for any
    other model)."""
    manifest = Path(model_dir) / TUNE_MANIFEST
    if not manifest.is_file():
        return set()
    try:
        return set(json.loads(manifest.read_text())["data"]["train_question_digests"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInputError(f"{manifest} is unreadable ({exc}): cannot tell which items this "
                            f"model was tuned on") from exc


def without_tuned(items: list[EvalItem], model_dir: str | Path) -> tuple[list[EvalItem], int]:
    """``items`` minus those the model was tuned on, and how many were dropped: a tuned model
    is never scored on what it learned from."""
    seen = tuned_question_digests(model_dir)
    kept = [i for i in items if question_digest(i.question) not in seen]
    return kept, len(items) - len(kept)
