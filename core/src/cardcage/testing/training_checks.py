"""The suite's training checks: each launch runs the kit's job once (every scenario, in
order) and the checks read what it left; a failing rank runs in a job of its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cardcage.plugins import manager as plugins
from cardcage.selection.rules import rule_name
from cardcage.testing import reference
from cardcage.testing.harness import Harness
from cardcage.testing.models import UNEVEN_SAMPLES, make_net
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
    raise KeyError(scenario)


class TrainingChecks(SuiteBase):
    """Training equivalence, lifecycle, what fit leaves, checkpoints, failures."""

    @pytest.fixture(scope="class")
    @classmethod
    def kit_job(cls, launch: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobOutput]:
        """The kit's job for ``launch``, run once for every check of this class."""
        cls.need_training()
        declared = cls.launches[launch]
        harness = Harness(tmp_path_factory.mktemp(f"kit-{cls.backend}-{launch}"))
        scenarios = [s for s in SCENARIOS if s not in cls.skip]
        try:
            yield run_job(harness, declared, scenarios, harness.root / "out", cls.batch_size)
        finally:
            left = harness.cleanup()
            assert not left, f"processes left behind: {left}"

    def assert_backend_trained(self, job: JobOutput) -> None:
        """Every training process of the launch ran this suite's backend (or another backend
        of its plugin, such as a spawn variant); with no backend named, one of that backend's
        rules chose it. A launch that trains another backend proves nothing about this one."""
        registry = plugins.registry({"CARDCAGE_PLUGINS_AUTOLOAD": "1"})
        own = registry.canonical(self.backend) or self.backend
        processes = [
            e for events in job.traces().values() for e in events if e["event"] == "setup_process"
        ]
        assert processes, f"no training process was traced\n{job.output}"
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

    def test_lifecycle(self, kit_job: JobOutput) -> None:
        """setup then train once per fit in the caller; in each training process,
        setup_process before configure_optimizers and one teardown."""
        self.assert_backend_trained(kit_job)
        traces = kit_job.traces()
        assert traces, f"nothing was traced\n{kit_job.output}"
        for where, events in traces.items():
            names = [e["event"] for e in events if e["scenario"] == "adam_shuffled"]
            callers = [n for n in names if n in ("setup", "train")]
            assert callers in ([], ["setup", "train"]), f"process/thread {where}: {names}"
            per_process = [n for n in names if n not in ("setup", "train")]
            assert per_process in ([], ["setup_process", "configure_optimizers", "teardown"]), (
                f"process/thread {where}: {names}"
            )
        ranks = sorted(
            e["rank"]
            for events in traces.values()
            for e in events
            if e["scenario"] == "adam_shuffled" and e["event"] == "setup_process"
        )
        assert ranks == list(range(kit_job.launch.world_size)), ranks

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
        self.skip_unsupported("checkpoint", "max_steps")
        self.assert_backend_trained(kit_job)
        shapes = {k: tuple(v.shape) for k, v in make_net(0).state_dict().items()}
        for name in ("after_fit.ckpt", "max_steps.ckpt", "in_step.ckpt"):
            path = Path(kit_job.out / name)
            assert path.exists(), f"{name} was not written\n{kit_job.output}"
            state = torch.load(path, weights_only=True)
            saved = {k.removeprefix("net."): tuple(v.shape) for k, v in state["state_dict"].items()}
            assert saved == shapes, f"{name} holds {saved}, not the full model"
            assert state["optimizers"] and state["optimizers"][0]["state"], f"{name}: no state"

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

    def test_leaves_no_process_or_folder(self, kit_job: JobOutput) -> None:
        assert kit_job.returncode == 0, kit_job.output
        self.assert_backend_trained(kit_job)
        kit_job.harness.assert_no_leftovers()
