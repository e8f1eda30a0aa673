"""The horovod backend's pieces that need no Horovod processes (nor Horovod itself): the
learning-rate switch, parameter naming, the optimizer broadcast, the build helper's cache
and patch, and selection messages."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cardcage_horovod import (
    HorovodAccelerator,
    broadcast_optimizer,
    named_parameters,
    scale_lr_setting,
)

import cardcage
from cardcage import Availability, MisconfigurationError, select
from cardcage.sdk import (
    ClusterEnvironment,
    modules_by_value,
    register_plugin,
    registry,
    unregister_plugin,
)

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "horovod"}
HOROVODRUN = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0"}
# The builder that ships in the package (python -m cardcage_horovod.build), loaded by path as
# the noxfile loads it: a fresh module for each test.
BUILD_HELPER = Path(__file__).parents[1] / "cardcage_horovod" / "build.py"


@pytest.fixture
def with_horovod(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = registry(ALONE).accelerators["horovod"].cls
    monkeypatch.setattr(cls, "availability", classmethod(lambda cls, ctx: Availability(True)))


@pytest.fixture
def gpus(fake_cuda: Callable[[int], None]) -> None:
    fake_cuda(2)


def build_helper() -> Any:
    spec = importlib.util.spec_from_file_location("cardcage_horovod_build", BUILD_HELPER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, True), ("", True), ("1", True), ("true", True), ("0", False), ("off", False)],
)
def test_learning_rate_scaling_is_on_unless_switched_off(value: str | None, expected: bool) -> None:
    env = {} if value is None else {"CARDCAGE_HOROVOD_SCALE_LR": value}
    assert scale_lr_setting(env) is expected


def test_a_subclass_may_switch_scaling_off_and_the_variable_still_wins() -> None:
    assert scale_lr_setting({}, default=False) is False
    assert scale_lr_setting({"CARDCAGE_HOROVOD_SCALE_LR": "1"}, default=False) is True


def test_a_bad_scaling_value_fails_when_the_trainer_is_built(
    with_horovod: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CARDCAGE_HOROVOD_SCALE_LR", "maybe")
    for name, value in ALONE.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MisconfigurationError, match=r"CARDCAGE_HOROVOD_SCALE_LR='maybe'.*1 .* 0"):
        cardcage.Trainer(distributed_backend="horovod", num_processes=2)


def test_sync_batchnorm_on_the_cpu_is_refused_when_the_trainer_is_built(
    with_horovod: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ALONE.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MisconfigurationError, match=r"sync_batchnorm=True .* needs GPUs"):
        cardcage.Trainer(distributed_backend="horovod", sync_batchnorm=True)


def test_parameters_are_named_as_the_model_names_them() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    extra = torch.nn.Parameter(torch.zeros(1))
    second = torch.optim.SGD([*model[1].parameters(), extra], lr=0.1)
    assert [n for n, _ in named_parameters(model, first)] == ["0.weight", "0.bias"]
    names = [n for n, _ in named_parameters(model, second)]
    assert names[:2] == ["1.weight", "1.bias"] and names[2].startswith("unnamed.")


class FakeHorovod:
    """Records the broadcasts; rank 0 holds lr 0.5 and momentum 0.8."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def broadcast_optimizer_state(self, optimizer: Any, root_rank: int) -> None:
        self.calls.append(f"state from {root_rank}")

    def broadcast_object(self, obj: Any, root_rank: int) -> Any:
        self.calls.append(f"object from {root_rank}")
        return [{**group, "lr": 0.5, "momentum": 0.8} for group in obj]


def test_an_optimizer_without_state_gets_rank_0s_hyperparameters_and_no_step() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9, weight_decay=0.1)
    fake = FakeHorovod()
    broadcast_optimizer(fake, optimizer, root_rank=0)
    assert fake.calls == ["object from 0"]
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert optimizer.param_groups[0]["momentum"] == 0.8
    assert torch.equal(weight.detach(), torch.ones(2))  # no zero-gradient step was taken
    assert not optimizer.state


def test_an_optimizer_with_state_is_broadcast_by_horovod() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    weight.grad = torch.ones(2)
    optimizer.step()
    fake = FakeHorovod()
    broadcast_optimizer(fake, optimizer, root_rank=1)
    assert fake.calls == ["state from 1"]


@pytest.mark.parametrize(
    ("flags", "flag"), [({"gpus": 2}, "gpus=2"), ({"num_nodes": 2}, "num_nodes=2")]
)
def test_process_counts_from_flags_are_refused_with_what_to_do(
    with_horovod: None, gpus: None, flags: dict[str, int], flag: str
) -> None:
    with pytest.raises(MisconfigurationError) as error:
        select(env=ALONE, distributed_backend="horovod", **flags)
    message = str(error.value)
    assert f"distributed_backend='horovod' with {flag}:" in message
    assert "Set gpus=1" in message and "num_nodes=1" in message
    assert "horovodrun -np N -H host1:n1,host2:n2 python train.py" in message
    assert "num_processes=N starts N processes without horovodrun" in message


