"""``minipic tune``: the split never lets it see what ``minipic eval`` scores, bad data and bad
options get clear errors, a crash resumes to the same weights, and the merged model loads in
vLLM and runs ``minipic eval`` (which drops the items the model was tuned on).

Fresh random items every run (the tiny random Llama with SmolLM2's tokenizer; tuning it teaches
nothing, it exercises the same code as a real model).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from minipic.cli import main
from minipic.tune import data as tune_data

VOCAB = ["river", "stone", "lamp", "cedar", "harbor", "violet", "ember", "falcon", "tundra",
         "quartz", "meadow", "copper"]


def random_items(rng: random.Random, n: int, first: int = 0) -> list[dict]:
    """``n`` items with ids ``r{first}`` onwards (ids stay unique when a test draws more)."""
    return [{"id": f"r{i}", "question": f"Which {rng.choice(VOCAB)} is {i} "
                                        f"{' '.join(rng.sample(VOCAB, 3))}?",
             "documents": [" ".join(rng.choice(VOCAB) for _ in range(rng.randint(15, 45)))
                           for _ in range(rng.randint(2, 3))],
             "answer": rng.choice(VOCAB)} for i in range(first, first + n)]


def write_jsonl(path: Path, rows: list[dict], extra: bytes = b"") -> Path:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + extra)
    return path


@pytest.mark.fast
def test_bad_options_and_bad_data_get_clear_errors(tmp_path: Path, capsys, seed) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", random_items(random.Random(seed), 6))
    cases = [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--batch", "0"], "--batch must be at least 1"),
        (["--lr", "nan"], "--lr and --epochs must be positive"),
        (["--method", "full", "--lr", "-1"], "--lr and --epochs must be positive"),
        (["--keep-full", "-0.5"], "--keep-full must be 0 or a positive number"),
        (["--method", "full", "--dtype", "bfloat16"], "--method full needs --dtype float32"),
        (["--passages", "5-2"], "--passages must be MIN-MAX"),
        (["--data", str(tmp_path / "missing.jsonl")], "no such file"),
        (["--data", "wikipedia"], "builtin (SQuAD 1.1 train) or a .jsonl"),
        (["--data", "cpkc"], "its replacement is `squad`"),
        (["--model", str(tmp_path)], "not a model folder"),
    ]
    for extra, message in cases:
        argv = ["tune", "--out", str(tmp_path / "run"), "--data", str(good), *extra]
        assert main(argv) == 2, extra
        assert message in capsys.readouterr().err, extra
    bad = write_jsonl(tmp_path / "bad.jsonl", random_items(random.Random(seed), 3),
                      b'{"question": "no documents"}\n\xff\xfe\nnot json\n')
    assert main(["tune", "--model", "tiny-llama", "--out", str(tmp_path / "run"),
                 "--data", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "3 bad line(s)" in err and "line 4:" in err and "line 5: not UTF-8" in err
    assert "--skip-bad-lines" in err and not (tmp_path / "run" / "model").exists()
    few = write_jsonl(tmp_path / "few.jsonl", random_items(random.Random(seed), 1))
    assert main(["tune", "--model", "tiny-llama", "--out", str(tmp_path / "run"),
                 "--data", str(few)]) == 2
    assert "need at least 2" in capsys.readouterr().err


@pytest.mark.fast
def test_builtin_tuning_items_never_include_what_eval_scores(seed) -> None:
    from minipic.eval.datasets import builtin_items

    loaded = tune_data.load("builtin", 40, seed, (3, 10), 80, report_n=5)
    scored = builtin_items(**tune_data.EVAL_DEFAULT)  # minipic eval's default set
    scored_digests = {tune_data.question_digest(i.question) for i in scored}
    assert len(loaded.train) == 40 and len(loaded.heldout) == 5
    assert all(i.id.startswith("squad-train-") for i in loaded.train), loaded.train[0].id
    assert loaded.source == "builtin (squad train)"
    assert not scored_digests & {tune_data.question_digest(i.question) for i in loaded.train}
    assert [i.id for i in loaded.heldout] == [i.id for i in scored[:5]]
    # a JSONL splits by question content: the same question lands on the same side in any file
    rows = random_items(random.Random(seed), 60)
    sides = [tune_data.is_heldout(r["question"]) for r in rows]
    assert 0 < sum(sides) < len(rows)
    assert sides == [tune_data.is_heldout("  " + r["question"].upper()) for r in rows]


def _settings(model_dir: str, steps: int, seed: int, **extra):
    from minipic.tune.trainer import TuneSettings

    return TuneSettings(model=model_dir, steps=steps, batch=2, max_tokens=3, seed=seed,
                        **{"lr": 1e-3, **extra})


class _Crash(Exception):
    pass


def _progress_crashing_after(steps: int | None):
    class Bar:
        def __init__(self, **_: object) -> None:
            self.n = 0

        def update(self, k: int) -> None:
            self.n += k
            if steps is not None and self.n > steps:
                raise _Crash

        def set_postfix(self, **_: object) -> None:
            pass

        def close(self) -> None:
            pass

    return Bar


@pytest.mark.fast
@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_crashed_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path: Path, seed,
                                                                      method: str) -> None:
    """Same tuned weights, bit for bit, whether the run was cut after a checkpoint and resumed
    (with activation checkpointing on) or ran straight through; for both methods, the full one
    with the plain-prompt term on. Only the tuned weights move: the base the student learns from
    stays the untouched model."""
    from minipic.eval.datasets import EvalItem
    from minipic.span_contract.models import resolve_model
    from minipic.tune import trainer
    from minipic.tune.cli import _builder

    torch.set_num_threads(1)
    model_dir = resolve_model("tiny-llama")
    items = [EvalItem(**{k: v for k, v in r.items()})
             for r in random_items(random.Random(seed), 6)]
    extra = {"method": "full", "keep_full": 0.5, "lr": 1e-4} if method == "full" else {}
    settings = _settings(model_dir, 4, seed % 1000, **extra)
    builder = _builder(model_dir, settings)
    initial = trainer.load_student(model_dir, settings)
    initial_weights = initial.weights()
    with initial.base() as fresh:
        pristine_base = {k: v.clone() for k, v in fresh.state_dict().items()}

    def tuned_after(run: Path, crash_after: int | None,
                    checkpointing: bool = False) -> dict[str, torch.Tensor]:
        student = trainer.load_student(model_dir, settings, checkpointing=checkpointing)
        try:
            trainer.train(student, builder, items, settings, run, resume=False, save_every=2,
                          progress=_progress_crashing_after(crash_after))
        except _Crash:
            # a new process, in effect
            student = trainer.load_student(model_dir, settings, checkpointing=checkpointing)
            state = trainer.train(student, builder, items, settings, run, resume=True,
                                  save_every=2, progress=_progress_crashing_after(None))
            assert state["step"] == 4 and len(state["losses"]) == 4
        with student.base() as base:
            untouched = base.state_dict()
        # (a LoRA base is the same module with the adapter off: its adapter weights are not base)
        assert all(torch.equal(v, pristine_base[k]) for k, v in untouched.items()
                   if "lora_" not in k)
        return student.weights()

    whole = tuned_after(tmp_path / "whole", None)
    # dies in step 3, after step 2's save; recomputing activations (what a GPU user turns on
    # for long prompts) must not change a gradient either
    resumed = tuned_after(tmp_path / "crashed", 2, checkpointing=True)
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert any(not torch.equal(v, initial_weights[k]) for k, v in whole.items())  # it learned
    if method == "full":
        return  # the refusal below is the same code for both methods
    # another run's checkpoint is refused, not silently mixed in
    other = _settings(model_dir, 5, seed % 1000, **extra)
    with pytest.raises(tune_data.BadInputError, match="other settings"):
        trainer.train(trainer.load_student(model_dir, other), builder, items, other,
                      tmp_path / "whole", resume=True, save_every=2,
                      progress=_progress_crashing_after(None))


@pytest.mark.engine
def test_tuned_model_loads_in_vllm_and_eval_skips_its_tuning_items(tmp_path: Path, capsys,
                                                                    seed) -> None:
    rng = random.Random(seed)
    rows = random_items(rng, 14)
    data = write_jsonl(tmp_path / "mine.jsonl", rows, b'{"question": "x"}\n')
    run = tmp_path / "run"
    assert main(["tune", "--model", "tiny-llama", "--data", str(data), "--skip-bad-lines",
                 "--out", str(run), "--steps", "2", "--batch", "2", "--max-tokens", "3",
                 "--threads", "1", "--seed", str(seed % 1000), "--sink-gap", "24"]) == 0
    out = capsys.readouterr().out
    assert "1 bad lines skipped" in out
    manifest = json.loads((run / "model" / "minipic_tune.json").read_text())
    assert manifest["sink_gap"] == 24  # the layout it was tuned for, which engines take
    heldout = [json.loads(line) for line in (run / "heldout.jsonl").read_text().splitlines()]
    trained = set(manifest["data"]["train_question_digests"])
    assert len(trained) + len(heldout) == len(rows)
    assert not trained & {tune_data.question_digest(r["question"]) for r in heldout}
    report = json.loads((run / "tune.json").read_text())
    assert len(report["losses"]) == 2 and all(x >= 0 for x in report["losses"])
    if heldout:
        assert report["summary"]["n"] == len(heldout)
    # eval on the merged folder: an embedded vLLM engine loads it; a tuning item is dropped
    tuned_row = next(r for r in rows if tune_data.question_digest(r["question"]) in trained)
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [tuned_row, *heldout, *random_items(rng, 1)])
    # compared with the base model's full attention (a second engine): the user's question
    assert main(["eval", "--model", str(run / "model"), "--reference-model", "tiny-llama",
                 "--data", str(mixed), "--modes", "prefix,selective@0.5", "--max-tokens", "3",
                 "--out", str(tmp_path / "eval")]) == 0
    out = capsys.readouterr().out
    assert "1 item(s) dropped: the model was tuned on them" in out
    scored = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert scored["summary"]["n"] == len(heldout) + 1
    assert scored["engine"]["model"] == str(run / "model")
    assert scored["engine"]["reference_model"] != scored["engine"]["model"]
    assert scored["engine"]["span_config"]["sink_gap"] == 24  # the engine took the folder's
    assert scored["summary"]["modes"]["prefix"]["kl_mean"]["mean"] >= 0  # what tuning moved
    assert set(scored["summary"]["modes"]) == {"prefix", "selective@0.5"}
    assert tuned_row["question"] not in {r["question"] for r in scored["items"]}


class _CountingBuilder:
    """The real prompt builder, counting the layouts asked for per question: shows whether the
    loop lays out an item again after it failed."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tries: dict[str, int] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def build(self, **kwargs):
        self.tries[kwargs["question"]] = self.tries.get(kwargs["question"], 0) + 1
        return self.inner.build(**kwargs)


