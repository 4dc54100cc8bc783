"""``minipic tune``: teach a model to answer under span layouts as it does with full attention.

    minipic tune --out runs/smol                       # default model, built-in data
    minipic tune --model DIR --data mine.jsonl --out runs/mine --steps 200
    minipic tune --out runs/smol --resume              # go on from the last checkpoint
    minipic tune --out runs/smol-full --method full    # every weight (small models)

Self-distillation, no labels: the frozen model on the plain prompt is the teacher, the same
model with a LoRA adapter (or, --method full, all its weights) under the block_attention layout
(the engine's block mask) is the student, and the loss is KL(teacher ‖ student) over the
question and the teacher's own greedy answer (``minipic/tune/objective.py``). --keep-full adds
the same KL with the student on the plain prompt, to hold the model's full-attention answers in
place. Tuning items never overlap what ``minipic eval`` scores (``minipic/tune/data.py``).

Writes to ``--out``:
  model/          the merged model (weights in the base model's dtype, tokenizer,
                  minipic_tune.json): give it to `minipic serve --model`, `Orchestrator.embedded`
                  or `minipic eval --model`
  checkpoints/    last.pt, for --resume
  heldout.jsonl   the held-out items (a JSONL --data; built-in data: eval's own default set)
  tune.json, tune.md, tune.png   settings, wall time, loss curve and the held-out report
                  (of model/ as saved, read back: its dtype, not the float32 of tuning)
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from minipic.span_contract.models import TUNE_MANIFEST

__all__ = ["add_subparser", "run"]

MANIFEST = TUNE_MANIFEST
# the best of 2e-4 / 5e-4 (LoRA) and 1e-5 / 2e-5 / 5e-5 (full) at equal steps on SmolLM2; the
# two bests learn alike (results/tune/methods/)
DEFAULT_LR = {"lora": 5e-4, "full": 5e-5}


def add_subparser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tune", help="block-attention tuning of a model by self-distillation (LoRA or full)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="run folder (see above)")
    p.add_argument("--model", default=None, help="model folder (default SmolLM2-135M)")
    p.add_argument("--data", default="builtin",
                   help="builtin (SQuAD 1.1 train, minus eval's items; also called squad) or "
                        "a .jsonl of {question, documents, answer?, system?} (default builtin)")
    p.add_argument("--n", type=int, default=400, help="tuning items at most (default 400)")
    p.add_argument("--epochs", type=float, default=1.0,
                   help="passes over the tuning items; sets --steps (default 1)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: epochs × items / batch)")
    p.add_argument("--batch", type=int, default=4, help="items per step (default 4)")
    p.add_argument("--method", default="lora", choices=("lora", "full"),
                   help="lora: an adapter on every projection, merged at the end (default; "
                        "what fits an 8B model on one GPU); full: every weight, beside a frozen "
                        "copy as the teacher")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default 5e-4 for lora, 5e-5 for full)")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--keep-full", type=float, default=0.0,
                   help="weight of a second loss that keeps the plain prompt's answers where "
                        "the base model had them (0: off, the default; costs one more forward "
                        "pass per item)")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="the teacher's answer length (default 16, as minipic eval)")
    p.add_argument("--passages", default="3-10",
                   help="documents per built-in item, MIN-MAX (default 3-10)")
    p.add_argument("--max-words", type=int, default=80,
                   help="built-in passages are cut to this many words (default 80)")
    p.add_argument("--report-n", type=int, default=40,
                   help="held-out items scored at the end (0: none; default 40)")
    p.add_argument("--sink-gap", type=int, default=0, metavar="G",
                   help="tune for spans whose sink sits G positions before their first token "
                        "(SpanConfig.sink_gap; default 0). The model folder records it, and an "
                        "engine serving that folder places sinks so by default")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue from checkpoints/last.pt")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="tune on the good lines of a JSONL with bad ones (default: refuse)")
    p.add_argument("--device", default="auto",
                   help="auto (cuda when torch sees a GPU, else cpu), cpu or cuda")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="weights while tuning: auto = float32, but bfloat16 for lora on cuda (the "
                        "adapter itself stays float32)")
    p.add_argument("--gradient-checkpointing", default="auto", choices=("auto", "on", "off"),
                   help="recompute activations in the backward pass to save memory "
                        "(auto: on with cuda)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--seed", type=int, default=1, help="item draw, order and adapter init")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"minipic tune: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from minipic.span_contract.errors import BadInputError

    for name in ("n", "batch", "lora_rank", "max_tokens", "save_every"):
        if getattr(args, name) < 1:
            return _fail(f"--{name.replace('_', '-')} must be at least 1")
    if args.steps is not None and args.steps < 1:
        return _fail("--steps must be at least 1")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.method]
    if not (args.lr > 0 and math.isfinite(args.lr)) or not args.epochs > 0:
        return _fail("--lr and --epochs must be positive numbers")
    if not (args.keep_full >= 0 and math.isfinite(args.keep_full)):
        return _fail("--keep-full must be 0 or a positive number")
    if args.report_n < 0:
        return _fail("--report-n must be 0 or more")
    try:
        low, high = (int(x) for x in args.passages.split("-"))
        if not 1 <= low <= high:
            raise ValueError
    except ValueError:
        return _fail(f"--passages must be MIN-MAX, got {args.passages!r}")
    if (args.out / "model").exists() and not args.resume:
        return _fail(f"{args.out}/model exists: pick another --out, or --resume")
    try:
        return _tune(args, (low, high))
    except BadInputError as exc:
        return _fail(str(exc))
    except ImportError as exc:
        if exc.name == "peft":
            return _fail("needs peft: `pip install 'minipic[tune]'` (or `make setup`)")
        raise


def _tune(args: argparse.Namespace, passages: tuple[int, int]) -> int:
    import torch
    from tqdm import tqdm

    from minipic.span_contract.errors import BadInputError
    from minipic.span_contract.models import resolve_model
    from minipic.tune import data as tune_data
    from minipic.tune import report, trainer

    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        return _fail(f"--device {args.device}: cpu, or cuda on a machine where torch sees a GPU")
    if args.method == "full" and args.dtype == "bfloat16":
        return _fail("--method full needs --dtype float32: in bfloat16 weights, AdamW steps "
                     "smaller than 1/256 of a weight round away (LoRA keeps its adapter in "
                     "float32 over a bfloat16 base)")
    dtype = args.dtype if args.dtype != "auto" else (
        "bfloat16" if device == "cuda" and args.method == "lora" else "float32")
    model_dir = resolve_model(args.model)
    if not Path(model_dir, "config.json").is_file():
        return _fail(f"--model {model_dir}: not a model folder (no config.json)")
    print(f"minipic tune: loading data ({args.data})", flush=True)
    loaded = tune_data.load(args.data, args.n, args.seed, passages, args.max_words,
                            args.report_n, args.skip_bad_lines)
    data_digest = hashlib.sha256(json.dumps(
        loaded.manifest()["train_question_digests"]).encode()).hexdigest()[:16]
    steps = args.steps or max(1, math.ceil(args.epochs * len(loaded.train) / args.batch))
    settings = trainer.TuneSettings(
        model=model_dir, steps=steps, batch=args.batch, lr=args.lr, lora_rank=args.lora_rank,
        lora_alpha=2 * args.lora_rank, max_tokens=args.max_tokens, seed=args.seed,
        dtype=dtype, data_digest=data_digest, method=args.method, keep_full=args.keep_full,
        sink_gap=args.sink_gap)
    print(f"minipic tune: {len(loaded.train)} tuning items ({loaded.excluded} dropped as eval "
          f"items, {len(loaded.bad_lines)} bad lines skipped), {len(loaded.heldout)} held out; "
          f"{steps} steps × {args.batch}", flush=True)
    builder = _builder(model_dir, settings)
    checkpointing = args.gradient_checkpointing == "on" or (
        args.gradient_checkpointing == "auto" and device == "cuda")
    student = trainer.load_student(model_dir, settings, device, checkpointing)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.resume and not (args.out / "checkpoints" / "last.pt").exists():
        print(f"minipic tune: no checkpoint in {args.out}/checkpoints: starting from step 0",
              flush=True)
    state = trainer.train(student, builder, loaded.train, settings, args.out, resume=args.resume,
                          save_every=args.save_every, progress=tqdm)
    tune_data.write_heldout(loaded.heldout, args.out / "heldout.jsonl")
    to_score = loaded.heldout[: args.report_n]
    staged = args.out / "model.tmp"  # becomes model/ once its manifest is written
    saved_dtype, saved = _save_merged(student, model_dir, staged, settings, device,
                                      load_back=bool(to_score))
    records, errors = [], []
    for item in tqdm(to_score, desc="held-out report", unit="item"):
        try:
            records.append(report.score_item(saved, builder, item, args.max_tokens))
        except BadInputError as exc:
            errors.append({"id": item.id, "error": str(exc)[:200]})
    summary = report.summarize(records, args.seed) if records else None
    wall = time.perf_counter() - started
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": model_dir, "model_name": Path(model_dir).name, "out": str(args.out / "model"),
        **{k: getattr(settings, k) for k in ("steps", "batch", "lr", "lora_rank",
                                             "lora_alpha", "max_tokens", "seed", "dtype",
                                             "keep_full", "sink_gap")},
        "saved_dtype": saved_dtype, "scored": saved.describe() if saved is not None else None,
        "device": device, "gradient_checkpointing": checkpointing,
        "method": settings.describe(),
        "train_items": len(loaded.train), "skipped_items": len(state["skipped"]),
        "wall_s": wall, "train_s": state["seconds"],
        "threads": torch.get_num_threads(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }
    _publish(staged, args.out / "model",
             {**meta, "settings": state["settings"], "data": loaded.manifest(),
              "final_loss": state["losses"][-1] if state["losses"] else None})
    (args.out / "tune.json").write_text(json.dumps(
        {"meta": meta, "losses": state["losses"], "summary": summary, "items": records,
         "errors": errors, "skipped": state["skipped"]}, indent=1))
    if summary:
        text = report.table(summary, meta)
        (args.out / "tune.md").write_text(text + "\n")
        report.plot(state["losses"], summary, args.out / "tune.png")
        print(text)
    print(f"minipic tune: merged model in {args.out / 'model'} ({wall / 60:.1f} min)")
    return 0


def _builder(model_dir: str, settings: Any) -> Any:
    from minipic.prompt_builder import PromptBuilder
    from minipic.span_contract.special_tokens import span_config_for_model

    span = span_config_for_model(model_dir, settings.block_size)
    return PromptBuilder.from_pretrained(model_dir, block_size=settings.block_size,
                                         ssep_id=span.ssep_id, pdep_id=span.pdep_id,
                                         pad_id=span.pad_id, max_model_len=settings.max_model_len,
                                         sink_ids=span.sink_ids, sink_gap=settings.sink_gap)


def _save_merged(student: Any, base_dir: str, folder: Path, settings: Any, device: str,
                 load_back: bool = True) -> tuple[str, Any]:
    """Write the tuned weights (an adapter folded in), in the base model's dtype, with its
    tokenizer, to ``folder`` (``_publish`` adds the manifest and moves it into place), and
    return the dtype written and what the report scores (``report.SavedModel``; None without
    ``load_back``): those weights read back from ``folder`` in the tuning dtype, the untuned
    base, and, when the cast to the base's dtype rounded them, the weights before it.

    Why read them back: the report must score the model a user gets. Tuning on CPU keeps
    float32 weights and SmolLM2 saves bfloat16; scoring the float32 ones described a model that
    exists only in this process."""
    import copy

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from minipic.tune import report, trainer

    base_config = AutoConfig.from_pretrained(base_dir)
    dtype = getattr(base_config, "dtype", None) or getattr(base_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    merged = student.merged().to("cpu")  # LoRA: merged in place, the base is gone from memory
    rounds = isinstance(dtype, torch.dtype) and dtype != merged.dtype and (
        torch.finfo(dtype).bits <= torch.finfo(merged.dtype).bits)  # a wider dtype is exact
    written = merged
    if isinstance(dtype, torch.dtype):
        # a copy only where the weights before the rounding are scored too
        written = copy.deepcopy(merged).to(dtype) if rounds and load_back else merged.to(dtype)
    shutil.rmtree(folder, ignore_errors=True)
    written.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(folder)
    saved_dtype = str(written.dtype).removeprefix("torch.")
    del written
    if not load_back:
        return saved_dtype, None
    scored = trainer.load_plain(folder, settings.dtype, device).eval().requires_grad_(False)
    base = student.frozen
    if base is None:
        base = trainer.load_plain(base_dir, settings.dtype, device).eval().requires_grad_(False)
    unrounded = merged.to(device).eval() if rounds else None
    return saved_dtype, report.SavedModel(scored, base, saved_dtype, settings.dtype, unrounded)


def _publish(folder: Path, target: Path, manifest: dict[str, Any]) -> None:
    """The staged model folder with its manifest, renamed into place whole: ``target`` never
    holds a model without the manifest that ``minipic eval`` filters by."""
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(target, ignore_errors=True)
    folder.rename(target)
