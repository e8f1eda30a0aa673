"""The conformance kit's training job: ``python -m cardcage.testing.job SPEC.json``.

The spec names the Trainer flags of a launch and the scenarios to run. Every process that
runs this script (the caller; under script relaunch, torchrun or a manual multi-node launch,
every rank) runs the scenarios in order, each with fresh Trainers, and writes what it saw to
``<out>/<scenario>-rank<R>.json``. Each rank builds its models from a seed of its own (rank 0
from the plain loop's), so a backend must start every rank from rank 0's weights. A scenario
named ``fail`` makes rank 1 raise at its second step; it runs alone, in an invocation of its
own, and so do ``metric_names`` (rank 1 validates under another metric name: refused), and
``resize_save`` and ``resize_resume`` (jobs of two world sizes, one resuming the other's
checkpoint). The own-loop scenarios (``cage_*``, :mod:`cardcage.testing.own_loop`)
run after the others, all in one ``cardcage.Cage.launch``; their training processes write
their results themselves.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import cardcage
from cardcage.testing import own_loop
from cardcage.testing.models import (
    SAMPLES,
    SCENARIO,
    UNEVEN_SAMPLES,
    VAL_SAMPLES,
    EachTurnsOutput,
    FailingModel,
    KitModel,
    MetricNamesModel,
    RecordFitEnd,
    StopOnLastRank,
    TurnsModel,
    flat,
    loader,
    seed_for_rank,
)

#: The global step at which ``checkpoint_in_step`` saves from inside ``training_step``.
IN_STEP = 3
#: What ``resize_save`` writes, and the variable naming it to ``resize_resume``.
RESIZE_CHECKPOINT, RESUME = "resize.ckpt", "CARDCAGE_KIT_RESUME"
#: ``accumulate``'s micro-batches per optimizer step: each epoch's last group is shorter.
ACCUMULATE = 3
#: ``clip``'s limits: the total gradient norm (with 2 micro-batches a step), and each element.
CLIP_NORM, CLIP_VALUE, CLIP_ACCUMULATE = 0.2, 0.05, 2
#: ``early_stop``'s max_epochs: the last rank asks to stop after the first of them.
EARLY_STOP_EPOCHS = 3


class Job:
    """One process's view of a spec: its flags, batch size and output folder."""

    def __init__(self, spec: dict[str, Any]):
        self.flags: dict[str, Any] = spec["flags"]
        self.batch = int(spec["batch_size"])
        self.out = Path(spec["out"])

    def trainer(self, **flags: Any) -> cardcage.Trainer:
        return cardcage.Trainer(**{"progress_bar": False, **self.flags, **flags})

    def train(self, samples: int = SAMPLES, **options: Any) -> Any:
        return loader(samples, self.batch, **options)

    def val(self) -> Any:
        return loader(VAL_SAMPLES, self.batch)

    def path(self, name: str) -> str:
        return str(self.out / name)


def _fit(job: Job, model: KitModel, data: Any, val: Any = None, **flags: Any) -> Any:
    trainer = job.trainer(**flags)
    trainer.fit(model, data, val)
    return trainer


def sgd(job: Job) -> dict[str, Any]:
    """Momentum SGD, unshuffled, with validation; then what fit left, and a second fit."""
    model = KitModel("sgd")
    trainer = _fit(job, model, job.train(), job.val(), max_epochs=2)
    result = {
        "weights": flat(model),
        "val_loss": trainer.logged_metrics.get("val_loss"),
        "class": type(model).__name__,
        "plain_tensors": all(type(p.data) is torch.Tensor for p in model.parameters()),
        "global_step": trainer.global_step,
        "validate": trainer.validate(model, job.val())[0]["val_loss"],
        "test": trainer.test(model, job.val())[0]["test_loss"],
    }
    _fit(job, model, job.train(), max_epochs=2)  # a new Trainer continues the same model
    result["second_fit"] = flat(model)
    return result


def adam_shuffled(job: Job) -> dict[str, Any]:
    model = KitModel("adam")
    _fit(job, model, job.train(shuffle=True), max_epochs=2)
    return {"weights": flat(model)}


def uneven(job: Job) -> dict[str, Any]:
    model = KitModel("sgd")
    _fit(job, model, job.train(UNEVEN_SAMPLES), max_epochs=2)
    return {"weights": flat(model)}


