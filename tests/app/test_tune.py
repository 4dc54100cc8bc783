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


def random_items(rng: random.Random, n: int) -> list[dict]:
    return [{"id": f"r{i}", "question": f"Which {rng.choice(VOCAB)} is {i} "
                                        f"{' '.join(rng.sample(VOCAB, 3))}?",
             "documents": [" ".join(rng.choice(VOCAB) for _ in range(rng.randint(15, 45)))
                           for _ in range(rng.randint(2, 3))],
             "answer": rng.choice(VOCAB)} for i in range(n)]


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
        (["--data", "wikipedia"], "builtin (BIG-bench knowledge conflicts) or a .jsonl"),
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
    from minipic.tune import trainer
    from minipic.tune.cli import _builder
    from span_contract.models import resolve_model

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
                 "--threads", "1", "--seed", str(seed % 1000)]) == 0
    out = capsys.readouterr().out
    assert "1 bad lines skipped" in out
    manifest = json.loads((run / "model" / "minipic_tune.json").read_text())
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
    assert scored["summary"]["modes"]["prefix"]["kl_mean"]["mean"] >= 0  # what tuning moved
    assert set(scored["summary"]["modes"]) == {"prefix", "selective@0.5"}
    assert tuned_row["question"] not in {r["question"] for r in scored["items"]}
