"""Tests of cardcage-fsdp beyond the kit: selection, its settings, real sharding, sharded
checkpoints resumed on 2 and on 1 rank, bf16. They pass with only cardcage-core and this
plugin installed (``nox -s fsdp``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import cardcage_fsdp
import pytest
import torch

from cardcage import MisconfigurationError, Trainer, sdk, select
from cardcage.testing.harness import Harness

ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "fsdp"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
TORCHRUN.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # torchrun sets them
JOB = Path(__file__).with_name("fsdp_job.py")


# -- selection and settings --------------------------------------------------------------------


def test_both_names_come_from_its_entry_point() -> None:
    found = sdk.registry({}).accelerators
    for name in ("fsdp", "fsdp_spawn"):
        assert (found[name].plugin, found[name].distribution) == ("fsdp", "cardcage-fsdp")


def test_it_claims_no_job_unless_named() -> None:
    assert cardcage_fsdp.FSDPAccelerator.rules == ()
    selection = select(env=ALONE, distributed_backend="fsdp", num_processes=2)
    assert (selection.accelerator, selection.num_processes, selection.world_size) == ("fsdp", 2, 2)


def test_spawn_runs_as_fsdp_where_torchrun_made_the_processes() -> None:
    selection = select(env={**ALONE, **TORCHRUN}, distributed_backend="fsdp_spawn")
    assert (selection.accelerator, selection.global_rank) == ("fsdp", 1)
    assert "runs as 'fsdp'" in (selection.warnings[0] if selection.warnings else "")


@pytest.mark.parametrize("value", ["sharded", "full", "FULL", ""])
def test_checkpoint_format_setting(value: str) -> None:
    assert sdk.state_dict_type({"CARDCAGE_FSDP_STATE_DICT": value}) in ("full", "sharded")


def test_a_bad_checkpoint_format_fails_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARDCAGE_FSDP_STATE_DICT", "shards")
    with pytest.raises(MisconfigurationError, match=r"CARDCAGE_FSDP_STATE_DICT='shards'.*'full'"):
        cardcage_fsdp.FSDPAccelerator(
            select(env=ALONE, distributed_backend="fsdp", num_processes=2)
        )


def test_select_refuses_a_bad_checkpoint_format_as_the_trainer_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """select (and so cardcage explain) makes the Trainer's decision: the same refusal."""
    bad = {**ALONE, "CARDCAGE_FSDP_STATE_DICT": "shards"}
    with pytest.raises(MisconfigurationError, match=r"CARDCAGE_FSDP_STATE_DICT='shards'") as one:
        select(env=bad, distributed_backend="fsdp", num_processes=2)
    monkeypatch.setenv("CARDCAGE_FSDP_STATE_DICT", "shards")
    with pytest.raises(MisconfigurationError) as other:
        Trainer(distributed_backend="fsdp", num_processes=2)
    assert str(one.value) == str(other.value)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)


class Model(torch.nn.Module):
    def __init__(self, policy: Any = None) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.act = torch.nn.ReLU()
        self.head = torch.nn.Linear(2, 1)
        if policy is not None:
            self.fsdp_modules = policy


def test_by_default_each_child_with_parameters_is_sharded() -> None:
    model = Model()
    assert sdk.shard_targets(model) == [model.blocks, model.head]


def test_fsdp_modules_names_classes_or_a_predicate_innermost_first() -> None:
    model = Model({Block})
    assert sdk.shard_targets(model) == [model.blocks[1], model.blocks[0]]
    model = Model(lambda m: isinstance(m, torch.nn.Linear))
    assert sdk.shard_targets(model) == [
        model.head,
        model.blocks[1].inner,
        model.blocks[0].inner,
    ]


def test_a_bad_fsdp_modules_names_the_attribute() -> None:
    with pytest.raises(MisconfigurationError, match=r"Model.fsdp_modules=\['blocks'\]"):
        sdk.shard_targets(Model(["blocks"]))


# -- training ------------------------------------------------------------------------------------


def run(harness: Harness, scenario: str, out: Path, processes: int = 2) -> dict[str, Any]:
    harness.start([sys.executable, str(JOB), scenario, str(out), str(processes)]).check()
    result: dict[str, Any] = json.loads((out / f"{scenario}.json").read_text())
    return result


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    harness = Harness(tmp_path_factory.mktemp("fsdp"))
    out = harness.root / "out"
    out.mkdir()
    names = ("sharded", "resume_alone", "reference", "save_alone")
    results = {name: run(harness, name, out) for name in names}
    assert not harness.cleanup(), "processes left behind"
    return results


def close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_each_rank_holds_half_of_every_parameter(jobs: Any) -> None:
    shapes = jobs["sharded"]["local_shapes"]
    full = jobs["sharded"]["full_shapes"]
    assert full == {
        "a.weight": [32, 6],
        "a.bias": [32],
        "b.weight": [2, 32],
        "b.bias": [2],
        "scale": [2],
    }
    for name, shape in full.items():
        assert shapes[name] == [shape[0] // 2, *shape[1:]], name


def test_two_ranks_of_8_reproduce_one_process_of_16(jobs: Any) -> None:
    assert close(jobs["sharded"]["weights"], jobs["reference"]["weights"]) < 1e-5


def test_after_fit_the_model_is_the_users_class_with_plain_tensors(jobs: Any) -> None:
    assert (jobs["sharded"]["class"], jobs["sharded"]["plain"]) == ("Net", True)


def test_the_full_checkpoint_holds_full_shapes_and_adam_state(jobs: Any) -> None:
    assert jobs["sharded"]["adam_steps"] == [4.0] * 5


def test_resume_reaches_the_uninterrupted_weights(jobs: Any) -> None:
    straight = jobs["sharded"]["weights"]
    assert close(jobs["sharded"]["resumed_from_full"], straight) < 1e-6
    assert close(jobs["sharded"]["resumed"], straight) < 1e-6


def test_a_sharded_checkpoint_is_a_folder_of_shards(jobs: Any) -> None:
    shards = jobs["sharded"]["shards"]
    assert ".metadata" in shards and "loop.pt" in shards
    assert sum(name.endswith(".distcp") for name in shards) == 2  # one per rank


def test_a_sharded_checkpoint_of_two_ranks_resumes_on_one(jobs: Any) -> None:
    assert close(jobs["resume_alone"]["resumed"], jobs["sharded"]["weights"]) < 1e-6


@pytest.mark.parametrize("state_dict", ["full", "sharded"])
def test_one_process_saves_after_fit_and_resumes_exactly(jobs: Any, state_dict: str) -> None:
    """A fit of one process trains in the caller, and leaves it without the process group it
    joined; save_checkpoint afterwards still writes the state, and a run resumed from it
    reaches the plain loop's weights."""
    assert close(jobs["save_alone"][state_dict], jobs["reference"]["weights"]) < 1e-5


def test_bf16_trains_with_fp32_weights(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    (tmp_path / "out").mkdir()
    try:
        result = run(harness, "bf16", tmp_path / "out")
    finally:
        assert not harness.cleanup(), "processes left behind"
    assert result["dtypes"] == ["torch.float32"]  # FSDP2 computes in bf16, keeps fp32 masters
    assert all(abs(loss) < 1e3 for loss in result["losses"])  # finite
    # bf16 (8 bits of mantissa) moves the weights a little off the fp32 run, not far.
    assert 1e-6 < close(result["weights"], result["fp32"]) < 5e-2
