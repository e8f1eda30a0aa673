"""Which backend `cardcage.select` picks, in which cluster environment, and why.

Every test passes an explicit ``env`` mapping (never ``os.environ``) and fixes the GPU count
through the ``cuda_count_*`` fixtures, which patch the two torch calls selection uses.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cardcage import Availability, MisconfigurationError, Selection, select
from cardcage.environments.slurm import first_slurm_host
from cardcage.plugins import manager as plugins

MULTI_GPU_WARNING = 'Setting distributed_backend="ddp_spawn" for you.'
HOROVOD_MISSING = importlib.util.find_spec("horovod") is None
XLA_MISSING = importlib.util.find_spec("torch_xla") is None

SLURM_4_TASKS = {
    "SLURM_JOB_ID": "1234567",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NODELIST": "n[3-5,7],m1",
}
TORCHRUN_4 = {
    "TORCHELASTIC_RUN_ID": "job-1",
    "WORLD_SIZE": "4",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "29500",
}


def outcomes(selection: Selection) -> dict[str, str]:
    """Rule name -> what it did in this decision."""
    return {entry.rule: entry.outcome for entry in selection.trace}


def entry(selection: Selection, rule: str) -> Any:
    (found,) = [e for e in selection.trace if e.rule == rule]
    return found


def make_available(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Pretend an installed backend's engine (horovod, torch-xla) is present."""
    cls = plugins.registry({}).accelerators[backend].cls
    monkeypatch.setattr(cls, "availability", classmethod(lambda cls, ctx: Availability(True)))


# --- the rule table (docs/choosing-a-backend.md, "The decision in two steps") ------------


def test_1000_cpu_when_nothing_else_claims(cuda_count_0: int) -> None:
    selection = select(env={})
    assert (selection.accelerator, selection.rule, selection.cluster) == (
        "cpu",
        "cpu_fallback",
        "local",
    )
    assert (selection.num_processes, selection.world_size, selection.gpu_ids) == (1, 1, None)
    assert selection.warnings == []


def test_1000_cpu_even_when_gpus_exist_but_none_were_requested(cuda_count_2: int) -> None:
    assert select(env={}).accelerator == "cpu"


def test_600_one_gpu(cuda_count_1: int) -> None:
    selection = select(env={}, gpus=1)
    assert (selection.accelerator, selection.rule) == ("gpu", "single_gpu")
    assert (selection.gpu_ids, selection.root_gpu, selection.num_processes) == ([0], 0, 1)


def test_600_one_gpu_by_id_trains_on_that_gpu(cuda_count_2: int) -> None:
    selection = select(env={}, gpus="1")
    assert (selection.accelerator, selection.gpu_ids, selection.root_gpu) == ("gpu", [1], 1)


def test_500_spawn_for_several_cpu_processes(cuda_count_0: int) -> None:
    selection = select(env={}, num_processes=2)
    assert (selection.accelerator, selection.rule) == ("ddp_spawn", "cpu_processes")
    assert (selection.num_processes, selection.world_size, selection.gpu_ids) == (2, 2, None)
    assert selection.warnings == []


def test_400_spawn_for_several_gpus_with_the_seeds_warning(cuda_count_4: int) -> None:
    selection = select(env={}, gpus=[1, 3])
    assert (selection.accelerator, selection.rule) == ("ddp_spawn", "multi_gpu")
    assert (selection.num_processes, selection.world_size, selection.root_gpu) == (2, 2, 1)
    assert len(selection.warnings) == 1
    assert MULTI_GPU_WARNING in selection.warnings[0]


def test_300_ddp_for_several_cpu_nodes(cuda_count_0: int) -> None:
    # Lightning 1.0 set use_ddp here but matched no accelerator until CPUAccelerator.
    selection = select(env={}, num_nodes=2)
    assert (selection.accelerator, selection.rule) == ("ddp", "multi_node_or_cluster")
    assert (selection.num_processes, selection.num_nodes, selection.world_size) == (1, 2, 2)
    assert (selection.cluster, selection.node_rank, selection.global_rank) == ("local", 0, 0)


def test_300_ddp_for_several_gpu_nodes(cuda_count_2: int) -> None:
    selection = select(env={}, gpus=2, num_nodes=3)
    assert selection.accelerator == "ddp"
    assert (selection.num_processes, selection.world_size) == (2, 6)


