"""The tuning loop: LoRA (default) or full fine-tuning, AdamW, checkpoints that resume.

Why LoRA is the default: the adapter is 1-2% of the weights, so an 8B model tunes on one GPU
with the optimizer state of a small model, and the teacher is the same weights with the adapter
switched off (one copy in memory, not two). Full fine-tuning keeps a second, frozen copy as the
teacher and AdamW state for every weight (about 16 bytes per parameter besides the two copies):
it is there to be measured against LoRA (``results/tune/``), and for small models. Either way
the output folder is an ordinary model.

A checkpoint (``checkpoints/last.pt``, written whole then renamed) holds the tuned weights, the
optimizer and schedule, the step, the loss history and the RNG state; the item order is a
function of the seed and the epoch, so a resumed run sees the same items in the same order as an
uninterrupted one. ``settings`` must match to resume: another run's checkpoint is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minipic.span_contract.errors import BadInputError
from minipic.tune import objective

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
METHODS = ("lora", "full")


@dataclass(frozen=True)
class TuneSettings:
    """Everything that decides the tuned weights (with the data); a checkpoint names them."""

    model: str
    steps: int
    batch: int = 4  # items per optimizer step (gradient accumulation)
    lr: float = 5e-4  # the CLI's default for LoRA (full: 5e-5)
    warmup: float = 0.05  # share of steps
    lora_rank: int = 16
    lora_alpha: int = 32
    max_tokens: int = 16  # the teacher's answer length
    block_size: int = 32
    max_model_len: int = 2048
    seed: int = 1
    dtype: str = "float32"  # of the weights while tuning; the merged model keeps the base's
    data_digest: str = ""
    method: str = "lora"  # or "full" (METHODS)
    keep_full: float = 0.0  # weight of KL(base plain ‖ student plain) beside the block loss
    sink_gap: int = 0  # SpanConfig.sink_gap of the layout tuned for (the engine's positions)

    def describe(self) -> str:
        """One line for reports: what was trained, and on which loss."""
        what = (f"LoRA r={self.lora_rank} α={self.lora_alpha} on "
                + ", ".join(LORA_TARGETS) if self.method == "lora" else "full fine-tuning")
        loss = "KL(base plain ‖ student block_attention)"
        if self.keep_full:
            loss += f" + {self.keep_full:g} × KL(base plain ‖ student plain)"
        return f"{what}; self-distillation {loss} over question + greedy answer"

    def digest(self) -> str:
        fields = dataclasses.asdict(self)
        if not self.sink_gap:  # runs from before the field keep their digest, so they resume
            del fields["sink_gap"]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def item_order(n_items: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n_items))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


class Student:
    """The weights being tuned and the frozen base they learn from.

    Why one type for both methods: they differ only in where the base lives (LoRA: the same
    weights with the adapter switched off; full: a second frozen copy), which weights train, what
    a checkpoint holds and how the output folder is made. The loop and the report ask this
    object and never the method.
    """

    def __init__(self, model: Any, method: str, frozen: Any = None) -> None:
        self.model = model
        self.method = method
        self._frozen = frozen
        self._merged = False

    @property
    def frozen(self) -> Any:
        """The separate untouched copy (full fine-tuning), or None (LoRA: the base is the same
        weights with the adapter off)."""
        return self._frozen

    @contextmanager
    def base(self) -> Iterator[Any]:
        """The untuned model, to answer and score as the user's model does today."""
        if self._merged and self._frozen is None:
            # with the adapter folded in, "adapter off" would be the tuned weights
            raise RuntimeError("the LoRA adapter is merged into the weights: the untuned base "
                               "is gone from memory; load it again from its folder")
        if self._frozen is not None:
            yield self._frozen
        else:
            with self.model.disable_adapter():
                yield self.model

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def weights(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: the adapter, or every weight."""
        if self.method == "lora":
            from peft import get_peft_model_state_dict

            return get_peft_model_state_dict(self.model)
        return self.model.state_dict()

    def load_weights(self, saved: dict[str, torch.Tensor]) -> None:
        if self.method == "lora":
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, saved)
        else:
            self.model.load_state_dict(saved)

    def merged(self) -> Any:
        """An ordinary transformers model holding the tuned weights. LoRA folds the adapter
        into the base weights in place: ``base()`` refuses afterwards."""
        if self.method == "lora":
            self._merged = True
            return self.model.merge_and_unload()
        return self.model


def load_plain(model_dir: str | Path, dtype: str, device: str = "cpu") -> Any:
    """A model folder as an ordinary transformers model, in ``dtype`` on ``device``: how the
    student and its frozen base are loaded, and how the report loads the saved model back."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa").to(device)


def load_student(model_dir: str, settings: TuneSettings, device: str = "cpu",
                 checkpointing: bool = False) -> Student:
    """The transformers model (``settings.dtype``, on ``device``) made trainable by
    ``settings.method``: a fresh LoRA adapter (seeded), or all weights beside a frozen copy.
    ``checkpointing``: recompute each layer's activations in the backward pass instead of
    keeping them (what lets an 8B model's multi-thousand-token prompts fit on one GPU; the
    gradients are the same)."""
    if settings.method not in METHODS:
        raise BadInputError(f"method {settings.method!r}: one of {', '.join(METHODS)}")

    def load() -> Any:
        return load_plain(model_dir, settings.dtype, device)

    torch.manual_seed(settings.seed)
    base = load()
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    if settings.method == "full":
        frozen = load().eval().requires_grad_(False)
        return Student(base, "full", frozen)
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in base.named_modules()}
    targets = [t for t in LORA_TARGETS if t in present]
    if not targets:
        raise BadInputError(f"{model_dir}: none of the projections LoRA targets "
                            f"({', '.join(LORA_TARGETS)}) exist in this model; "
                            f"tune it with --method full")
    config = LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, lora_dropout=0.0,
                        target_modules=targets, bias="none", task_type="CAUSAL_LM")
    return Student(get_peft_model(base, config), "lora")