@pytest.mark.fast
def test_items_too_long_to_lay_out_are_skipped_once_over_many_epochs_and_on_resume(
        tmp_path: Path, seed) -> None:
    """A set with a few items that can never fit ``max_model_len`` trains for more epochs than
    it has items: each bad item is tried once, recorded once and passed over afterwards, the run
    finishes, and a run resumed from a checkpoint (also one written before records named the
    item's position) skips the same items without trying them again and ends with the same
    losses. Counting failures instead of items ended such runs, and their resumes, mid-way."""
    import shutil

    from minipic.eval.datasets import EvalItem
    from minipic.span_contract.models import resolve_model
    from minipic.tune import trainer
    from minipic.tune.cli import _builder

    torch.set_num_threads(1)
    rng = random.Random(seed)
    model_dir = resolve_model("tiny-llama")
    good = [EvalItem(**r) for r in random_items(rng, 2)]
    # one document far over the 2048-token context: no layout policy may shrink it to fit
    bad = [EvalItem(id=f"long{i}", question=f"Which {rng.choice(VOCAB)} is long {i}?",
                    documents=[" ".join(rng.choice(VOCAB) for _ in range(rng.randint(3000, 4000))),
                               "short"]) for i in range(2)]
    items = [*good, *bad]
    rng.shuffle(items)
    bad_ids = sorted(i.id for i in bad)
    # 5 steps × 2 good items = 5 epochs over 4 items: 10 failures of 2 distinct items
    settings = _settings(model_dir, 5, seed % 1000)
    base_builder = _builder(model_dir, settings)

    def run(folder: Path, resume: bool, crash_after: int | None = None):
        builder = _CountingBuilder(base_builder)
        state = trainer.train(trainer.load_student(model_dir, settings), builder, items,
                              settings, folder, resume=resume, save_every=2,
                              progress=_progress_crashing_after(crash_after))
        return state, builder

    whole, builder = run(tmp_path / "whole", False)
    assert whole["step"] == 5 and len(whole["losses"]) == 5
    assert sorted(r["id"] for r in whole["skipped"]) == bad_ids
    assert [builder.tries[i.question] for i in bad] == [1, 1]
    assert all(builder.tries[i.question] >= 2 * 5 for i in good)  # every epoch, both layouts

    crashed = tmp_path / "crashed"
    with pytest.raises(_Crash):
        run(crashed, False, crash_after=2)  # dies in step 3, after step 2's checkpoint
    # the same checkpoint as an older run wrote it: one record per failure, by id only
    legacy = tmp_path / "legacy"
    shutil.copytree(crashed, legacy)
    saved = torch.load(legacy / "checkpoints" / "last.pt", weights_only=False)
    assert sorted(r["id"] for r in saved["skipped"]) == bad_ids
    saved["skipped"] = [{"id": r["id"], "error": r["error"]} for r in saved["skipped"]] * 3
    torch.save(saved, legacy / "checkpoints" / "last.pt")
    for folder in (crashed, legacy):
        resumed, builder = run(folder, True)
        assert resumed["losses"] == whole["losses"], folder.name
        assert sorted(r["id"] for r in resumed["skipped"]) == bad_ids, folder.name
        # both failed in epoch 0, before the checkpoint: not laid out again
        assert not any(builder.tries.get(i.question) for i in bad), folder.name

    # a set where every item fails is still an error, and says so at once
    builder = _CountingBuilder(base_builder)
    with pytest.raises(tune_data.BadInputError, match="no item could be laid out"):
        trainer.train(trainer.load_student(model_dir, settings), builder, bad, settings,
                      tmp_path / "hopeless", resume=False, save_every=2,
                      progress=_progress_crashing_after(None))
    assert [builder.tries[i.question] for i in bad] == [1, 1]


