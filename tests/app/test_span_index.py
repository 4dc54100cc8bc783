"""``minipic index``: a corpus's span KV precomputed into a span store, resumably, and found by
the next orchestrator without a single span prefill.

Fast tests: the command line (help, clear errors for a missing, empty or malformed corpus
before any engine starts), the corpus readers, the manifest (torn tails) and the warmth
registry's stored beliefs.

Engine tests (tiny random Llama, fresh random documents every run), sharing one module fixture:
``minipic index`` runs as a real subprocess and is SIGKILLed once the manifest shows progress;
every store entry must still verify and the engine processes must be gone; a rerun skips the
documents the manifest lists and completes. Then a fresh orchestrator on that store answers a
question over indexed documents: no prefill sent for them, their tokens loaded from the store
and counted as cached, and the greedy output equal to the same question computed without
the store's help (under another cache salt, which no stored block carries) and to the
transformers block-mask reference (teacher-forced; a split only at a near-tie).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from minipic.cli import main
from minipic.index import DEFAULT_TITLE_FORMAT, CorpusError, load_corpus
from minipic.orchestrator.span_index import (
    MANIFEST_NAME,
    ManifestRecord,
    append_records,
    read_manifest,
    salt_digest,
    stored_warm_keys,
)
from minipic.orchestrator.warmth import WarmthRegistry
from minipic.span_contract.env import TEST_SEED_ENV

WORDS = ("river stone cloud ember quartz lumen harbor violet cedar orbit nimbus falcon meadow "
         "tundra copper saffron glacier willow basalt comet lantern marsh pepper").split()


def _write_corpus(path: Path, rng: random.Random, count: int) -> list[dict[str, str]]:
    items = []
    for i in range(count):
        # a distinct opening: a span's first block holds only a few of its tokens after the
        # sink (7 of SmolLM2's, digits one token each), and two documents that share them
        # share that block's KV entry, which would make the store's entry count smaller than
        # the manifest's block count; a title comes first ("{title}: {text}"), so it leads
        # with the document's number too (a random 6-digit title alone collided in its first
        # five digits in ~5% of runs)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
        item = {"text": f"Document {i}: {words}", "id": f"doc-{i}"}
        if i % 4 == 0:
            item["title"] = f"Entry {i} ({rng.randrange(10**6)})"
        items.append(item)
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return items


# -- fast: command line, corpus, manifest, registry ---------------------------------------------


@pytest.mark.fast
def test_help_names_inputs_store_and_resume(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["index", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for needle in ("CORPUS", ".jsonl", "wiki", "--store", "index-manifest.jsonl", "rerun",
                   "--salt", "--mode", "--url", "--batch", "system prompt"):
        assert needle in out, needle


@pytest.mark.fast
def test_bad_corpus_fails_clearly_before_any_engine(tmp_path, capsys) -> None:
    store = tmp_path / "store"
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (empty_dir / "notes.pdf").write_bytes(b"%PDF")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    (tmp_path / "notext.jsonl").write_text('{"body": "no text field"}\n')
    cases = {
        str(tmp_path / "missing.jsonl"): "does not exist",
        str(tmp_path / "empty.jsonl"): "no documents",
        str(empty_dir): "no .txt/.md files",
        str(tmp_path / "bad.jsonl"): "bad.jsonl:2: not JSON",
        str(tmp_path / "notext.jsonl"): '"text" string',
    }
    for corpus, message in cases.items():
        started = time.perf_counter()
        assert main(["index", corpus, "--store", str(store)]) == 2, corpus
        err = capsys.readouterr().err
        assert err.startswith("minipic index: error: ") and message in err, (corpus, err)
        assert time.perf_counter() - started < 5, "an engine must not start for a bad corpus"
    assert main(["index", str(tmp_path / "bad.jsonl"), "--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err
    assert not store.exists(), "nothing is written for a corpus that cannot be read"


@pytest.mark.fast
def test_corpus_readers(tmp_path) -> None:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.md").write_text("# B\nbody\n")
    (folder / "sub" / "a.txt").write_text("a text")
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "x.txt").write_text("never")
    (folder / "skip.json").write_text("{}")
    docs = load_corpus(str(folder))
    assert [(d.id, d.text) for d in docs] == [("b.md", "# B\nbody\n"), ("sub/a.txt", "a text")]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "t1", "title": "T", "id": 7}\n\n{"text": "t2"}\n')
    one, two = load_corpus(str(jsonl))
    assert one.text == DEFAULT_TITLE_FORMAT.format(title="T", text="t1") and one.id == "7"
    assert two.text == "t2" and two.id is None and one.digest != two.digest
    assert load_corpus(str(jsonl), "{text}")[0].text == "t1"
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(CorpusError, match="not UTF-8"):
        load_corpus(str(tmp_path))


@pytest.mark.fast
def test_index_creates_the_store_with_the_engines_modes(tmp_path) -> None:
    """``minipic index`` often creates the store before any server: the folders it makes
    must have the store's own modes (0700), not the umask's 0755."""
    import os
    import stat

    from minipic.engine_ext.span_store.tiers import DirTier
    from minipic.index.cli import make_store_root

    old = os.umask(0o022)
    try:
        make_store_root(tmp_path / "cache" / "span-store")
        tier = DirTier(tmp_path / "engine-made" / "span-store", 1 << 20, "fp")
    finally:
        os.umask(old)
    for root in (tmp_path / "cache", tmp_path / "engine-made"):
        for folder in (root, root / "span-store"):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert tier.usable


@pytest.mark.fast
def test_manifest_torn_tail_and_stored_beliefs(tmp_path) -> None:
    def record(doc: str, keys: tuple[str, ...], fp: str = "fp-a", salt: str | None = None
               ) -> ManifestRecord:
        return ManifestRecord(doc=doc, fingerprint=fp, mode="block_attention",
                              salt=salt_digest(salt), prefill_keys=keys, tokens=64, blocks=2)

    append_records(tmp_path, [record("d1", ("k1",)), record("d2", ("k2",), salt="tenant")])
    with (tmp_path / MANIFEST_NAME).open("ab") as fh:  # an append cut by a SIGKILL
        fh.write(record("d3", ("k3",)).model_dump_json().encode()[:40])
    assert [r.doc for r in read_manifest(tmp_path)] == ["d1", "d2"]
    append_records(tmp_path, [record("d4", ("k4",)), record("d5", ("k5",), fp="fp-b")])
    assert [r.doc for r in read_manifest(tmp_path)] == ["d1", "d2", "d4", "d5"]
    keys = stored_warm_keys([tmp_path], "fp-a")
    assert keys == {(None, "k1"), (salt_digest("tenant"), "k2"), (None, "k4")}
    assert "tenant" not in (tmp_path / MANIFEST_NAME).read_text(), "salts stay digests"
    assert (tmp_path / MANIFEST_NAME).stat().st_mode & 0o077 == 0, "private like the entries"

    registry = WarmthRegistry()
    assert registry.learn_stored(keys) == 3
    assert registry.is_warm((None, "k1")) and (None, "k4") in registry
    assert registry.is_warm(("tenant", "k2")) and not registry.is_warm((None, "k2"))
    assert not registry.is_warm(("other", "k2")) and not registry.is_warm((None, "k5"))
    registry.reset()  # the pool was emptied; the store was not
    assert registry.is_warm((None, "k1"))
    registry.mark_cold([(None, "k1")])  # a final found it missing (evicted from the store)
    assert not registry.is_warm((None, "k1")) and registry.stored == 2


# -- engine: SIGKILL, resume, and a fresh orchestrator on the store ------------------------------

CORPUS_DOCS = 400


@dataclass
class Indexed:
    seed: int
    corpus: Path
    store: Path
    total: int
    killed_at: int  # manifest records when the kill was sent
    after_kill: list[ManifestRecord]
    entries_after_kill: int
    unverified_after_kill: list[str]
    temps_after_kill: int
    survivors: list[int]  # engine processes of the killed run still alive afterwards
    rerun: dict[str, Any]
    rerun_log: str


def _index_cmd(corpus: Path, store: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "minipic.cli", "index", str(corpus), "--store", str(store),
            "--model", "tiny-llama", "--batch", "2", *extra]


def _verify_all(store: Path, fingerprint: str) -> tuple[int, list[str]]:
    """Every entry file read through the store's own reader: (entries, those that failed)."""
    from minipic.engine_ext.span_store.tiers import DirTier

    tier = DirTier(store, 8 << 30, fingerprint, "disk")
    keys = list(tier.keys())
    return len(keys), [k for k in keys if tier.get(k) is None]


