"""The suite's training checks: each launch runs the kit's job once (every scenario, in
order) and the checks read what it left; a failing rank runs in a job of its own."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from cardcage.plugins import manager as plugins
from cardcage.selection.rules import rule_name
from cardcage.testing import reference
from cardcage.testing.harness import Harness
from cardcage.testing.job import (
    ACCUMULATE,
    CLIP_ACCUMULATE,
    CLIP_NORM,
    CLIP_VALUE,
    EARLY_STOP_EPOCHS,
    FITS,
    IN_STEP,
    RESIZE_CHECKPOINT,
    RESUME,
)
from cardcage.testing.models import UNEVEN_SAMPLES, flat, make_net
from cardcage.testing.suite import SCENARIOS, JobOutput, Launch, SuiteBase, run_job


def expected(scenario: str, world: int, batch: int) -> dict[str, list[float]]:
    """The plain loop's weights for what a scenario reports (``weights``, ``resumed``...)."""
    options: dict[str, Any] = {"batch": batch, "world": world}
    two_epochs = {**options, "epochs": 2}
    if scenario == "sgd":
        model = make_net(0)
        reference.train(model, "sgd", **two_epochs)
        first = [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]
        reference.train(model, "sgd", **two_epochs)  # a new Trainer: new optimizers
        second = [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]
        return {"weights": first, "second_fit": second}
    if scenario == "adam_shuffled":
        return {"weights": reference.weights("adam", shuffle=True, **two_epochs)}
    if scenario in ("uneven", "drop_last"):
        drop = scenario == "drop_last"
        weights = reference.weights("sgd", samples=UNEVEN_SAMPLES, drop_last=drop, **two_epochs)
        return {"weights": weights}
    if scenario == "two_optimizers":
        return {"weights": reference.weights("two", **two_epochs)}
    if scenario == "optimizer_idx":
        clipped: dict[str, Any] = {
            "accumulate": CLIP_ACCUMULATE,
            "clip": ("norm", CLIP_NORM),
            "turns": True,
        }
        return {"weights": reference.weights("two", **clipped, **two_epochs)}
    if scenario == "max_steps":
        return {
            "weights": reference.weights("adam", epochs=None, max_steps=5, **options),
            "resumed": reference.weights("adam", epochs=None, max_steps=12, **options),
        }
    if scenario == "checkpoint":
        return {
            "weights": reference.weights("adam", shuffle=True, epochs=1, **options),
            "resumed": reference.weights("adam", shuffle=True, epochs=3, **options),
        }
    if scenario == "checkpoint_in_step":
        weights = reference.weights("sgd", **two_epochs)
        return {"weights": weights, "resumed": weights}
    if scenario == "accumulate":
        return {"weights": reference.weights("sgd", accumulate=ACCUMULATE, **two_epochs)}
    if scenario == "clip":
        norm = ("norm", CLIP_NORM)
        return {
            "norm": reference.weights("sgd", accumulate=CLIP_ACCUMULATE, clip=norm, **two_epochs),
            "value": reference.weights("sgd", clip=("value", CLIP_VALUE), **two_epochs),
        }
    if scenario == "step_scheduler":
        return {"weights": reference.weights("step_lr", **two_epochs)}
    if scenario == "early_stop":  # one epoch: the last rank's stop ends every rank's fit
        return {"weights": reference.weights("sgd", epochs=1, **options)}
    raise KeyError(scenario)


def fit_ends(job: JobOutput, scenario: str) -> dict[int, dict[str, Any]]:
    """``{rank: event}``: the ``fit_end`` each training process of ``scenario``'s one fit
    traced (:class:`~cardcage.testing.models.RecordFitEnd`), exactly one on each rank
    0 .. world size - 1."""
    world = job.launch.world_size
    events = [
        e
        for trace in job.traces().values()
        for e in trace
        if e["event"] == "fit_end" and e["scenario"] == scenario
    ]
    ranks = sorted(e["rank"] for e in events)
    assert ranks == list(range(world)), (
        f"{scenario}: the training processes' fits ended on ranks {ranks}, not once on each "
        f"rank 0 .. {world - 1}\n{job.output}"
    )
    return {e["rank"]: e for e in events}


