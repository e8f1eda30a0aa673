"""The conformance kit's checks fail a backend that breaks what they check."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cardcage
from cardcage.backend.accelerator import Resolution
from cardcage.testing import reference
from cardcage.testing.harness import Harness
from cardcage.testing.selection_checks import SelectionChecks
from cardcage.testing.suite import SCENARIOS, JobOutput, Launch, run_job
from cardcage.testing.training_checks import TrainingChecks


class Bare(cardcage.Accelerator):
    """Refuses a named job with an error that tells the user nothing to change."""

    name = "bare"

    @classmethod
    def resolve(cls, ctx: Any) -> Resolution:
        raise cardcage.MisconfigurationError("this job cannot run here, for reasons of its own")


class Suite(SelectionChecks):
    backend = "bare"


def test_an_error_that_names_no_flag_fails_the_rule_matrix(
    inprocess_accelerators: Callable[..., None],
) -> None:
    """An error of more than 20 characters used to pass; one must name a flag or variable."""
    inprocess_accelerators("bare", Bare)
    with pytest.raises(AssertionError, match="the error names none of"):
        Suite().test_rule_matrix("plain")


# -- training checks against a real job's output, then that output broken on purpose --------

RAN = ["adam_shuffled", "max_steps", "checkpoint", "checkpoint_in_step"]


class CPUSuite(TrainingChecks):
    """The cpu backend in process, with only the scenarios of :data:`RAN`."""

    backend = "cpu"
    launches = {"in_process": Launch({"distributed_backend": "cpu"})}
    skip = {s: "not run by this test" for s in SCENARIOS if s not in RAN}


@pytest.fixture(scope="module")
def cpu_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobOutput]:
    """The kit's job for the cpu backend (what a passing backend leaves)."""
    harness = Harness(tmp_path_factory.mktemp("cpu_job"))
    try:
        yield run_job(harness, CPUSuite.launches["in_process"], RAN, harness.root / "out")
    finally:
        harness.cleanup()


@pytest.fixture
def broken(cpu_job: JobOutput, tmp_path: Path) -> JobOutput:
    """A copy of the cpu job's output, for a test to break."""
    shutil.copytree(cpu_job.out, tmp_path / "out")
    return dataclasses.replace(cpu_job, out=tmp_path / "out")


def edit_checkpoint(job: JobOutput, name: str, edit: Callable[[dict[str, Any]], None]) -> None:
    state = torch.load(job.out / name, weights_only=True)
    edit(state)
    torch.save(state, job.out / name)


def edit_trace(job: JobOutput, keep: Callable[[dict[str, Any]], bool]) -> None:
    for path in (job.out / "trace").glob("trace-*.jsonl"):
        events = [json.loads(line) for line in path.read_text().splitlines() if line]
        path.write_text("".join(json.dumps(e) + "\n" for e in events if keep(e)))


@pytest.mark.slow
def test_the_cpu_job_passes_the_checks_these_tests_break(cpu_job: JobOutput) -> None:
    """The unbroken output passes, so each failure below comes from what its test broke."""
    suite = CPUSuite()
    suite.test_checkpoints_load_with_weights_only(cpu_job)
    suite.test_lifecycle(cpu_job)