def drop_last(job: Job) -> dict[str, Any]:
    model = KitModel("sgd")
    _fit(job, model, job.train(UNEVEN_SAMPLES, drop_last=True), max_epochs=2)
    return {"weights": flat(model)}


def two_optimizers(job: Job) -> dict[str, Any]:
    model = KitModel("two")
    _fit(job, model, job.train(), max_epochs=2)
    return {"weights": flat(model)}


def max_steps(job: Job) -> dict[str, Any]:
    """Stop mid-epoch, checkpoint between steps, resume other weights to a later step."""
    model = KitModel("adam")
    trainer = _fit(job, model, job.train(), max_epochs=None, max_steps=5)
    trainer.save_checkpoint(job.path("max_steps.ckpt"))
    resumed = KitModel("adam", seed=99)
    _fit(
        job,
        resumed,
        job.train(),
        max_epochs=None,
        max_steps=12,
        resume_from_checkpoint=job.path("max_steps.ckpt"),
    )
    return {"weights": flat(model), "resumed": flat(resumed), "global_step": trainer.global_step}


def checkpoint(job: Job) -> dict[str, Any]:
    """Adam with a scheduler: save after fit, resume other weights for two more epochs."""
    model = KitModel("adam")
    trainer = _fit(job, model, job.train(shuffle=True), max_epochs=1)
    trainer.save_checkpoint(job.path("after_fit.ckpt"))
    resumed = KitModel("adam", seed=99)
    _fit(
        job,
        resumed,
        job.train(shuffle=True),
        max_epochs=3,
        resume_from_checkpoint=job.path("after_fit.ckpt"),
    )
    return {"weights": flat(model), "resumed": flat(resumed)}


def checkpoint_in_step(job: Job) -> dict[str, Any]:
    """Save from inside ``training_step`` at step ``IN_STEP``; resume from there to the end."""
    model = KitModel("sgd", save_at=(IN_STEP, job.path("in_step.ckpt")))
    _fit(job, model, job.train(), max_epochs=2)
    resumed = KitModel("sgd", seed=99)
    _fit(job, resumed, job.train(), max_epochs=2, resume_from_checkpoint=job.path("in_step.ckpt"))
    return {"weights": flat(model), "resumed": flat(resumed)}


def resize_save(job: Job) -> dict[str, Any]:
    """Adam with a scheduler for one epoch, saved after fit, for a job of another world size
    to resume (``resize_resume``)."""
    model = KitModel("adam")
    trainer = _fit(job, model, job.train(), max_epochs=1)
    trainer.save_checkpoint(job.path(RESIZE_CHECKPOINT))
    return {"weights": flat(model)}


def resize_resume(job: Job) -> dict[str, Any]:
    """Resume other weights from what ``resize_save`` wrote (``CARDCAGE_KIT_RESUME`` names
    it) for two more epochs, at this job's world size."""
    resumed = KitModel("adam", seed=99)
    _fit(job, resumed, job.train(), max_epochs=3, resume_from_checkpoint=os.environ[RESUME])
    return {"resumed": flat(resumed)}


def accumulate(job: Job) -> dict[str, Any]:
    """Momentum SGD stepping once every ``ACCUMULATE`` batches (and at each epoch's end);
    every rank traces its ``global_step`` (``fit_end``)."""
    model = KitModel("sgd")
    trainer = _fit(
        job,
        model,
        job.train(),
        max_epochs=2,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[RecordFitEnd()],
    )
    return {"weights": flat(model), "global_step": trainer.global_step}


def step_scheduler(job: Job) -> dict[str, Any]:
    """Momentum SGD with a StepLR stepped after every optimizer step (``"interval":
    "step"``); every rank traces its learning rate at the end (``fit_end``)."""
    model = KitModel("step_lr")
    trainer = _fit(job, model, job.train(), max_epochs=2, callbacks=[RecordFitEnd()])
    return {"weights": flat(model), "global_step": trainer.global_step}


def early_stop(job: Job) -> dict[str, Any]:
    """The last rank alone asks to stop at the end of epoch 0 of ``EARLY_STOP_EPOCHS``;
    every rank traces where it ended (``fit_end``)."""
    model = KitModel("sgd")
    trainer = _fit(
        job,
        model,
        job.train(),
        max_epochs=EARLY_STOP_EPOCHS,
        callbacks=[StopOnLastRank(), RecordFitEnd()],
    )
    return {
        "weights": flat(model),
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
    }


