"""One validation path: what ``Trainer(**flags)`` refuses, ``select(**flags)`` and ``cardcage
explain`` refuse with the same message, before anything starts; and the messages for
``sync_batchnorm`` on the CPU, the flags of later Lightning versions and the Lightning 1.0 flags
cardcage does not run yet name the flag, the value and the fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest

import cardcage
from cardcage import MisconfigurationError, select
from cardcage.cli.main import main
from cardcage.config.flags import FLAG_NAMES, NOT_SUPPORTED_YET


class Bad(NamedTuple):
    flags: dict[str, Any]
    cuda: int  # GPUs torch reports
    argv: tuple[str, ...] | None  # the same flags for `cardcage explain`; None: no CLI spelling
    says: tuple[str, ...]  # the flag and value, and the fix, as the message shows them


def bad(*says: str, argv: tuple[str, ...] | None = None, cuda: int = 0, **flags: Any) -> Bad:
    return Bad(flags, cuda, argv, says)


CASES = {
    # Refused by the Trainer alone before: the backend's precision check.
    "precision=16 on the CPU": bad(
        "precision=16", "precision='bf16'", argv=("--precision", "16"), precision=16
    ),
    "precision=16 with ddp_spawn on the CPU": bad(
        "precision=16",
        "distributed_backend='ddp_spawn'",
        argv=("--precision", "16", "--backend", "ddp_spawn", "--num-processes", "2"),
        precision=16,
        distributed_backend="ddp_spawn",
        num_processes=2,
    ),
    "precision=16 with gpu but no GPU": bad(
        "precision=16",
        "set gpus",
        argv=("--precision", "16", "--backend", "gpu"),
        precision=16,
        distributed_backend="gpu",
    ),
    # Refused by the Trainer alone before: its own check (progress_bar was no select flag).
    "progress_bar='yes'": bad("progress_bar='yes'", "Use True, False or None", progress_bar="yes"),
    # Flags, the same everywhere already; kept so that a split path shows.
    "num_processes=0": bad(
        "num_processes=0", "must be", argv=("--num-processes", "0"), num_processes=0
    ),
    "gpus=3 with one GPU": bad("gpus=3", argv=("--gpus", "3"), gpus=3, cuda=1),
    "unknown backend": bad(
        "distributed_backend='dpp'",
        "Did you mean 'dp'?",
        argv=("--backend", "dpp"),
        distributed_backend="dpp",
    ),
    # sync_batchnorm without GPUs: torch's SyncBatchNorm refuses CPU tensors in every rank.
    "sync_batchnorm on the CPU": bad(
        "sync_batchnorm=True", "Train on GPUs", "sync_batchnorm=False", sync_batchnorm=True
    ),
    "sync_batchnorm with ddp_cpu": bad(
        "sync_batchnorm=True",
        "distributed_backend='ddp_spawn'",
        "sync_batchnorm=False",
        sync_batchnorm=True,
        distributed_backend="ddp_cpu",
        num_processes=2,
    ),
    "sync_batchnorm with ddp and no GPU": bad(
        "sync_batchnorm=True", "Train on GPUs", sync_batchnorm=True, distributed_backend="ddp"
    ),
    # Flags of later Lightning versions: the 1.0 flag that does it.
    "strategy='ddp'": bad("strategy='ddp'", "distributed_backend='ddp'", strategy="ddp"),
    "accelerator='gpu', devices=2": bad(
        "accelerator='gpu', devices=2", "gpus=2", accelerator="gpu", devices=2
    ),
    "accelerator='cpu', devices=2": bad(
        "accelerator='cpu', devices=2",
        "num_processes=2 with distributed_backend='ddp_cpu'",
        accelerator="cpu",
        devices=2,
    ),
    "devices=4": bad("devices=4", "gpus=4", "tpu_cores=4", "num_processes=4", devices=4),
    "accelerator='tpu', devices=8": bad(
        "accelerator='tpu', devices=8", "tpu_cores=8", accelerator="tpu", devices=8
    ),
    "strategy with gpus": bad(
        "strategy='ddp_spawn'", "distributed_backend='ddp_spawn'", strategy="ddp_spawn", gpus=2
    ),
    # The loop's flags: the flag, the value and what to give.
    "accumulate_grad_batches=0": bad(
        "accumulate_grad_batches=0", "positive int", accumulate_grad_batches=0
    ),
    "limit_val_batches=1.5": bad(
        "limit_val_batches=1.5", "from 0.0 to 1.0", "give an int", limit_val_batches=1.5
    ),
    # nan and inf raised a raw ValueError/OverflowError from int() while forming the message.
    **{
        f"{name}={value}": bad(f"{name}={value}", "from 0.0 to 1.0", "an int >= 0", **{name: value})
        for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches")
        for value in (float("nan"), float("inf"), float("-inf"))
    },
    "gradient_clip_val=inf": bad(
        "gradient_clip_val=inf", "a finite number > 0", gradient_clip_val=float("inf")
    ),
    "gradient_clip_algorithm": bad(
        "gradient_clip_algorithm='l2'", "'norm'", "'value'", gradient_clip_algorithm="l2"
    ),
    "min_epochs over max_epochs": bad(
        "min_epochs=3", "max_epochs=2", "Lower min_epochs", min_epochs=3, max_epochs=2
    ),
    "a logger that is not one": bad("logger=3", "is not a logger", "CSVLogger", logger=3),
    "a callback class": bad(
        "callbacks[0]=", "a class, not an instance", callbacks=[type("Stopper", (), {})]
    ),
    # Lightning 1.0 flags cardcage does not run: refused by name, no did-you-mean.
    **{
        f"{name} not supported yet": bad(
            f"{name}=1", "does not support yet", f"Leave {name} out", **{name: 1}
        )
        for name in NOT_SUPPORTED_YET
        if name not in FLAG_NAMES
    },
    # An unknown flag still gets its did-you-mean, among all the flags.
    "progress_bars": bad(
        "progress_bars=False", "Did you mean 'progress_bar'?", progress_bars=False
    ),
}


def _message(call: Callable[[], object]) -> str:
    with pytest.raises(MisconfigurationError) as error:
        call()
    return str(error.value)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_trainer_select_and_explain_refuse_with_the_same_message(
    case: Bad, fake_cuda: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_cuda(case.cuda)
    from_trainer = _message(lambda: cardcage.Trainer(**case.flags))
    from_select = _message(lambda: select(**case.flags))
    assert from_select == from_trainer
    for fragment in case.says:
        assert fragment in from_trainer, f"{fragment!r} missing from: {from_trainer}"
    assert "Did you mean 'log_gpu_memory'" not in from_trainer
    if case.argv is not None:
        capsys.readouterr()
        assert main(["explain", *case.argv]) == 2
        out, err = capsys.readouterr()
        assert err == f"cardcage: error: {from_trainer}\n"
        assert out == ""


def test_logger_is_not_a_typo_of_log_gpu_memory() -> None:
    """``logger`` used to get "Did you mean 'log_gpu_memory'?": a different flag."""
    message = _message(lambda: select(logger=3))
    assert "logger=3" in message and "is not a logger" in message
    assert "log_gpu_memory" not in message


def test_sync_batchnorm_with_gpus_is_accepted(fake_cuda: Callable[[int], None]) -> None:
    """The refusal is for a job that would train on the CPU only."""
    fake_cuda(2)
    assert select(env={}, sync_batchnorm=True, gpus=2, distributed_backend="ddp").gpu_ids == [0, 1]
    assert select(env={}, sync_batchnorm=False).accelerator == "cpu"


def test_progress_bar_is_a_known_flag() -> None:
    assert "progress_bar" in FLAG_NAMES
    assert select(env={}, progress_bar=True).flags.progress_bar is True