@pytest.mark.slow
def test_a_checkpoint_with_one_ranks_optimizer_shard_fails(broken: JobOutput) -> None:
    """Optimizer state cut to the first rows of each parameter, as rank 0 of two holds it
    under fsdp, fails, although the model's weights in it are whole."""

    def shard(state: dict[str, Any]) -> None:
        for entry in state["optimizers"][0]["state"].values():
            for key, value in entry.items():
                if value.dim() > 0:
                    entry[key] = value[: (len(value) + 1) // 2].clone()

    edit_checkpoint(broken, "after_fit.ckpt", shard)
    with pytest.raises(AssertionError, match="one rank's shard"):
        CPUSuite().test_checkpoints_load_with_weights_only(broken)


@pytest.mark.slow
def test_a_checkpoint_missing_some_parameters_optimizer_state_fails(broken: JobOutput) -> None:
    """Optimizer state for the first layer only (what one rank owns) fails."""

    def drop(state: dict[str, Any]) -> None:
        optimizer_state = state["optimizers"][0]["state"]
        for index in list(optimizer_state)[2:]:
            del optimizer_state[index]

    edit_checkpoint(broken, "max_steps.ckpt", drop)
    with pytest.raises(AssertionError, match="no optimizer state for parameter 2"):
        CPUSuite().test_checkpoints_load_with_weights_only(broken)


@pytest.mark.slow
def test_an_in_step_checkpoint_of_another_step_fails(broken: JobOutput) -> None:
    """in_step.ckpt recording the end of fit's step fails, and so does one that records
    step 3 but holds the final weights (the checkpoint_in_step scenario's result)."""
    final = broken.result("checkpoint_in_step")["weights"]
    edit_checkpoint(broken, "in_step.ckpt", lambda state: state.update(global_step=32))
    with pytest.raises(AssertionError, match="records global_step 32, but it was saved after 3"):
        CPUSuite().test_checkpoints_load_with_weights_only(broken)

    def final_weights(state: dict[str, Any]) -> None:
        state["global_step"] = 3
        offset = 0
        for tensor in state["state_dict"].values():
            count = tensor.numel()
            tensor.copy_(torch.tensor(final[offset : offset + count]).reshape(tensor.shape))
            offset += count

    edit_checkpoint(broken, "in_step.ckpt", final_weights)
    with pytest.raises(AssertionError, match=r"in_step.ckpt \(its weights at global_step 3\)"):
        CPUSuite().test_checkpoints_load_with_weights_only(broken)


@pytest.mark.slow
def test_a_fit_without_its_teardown_fails_the_lifecycle(broken: JobOutput) -> None:
    """The teardown of checkpoint_in_step's second fit gone: the lifecycle check, which
    used to read adam_shuffled's events alone, fails."""
    teardowns: list[dict[str, Any]] = []

    def keep(event: dict[str, Any]) -> bool:
        if event["scenario"] == "checkpoint_in_step" and event["event"] == "teardown":
            teardowns.append(event)
            return len(teardowns) == 1
        return True

    edit_trace(broken, keep)
    with pytest.raises(
        AssertionError, match=r"checkpoint_in_step: process/thread .* in that order"
    ):
        CPUSuite().test_lifecycle(broken)


@pytest.mark.slow
def test_a_training_process_that_reports_nothing_fails_the_lifecycle(broken: JobOutput) -> None:
    """max_steps's training events gone (setup_process, configure_optimizers, teardown),
    its caller's setup and train kept: an empty list from the training process fails."""
    edit_trace(broken, lambda e: e["scenario"] != "max_steps" or e["event"] in ("setup", "train"))
    with pytest.raises(AssertionError, match=r"max_steps: training processes .* ranks \[\]"):
        CPUSuite().test_lifecycle(broken)


@pytest.mark.slow
def test_a_backend_that_holds_the_whole_optimizer_state_fails_sharded(cpu_job: JobOutput) -> None:
    """A suite declaring sharded_optimizer_state fails for a backend (cpu) whose process holds
    all of it."""

    class Sharded(CPUSuite):
        sharded_optimizer_state = True

    with pytest.raises(AssertionError, match=r"holds 38 elements .* the whole 38: the state"):
        Sharded().test_shards_the_optimizer_state(cpu_job)


def test_the_resized_plain_loop_differs_from_the_unresized_one() -> None:
    """A backend that resumed at the saving job's world size, or did not resume, would not
    match what the world-size check expects: the three differ by far more than 1e-5."""
    options: dict[str, Any] = {"batch": 4, "epochs": 3}
    resized = reference.weights("adam", world=2, resize=(1, 3), **options)
    for other in (
        reference.weights("adam", world=2, **options),
        reference.weights("adam", world=3, seed=99, **options),
    ):
        assert max(abs(a - b) for a, b in zip(resized, other, strict=True)) > 1e-3