def assert_where_ranks_ended(job: JobOutput, scenario: str, batch: int) -> None:
    """Where each rank's fit ended, for the scenarios that trace it: ``accumulate``, every
    rank at the plain loop's number of optimizer steps; ``step_scheduler``, every rank at the
    plain loop's learning rate after its last step; ``early_stop``, every rank at the steps
    of exactly one epoch and at ``current_epoch`` 1 (one epoch done), though only the last
    rank asked to stop. What the job's scripts report after fit (the caller of spawned
    workers included) must say the same."""
    world = job.launch.world_size
    options: dict[str, Any] = {"batch": batch, "world": world}
    if scenario == "accumulate":
        kind, epochs = "sgd", {"accumulate": ACCUMULATE, "epochs": 2}
    elif scenario == "step_scheduler":
        kind, epochs = "step_lr", {"epochs": 2}
    elif scenario == "early_stop":
        kind, epochs = "sgd", {"epochs": 1}
    else:
        return
    ended = fit_ends(job, scenario)
    seen = {f"rank {r}": e for r, e in ended.items()}
    seen |= {f"rank {r} after fit": e for r, e in job.results(scenario).items()}
    steps = {where: e["global_step"] for where, e in seen.items()}
    wanted = reference.steps(kind, **epochs, **options)
    assert set(steps.values()) == {wanted}, (
        f"{scenario}: the fits ended at global_step {steps}, not all at the plain loop's "
        f"{wanted} optimizer steps"
    )
    if scenario == "step_scheduler":  # the same float arithmetic: no weight tolerance
        lrs = reference.learning_rates(kind, **epochs, **options)
        for rank, event in ended.items():
            assert len(event["lrs"]) == len(lrs) and all(
                math.isclose(a, b, rel_tol=1e-9) for a, b in zip(event["lrs"], lrs, strict=True)
            ), (
                f"{scenario}: rank {rank}'s learning rates after fit are {event['lrs']}, not "
                f"the plain loop's {lrs} (its scheduler stepped after each of {wanted} "
                "optimizer steps)"
            )
    if scenario == "early_stop":
        current = {where: e["current_epoch"] for where, e in seen.items()}
        assert set(current.values()) == {1}, (
            f"{scenario}: the last rank asked to stop after epoch 0 of {EARLY_STOP_EPOCHS}, "
            f"yet the fits ended at current_epoch {current}, not all at 1 (one epoch done)"
        )


#: What each checkpoint of the job holds: its scenario, and the plain loop that reaches it.
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "after_fit.ckpt": ("checkpoint", {"kind": "adam", "shuffle": True, "epochs": 1}),
    "max_steps.ckpt": ("max_steps", {"kind": "adam", "epochs": None, "max_steps": 5}),
    "in_step.ckpt": ("checkpoint_in_step", {"kind": "sgd", "epochs": 2, "max_steps": IN_STEP}),
}

#: What a training process traces of each fit, in this order (other events, such as a
#: scenario's ``fit_end``, are no part of the lifecycle).
PROCESS_LIFECYCLE = ("setup_process", "configure_optimizers", "teardown")


@dataclasses.dataclass(frozen=True)
class TracedFit:
    """One training process's part of one ``fit``, as the tracer saw it."""

    where: str  # "pid/thread"
    scenario: str
    rank: int
    kind: str | None  # the KitModel's optimizers: sgd, adam or two
    state_held: int | None  # elements of optimizer state it held at teardown