def test_more_processes_than_gpus_is_refused(with_horovod: None, gpus: None) -> None:
    with pytest.raises(MisconfigurationError, match=r"num_processes=3 .* has 2 GPU"):
        select(env=ALONE, distributed_backend="horovod", gpus=1, num_processes=3)


def test_one_gpu_per_process_is_accepted(with_horovod: None, gpus: None) -> None:
    selection = select(env=ALONE, distributed_backend="horovod", gpus=1, num_processes=2)
    assert (selection.accelerator, selection.world_size, selection.gpu_ids) == ("horovod", 2, [0])


def test_num_processes_under_horovodrun_is_ignored_with_a_warning(with_horovod: None) -> None:
    selection = select(env={**ALONE, **HOROVODRUN}, distributed_backend="horovod", num_processes=4)
    assert selection.world_size == 2
    assert any("num_processes=4 is ignored" in w for w in selection.warnings)


def test_named_without_horovodrun_it_starts_num_processes_workers(with_horovod: None) -> None:
    selection = select(env=ALONE, distributed_backend="horovod", num_processes=3)
    assert (selection.cluster, selection.num_processes, selection.world_size) == ("local", 3, 3)


TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "job",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.mark.parametrize("num_processes", [1, 2, 4])
def test_under_torchrun_with_several_processes_it_is_refused_with_what_to_do(
    with_horovod: None, monkeypatch: pytest.MonkeyPatch, num_processes: int
) -> None:
    """Each torchrun process would start horovod.run workers of its own (a Horovod job per
    torchrun rank): refused when the Trainer is built, naming the launchers that work."""
    for name, value in {**ALONE, **TORCHRUN}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MisconfigurationError) as error:
        cardcage.Trainer(distributed_backend="horovod", num_processes=num_processes)
    message = str(error.value)
    assert "distributed_backend='horovod' under torchrun (WORLD_SIZE=2)" in message
    assert "horovodrun -np 2 python train.py" in message
    assert "num_processes=2" in message and "distributed_backend='ddp'" in message


