"""The corpus ``minipic index`` reads: a JSONL file, a folder of text files, or the offline wiki.

Every reader yields the text exactly as the app passes it as a document (a titled JSONL
document as ``DEFAULT_TITLE_FORMAT``), so an indexed span is the one the app's prompts hold.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from minipic.orchestrator.span_index import document_digest
from minipic.span_contract.errors import BadInputError

WIKI = "wiki"
TEXT_SUFFIXES = (".txt", ".md")
DEFAULT_TITLE_FORMAT = "{title}: {text}"  # orchestrator.corpus.Passage.as_document


class CorpusError(BadInputError):
    """The corpus cannot be read (missing, empty, malformed): said before any engine starts."""


@dataclass(frozen=True)
class Document:
    text: str  # exactly what the app passes as the document
    id: str | None
    digest: str


def load_corpus(spec: str, title_format: str = DEFAULT_TITLE_FORMAT) -> list[Document]:
    """Documents of a JSONL file, a folder of text files, or ``wiki`` (the offline corpus)."""
    if spec == WIKI:
        return _wiki_documents()
    path = Path(spec).expanduser()
    if not path.exists():
        raise CorpusError(f"corpus {spec!r} does not exist (a .jsonl file, a folder of "
                          f"{'/'.join(TEXT_SUFFIXES)} files, or `{WIKI}`)")
    docs = list(_folder_documents(path) if path.is_dir() else _jsonl_documents(path,
                                                                               title_format))
    if not docs:
        what = f"no {'/'.join(TEXT_SUFFIXES)} files" if path.is_dir() else "no documents"
        raise CorpusError(f"corpus {spec!r} holds {what}")
    return docs


def _doc(text: str, doc_id: str | None) -> Document:
    return Document(text, doc_id, document_digest(text))


def _wiki_documents() -> list[Document]:
    from minipic.orchestrator.corpus import CorpusUnavailableError, load_passages

    try:
        passages = load_passages()
    except CorpusUnavailableError as exc:
        raise CorpusError(str(exc)) from None
    # as the demo and WikiRetriever pass them
    return [_doc(p.as_document, f"wiki:{p.title}") for p in passages]


def _folder_documents(root: Path) -> Iterator[Document]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
                              ) from None
        yield _doc(text, str(path.relative_to(root)))


def _jsonl_documents(path: Path, title_format: str) -> Iterator[Document]:
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc.strerror or exc}") from None
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise CorpusError(f"{where}: not JSON ({exc})") from None
            if not isinstance(item, dict) or not isinstance(item.get("text"), str):
                raise CorpusError(f'{where}: expected an object with a "text" string, e.g. '
                                  '{"text": "...", "title": "...", "id": "..."}')
            title = item.get("title")
            if title is not None and not isinstance(title, str):
                raise CorpusError(f'{where}: "title" must be a string')
            raw_id = item.get("id")
            doc_id = None if raw_id is None else str(raw_id)
            text = item["text"]
            if title:
                text = title_format.format(title=title, text=text)
            yield _doc(text, doc_id)