def traced_fits(
    traces: Mapping[str, list[dict[str, Any]]], scenarios: list[str], world: int
) -> list[TracedFit]:
    """Every training process's fits in ``scenarios``, once the trace shows the lifecycle
    kept: in each process, ``setup`` then ``train`` once per fit of the scenario, or neither
    (a spawned worker); ``setup_process``, ``configure_optimizers``, ``teardown`` in that
    order for each fit it trained; and on each rank 0 .. world - 1 exactly one such run per
    fit of the scenario (a process that reports nothing is a missing rank).
    ``configure_optimizers`` called by a caller to check a checkpoint before it trains
    does not count."""
    found: list[TracedFit] = []
    for scenario in scenarios:
        fits = FITS[scenario]
        callers = 0
        for where, all_events in traces.items():
            events = [
                e
                for e in all_events
                if e["scenario"] == scenario
                and (e["event"] != "configure_optimizers" or e.get("training", True))
            ]
            names = [e["event"] for e in events]
            caller = [n for n in names if n in ("setup", "train")]
            assert caller in ([], ["setup", "train"] * fits), (
                f"{scenario}: process/thread {where} traced {names}: a caller runs setup then "
                f"train once per fit ({fits} here)"
            )
            callers += bool(caller)
            own = [e for e in events if e["event"] in PROCESS_LIFECYCLE]
            for at in range(0, len(own), 3):
                triple = own[at : at + 3]
                assert [e["event"] for e in triple] == list(PROCESS_LIFECYCLE) and (
                    triple[0]["rank"] == triple[2]["rank"]
                ), (
                    f"{scenario}: process/thread {where} traced {names}: each fit it trains "
                    "runs setup_process, configure_optimizers and teardown, in that order"
                )
                start, optimizers, end = triple
                found.append(
                    TracedFit(
                        where,
                        scenario,
                        start["rank"],
                        optimizers.get("kind"),
                        end.get("state_held"),
                    )
                )
        assert callers, f"{scenario}: no process traced setup and train"
        ranks = sorted(f.rank for f in found if f.scenario == scenario)
        wanted = sorted(list(range(world)) * fits)
        assert ranks == wanted, (
            f"{scenario}: training processes traced their fits on ranks {ranks}, not on each "
            f"rank 0 .. {world - 1} once per fit ({fits}): every training process reports "
            "setup_process, configure_optimizers and teardown"
        )
    return found


def assert_optimizer_state_covers(name: str, state: dict[str, Any]) -> None:
    """Each optimizer state of the checkpoint ``name`` covers every parameter of the kit's
    model (one optimizer over all of them): each listed parameter has a state entry, and
    each per-parameter tensor in it (any that is not a scalar) has the parameter's full
    shape, not one rank's shard."""
    shapes = [tuple(p.shape) for p in make_net(0).parameters()]
    optimizers = state["optimizers"]
    assert len(optimizers) == 1, f"{name}: {len(optimizers)} optimizer states, not 1"
    for saved in optimizers:
        indices = [i for group in saved["param_groups"] for i in group["params"]]
        assert len(indices) == len(shapes), (
            f"{name}: the optimizer's param_groups list {len(indices)} parameters, not the "
            f"model's {len(shapes)}"
        )
        for position, index in enumerate(indices):
            entry = saved["state"].get(index)
            assert entry, f"{name}: no optimizer state for parameter {index}"
            tensors = {
                key: tuple(value.shape)
                for key, value in entry.items()
                if isinstance(value, torch.Tensor) and value.dim() > 0
            }
            assert tensors, f"{name}: parameter {index}'s optimizer state holds no tensor"
            for key, shape in tensors.items():
                assert shape == shapes[position], (
                    f"{name}: optimizer state {key!r} of parameter {index} has shape {shape}, "
                    f"not the parameter's {shapes[position]}: one rank's shard?"
                )


def assert_checkpoint_holds_its_step(
    name: str, state: dict[str, Any], world: int, batch: int, close: Any
) -> None:
    """The checkpoint ``name`` records the step it was written at, and its weights are the
    plain loop's after that many steps (not those of the end of fit)."""
    _, options = CHECKPOINTS[name]
    model = make_net(0)
    steps = reference.train(model, batch=batch, world=world, **options)
    assert state["global_step"] == steps, (
        f"{name} records global_step {state['global_step']}, but it was saved after {steps} steps"
    )
    saved = state["state_dict"]
    weights = [
        float(v) for key, _ in model.named_parameters() for v in saved[f"net.{key}"].reshape(-1)
    ]
    close(weights, flat(model), f"{name} (its weights at global_step {steps})")