def _bf16_tiny_llama() -> str:
    """The tiny Llama saved in bfloat16, as SmolLM2 is: tuning in float32 then rounds the
    merged weights when they are saved (the float32 tiny-llama would not exercise the cast)."""
    from minipic.span_contract.models import tiny_llama_dir

    return str(tiny_llama_dir(dtype="bfloat16"))


@pytest.mark.fast
@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_report_scores_the_weights_saved_not_the_float32_ones(tmp_path: Path, seed,
                                                                   method: str) -> None:
    """Tuning a bfloat16 model in float32: what the report scores holds, bit for bit, the
    tensors written to the model folder (read back; float32 holds every bfloat16 exactly), the
    float32 weights before the cast are kept apart as the extra row, and the base it scores
    against is the untouched model (a merged LoRA's "adapter off" would be the tuned weights:
    refused)."""
    from safetensors.torch import load_file

    from minipic.eval.datasets import EvalItem
    from minipic.tune import report, trainer
    from minipic.tune.cli import _builder, _save_merged

    torch.set_num_threads(1)
    model_dir = _bf16_tiny_llama()
    items = [EvalItem(**r) for r in random_items(random.Random(seed), 4)]
    extra = {"method": "full", "lr": 1e-4} if method == "full" else {}
    settings = _settings(model_dir, 2, seed % 1000, **extra)
    builder = _builder(model_dir, settings)
    student = trainer.load_student(model_dir, settings)
    trainer.train(student, builder, items, settings, tmp_path / "run", resume=False,
                  save_every=2, progress=_progress_crashing_after(None))
    folder = tmp_path / "model"
    saved_dtype, saved = _save_merged(student, model_dir, folder, settings, "cpu")
    if method == "lora":
        with pytest.raises(RuntimeError, match="merged"), student.base():
            pass
    files = sorted(folder.glob("*.safetensors"))
    on_disk = {k: v for f in files for k, v in load_file(f).items()}
    assert saved_dtype == "bfloat16" and on_disk
    assert {v.dtype for v in on_disk.values()} == {torch.bfloat16}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert isinstance(saved, report.SavedModel)
    assert saved.describe()["weights_dtype"] == "bfloat16"
    scored = saved.model.state_dict()
    assert scored.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert scored[name].dtype == torch.float32, name  # computed in the tuning dtype
        assert torch.equal(scored[name].to(torch.bfloat16), tensor), name
        assert torch.equal(tensor.float(), scored[name]), name
    unrounded = saved.unrounded.state_dict()
    assert all(torch.equal(unrounded[k].to(torch.bfloat16), v) for k, v in on_disk.items())
    # the cast did round something: the extra row measures a real difference
    assert any(not torch.equal(unrounded[k], v.float()) for k, v in on_disk.items())
    pristine = {k: v for f in sorted(Path(model_dir).glob("*.safetensors"))
                for k, v in load_file(f).items()}
    with saved.base() as base:
        base_weights = base.state_dict()
    assert all(torch.equal(base_weights[k], v.float()) for k, v in pristine.items())
    assert any(not torch.equal(on_disk[k], v) for k, v in pristine.items())  # it learned
    record = report.score_item(saved, builder, items[0], settings.max_tokens)
    assert set(record) >= {"base_block", "tuned_block", "tuned_full", "unrounded_block"}