class Checkpoints:
    """``checkpoints/last.pt`` under the run folder, atomically replaced."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / "last.pt"

    def save(self, student: Student, optimizer: Any, schedule: Any,
             state: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        torch.save({"weights": student.weights(),
                    "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                    "torch_rng": torch.get_rng_state(), **state}, tmp)
        os.replace(tmp, self.path)

    def load(self, student: Student, optimizer: Any, schedule: Any,
             settings_digest: str) -> dict:
        saved = torch.load(self.path, weights_only=False)
        if saved.get("settings_digest") != settings_digest:
            raise BadInputError(
                f"{self.path} was written by a run with other settings or data "
                f"({saved.get('settings')}); start over with a new --out, or drop --resume")
        student.load_weights(saved["weights"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        torch.set_rng_state(saved["torch_rng"])
        return saved


def failed_items(skipped: list[dict[str, Any]], items: list[Any]) -> dict[int, dict[str, Any]]:
    """The items that could not be laid out, by position in ``items``, one record each, from a
    run's ``skipped`` records. Records from checkpoints written before positions were kept
    (one per failure, named by id only) are matched by id (an id several items share marks
    them all), so such a run resumes too, with its repeated records merged."""
    failed: dict[int, dict[str, Any]] = {}
    by_id: dict[str, list[int]] = {}
    for position, item in enumerate(items):
        by_id.setdefault(item.id, []).append(position)
    for record in skipped:
        positions = ([record["index"]] if "index" in record
                     else by_id.get(record.get("id"), []))
        for position in positions:
            failed.setdefault(position, {**record, "index": position})
    return failed


def train(student: Student, builder: Any, items: list[Any], settings: TuneSettings,
          run_dir: Path, *, resume: bool, save_every: int, progress: Callable[..., Any],
          on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the steps (from the last checkpoint when ``resume``); returns the loss history and
    timings. An item that fails to lay out (too long for ``max_model_len``) is recorded once in
    ``state["skipped"]`` and passed over in every later epoch without another try: a layout
    depends only on the item and the settings, so it would fail again, and counting each
    failure (not each item) would end a long run, and its resume, over a few bad items. Only a
    set where every item fails is an error. ``on_step`` sees the state after every step (a run
    cut short by a time limit still leaves its loss curve)."""
    from transformers import get_cosine_schedule_with_warmup

    params = student.trainable()
    model = student.model
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    schedule = get_cosine_schedule_with_warmup(
        optimizer, math.ceil(settings.warmup * settings.steps), settings.steps)
    checkpoints = Checkpoints(run_dir / "checkpoints")
    state: dict[str, Any] = {"step": 0, "cursor": 0, "losses": [], "skipped": [],
                             "seconds": 0.0,
                             "settings": dataclasses.asdict(settings),
                             "settings_digest": settings.digest()}
    if resume and checkpoints.path.exists():
        saved = checkpoints.load(student, optimizer, schedule, settings.digest())
        state.update({k: saved[k] for k in ("step", "cursor", "losses", "skipped", "seconds")})
    failed = failed_items(state["skipped"], items)
    state["skipped"] = list(failed.values())
    bar = progress(total=settings.steps, initial=state["step"], desc="tuning", unit="step")
    started = time.perf_counter() - state["seconds"]
    while state["step"] < settings.steps:
        optimizer.zero_grad(set_to_none=True)
        step_losses = []
        while len(step_losses) < settings.batch:
            epoch, index = divmod(state["cursor"], len(items))
            position = item_order(len(items), settings.seed, epoch)[index]
            item = items[position]
            state["cursor"] += 1
            if position in failed:  # it cannot fit in a later epoch either
                continue
            model.eval()  # the teacher's answer and targets: inference, whatever trains
            try:
                with torch.no_grad(), student.base() as teacher:
                    ex = objective.make_example(teacher, builder, item, settings.max_tokens)
                    target = objective.teacher_targets(teacher, ex)
            except BadInputError as exc:
                failed[position] = {"id": item.id, "index": position, "error": str(exc)[:200]}
                state["skipped"].append(failed[position])
                if len(failed) == len(items):
                    raise BadInputError(f"no item could be laid out: {exc}") from exc
                continue
            model.train()
            loss = objective.distillation_loss(model, ex, target,
                                               settings.keep_full) / settings.batch
            loss.backward()
            step_losses.append(float(loss.detach()) * settings.batch)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        state["step"] += 1
        state["losses"].append(sum(step_losses) / len(step_losses))
        state["seconds"] = time.perf_counter() - started
        bar.update(1)
        bar.set_postfix(kl=f"{state['losses'][-1]:.3f}")
        if state["step"] % save_every == 0 or state["step"] == settings.steps:
            checkpoints.save(student, optimizer, schedule, state)
        if on_step is not None:
            on_step(state)
    bar.close()
    model.eval()
    return state