class TrainingChecks(SuiteBase):
    """Training equivalence, lifecycle, what fit leaves, checkpoints, failures."""

    @classmethod
    def job_scenarios(cls) -> list[str]:
        """The scenarios of the kit's job for each launch, in order: those not skipped."""
        return [s for s in SCENARIOS if s not in cls.skip]

    @pytest.fixture(scope="class")
    @classmethod
    def kit_job(cls, launch: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobOutput]:
        """The kit's job for ``launch``, run once for every check of this class."""
        cls.need_training()
        declared = cls.launches[launch]
        harness = Harness(tmp_path_factory.mktemp(f"kit-{cls.backend}-{launch}"))
        try:
            yield run_job(
                harness, declared, cls.job_scenarios(), harness.root / "out", cls.batch_size
            )
        finally:
            left = harness.cleanup()
            assert not left, f"processes left behind: {left}"

    def assert_backend_trained(self, job: JobOutput) -> None:
        """Every training process of the launch ran this suite's backend (or another backend
        of its plugin, such as a spawn variant); with no backend named, one of that backend's
        rules chose it. A launch that trains another backend proves nothing about this one."""
        processes = [
            e for events in job.traces().values() for e in events if e["event"] == "setup_process"
        ]
        assert processes, f"no training process was traced\n{job.output}"
        self.assert_processes_ran_backend(job, processes)

    def assert_processes_ran_backend(self, job: JobOutput, processes: list[dict[str, Any]]) -> None:
        """Each of ``processes`` (``accelerator``, ``rule``, ``rank`` and ``scenario`` of a
        training process) ran this suite's backend, as :meth:`assert_backend_trained` says."""
        registry = plugins.registry({"CARDCAGE_PLUGINS_AUTOLOAD": "1"})
        own = registry.canonical(self.backend) or self.backend
        for event in processes:
            trained = event["accelerator"]
            found = registry.accelerators.get(trained)
            ours = trained == own or (found is not None and found.plugin == self.entry_point())
            assert ours, (
                f"the suite tests {self.backend!r} but its launch {job.launch.flags} trained "
                f"{trained!r} (rank {event['rank']}, scenario {event['scenario']}): name "
                f"{self.backend!r} in the launch's flags"
            )
            if "distributed_backend" not in job.launch.flags and found is not None:
                rules = {rule_name(rule, found.cls) for rule in found.cls.rules}
                assert event["rule"] in rules, (
                    f"the suite tests {self.backend!r}, whose launch names no backend, but "
                    f"rule {event['rule']!r} chose {trained!r}, not one of {sorted(rules)}"
                )

    def test_trains_like_a_plain_loop(self, kit_job: JobOutput, scenario: str) -> None:
        """Every rank's weights equal a plain loop's at batch = world size x per-process
        batch, from rank 0's initial weights (each rank builds its model from its own seed:
        the backend must start them all from rank 0's)."""
        self.skip_unsupported(scenario)
        self.assert_backend_trained(kit_job)
        results = kit_job.results(scenario)
        wanted = expected(scenario, kit_job.launch.world_size, self.batch_size)
        for rank, result in results.items():
            for key, weights in wanted.items():
                self.close(result[key], weights, f"{scenario} ({key}, rank {rank})")
        assert_where_ranks_ended(kit_job, scenario, self.batch_size)

    def test_lifecycle(self, kit_job: JobOutput) -> None:
        """In every scenario that ran: setup then train once per fit in each caller; in
        each training process, setup_process, configure_optimizers and teardown, in that
        order, once per fit it trains; and a run of them on every rank for every fit."""
        self.assert_backend_trained(kit_job)
        traces = kit_job.traces()
        assert traces, f"nothing was traced\n{kit_job.output}"
        scenarios = [s for s in SCENARIOS if s not in self.skip]
        traced_fits(traces, scenarios, kit_job.launch.world_size)

    def test_shards_the_optimizer_state(self, kit_job: JobOutput) -> None:
        """With ``sharded_optimizer_state``: after every fit, each training process holds
        less than the whole per-parameter optimizer state, and all of them together at
        least the whole."""
        if not self.sharded_optimizer_state:
            pytest.skip("the suite does not declare sharded_optimizer_state")
        self.assert_backend_trained(kit_job)
        scenarios = [s for s in SCENARIOS if s not in self.skip]
        fits = traced_fits(kit_job.traces(), scenarios, kit_job.launch.world_size)
        totals: dict[str, tuple[int, int]] = {}  # scenario: (held by all ranks, whole)
        for fit in fits:
            assert fit.kind is not None and fit.state_held is not None, (
                f"{fit.scenario}: rank {fit.rank} traced no optimizer state\n{kit_job.output}"
            )
            whole = reference.state_elements(fit.kind)
            assert fit.state_held < whole, (
                f"{fit.scenario}: rank {fit.rank} holds {fit.state_held} elements of "
                f"optimizer state after a fit, the whole {whole}: the state is not sharded"
            )
            held, _ = totals.get(fit.scenario, (0, whole))
            totals[fit.scenario] = (held + fit.state_held, whole)
        for scenario, (held, whole) in totals.items():
            assert held >= whole * FITS[scenario], (
                f"{scenario}: the ranks hold {held} elements of optimizer state over "
                f"{FITS[scenario]} fit(s), less than the whole {whole} each time"
            )

    def test_what_fit_leaves(self, kit_job: JobOutput) -> None:
        """The user's model keeps its class and plain tensors; validate/test after fit and
        validation during fit (reduced across ranks) agree with the plain loop's metrics."""
        self.skip_unsupported("sgd")
        result = kit_job.result("sgd")
        assert result["class"] == "KitModel"
        self.assert_backend_trained(kit_job)
        assert result["plain_tensors"], "the model's parameters are not plain tensors after fit"
        metrics = reference.metrics(result["weights"])
        for key, value in (("val_loss", result["val_loss"]), ("validate", result["validate"])):
            assert value is not None and abs(value - metrics["val_loss"]) < 1e-4, (key, value)
        assert abs(result["test"] - metrics["test_loss"]) < 1e-4, result["test"]

    def test_checkpoints_load_with_weights_only(self, kit_job: JobOutput) -> None:
        """The checkpoints load with ``weights_only=True`` and hold the full model, an
        optimizer state for every parameter at its full shape, the step they were written
        at and the plain loop's weights at that step."""
        self.skip_unsupported("checkpoint", "max_steps")
        self.assert_backend_trained(kit_job)
        shapes = {k: tuple(v.shape) for k, v in make_net(0).state_dict().items()}
        world = kit_job.launch.world_size
        for name, (scenario, _) in CHECKPOINTS.items():
            if scenario in self.skip:
                continue
            path = Path(kit_job.out / name)
            assert path.exists(), f"{name} was not written\n{kit_job.output}"
            state = torch.load(path, weights_only=True)
            saved = {k.removeprefix("net."): tuple(v.shape) for k, v in state["state_dict"].items()}
            assert saved == shapes, f"{name} holds {saved}, not the full model"
            assert_optimizer_state_covers(name, state)
            assert_checkpoint_holds_its_step(name, state, world, self.batch_size, self.close)

    def test_resumes_on_another_world_size(self, tmp_path: Path) -> None:
        """For each of ``resume_world_sizes``: one epoch at the first launch's world size,
        saved; two more resumed from it at the second's; both equal the plain loop that
        changes world size there."""
        if not self.resume_world_sizes:
            pytest.skip("the suite declares no resume_world_sizes")
        self.need_training()
        for name, (saves, resumes) in self.resume_world_sizes.items():
            assert saves.world_size != resumes.world_size, (
                f"resume_world_sizes[{name!r}]: both launches have world size {saves.world_size}"
            )
            options: dict[str, Any] = {"batch": self.batch_size, "world": saves.world_size}
            harness = Harness(tmp_path / name)
            try:
                first = run_job(
                    harness, saves, ["resize_save"], harness.root / "save", self.batch_size
                )
                self.assert_backend_trained(first)
                traced_fits(first.traces(), ["resize_save"], saves.world_size)
                wanted = reference.weights("adam", epochs=1, **options)
                self.close(first.result("resize_save")["weights"], wanted, f"{name} (saved)")
                checkpoint = first.out / RESIZE_CHECKPOINT
                assert checkpoint.exists(), f"{checkpoint.name} was not written\n{first.output}"
                then = dataclasses.replace(resumes, env={**resumes.env, RESUME: str(checkpoint)})
                out = harness.root / "resume"
                second = run_job(harness, then, ["resize_resume"], out, self.batch_size)
                self.assert_backend_trained(second)
                traced_fits(second.traces(), ["resize_resume"], resumes.world_size)
                wanted = reference.weights(
                    "adam", epochs=3, resize=(1, resumes.world_size), **options
                )
                self.close(
                    second.result("resize_resume")["resumed"],
                    wanted,
                    f"{name} (resumed at world size {resumes.world_size} from {saves.world_size})",
                )
                harness.assert_no_leftovers()
            finally:
                harness.cleanup()

    def bf16_launch(self) -> Launch:
        """The launch the bf16 check runs: the first that spawns several processes (what a
        spawning backend sends its workers is pickled), else the first of several, else the
        first; at ``precision='bf16'``."""
        declared = list(self.launches.values())
        several = [launch for launch in declared if launch.world_size > 1]
        spawned = [
            launch
            for launch in several
            if launch.command == "python"
            and "spawn" in str(launch.flags.get("distributed_backend"))
        ]
        chosen = (spawned or several or declared)[0]
        return dataclasses.replace(chosen, flags={**chosen.flags, "precision": "bf16"})

    def test_trains_at_bf16(self, tmp_path: Path) -> None:
        """At ``precision='bf16'`` the Trainer's fit and the Cage's loop train in every
        process of one launch (:meth:`bf16_launch`), under bf16 autocast: each rank's
        weights are near the plain 32-bit loop's (within 0.05) but not equal to them."""
        self.need_training()
        self.skip_unsupported("bf16", "adam_shuffled", "cage_sgd")
        launch = self.bf16_launch()
        harness = Harness(tmp_path)
        try:
            job = run_job(
                harness, launch, ["adam_shuffled", "cage_sgd"], tmp_path / "out", self.batch_size
            )
            self.assert_backend_trained(job)
            options: dict[str, Any] = {"batch": self.batch_size, "world": launch.world_size}
            trained = {
                "adam_shuffled (Trainer)": (
                    job.result("adam_shuffled")["weights"],
                    reference.weights("adam", shuffle=True, epochs=2, **options),
                )
            }
            sgd = reference.weights("sgd", epochs=2, **options)
            for rank, result in job.results("cage_sgd", every_rank=True).items():
                trained[f"cage_sgd (Cage, rank {rank})"] = (result["sgd"], sgd)
            for what, (weights, full) in trained.items():
                worst = max(abs(a - b) for a, b in zip(weights, full, strict=True))
                assert 0 < worst <= 0.05, (
                    f"{what} at bf16 differs from the 32-bit plain loop by {worst:.3g}: "
                    f"{'not under autocast' if worst == 0 else 'more than 0.05'}\n{job.output}"
                )
            harness.assert_no_leftovers()
        finally:
            harness.cleanup()

    def test_a_failing_rank_is_named(self, launch: str, tmp_path: Path) -> None:
        declared: Launch = self.launches[launch]
        if declared.world_size < 2:
            pytest.skip("one training process: no other rank to stop")
        self.need_training()
        self.skip_unsupported("fail")
        harness = Harness(tmp_path)
        try:
            output = run_job(harness, declared, ["fail"], tmp_path / "out", self.batch_size)
            assert output.returncode != 0, output.output
            self.assert_backend_trained(output)
            # the whole output: a long traceback of another rank may follow the failing one's
            full = "".join(run.stdout + run.stderr for run in harness.runs)
            assert "injected failure on rank 1" in full, output.output
            if declared.command == "python":  # cardcage launched the workers: it names them
                assert "RankFailedError: rank 1 " in output.output, output.output
            harness.assert_no_leftovers()
        finally:
            harness.cleanup()

    def test_different_metric_names_are_refused_by_name(self, launch: str, tmp_path: Path) -> None:
        """Rank 1's validation_step returns ``zzz`` where rank 0's returns ``loss``: the job
        fails with a MisconfigurationError naming both, within 30 s of the first validation
        batch (before, rank 1's value was added into rank 0's ``val_loss``, or a rank waited
        for the others until ``CARDCAGE_TIMEOUT``)."""
        declared: Launch = self.launches[launch]
        if declared.world_size < 2:
            pytest.skip("one training process: no other rank to disagree with")
        self.need_training()
        self.skip_unsupported("metric_names")
        harness = Harness(tmp_path)
        try:
            output = run_job(harness, declared, ["metric_names"], tmp_path / "out", self.batch_size)
            ended = time.time()
            assert output.returncode != 0, output.output
            self.assert_backend_trained(output)
            full = "".join(run.stdout + run.stderr for run in harness.runs)
            for said in ("MisconfigurationError", "'val_loss (returned)'", "'val_zzz (returned)'"):
                assert said in full, f"{said!r} not in the job's output\n{output.output}"
            reached = [
                e["at"]
                for events in output.traces().values()
                for e in events
                if e["event"] == "metric_names_reached"
            ]
            assert reached, f"no rank reached validation\n{output.output}"
            assert ended - min(reached) < 30, (
                f"refused {ended - min(reached):.0f}s after the first validation batch, not "
                "within 30 s"
            )
            harness.assert_no_leftovers()
        finally:
            harness.cleanup()

    def test_leaves_no_process_or_folder(self, kit_job: JobOutput) -> None:
        assert kit_job.returncode == 0, kit_job.output
        self.assert_backend_trained(kit_job)
        kit_job.harness.assert_no_leftovers()
