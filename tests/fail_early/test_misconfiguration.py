"""Every bad flag, environment and combination raises MisconfigurationError, and its message
names the flag (or variable), the bad value, and what to do instead."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest

from cardcage import MisconfigurationError, select

MISSING_CHECKPOINT = "/nonexistent/cardcage/last.ckpt"
# Words that start the "what to do instead" part of a message.
ADVICE = re.compile(
    r"\b(Use|Set|set|Unset|unset|Install|Did you mean|Leave|leave|Give|Request|List|Fix|Train|"
    r"must be|pick|Start|launch)\b"
)


class Bad(NamedTuple):
    flags: dict[str, Any]
    env: dict[str, str]
    gpus: int  # GPUs torch reports
    says: tuple[str, ...]  # the flag or variable and its value, as the message shows them


def bad(*says: str, env: dict[str, str] | None = None, cuda: int = 0, **flags: Any) -> Bad:
    """A bad configuration: ``flags`` in ``env`` with ``cuda`` GPUs, and what the error says."""
    return Bad(flags, env or {}, cuda, says)


CASES = {
    # flags, one at a time
    "num_processes=0": bad("num_processes=0", num_processes=0),
    "num_processes='2'": bad("num_processes='2'", num_processes="2"),
    "num_nodes=-1": bad("num_nodes=-1", num_nodes=-1),
    "num_nodes=True": bad("num_nodes=True", num_nodes=True),
    "precision=8": bad("precision=8", precision=8),
    "precision='fp8'": bad("precision='fp8'", precision="fp8"),
    "precision=[16]": bad("precision=[16]", precision=[16]),
    "gpus=1.5": bad("gpus=1.5", gpus=1.5),
    "gpus=(0.5,)": bad("gpus=(0.5,)", gpus=(0.5,)),
    "gpus=[0,0]": bad("gpus=[0, 0]", "more than once", gpus=[0, 0], cuda=2),
    "gpus='a,b'": bad("gpus='a,b'", gpus="a,b"),
    "gpus=-2": bad("gpus=-2", gpus=-2),
    "gpus='-2'": bad("gpus='-2'", gpus="-2", cuda=2),
    "gpus=-1 without GPU": bad("gpus=-1", "has none", gpus=-1),
    "gpus=3 with one GPU": bad("gpus=3", "[1, 2]", gpus=3, cuda=1),
    "tpu_cores=3": bad("tpu_cores=3", tpu_cores=3),
    "tpu_cores=[1,2]": bad("tpu_cores=[1, 2]", tpu_cores=[1, 2]),
    "tpu_cores='1,2'": bad("tpu_cores='1,2'", tpu_cores="1,2"),
    "tpu_cores with gpus": bad("tpu_cores=8", "gpus=1", tpu_cores=8, gpus=1, cuda=1),
    "log_gpu_memory='x'": bad("log_gpu_memory='x'", log_gpu_memory="x"),
    "max_epochs=0": bad("max_epochs=0", max_epochs=0),
    "max_steps=-5": bad("max_steps=-5", max_steps=-5),
    "unknown flag": bad("num_node=2", "Did you mean 'num_nodes'?", num_node=2),
    "benchmark='yes'": bad("benchmark='yes'", benchmark="yes"),
    "sync_batchnorm=1": bad("sync_batchnorm=1", sync_batchnorm=1),
    "terminate_on_nan='yes'": bad("terminate_on_nan='yes'", terminate_on_nan="yes"),
    "terminate_on_nan=1.5": bad("terminate_on_nan=1.5", terminate_on_nan=1.5),
    "default_root_dir=5": bad("default_root_dir=5", default_root_dir=5),
    "distributed_backend=''": bad("distributed_backend=''", distributed_backend=""),
    "distributed_backend=3": bad("distributed_backend=3", distributed_backend=3),
    "unknown backend": bad(
        "distributed_backend='dpp'", "Did you mean 'dp'?", distributed_backend="dpp"
    ),
    "backend disabled": bad(
        "distributed_backend='ddp2'",
        "disabled by CARDCAGE_DISABLE_PLUGINS='ddp2'",
        env={"CARDCAGE_DISABLE_PLUGINS": "ddp2"},
        distributed_backend="ddp2",
    ),
    "resume_from_checkpoint missing": bad(
        f"resume_from_checkpoint={MISSING_CHECKPOINT!r}", resume_from_checkpoint=MISSING_CHECKPOINT
    ),
    "auto_select_gpus with ids": bad(
        "auto_select_gpus=True", "gpus='0,1'", auto_select_gpus=True, gpus="0,1"
    ),
    "auto_select_gpus with gpus=0": bad(
        "auto_select_gpus=True", "gpus=0", auto_select_gpus=True, gpus=0
    ),
    "auto_select_gpus too many": bad("gpus=3", auto_select_gpus=True, gpus=3, cuda=2),
    "tpu_cores with ddp": bad(
        "tpu_cores=8", "distributed_backend='ddp'", tpu_cores=8, distributed_backend="ddp"
    ),
    "tpu without tpu_cores": bad(
        "distributed_backend='tpu'", "tpu_cores", distributed_backend="tpu"
    ),
    # the environment
    "CARDCAGE_GPUS='x'": bad("CARDCAGE_GPUS='x'", env={"CARDCAGE_GPUS": "x"}),
    "PL_TRAINER_GPUS='9'": bad("PL_TRAINER_GPUS='9'", "[9]", env={"PL_TRAINER_GPUS": "9"}, cuda=2),
    "LOCAL_RANK='a'": bad("LOCAL_RANK='a'", env={"WORLD_SIZE": "2", "LOCAL_RANK": "a"}),
    "WORLD_SIZE=0": bad("WORLD_SIZE=0", env={"WORLD_SIZE": "0", "LOCAL_RANK": "0", "RANK": "0"}),
    "RANK outside WORLD_SIZE": bad(
        "RANK=4", "WORLD_SIZE=4", env={"WORLD_SIZE": "4", "LOCAL_RANK": "0", "RANK": "4"}
    ),
    "torchelastic without RANK": bad(
        "TORCHELASTIC_RUN_ID", "RANK", env={"TORCHELASTIC_RUN_ID": "r"}
    ),
    "MASTER_PORT='99999'": bad("MASTER_PORT=99999", env={"MASTER_PORT": "99999"}),
    "MASTER_PORT='http'": bad("MASTER_PORT='http'", env={"MASTER_PORT": "http"}),
    "NODE_RANK beyond num_nodes": bad(
        "NODE_RANK=2", "num_nodes=2", env={"NODE_RANK": "2", "MASTER_ADDR": "h"}, num_nodes=2
    ),
    "NODE_RANK without MASTER_ADDR": bad(
        "NODE_RANK=1", "MASTER_ADDR", env={"NODE_RANK": "1"}, num_nodes=2
    ),
    "NODE_RANK and GROUP_RANK disagree": bad(
        "NODE_RANK=1",
        "GROUP_RANK=0",
        env={"NODE_RANK": "1", "GROUP_RANK": "0", "MASTER_ADDR": "h"},
        num_nodes=2,
    ),
    "SLURM_NTASKS='four'": bad(
        "SLURM_NTASKS='four'", env={"SLURM_NTASKS": "four", "SLURM_JOB_NAME": "train"}
    ),
    "SLURM_PROCID='x'": bad(
        "SLURM_PROCID='x'",
        env={"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "x"},
        num_processes=2,
    ),
    # rank variables against each other (those the detected cluster environment reads)
    "LOCAL_RANK beyond LOCAL_WORLD_SIZE": bad(
        "LOCAL_RANK=5",
        "LOCAL_WORLD_SIZE=2",
        env={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "5", "RANK": "1"},
    ),
    "LOCAL_RANK beyond WORLD_SIZE": bad(
        "LOCAL_RANK=5", "WORLD_SIZE=2", env={"WORLD_SIZE": "2", "LOCAL_RANK": "5", "RANK": "1"}
    ),
    "LOCAL_RANK=-1": bad(
        "LOCAL_RANK=-1", "negative", env={"WORLD_SIZE": "2", "LOCAL_RANK": "-1", "RANK": "1"}
    ),
    "LOCAL_WORLD_SIZE beyond WORLD_SIZE": bad(
        "LOCAL_WORLD_SIZE=4",
        "WORLD_SIZE=2",
        env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0", "RANK": "0"},
    ),
    "GROUP_RANK beyond WORLD_SIZE": bad(
        "GROUP_RANK=3",
        "WORLD_SIZE=2",
        env={"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "1"}
        | {"GROUP_RANK": "3"},
    ),
    "RANK beyond WORLD_SIZE, no LOCAL_RANK": bad(
        "RANK=7", "WORLD_SIZE=2", env={"WORLD_SIZE": "2", "RANK": "7"}, num_processes=2
    ),
    "SLURM_PROCID beyond SLURM_NTASKS": bad(
        "SLURM_PROCID=7",
        "SLURM_NTASKS=2",
        env={"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "7"},
        num_processes=2,
    ),
    "SLURM_LOCALID beyond SLURM_NTASKS_PER_NODE": bad(
        "SLURM_LOCALID=2",
        "SLURM_NTASKS_PER_NODE=2",
        env={"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "3"}
        | {"SLURM_LOCALID": "2", "SLURM_NODEID": "1", "SLURM_JOB_NAME": "train"},
        num_processes=2,
        num_nodes=2,
    ),
    "SLURM_LOCALID beyond SLURM_NTASKS": bad(
        "SLURM_LOCALID=9",
        "SLURM_NTASKS=2",
        env={"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "9"},
        num_processes=2,
    ),
    "SLURM_NODEID beyond SLURM_JOB_NUM_NODES": bad(
        "SLURM_NODEID=2",
        "SLURM_JOB_NUM_NODES=2",
        env={"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_NODEID": "2"}
        | {"SLURM_JOB_NUM_NODES": "2"},
        num_processes=2,
    ),
    "OMPI_COMM_WORLD_RANK beyond its size": bad(
        "OMPI_COMM_WORLD_RANK=5",
        "OMPI_COMM_WORLD_SIZE=2",
        env={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "5"},
    ),
    # cardcage's own variables (cardcage.config.variables)
    "CARDCAGE_INIT_TIMEOUT=-5": bad(
        "CARDCAGE_INIT_TIMEOUT='-5'", env={"CARDCAGE_INIT_TIMEOUT": "-5"}
    ),
    "CARDCAGE_INIT_TIMEOUT=0": bad("CARDCAGE_INIT_TIMEOUT='0'", env={"CARDCAGE_INIT_TIMEOUT": "0"}),
    "CARDCAGE_INIT_TIMEOUT=nan": bad(
        "CARDCAGE_INIT_TIMEOUT='nan'", env={"CARDCAGE_INIT_TIMEOUT": "nan"}
    ),
    "CARDCAGE_TIMEOUT='soon'": bad("CARDCAGE_TIMEOUT='soon'", env={"CARDCAGE_TIMEOUT": "soon"}),
    "CARDCAGE_STUCK_WARN=inf": bad("CARDCAGE_STUCK_WARN='inf'", env={"CARDCAGE_STUCK_WARN": "inf"}),
    "CARDCAGE_TIMEOUT=1e10": bad(
        "CARDCAGE_TIMEOUT='1e10'", "at most 1000000000", env={"CARDCAGE_TIMEOUT": "1e10"}
    ),
    "CARDCAGE_INIT_TIMEOUT=1e308": bad(
        "CARDCAGE_INIT_TIMEOUT='1e308'",
        "at most 1000000000",
        env={"CARDCAGE_INIT_TIMEOUT": "1e308"},
    ),
    "CARDCAGE_STUCK_WARN=1e10": bad(
        "CARDCAGE_STUCK_WARN='1e10'", "at most 1000000000", env={"CARDCAGE_STUCK_WARN": "1e10"}
    ),
    "CARDCAGE_REQUEUE_SIGNAL='USR9'": bad(
        "CARDCAGE_REQUEUE_SIGNAL='USR9'", env={"CARDCAGE_REQUEUE_SIGNAL": "USR9"}
    ),
    "CARDCAGE_REQUEUE_DIR a file": bad(
        f"CARDCAGE_REQUEUE_DIR={__file__!r}", "not a folder", env={"CARDCAGE_REQUEUE_DIR": __file__}
    ),
    "CARDCAGE_CHECKPOINT_DIR under a file": bad(
        f"CARDCAGE_CHECKPOINT_DIR={__file__ + '/sub'!r}",
        "is a file",
        env={"CARDCAGE_CHECKPOINT_DIR": __file__ + "/sub"},
    ),
    "CARDCAGE_RESTART_FROM missing": bad(
        f"CARDCAGE_RESTART_FROM={MISSING_CHECKPOINT!r}",
        "does not exist",
        env={"CARDCAGE_RESTART_FROM": MISSING_CHECKPOINT},
    ),
    "CARDCAGE_PLUGINS_AUTOLOAD='maybe'": bad(
        "CARDCAGE_PLUGINS_AUTOLOAD='maybe'", env={"CARDCAGE_PLUGINS_AUTOLOAD": "maybe"}
    ),
    "CARDCAGE_STRICT_PLUGINS='sometimes'": bad(
        "CARDCAGE_STRICT_PLUGINS='sometimes'", env={"CARDCAGE_STRICT_PLUGINS": "sometimes"}
    ),
    # combinations
    "dp with num_nodes=2": bad(
        "distributed_backend='dp'", "num_nodes=2", distributed_backend="dp", num_nodes=2
    ),
    "gpu with num_nodes=2": bad(
        "distributed_backend='gpu'", "num_nodes=2", distributed_backend="gpu", num_nodes=2
    ),
    "cpu with num_nodes=2": bad(
        "distributed_backend='cpu'", "num_nodes=2", distributed_backend="cpu", num_nodes=2
    ),
    "horovod with gpus=2": bad(
        "distributed_backend='horovod'",
        "gpus=2",
        distributed_backend="horovod",
        gpus=2,
        cuda=2,
    ),
    "horovod with num_nodes=2": bad(
        "distributed_backend='horovod'", "num_nodes=2", distributed_backend="horovod", num_nodes=2
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_configuration_is_refused_with_a_useful_message(
    case: Bad, fake_cuda: Callable[[int], None]
) -> None:
    fake_cuda(case.gpus)
    with pytest.raises(MisconfigurationError) as error:
        select(env=case.env, **case.flags)
    message = str(error.value)
    for fragment in case.says:
        assert fragment in message, f"{fragment!r} missing from: {message}"
    assert ADVICE.search(message), f"no advice in: {message}"
    assert "Traceback" not in message


@pytest.mark.skipif(importlib.util.find_spec("horovod") is not None, reason="horovod installed")
def test_a_named_backend_that_cannot_run_here_says_why_and_how_to_fix_it(
    cuda_count_0: int,
) -> None:
    with pytest.raises(MisconfigurationError) as error:
        select(env={}, distributed_backend="horovod")
    message = str(error.value)
    assert "distributed_backend='horovod'" in message
    assert "horovod is not installed" in message
    assert "python -m cardcage_horovod.build --install" in message


def test_misconfiguration_is_a_value_error() -> None:
    # Code written against Lightning catches ValueError-like configuration errors.
    assert issubclass(MisconfigurationError, ValueError)
