"""The suite's own-loop checks: the kit's trainings written as a user's own loop through
:class:`cardcage.Cage` (:mod:`cardcage.testing.own_loop`), run in the same job as the
Trainer's scenarios (one more ``launch`` per job), and a failing rank in a job of its own."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from cardcage.testing import reference
from cardcage.testing.harness import Harness
from cardcage.testing.models import flat, make_net
from cardcage.testing.own_loop import (
    ACCUMULATE,
    CLIP_ACCUMULATE,
    CLIP_NORM,
    CLIP_VALUE,
    COLLECTIVES,
    FAIL,
    FAILURE,
    LAUNCH,
    RESUME_CHECKPOINT,
    SCALE,
    TRAINING,
)
from cardcage.testing.suite import JobOutput, Launch, run_job
from cardcage.testing.training_checks import TrainingChecks, assert_optimizer_state_covers


def expected_own_loop(scenario: str, world: int, batch: int) -> dict[str, list[float]]:
    """The plain loop's weights for what an own-loop scenario reports, at batch = world x
    per-process ``batch``."""
    options: dict[str, Any] = {"batch": batch, "world": world}
    two_epochs = {**options, "epochs": 2}
    if scenario == "cage_sgd":
        by_norm = ("norm", CLIP_NORM)
        return {
            "sgd": reference.weights("sgd", **two_epochs),
            "adam_shuffled": reference.weights("adam", shuffle=True, **two_epochs),
            "clip_norm": reference.weights(
                "sgd", accumulate=CLIP_ACCUMULATE, clip=by_norm, **two_epochs
            ),
            "clip_value": reference.weights("sgd", clip=("value", CLIP_VALUE), **two_epochs),
        }
    if scenario == "cage_accumulate":
        return {"weights": reference.weights("sgd", accumulate=ACCUMULATE, **two_epochs)}
    if scenario == "cage_resume":
        return {
            "weights": reference.weights("adam", shuffle=True, epochs=1, **options),
            "resumed": reference.weights("adam", shuffle=True, epochs=3, **options),
        }
    raise KeyError(scenario)


def launch_records(job: JobOutput) -> dict[int, dict[str, Any]]:
    """``{rank: record}`` that the own-loop function wrote when it started in each training
    process (with ``returned`` once it finished)."""
    records: dict[int, dict[str, Any]] = {}
    for path in sorted(job.out.glob(f"{LAUNCH}-rank*.json")):
        record = json.loads(path.read_text())
        assert record["rank"] not in records, (
            f"two training processes ran cage.launch's function as rank {record['rank']}"
        )
        records[record["rank"]] = record
    return records


class OwnLoopChecks(TrainingChecks):
    """A user's own loop through :class:`cardcage.Cage` on this backend: parity with the
    plain loop, ``no_backward_sync`` accumulation, ``save``/``load``, collectives, what
    ``launch`` returns, a failing rank."""

    @classmethod
    def job_scenarios(cls) -> list[str]:
        own = [s for s in (*TRAINING, COLLECTIVES) if s not in cls.skip]
        return [*super().job_scenarios(), *own]

    def assert_own_loop_launched(self, job: JobOutput, finished: bool = True) -> None:
        """``cage.launch`` ran its function once on each rank 0 .. world size - 1, each on
        this suite's backend (as :meth:`assert_backend_trained` says) and knowing the world
        size; ``finished``: each returned, and every process that called ``launch`` got
        rank 0's return value (where the kit started every rank's script itself, each of
        them called it)."""
        records = launch_records(job)
        world = job.launch.world_size
        assert sorted(records) == list(range(world)), (
            f"cage.launch ran its function on ranks {sorted(records)}, not once on each rank "
            f"0 .. {world - 1}\n{job.output}"
        )
        sizes = {rank: record["world"] for rank, record in records.items()}
        assert set(sizes.values()) == {world}, f"cage.world_size on each rank: {sizes}"
        self.assert_processes_ran_backend(
            job, [{**record, "scenario": LAUNCH} for record in records.values()]
        )
        if not finished:
            return
        assert job.returncode == 0, f"the job exited {job.returncode}\n{job.output}"
        unfinished = [rank for rank, record in records.items() if "returned" not in record]
        assert not unfinished, f"cage.launch's function did not return on ranks {unfinished}"
        wanted = records[0]["returned"]
        returned = [
            json.loads(path.read_text())
            for path in sorted(job.out.glob(f"{LAUNCH}-returned-*.json"))
        ]
        assert returned, f"no process that called cage.launch got back from it\n{job.output}"
        if job.launch.command != "python":
            assert len(returned) == world, (
                f"{len(returned)} of the {world} processes the kit started returned from "
                "cage.launch"
            )
        for got in returned:
            assert got["value"] == wanted, (
                f"cage.launch returned {got['value']} in process {got['pid']}, not rank 0's "
                f"return value {wanted}"
            )

    def test_own_loop_trains_like_a_plain_loop(self, kit_job: JobOutput, own_loop: str) -> None:
        """Every rank's weights, trained by a plain PyTorch loop written with the Cage's
        calls, equal the plain loop's at batch = world size x per-process batch (each rank
        built its net from its own seed: setup must start them all from rank 0's).
        ``cage_sgd``: also the norm ``clip_gradients(max_norm=...)`` returned at the first
        step is the plain loop's whole gradient's, before clipping. ``cage_accumulate``:
        every rank took the plain loop's number of optimizer steps, and a backward inside
        ``no_backward_sync`` left each rank its own gradients (where they are plain tensors
        of several ranks). ``cage_resume``: ``load`` returned the other entries saved."""
        self.skip_unsupported(own_loop)
        self.assert_own_loop_launched(kit_job)
        world = kit_job.launch.world_size
        options: dict[str, Any] = {"batch": self.batch_size, "world": world}
        results = kit_job.results(own_loop, every_rank=True)
        wanted = expected_own_loop(own_loop, world, self.batch_size)
        for rank, result in results.items():
            for key, weights in wanted.items():
                self.close(result[key], weights, f"{own_loop} ({key}, rank {rank})")
        if own_loop == "cage_sgd":
            norm = reference.first_gradient_norm(accumulate=CLIP_ACCUMULATE, **options)
            for rank, result in results.items():
                got = result["first_norm"]
                assert got is not None and abs(got - norm) <= self.tolerance * max(1.0, norm), (
                    f"{own_loop}: cage.clip_gradients(max_norm={CLIP_NORM}) returned {got} at "
                    f"the first step on rank {rank}, not the whole gradient's norm {norm}"
                )
        if own_loop == "cage_accumulate":
            steps = reference.steps("sgd", accumulate=ACCUMULATE, epochs=2, **options)
            taken = {rank: result["steps"] for rank, result in results.items()}
            assert set(taken.values()) == {steps}, (
                f"{own_loop}: the ranks took {taken} optimizer steps, not the plain loop's {steps}"
            )
            synced = [r for r, result in results.items() if result["local_gradients"] is False]
            assert not synced, (
                f"{own_loop}: after a backward inside cage.no_backward_sync, every rank held the "
                f"same gradients (seen on ranks {synced}): that backward communicated"
            )
        if own_loop == "cage_resume":
            for rank, result in results.items():
                assert result["rest"] == ["epoch", "rng", "scheduler"] and result["epoch"] == 1, (
                    f"{own_loop}: cage.load returned {result['rest']} (epoch "
                    f"{result['epoch']}) on rank {rank}, not the epoch 1, random state and "
                    "scheduler state saved"
                )

    def test_own_loop_checkpoint_loads_with_weights_only(self, kit_job: JobOutput) -> None:
        """What ``cage.save`` wrote loads with ``weights_only=True``: the model as the user's
        net's own ``state_dict`` (its keys, no wrapper prefix, full shapes) with the plain
        loop's weights after one epoch, the optimizer's state for every parameter at its full
        shape, and the plain entries (epoch, the scheduler's and the random state) as given."""
        self.skip_unsupported("cage_resume")
        self.assert_own_loop_launched(kit_job)
        path = Path(kit_job.out / RESUME_CHECKPOINT)
        assert path.exists(), f"{path.name} was not written\n{kit_job.output}"
        state = torch.load(path, weights_only=True)
        assert sorted(state) == ["epoch", "model", "optimizer", "rng", "scheduler"], sorted(state)
        net = make_net(0)
        shapes = {key: tuple(value.shape) for key, value in net.state_dict().items()}
        saved = {key: tuple(value.shape) for key, value in state["model"].items()}
        assert saved == shapes, (
            f"{path.name} holds the model as {saved}, not as the net's own state_dict {shapes}"
        )
        assert_optimizer_state_covers(path.name, {"optimizers": [state["optimizer"]]})
        assert state["epoch"] == 1 and state["scheduler"]["last_epoch"] == 1, (
            state["epoch"],
            state["scheduler"],
        )
        rng = state["rng"]
        assert isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8, rng
        options = {"batch": self.batch_size, "world": kit_job.launch.world_size}
        reference.train(net, "adam", shuffle=True, epochs=1, **options)
        weights = [
            float(v) for key, _ in net.named_parameters() for v in state["model"][key].reshape(-1)
        ]
        self.close(weights, flat(net), f"{path.name} (its weights after one epoch)")

    def test_own_loop_collectives(self, kit_job: JobOutput) -> None:
        """On every rank, for each rank's tensor ``[r + 1, SCALE * (r + 1)]``: ``all_reduce``
        gives their mean and their sum (as new tensors: the rank's own is unchanged),
        ``all_gather`` every rank's, stacked in rank order (shape ``(world, 2)``), and
        ``broadcast`` from rank 1 (rank 0 with one process) rank 1's dict."""
        self.skip_unsupported(COLLECTIVES)
        self.assert_own_loop_launched(kit_job)
        world = kit_job.launch.world_size
        each = [[r + 1.0, SCALE * (r + 1)] for r in range(world)]
        total = [sum(values[i] for values in each) for i in range(2)]
        src = 1 if world > 1 else 0
        for rank, result in kit_job.results(COLLECTIVES, every_rank=True).items():
            wanted: dict[str, Any] = {
                "mean": [value / world for value in total],
                "sum": total,
                "gathered": each,
                "mine": each[rank],
            }
            for key, value in wanted.items():
                got = result[key]
                same = _same_numbers(got, value)
                assert same, f"{COLLECTIVES}: rank {rank}'s {key} is {got}, not {value}"
            sent = {"from": src, "items": [src] * 3}
            assert result["broadcast"] == sent, (
                f"{COLLECTIVES}: rank {rank} got {result['broadcast']} from "
                f"cage.broadcast(..., src={src}), not rank {src}'s {sent}"
            )

    def test_own_loop_failing_rank_is_named(self, launch: str, tmp_path: Path) -> None:
        """Rank 1 of a Cage's function raises at its second step: the job fails, its output
        says why and, where cardcage started the workers, names rank 1 in a
        ``RankFailedError``; no process or temporary folder is left."""
        declared: Launch = self.launches[launch]
        if declared.world_size < 2:
            pytest.skip("one training process: no other rank to stop")
        self.need_training()
        self.skip_unsupported(FAIL)
        harness = Harness(tmp_path)
        try:
            output = run_job(harness, declared, [FAIL], tmp_path / "out", self.batch_size)
            assert output.returncode != 0, output.output
            self.assert_own_loop_launched(output, finished=False)
            full = "".join(run.stdout + run.stderr for run in harness.runs)
            assert FAILURE in full, output.output
            if declared.command == "python":  # cardcage launched the workers: it names them
                assert "RankFailedError: rank 1 " in output.output, output.output
            harness.assert_no_leftovers()
        finally:
            harness.cleanup()


def _same_numbers(got: Any, wanted: Any) -> bool:
    """Nested lists of numbers equal, each within a relative 1e-6."""
    if isinstance(wanted, list):
        return (
            isinstance(got, list)
            and len(got) == len(wanted)
            and all(_same_numbers(g, w) for g, w in zip(got, wanted, strict=True))
        )
    return isinstance(got, int | float) and math.isclose(got, wanted, rel_tol=1e-6)