@pytest.mark.fast
def test_tune_cli_reports_the_saved_dtype_and_its_rows_are_the_saved_models(
        tmp_path: Path, seed) -> None:
    """Through ``minipic tune``: the report says which weights it scored (the saved bfloat16
    ones, computed in float32) and what the rounding cost, and its tuned row for a held-out item
    is exactly what scoring the published folder against the base gives."""
    from minipic.eval.datasets import EvalItem
    from minipic.tune import report, trainer
    from minipic.tune.cli import _builder

    rng = random.Random(seed)
    rows = random_items(rng, 16)
    while not any(tune_data.is_heldout(r["question"]) for r in rows):
        rows += random_items(rng, 4, first=len(rows))
    data = write_jsonl(tmp_path / "mine.jsonl", rows)
    model_dir = _bf16_tiny_llama()
    run = tmp_path / "run"
    assert main(["tune", "--model", model_dir, "--data", str(data), "--out", str(run),
                 "--steps", "2", "--batch", "2", "--max-tokens", "3", "--threads", "1",
                 "--dtype", "float32", "--report-n", "3", "--seed", str(seed % 1000)]) == 0
    assert not (run / "model.tmp").exists() and (run / "model" / "minipic_tune.json").is_file()
    tuned = json.loads((run / "tune.json").read_text())
    meta, summary = tuned["meta"], tuned["summary"]
    assert meta["dtype"] == "float32" and meta["saved_dtype"] == "bfloat16"
    assert meta["scored"] == {"weights": "as saved", "weights_dtype": "bfloat16",
                              "compute_dtype": "float32", "unrounded_scored": True}
    assert {"unrounded_block", "saved_minus_unrounded_block_kl"} <= set(summary)
    text = (run / "tune.md").read_text()
    assert "score the saved model: its bfloat16 weights" in text and "saved − unrounded" in text
    first = tuned["items"][0]
    item = next(EvalItem(**r) for r in rows if r["id"] == first["id"])
    settings = trainer.TuneSettings(model=model_dir, steps=2, max_tokens=3)
    again = report.score_item(
        report.SavedModel(trainer.load_plain(run / "model", "float32").eval(),
                          trainer.load_plain(model_dir, "float32").eval(), "bfloat16", "float32"),
        _builder(model_dir, settings), item, 3)
    for row in ("base_block", "tuned_block", "tuned_full"):
        assert again[row] == first[row], row
    # and the float32 weights score otherwise: the equality above tells the two apart
    assert first["unrounded_block"]["kl"] != first["tuned_block"]["kl"]