def test_under_a_one_process_torchrun_it_trains_in_place(with_horovod: None) -> None:
    """torchrun with one process: one Horovod process, in the torchrun process itself, even
    when num_processes asks for more (which it warns is ignored)."""
    env = {**ALONE, **TORCHRUN, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    selection = select(env=env, distributed_backend="horovod", num_processes=2)
    assert (selection.cluster, selection.num_processes, selection.world_size) == (
        "torchelastic",
        1,
        1,
    )
    assert any("num_processes=2 is ignored" in w for w in selection.warnings)
    launcher = HorovodAccelerator(selection).make_launcher()
    assert type(launcher).__name__ == "InProcessLauncher"


# srun -n 2: SLURM started two tasks; this is the second.
SLURM_2_TASKS = {
    "SLURM_JOB_ID": "1234567",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "n3",
}


def test_under_slurm_managing_tasks_it_is_refused_with_what_to_do(
    with_horovod: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each srun task would start horovod.run workers of its own (a Horovod job per task):
    refused when the Trainer is built, naming what to run instead."""
    for name, value in {**ALONE, **SLURM_2_TASKS}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MisconfigurationError) as error:
        cardcage.Trainer(distributed_backend="horovod", num_processes=2)
    message = str(error.value)
    assert "distributed_backend='horovod' under SLURM managing tasks (SLURM_NTASKS=2)" in message
    assert "each of the 2 SLURM tasks would start a Horovod job of its own" in message
    assert "`srun -n 1 python train.py` with num_processes=2" in message
    assert "horovodrun -np 2 python train.py" in message and "'ddp'" in message


def test_as_one_slurm_task_it_starts_num_processes_workers(with_horovod: None) -> None:
    """What the refusal suggests: ``srun -n 1`` and num_processes=2 is one Horovod job of two
    processes started by Horovod's runner."""
    env = {**ALONE, **SLURM_2_TASKS, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    selection = select(env=env, distributed_backend="horovod", num_processes=2)
    assert (selection.cluster, selection.world_size) == ("local", 2)
    launcher = HorovodAccelerator(selection).make_launcher()
    assert type(launcher).__name__ == "HorovodRunLauncher"


class Scheduler(ClusterEnvironment):
    """A plugin's scheduler that starts one process per rank, as SLURM does."""

    name = "scheduler"
    order = 250
    creates_processes = True
    variables = ("SCHEDULER_SIZE", "SCHEDULER_RANK")

    @classmethod
    def detect(cls, env: Any, expected_world_size: int) -> bool:
        return "SCHEDULER_SIZE" in env

    def world_size(self) -> int:
        return int(self.env["SCHEDULER_SIZE"])

    def global_rank(self) -> int:
        return int(self.env["SCHEDULER_RANK"])


@pytest.fixture
def scheduler() -> Iterator[None]:
    module = types.ModuleType("cardcage_scheduler")
    module.cardcage_cluster_environments = cardcage.hookimpl(lambda: [Scheduler])  # type: ignore[attr-defined]
    register_plugin(module, "scheduler")
    try:
        yield
    finally:
        unregister_plugin("scheduler")


def test_under_any_cluster_that_started_the_processes_it_is_refused(
    with_horovod: None, scheduler: None
) -> None:
    env = {**ALONE, "CARDCAGE_PLUGINS": "horovod,scheduler", "SCHEDULER_SIZE": "2"}
    with pytest.raises(MisconfigurationError) as error:
        select(env={**env, "SCHEDULER_RANK": "0"}, distributed_backend="horovod")
    message = str(error.value)
    assert "under the cluster environment 'scheduler', which started 2 processes" in message
    assert "horovodrun -np 2 python train.py" in message and "num_processes=2" in message
    # one process started by it trains in place
    selection = select(
        env={**env, "SCHEDULER_SIZE": "1", "SCHEDULER_RANK": "0"}, distributed_backend="horovod"
    )
    assert (selection.cluster, selection.world_size) == ("scheduler", 1)


def test_without_horovod_availability_names_the_build_helper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    availability = HorovodAccelerator.availability(None)  # type: ignore[arg-type]
    assert not availability
    assert "`python -m cardcage_horovod.build --install`" in availability.hint


def test_a_module_horovods_workers_cannot_import_travels_by_value(tmp_path: Path) -> None:
    path = tmp_path / "loose_model.py"
    path.write_text(
        "import torch\nclass Loose(torch.nn.Module):\n    pass\ndef train(cage):\n    pass\n"
    )
    spec = importlib.util.spec_from_file_location("loose_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["loose_model"] = module
    try:
        spec.loader.exec_module(module)

        class Holder:
            """The parts a job pickles: a Trainer's model and loader, or a Cage's fn."""

            def __init__(self, **parts: Any):
                self.parts = parts

            def pickled_parts(self) -> dict[str, Any]:
                return self.parts

        def by_value(**parts: Any) -> list[Any]:
            return modules_by_value(Holder(**parts))  # type: ignore[arg-type]

        loader = [torch.zeros(1)]
        assert by_value(model=module.Loose(), train_dataloader=loader) == [module]
        assert by_value(model=torch.nn.Linear(1, 1), train_dataloader=loader) == []
        assert by_value(fn=module.train, args=[torch.nn.Linear(1, 1)]) == [module]
    finally:
        del sys.modules["loose_model"]


# -- the build helper -------------------------------------------------------------------------


def test_the_cxx17_patch_changes_the_two_cmake_files(tmp_path: Path) -> None:
    helper = build_helper()
    (tmp_path / "horovod/torch").mkdir(parents=True)
    (tmp_path / "CMakeLists.txt").write_text("project(x)\nset(CMAKE_CXX_STANDARD 14)\n")
    (tmp_path / "horovod/torch/CMakeLists.txt").write_text("    set(CMAKE_CXX_STANDARD 14)\n")
    assert helper.patch_cxx17(tmp_path) == list(helper.CXX_FILES)
    assert "set(CMAKE_CXX_STANDARD 17)" in (tmp_path / "CMakeLists.txt").read_text()
    assert helper.patch_cxx17(tmp_path) == []  # a release that needs no patch is left alone


def test_the_cache_is_keyed_by_horovod_and_torch_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    helper = build_helper()
    monkeypatch.setenv("CARDCAGE_CACHE_DIR", str(tmp_path))
    folder = helper.cache_dir("0.28.1", torch.__version__)
    assert folder == tmp_path / "horovod" / f"0.28.1-torch{torch.__version__}"
    tag = helper.python_tag(sys.executable)
    folder.mkdir(parents=True)
    wheel = folder / f"horovod-0.28.1-{tag}-{tag}-linux_x86_64.whl"
    wheel.write_bytes(b"")

    def no_build(*args: object) -> None:
        raise AssertionError("a cached wheel must not be rebuilt")

    monkeypatch.setattr(helper, "build_wheel", no_build)
    assert helper.ensure_wheel(sys.executable, "0.28.1") == wheel
    assert "reusing cached Horovod wheel" in capsys.readouterr().out


def test_the_builder_ships_in_the_package_and_runs_as_the_hint_says() -> None:
    """`python -m cardcage_horovod.build` works wherever the plugin is installed (a wheel
    included): the hint's command needs no repository."""
    assert importlib.util.find_spec("cardcage_horovod.build") is not None
    result = subprocess.run(
        [sys.executable, "-m", "cardcage_horovod.build", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m cardcage_horovod.build")
    assert "--install" in result.stdout