def test_300_ddp_when_torchelastic_created_the_processes(cuda_count_0: int) -> None:
    selection = select(env=TORCHRUN_4, num_nodes=2)
    assert (selection.accelerator, selection.cluster) == ("ddp", "torchelastic")
    assert selection.processes_created_outside


def test_300_ddp_when_slurm_created_the_processes(cuda_count_2: int) -> None:
    selection = select(env=SLURM_4_TASKS, gpus=2, num_nodes=2)
    assert (selection.accelerator, selection.cluster) == ("ddp", "slurm")
    assert outcomes(selection)["multi_gpu"] == "not evaluated"  # 300 came first


def test_300_one_process_in_a_one_task_slurm_job_stays_on_the_cpu(cuda_count_0: int) -> None:
    env = {**SLURM_4_TASKS, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    env["SLURM_NODEID"] = "0"
    selection = select(env=env)
    assert (selection.accelerator, selection.cluster, selection.world_size) == ("cpu", "slurm", 1)


@pytest.mark.skipif(not HOROVOD_MISSING, reason="horovod is installed here")
@pytest.mark.parametrize("variable", ["HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"])
def test_100_horovodrun_without_horovod_is_skipped_with_its_reason(
    cuda_count_0: int, variable: str
) -> None:
    selection = select(env={variable: "0"})
    assert selection.cluster == "horovod"
    horovodrun = entry(selection, "horovodrun")
    assert (horovodrun.order, horovodrun.outcome) == (100, "unavailable")
    assert "horovod is not installed" in horovodrun.detail
    assert selection.accelerator == "cpu"  # one process: nothing else claims it


def test_100_mpirun_world_without_horovod_falls_through_to_ddp(cuda_count_0: int) -> None:
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    env["OMPI_COMM_WORLD_LOCAL_RANK"] = "1"
    env["CARDCAGE_DISABLE_PLUGINS"] = "horovod"
    # mpirun gives ranks but no rendezvous: ddp's processes could never meet
    with pytest.raises(MisconfigurationError) as error:
        select(env=env)
    assert "MASTER_ADDR" in str(error.value) and "'ddp'" in str(error.value)
    assert "pip install cardcage-horovod" in str(error.value)
    selection = select(env={**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511"})
    assert (selection.accelerator, selection.world_size, selection.global_rank) == ("ddp", 2, 1)
    assert (selection.master_address, selection.master_port) == ("10.0.0.1", 29511)


def test_an_alias_is_named_in_the_why(cuda_count_0: int) -> None:
    selection = select(env={}, distributed_backend="ddp_cpu", num_processes=2)
    assert selection.accelerator == "ddp_spawn"
    assert "distributed_backend='ddp_cpu' was named (an alias of 'ddp_spawn')" in selection.why


def test_100_horovodrun_with_horovod_decides(
    cuda_count_0: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_available(monkeypatch, "horovod")
    env = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1"}
    selection = select(env=env, num_nodes=2)
    assert (selection.accelerator, selection.rule, selection.cluster) == (
        "horovod",
        "horovodrun",
        "horovod",
    )
    assert (selection.world_size, selection.global_rank, selection.local_rank) == (4, 1, 1)


@pytest.mark.skipif(not XLA_MISSING, reason="torch-xla is installed here")
def test_200_tpu_cores_without_torch_xla_fails_with_the_reason(cuda_count_0: int) -> None:
    # The rule is skipped like any unavailable one, but tpu_cores asked for TPU cores: training
    # on the CPU instead would hide that for a whole run (the seed failed here too).
    with pytest.raises(MisconfigurationError) as error:
        select(env={}, tpu_cores=8)
    message = str(error.value)
    assert "tpu_cores=8" in message and "torch_xla is not installed" in message
    assert "unset tpu_cores" in message


def test_tpu_cores_without_a_tpu_plugin_names_the_install_command(cuda_count_0: int) -> None:
    with pytest.raises(MisconfigurationError) as error:
        select(env={"CARDCAGE_DISABLE_PLUGINS": "tpu"}, tpu_cores="1")
    assert "tpu_cores='1'" in str(error.value)
    assert "pip install cardcage-tpu" in str(error.value)


def test_200_tpu_cores_with_torch_xla_decides(
    cuda_count_0: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_available(monkeypatch, "tpu")
    eight = select(env={}, tpu_cores=8)
    assert (eight.accelerator, eight.rule, eight.tpu_cores, eight.num_processes) == (
        "tpu",
        "tpu_cores",
        8,
        8,
    )
    one_core = select(env={}, tpu_cores="5,")
    assert (one_core.accelerator, one_core.tpu_cores, one_core.num_processes) == ("tpu", [5], 1)


# --- explain() and as_dict() ---------------------------------------------------------------


def test_explain_lists_every_rule_in_order_with_its_outcome(cuda_count_0: int) -> None:
    selection = select(env={}, num_nodes=2)
    orders = [e.order for e in selection.trace]
    assert orders == sorted(orders)
    assert [e.rule for e in selection.trace] == [r.name for r, _ in _rules()]
    assert outcomes(selection) == {
        "horovodrun": "not claimed",
        "tpu_cores": "not claimed",
        "multi_node_or_cluster": "claimed",
        "multi_gpu": "not evaluated",
        "cpu_processes": "not evaluated",
        "single_gpu": "not evaluated",
        "cpu_fallback": "not evaluated",
    }
    lines = selection.explain().splitlines()
    assert lines[0].startswith("selected 'ddp' by multi_node_or_cluster")
    # one line per rule, in ascending order, each with its outcome
    rule_lines = [line for line in lines if line[:10].strip(" ->").isdigit()]
    assert len(rule_lines) == len(selection.trace)
    for line, e in zip(rule_lines, selection.trace, strict=True):
        assert str(e.order) in line and e.rule in line and e.outcome in line
    (decided,) = [line for line in lines if line.lstrip().startswith("->")]
    assert "multi_node_or_cluster" in decided and "claimed" in decided
    assert sum("not evaluated" in line for line in lines) == 4


def _rules() -> list[Any]:
    return plugins.registry({}).ordered_rules()


@pytest.mark.skipif(not XLA_MISSING, reason="torch-xla is installed here")
def test_explain_of_a_named_backend_evaluates_no_rule(cuda_count_2: int) -> None:
    selection = select(env={}, distributed_backend="dp", gpus=2)
    assert selection.rule == "distributed_backend"
    assert set(outcomes(selection).values()) == {"not evaluated"}
    assert len(selection.trace) == len(_rules())
    assert "distributed_backend='dp' was named" in selection.explain()


DESIGN_FIELDS = (
    "accelerator",
    "cluster",
    "rule",
    "gpu_ids",
    "root_gpu",
    "tpu_cores",
    "num_processes",
    "num_nodes",
    "world_size",
    "global_rank",
    "local_rank",
    "node_rank",
    "warnings",
)


@pytest.mark.parametrize(
    ("env", "flags"),
    [
        ({}, {}),
        ({}, {"gpus": "1, 3"}),
        (SLURM_4_TASKS, {"gpus": 2, "num_nodes": 2}),
        ({}, {"tpu_cores": [2]}),
    ],
)
def test_as_dict_is_json_and_holds_every_field(
    cuda_count_4: int, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], flags: dict[str, Any]
) -> None:
    if "tpu_cores" in flags:
        make_available(monkeypatch, "tpu")
    selection = select(env=env, **flags)
    data = json.loads(json.dumps(selection.as_dict()))
    for name in DESIGN_FIELDS:
        assert data[name] == getattr(selection, name), name
    assert [t["rule"] for t in data["trace"]] == [e.rule for e in selection.trace]


# --- a named distributed_backend (docs/choosing-a-backend.md, "Naming a backend") ---------


@pytest.mark.parametrize("backend", ["ddp", "ddp_spawn"])
def test_ddp_and_spawn_run_one_process_per_gpu(cuda_count_2: int, backend: str) -> None:
    selection = select(env={}, distributed_backend=backend, gpus=2)
    assert (selection.accelerator, selection.rule) == (backend, "distributed_backend")
    assert (selection.num_processes, selection.world_size, selection.gpu_ids) == (2, 2, [0, 1])
    assert selection.warnings == []


@pytest.mark.parametrize("backend", ["gpu", "dp", "ddp2"])
def test_gpu_backends_without_gpus_train_on_the_cpu_with_a_warning(
    cuda_count_0: int, backend: str
) -> None:
    # CUDA is unavailable (the backends are too), so the fallback came first.
    selection = select(env={}, distributed_backend=backend)
    assert selection.accelerator == "cpu"
    assert selection.requested == backend
    assert len(selection.warnings) == 1
    assert f"distributed_backend={backend!r} needs GPUs" in selection.warnings[0]
    assert "CPU" in selection.warnings[0]


def test_ddp_with_one_cpu_process_trains_in_this_process(cuda_count_0: int) -> None:
    selection = select(env={}, distributed_backend="ddp")
    assert (selection.accelerator, selection.num_processes, selection.world_size) == ("cpu", 1, 1)
    assert "nothing to distribute" in selection.warnings[0]


def test_ddp_with_two_cpu_processes(cuda_count_0: int) -> None:
    selection = select(env={}, distributed_backend="ddp", num_processes=2)
    assert (selection.accelerator, selection.num_processes, selection.world_size) == ("ddp", 2, 2)
    assert selection.warnings == []


@pytest.mark.parametrize("backend", ["ddp_spawn", "ddp_cpu", "spawn"])
@pytest.mark.parametrize(
    ("env", "cluster"), [(TORCHRUN_4, "torchelastic"), (SLURM_4_TASKS, "slurm")]
)
def test_spawn_runs_as_ddp_where_a_cluster_made_the_processes(
    cuda_count_0: int, backend: str, env: dict[str, str], cluster: str
) -> None:
    selection = select(env=env, distributed_backend=backend, num_processes=2, num_nodes=2)
    assert (selection.accelerator, selection.cluster) == ("ddp", cluster)
    assert selection.requested == "ddp_spawn"
    assert selection.world_size == 4
    assert any(f"{backend!r} runs as 'ddp'" in w for w in selection.warnings)


def test_ddp_cpu_drops_the_gpus_with_the_seeds_warning(cuda_count_2: int) -> None:
    selection = select(env={}, distributed_backend="ddp_cpu", gpus=2, num_processes=3)
    assert (selection.accelerator, selection.gpu_ids, selection.root_gpu) == (
        "ddp_spawn",
        None,
        None,
    )
    assert selection.num_processes == 3
    assert any("Training will not use GPUs" in w for w in selection.warnings)


def test_spawn_keeps_the_gpus(cuda_count_2: int) -> None:
    selection = select(env={}, distributed_backend="spawn", gpus=2)
    assert (selection.accelerator, selection.gpu_ids) == ("ddp_spawn", [0, 1])


@pytest.mark.parametrize("backend", ["dp", "gpu", "cpu"])
def test_single_node_backends_refuse_several_nodes(cuda_count_2: int, backend: str) -> None:
    with pytest.raises(MisconfigurationError) as error:
        select(env={}, distributed_backend=backend, gpus=2, num_nodes=2)
    message = str(error.value)
    assert f"distributed_backend={backend!r}" in message
    assert "num_nodes=2" in message
    assert "distributed_backend='ddp'" in message  # what to set instead
    assert "Switching" not in message  # the seed claimed to switch while raising


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("spawn", "ddp_spawn"),
        ("ddp_cpu", "ddp_spawn"),
        ("DDP_CPU", "ddp_spawn"),
        (" Ddp_Spawn ", "ddp_spawn"),
        ("DDP", "ddp"),
        ("Cpu", "cpu"),
    ],
)
def test_aliases_and_case_give_the_canonical_name(
    cuda_count_0: int, name: str, canonical: str
) -> None:
    selection = select(env={}, distributed_backend=name, num_processes=2)
    assert selection.accelerator == canonical


def test_ddp2_without_gpus_on_several_nodes_runs_one_process_per_node(cuda_count_0: int) -> None:
    selection = select(env={}, distributed_backend="ddp2", num_nodes=2)
    assert (selection.accelerator, selection.num_processes, selection.world_size) == ("ddp2", 1, 2)
    assert "trains one process on the CPU" in selection.warnings[0]


def test_ddp2_with_gpus_runs_one_process_per_node(cuda_count_4: int) -> None:
    selection = select(env={}, distributed_backend="ddp2", gpus=4, num_nodes=2)
    assert (selection.accelerator, selection.num_processes, selection.world_size) == ("ddp2", 1, 2)
    assert selection.gpu_ids == [0, 1, 2, 3]


def test_dp_uses_every_gpu_in_one_process(cuda_count_2: int) -> None:
    selection = select(env={}, distributed_backend="dp", gpus=-1)
    assert (selection.accelerator, selection.num_processes, selection.gpu_ids) == ("dp", 1, [0, 1])


def test_gpu_with_several_gpus_trains_on_the_first_and_says_so(cuda_count_2: int) -> None:
    selection = select(env={}, distributed_backend="gpu", gpus=2)
    assert (selection.accelerator, selection.root_gpu, selection.num_processes) == ("gpu", 0, 1)
    assert "trains on one GPU" in selection.warnings[0]


@pytest.mark.parametrize(
    ("flags", "flag"), [({"gpus": 2}, "gpus=2"), ({"num_nodes": 2}, "num_nodes=2")]
)
def test_horovod_refuses_process_counts(
    cuda_count_2: int, flags: dict[str, Any], flag: str
) -> None:
    with pytest.raises(MisconfigurationError, match=rf"'horovod' with {flag}.*horovodrun -np"):
        select(env={}, distributed_backend="horovod", **flags)


# --- SLURM ---------------------------------------------------------------------------------


def test_slurm_managing_tasks_supplies_ranks_and_rendezvous(cuda_count_2: int) -> None:
    selection = select(env=SLURM_4_TASKS, gpus=2, num_nodes=2)
    assert selection.cluster == "slurm"
    assert (selection.global_rank, selection.local_rank, selection.node_rank) == (3, 1, 1)
    assert (selection.world_size, selection.num_processes) == (4, 2)
    assert selection.master_address == "n3"
    assert selection.master_port == 15000 + 4567
    assert selection.warnings == []


def test_slurm_manages_a_multi_node_cpu_job(cuda_count_0: int) -> None:
    # The seed compared SLURM_NTASKS with num_processes (2) alone: never managed.
    selection = select(env=SLURM_4_TASKS, num_nodes=2, num_processes=2)
    assert (selection.cluster, selection.accelerator, selection.world_size) == ("slurm", "ddp", 4)
    assert selection.global_rank == 3


def test_slurm_manages_ddp2_with_one_task_per_node(cuda_count_2: int) -> None:
    env = {**SLURM_4_TASKS, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    selection = select(env=env, distributed_backend="ddp2", gpus=2, num_nodes=2)
    assert (selection.cluster, selection.accelerator, selection.world_size) == ("slurm", "ddp2", 2)


def test_slurm_without_a_job_name_still_manages(cuda_count_0: int) -> None:
    # The seed's check raised on the missing variable and so answered "not managing".
    env = {k: v for k, v in SLURM_4_TASKS.items() if k != "SLURM_JOB_NAME"}
    assert select(env=env, num_nodes=2, num_processes=2).cluster == "slurm"


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("n[3-5,7],m1", "n3"),
        ("node[001-004]", "node001"),
        ("gpu[7,2]", "gpu7"),
        ("a01,a02", "a01"),
        ("single", "single"),
        ("rack1-[09-12]-x", "rack1-09-x"),
    ],
)
def test_master_address_is_the_first_slurm_host(nodelist: str, host: str) -> None:
    assert first_slurm_host(nodelist) == host


def test_slurm_job_nodelist_is_used_when_nodelist_is_absent(cuda_count_0: int) -> None:
    env = {k: v for k, v in SLURM_4_TASKS.items() if k != "SLURM_NODELIST"}
    env["SLURM_JOB_NODELIST"] = "node[001-004]"
    assert select(env=env, num_nodes=2, num_processes=2).master_address == "node001"


@pytest.mark.parametrize(
    ("job_id", "port"), [("1234567", 19567), ("42", 15042), ("90000", 15000), (None, 12910)]
)
def test_slurm_port_comes_from_the_job_id(cuda_count_0: int, job_id: str | None, port: int) -> None:
    env = {k: v for k, v in SLURM_4_TASKS.items() if k != "SLURM_JOB_ID"}
    if job_id is not None:
        env["SLURM_JOB_ID"] = job_id
    assert select(env=env, num_nodes=2, num_processes=2).master_port == port


def test_master_addr_and_port_in_the_environment_win(cuda_count_0: int) -> None:
    env = {**SLURM_4_TASKS, "MASTER_ADDR": "head.example", "MASTER_PORT": "23456"}
    selection = select(env=env, num_nodes=2, num_processes=2)
    assert (selection.master_address, selection.master_port) == ("head.example", 23456)


def test_slurm_with_other_task_count_is_not_managing_and_says_so(cuda_count_2: int) -> None:
    selection = select(env=SLURM_4_TASKS, gpus=2)  # asks for 2 processes, SLURM has 4
    assert selection.cluster == "local"
    assert (selection.global_rank, selection.master_address) == (0, "127.0.0.1")
    assert selection.accelerator == "ddp_spawn"
    (note,) = [w for w in selection.warnings if "SLURM_NTASKS=4" in w]
    assert "differs from the 2 processes" in note and "--ntasks-per-node" in note


@pytest.mark.parametrize("job_name", ["bash", "interactive"])
def test_interactive_slurm_is_local(cuda_count_0: int, job_name: str) -> None:
    env = {**SLURM_4_TASKS, "SLURM_JOB_NAME": job_name}
    selection = select(env=env, num_nodes=2, num_processes=2)
    assert (selection.cluster, selection.global_rank, selection.node_rank) == ("local", 0, 0)
    assert any("interactive SLURM job" in w for w in selection.warnings)


# --- torchelastic and manual launches --------------------------------------------------------


def test_torchelastic_supplies_ranks_and_rendezvous(cuda_count_0: int) -> None:
    selection = select(env=TORCHRUN_4, num_nodes=2, num_processes=2)
    assert selection.cluster == "torchelastic"
    assert (selection.global_rank, selection.local_rank, selection.node_rank) == (3, 1, 1)
    assert selection.world_size == 4
    assert (selection.master_address, selection.master_port) == ("10.1.2.3", 29500)


def test_world_size_and_local_rank_alone_mean_an_env_launcher(cuda_count_0: int) -> None:
    env = {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "1", "MASTER_PORT": "29500"}
    selection = select(env=env)
    assert (selection.cluster, selection.accelerator) == ("torchelastic", "ddp")
    assert (selection.global_rank, selection.local_rank, selection.master_address) == (
        1,
        1,
        "127.0.0.1",
    )


def test_torchelastic_rank_from_local_world_size(cuda_count_0: int) -> None:
    env = {k: v for k, v in TORCHRUN_4.items() if k != "RANK"}
    assert select(env=env, num_nodes=2).global_rank == 1 * 2 + 1


def test_torchelastic_wins_over_slurm(cuda_count_0: int) -> None:
    # torchrun inside a SLURM allocation: the ranks are torchrun's.
    selection = select(env={**SLURM_4_TASKS, **TORCHRUN_4}, num_nodes=2, num_processes=2)
    assert selection.cluster == "torchelastic"
    assert (selection.global_rank, selection.master_address) == (3, "10.1.2.3")


def test_manual_multi_node_launch_starts_this_nodes_processes(cuda_count_0: int) -> None:
    # WORLD_SIZE and NODE_RANK without LOCAL_RANK: the seed took it for torchelastic and hung.
    env = {"WORLD_SIZE": "4", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    selection = select(env=env, num_nodes=2, num_processes=2)
    assert (selection.cluster, selection.accelerator) == ("local", "ddp")
    assert not selection.processes_created_outside
    assert (selection.node_rank, selection.global_rank, selection.local_rank) == (1, 2, 0)
    assert (selection.master_address, selection.master_port) == ("10.0.0.1", 1234)


def test_group_rank_alone_is_the_node_rank(cuda_count_0: int) -> None:
    env = {"GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1"}
    assert select(env=env, num_nodes=2).node_rank == 1


# --- environment overrides of gpus ---------------------------------------------------------


@pytest.mark.parametrize("variable", ["CARDCAGE_GPUS", "PL_TRAINER_GPUS"])
@pytest.mark.parametrize(
    ("value", "gpu_ids", "accelerator"),
    [("1", [1], "gpu"), ("2,3", [2, 3], "ddp_spawn"), ("-1", [0, 1, 2, 3], "ddp_spawn")],
)
def test_gpus_override_from_the_environment(
    cuda_count_4: int, variable: str, value: str, gpu_ids: list[int], accelerator: str
) -> None:
    selection = select(env={variable: value}, gpus=None)
    assert (selection.gpu_ids, selection.accelerator) == (gpu_ids, accelerator)


def test_gpus_override_beats_the_flag(cuda_count_4: int) -> None:
    assert select(env={"CARDCAGE_GPUS": "3"}, gpus=2).gpu_ids == [3]


def test_cardcage_gpus_beats_pl_trainer_gpus(cuda_count_4: int) -> None:
    env = {"CARDCAGE_GPUS": "1", "PL_TRAINER_GPUS": "0,2"}
    assert select(env=env).gpu_ids == [1]


def test_an_empty_override_is_ignored(cuda_count_4: int) -> None:
    assert select(env={"CARDCAGE_GPUS": " "}, gpus=2).gpu_ids == [0, 1]


# --- purity ----------------------------------------------------------------------------------


def _forbid(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"select() must not call {name}")

    return refuse


@pytest.mark.parametrize(
    ("env", "flags"),
    [
        ({}, {}),
        ({}, {"gpus": 2}),
        ({}, {"gpus": 2, "auto_select_gpus": True}),
        ({}, {"num_processes": 2}),
        ({}, {"distributed_backend": "ddp", "num_nodes": 2}),
        (SLURM_4_TASKS, {"num_nodes": 2, "num_processes": 2}),
        (TORCHRUN_4, {"distributed_backend": "ddp_spawn", "num_nodes": 2}),
        ({}, {"tpu_cores": 8}),
    ],
)
def test_select_is_pure(
    cuda_count_2: int, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], flags: dict[str, Any]
) -> None:
    if "tpu_cores" in flags:
        make_available(monkeypatch, "tpu")
    select(env=env, **flags)  # load plugins first: their imports are not select's doing
    threads = set(threading.enumerate())
    for target, name in [
        (subprocess.Popen, "__init__"),
        (multiprocessing.Process, "start"),
        (socket.socket, "bind"),
        (socket.socket, "connect"),
        (torch.cuda, "init"),
        (torch.cuda, "_lazy_init"),
        (torch.cuda, "set_device"),
    ]:
        monkeypatch.setattr(target, name, _forbid(f"{getattr(target, '__name__', target)}.{name}"))
    environ = dict(env)
    select(env=environ, **flags)
    assert environ == env  # the environment mapping is read, never written
    assert set(threading.enumerate()) == threads
    assert multiprocessing.active_children() == []
    assert not torch.cuda.is_initialized()


def test_processes_per_node_come_from_the_launcher_that_started_them(cuda_count_0: int) -> None:
    # torchrun --nproc_per_node=2 on two nodes, with no num_processes flag
    elastic = select(env={**TORCHRUN_4, "MASTER_ADDR": "node1", "MASTER_PORT": "29500"})
    assert (elastic.num_processes, elastic.world_size, elastic.node_rank) == (2, 4, 1)
    mpirun = {"OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_RANK": "4"}
    mpirun.update(OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="3")
    mpirun.update(CARDCAGE_DISABLE_PLUGINS="horovod", MASTER_ADDR="a", MASTER_PORT="29500")
    assert select(env=mpirun).num_processes == 3


ENV_LAUNCH_2_NODES = {  # an env:// launcher that gives no LOCAL_WORLD_SIZE
    "WORLD_SIZE": "4",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node1",
    "MASTER_PORT": "29500",
}


@pytest.mark.parametrize("backend", [None, "ddp", "ddp_spawn"])
def test_without_a_local_count_the_launchers_world_is_split_over_the_nodes(
    cuda_count_0: int, backend: str | None
) -> None:
    selection = select(env=ENV_LAUNCH_2_NODES, distributed_backend=backend, num_nodes=2)
    assert (selection.accelerator, selection.cluster) == ("ddp", "torchelastic")
    assert (selection.num_processes, selection.world_size, selection.node_rank) == (2, 4, 1)


def test_num_processes_a_launcher_overrides_is_named_in_a_warning(cuda_count_0: int) -> None:
    launched = {"env": TORCHRUN_4, "distributed_backend": "ddp", "num_nodes": 2}
    ignored = select(**launched, num_processes=4)
    assert (ignored.num_processes, ignored.world_size) == (2, 4)
    assert ignored.warnings == [
        "num_processes=4 is ignored: the torchelastic launcher started 2 process(es) on this "
        "node. Leave num_processes unset, or set it to 2."
    ]
    assert select(**launched, num_processes=2).warnings == []
    assert select(**launched).warnings == []  # the default asks for nothing
    local = select(env={}, distributed_backend="ddp", num_processes=4)  # cardcage starts them
    assert (local.num_processes, local.warnings) == (4, [])


def test_device_count_plans_for_another_machine(cuda_count_0: int) -> None:
    # a login node without GPUs planning a job for nodes with 8 (cardcage-submit does this)
    selection = select(env={}, device_count=8, gpus=8)
    assert (selection.accelerator, selection.num_processes) == ("ddp_spawn", 8)
    assert select(env={}).accelerator == "cpu"  # this machine's count is read again after