def _alive(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _remove_leaked_shm(before: set[str], since: float, pids: list[int]) -> None:
    """vLLM's ring buffer and Intel OpenMP's registration files outlive a SIGKILLed engine;
    remove the ones this test's killed processes left (new since ``since``, mapped by no live
    process, or named by a killed pid)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split()[-1] for line in maps.read_text().splitlines()
                          if "/dev/shm/" in line)
        except (OSError, IndexError):
            continue
    for path in shm.iterdir():
        try:
            st = path.stat()
        except OSError:
            continue
        if path.name in before or st.st_uid != os.getuid() or st.st_mtime < since:
            continue
        by_pid = any(f"_{pid}_" in path.name for pid in pids)
        # never a semaphore: another process's multiprocessing lock is a sem.* file no one
        # maps, and removing it breaks that process's next spawn (seen while engines started
        # concurrently on the same machine)
        if by_pid or (str(path) not in mapped and not path.name.startswith("sem.")):
            path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def indexed(tmp_path_factory) -> Iterator[Indexed]:
    import psutil

    env_seed = os.environ.get(TEST_SEED_ENV)
    seed = int(env_seed) if env_seed else random.SystemRandom().randrange(2**31)
    root = tmp_path_factory.mktemp("span-index")
    corpus, store = root / "corpus.jsonl", root / "store"
    _write_corpus(corpus, random.Random(seed), CORPUS_DOCS)
    manifest = store / MANIFEST_NAME
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    started = time.time()
    with (root / "killed.log").open("w") as log:
        proc = subprocess.Popen(_index_cmd(corpus, store, "--no-baseline"), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        lines = 0
        while lines < 2:  # one batch recorded: the index is under way
            assert proc.poll() is None, (root / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no progress in the manifest after 300 s"
            lines = manifest.read_bytes().count(b"\n") if manifest.exists() else 0
            time.sleep(0.01)
        kids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGKILL)  # `minipic index` itself, as a user or the OOM killer
        proc.wait()
        deadline = time.monotonic() + 90  # its guard stops the engine (SIGTERM, then SIGKILL)
        while _alive(kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = _alive(kids)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _alive(kids):
            os.kill(pid, signal.SIGKILL)
        _remove_leaked_shm(shm_before, started, kids)
    after_kill = list(read_manifest(store))
    temps = sum(1 for p in store.rglob(".tmp.*"))  # torn writes, if the kill caught one
    entries, unverified = _verify_all(store, after_kill[0].fingerprint)
    report_path = root / "rerun.json"
    rerun = subprocess.run(_index_cmd(corpus, store, "--json", str(report_path)),
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    yield Indexed(seed, corpus, store, CORPUS_DOCS, lines, after_kill, entries, unverified,
                  temps, survivors, json.loads(report_path.read_text()), rerun.stdout)


@pytest.mark.engine
def test_sigkill_leaves_valid_entries_and_a_rerun_resumes(indexed: Indexed) -> None:
    r = indexed
    done = {rec.doc for rec in r.after_kill}
    assert 2 <= len(done) < r.total, f"the kill did not land mid-way ({len(done)} done)"
    assert not r.survivors, f"engine processes outlived the killed index: {r.survivors}"
    # every file under an entry's name verifies (a torn write never is one); the manifest only
    # names documents whose blocks were on disk
    assert r.entries_after_kill > 0 and not r.unverified_after_kill, r.unverified_after_kill
    assert sum(rec.blocks for rec in r.after_kill) <= r.entries_after_kill
    rep = r.rerun
    assert rep["error"] is None and rep["unrecorded"] == 0, rep
    assert rep["already_indexed"] == len(done), (rep, len(done))
    assert rep["indexed"] == r.total - len(done), rep
    final = list(read_manifest(r.store))
    assert {rec.doc for rec in final} == {d.digest for d in load_corpus(str(r.corpus))}
    assert len(final) == r.total, "no document recorded twice"
    entries, unverified = _verify_all(r.store, final[0].fingerprint)
    assert not unverified and entries >= sum(rec.blocks for rec in final), (
        entries, sum(rec.blocks for rec in final))
    assert rep["store_bytes_per_token"] and rep["kv_bytes_per_token"], rep
    assert rep["store_bytes_per_token"] < 1.05 * rep["kv_bytes_per_token"], rep
    assert rep["tokens_per_s"] > 0 and rep["baseline_prefill_tokens_per_s"], rep


NEAR_TIE = 1e-3  # reference logprob margin under which greedy may pick either token


def _off_reference(ref, prompt, token_ids: list[int]) -> list[tuple[int, float]]:
    """Steps where greedy ``token_ids`` are not the block-mask reference's choice (teacher
    forcing), with the reference's margin there; near-ties (``NEAR_TIE``) are not listed:
    fp32 noise of another batch composition may flip them, and does not make KV wrong."""
    spans = [(s.start, s.end) for s in prompt.spans if s.kind == "span"]
    ids = list(prompt.prompt_token_ids)
    logprobs = ref.logprobs(ids + token_ids, spans, prompt_len=len(ids))
    off = []
    for step, token in enumerate(token_ids):
        row = logprobs[len(ids) - 1 + step]
        margin = float(row.max() - row[token])
        if margin > NEAR_TIE:
            off.append((step, margin))
    return off


def _store_tokens(orc) -> int:
    from minipic.span_contract.engine_utilities import SPAN_STORE_STATS_UTILITY

    engine = orc.aio.backend.engine
    stats = orc.submit(engine.engine_core.call_utility_async(SPAN_STORE_STATS_UTILITY)).result()
    counts = stats["counts"]
    return sum(int(counts.get(f"tokens_{tier}", 0)) for tier in ("ram", "disk", "shared"))


@pytest.mark.engine
def test_fresh_orchestrator_sends_no_prefill_for_indexed_spans(indexed: Indexed) -> None:
    from minipic.orchestrator import SyncOrchestrator
    from minipic.span_contract.span_store_config import SpanStoreConfig

    rng = random.Random(indexed.seed)
    docs = [d.text for d in rng.sample(load_corpus(str(indexed.corpus)), 4)]
    question = " ".join(rng.choice(WORDS) for _ in range(6)) + "?"
    orc = SyncOrchestrator.embedded("tiny-llama", max_model_len=2048,
                                    span_store=SpanStoreConfig(dir=str(indexed.store)))
    try:
        assert orc.registry.stored == len({k for rec in read_manifest(indexed.store)
                                           for k in rec.prefill_keys})
        prompt = orc.build(question, docs, max_tokens=8)
        span_keys = {s.prefill_key for s in prompt.spans if s.kind == "span"}
        span_tokens = sum(s.end - s.start for s in prompt.spans if s.kind == "span")
        before = _store_tokens(orc)
        with orc.record_events() as events:
            stored = orc.answer(question, docs, max_tokens=8)
        loaded = _store_tokens(orc) - before
        sent = {e.key for e in events if e.kind == "prefill_sent"}
        assert not sent & span_keys, f"prefills sent for indexed spans (seed={indexed.seed})"
        assert [s.status for s in stored.spans if s.kind == "span"] == ["warm"] * len(docs)
        assert loaded == span_tokens, (loaded, span_tokens, indexed.seed)
        assert stored.cache_ok and stored.cached_tokens == stored.expected_cached_tokens
        # the same question with nothing from the store: another salt, under which no block
        # was stored, so every span is computed for it
        before = _store_tokens(orc)
        fresh = orc.answer(question, docs, max_tokens=8, cache_salt=f"ref-{indexed.seed}")
        assert _store_tokens(orc) == before
        model = orc.aio.backend.settings.model
    finally:
        orc.close()
    # Both are the transformers block-mask reference's greedy answer (teacher-forced, so a
    # near-tie that fp32 noise flips cannot fail it), and equal unless such a tie split them.
    from support.pic_reference import PicReference

    ref = PicReference(model)
    assert not _off_reference(ref, prompt, stored.token_ids), f"seed={indexed.seed}"
    assert not _off_reference(ref, prompt, fresh.token_ids), f"seed={indexed.seed}"
    if fresh.token_ids != stored.token_ids:
        split = next((i for i, (a, b) in enumerate(zip(fresh.token_ids, stored.token_ids,
                                                       strict=False)) if a != b), None)
        assert split is not None, (fresh.token_ids, stored.token_ids)
        head = stored.token_ids[:split]
        row = ref.logprobs(list(prompt.prompt_token_ids) + head,
                           [(s.start, s.end) for s in prompt.spans if s.kind == "span"],
                           prompt_len=len(prompt.prompt_token_ids))[-1]
        gap = abs(float(row[stored.token_ids[split]] - row[fresh.token_ids[split]]))
        assert gap < NEAR_TIE, f"outputs differ at step {split} (seed={indexed.seed})"