def clip(job: Job) -> dict[str, Any]:
    """Gradients clipped by their total norm after 2 accumulated micro-batches (so after
    the backend synchronized their sum), then, in a second model, clamped element-wise."""
    by_norm = KitModel("sgd")
    _fit(
        job,
        by_norm,
        job.train(),
        max_epochs=2,
        gradient_clip_val=CLIP_NORM,
        accumulate_grad_batches=CLIP_ACCUMULATE,
    )
    by_value = KitModel("sgd")
    _fit(
        job,
        by_value,
        job.train(),
        max_epochs=2,
        gradient_clip_val=CLIP_VALUE,
        gradient_clip_algorithm="value",
    )
    return {"norm": flat(by_norm), "value": flat(by_value)}


def optimizer_idx(job: Job) -> dict[str, Any]:
    """Two optimizers stepped in turn (``training_step`` takes ``optimizer_idx``), clipped by
    norm after 2 accumulated micro-batches, with a batch callback: the loop's hooked path,
    where each optimizer must still get its own turn."""
    model = TurnsModel("two")
    _fit(
        job,
        model,
        job.train(),
        max_epochs=2,
        gradient_clip_val=CLIP_NORM,
        accumulate_grad_batches=CLIP_ACCUMULATE,
        callbacks=[EachTurnsOutput()],
    )
    return {"weights": flat(model)}


def fail(job: Job) -> dict[str, Any]:
    """Rank 1 raises at its second step."""
    model = FailingModel("sgd")
    _fit(job, model, job.train(), max_epochs=1)
    return {"weights": flat(model)}


def metric_names(job: Job) -> dict[str, Any]:
    """Rank 1's validation_step returns another metric name than rank 0's: refused."""
    model = MetricNamesModel("sgd")
    _fit(job, model, job.train(), job.val(), max_epochs=1, num_sanity_val_steps=0)
    return {"weights": flat(model)}


SCENARIOS: dict[str, Callable[[Job], dict[str, Any]]] = {
    "sgd": sgd,
    "adam_shuffled": adam_shuffled,
    "uneven": uneven,
    "drop_last": drop_last,
    "two_optimizers": two_optimizers,
    "optimizer_idx": optimizer_idx,
    "max_steps": max_steps,
    "checkpoint": checkpoint,
    "checkpoint_in_step": checkpoint_in_step,
    "accumulate": accumulate,
    "clip": clip,
    "step_scheduler": step_scheduler,
    "early_stop": early_stop,
    "resize_save": resize_save,
    "resize_resume": resize_resume,
    "fail": fail,
    "metric_names": metric_names,
}
#: How many times each scenario calls ``fit`` (``validate`` and ``test`` start no training).
FITS = {name: 1 for name in SCENARIOS} | {
    "sgd": 2,
    "max_steps": 2,
    "checkpoint": 2,
    "checkpoint_in_step": 2,
    "clip": 2,
}


#: Where launchers put a process's global rank: torchrun (and cardcage's script relaunch,
#: once it ran), horovodrun, Open MPI's mpirun, MPICH and Intel MPI (PMI), and LSF's jsrun.
RANK_VARIABLES = ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "JSM_NAMESPACE_RANK")


def _rank() -> int:
    """This process's global rank as its launcher set it; in a node started by hand before
    its backend set ``RANK`` (one process per node until then), its node rank; else 0 (the
    script of a single process, or the caller whose spawned workers train)."""
    for name in (*RANK_VARIABLES, "NODE_RANK"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 0


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    job = Job(spec)
    job.out.mkdir(parents=True, exist_ok=True)
    own = [name for name in spec["scenarios"] if name in own_loop.SCENARIOS]
    for name in spec["scenarios"]:
        if name in own:
            continue
        os.environ[SCENARIO] = name
        seed_for_rank(_rank())  # every rank but 0 builds other initial weights
        result = SCENARIOS[name](job)
        rank = _rank()
        result.update(rank=rank, pid=os.getpid())
        target = job.out / f"{name}-rank{rank}.json"
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(result))
        os.replace(partial, target)
    if own:  # one launch for all of them: their processes start once
        os.environ[SCENARIO] = own_loop.LAUNCH
        own_loop.run(job.flags, own, job.batch, job.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
