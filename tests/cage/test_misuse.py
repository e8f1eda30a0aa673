"""Mistakes with the Cage are refused with a MisconfigurationError that names the call and
says what to do: here on the CPU, and under ``ddp_spawn`` with two real processes for
those that need several (a loss of the module that was not set up, no loader set up, a
value that cannot come back to the caller)."""

from __future__ import annotations

from typing import Any

import processes
import pytest
import torch
from cage_helpers import outputs, start

import cardcage
from cardcage import MisconfigurationError
from cardcage.testing.harness import Harness


def loss_of(model: Any, job: Any) -> torch.Tensor:
    x, y = job.dataset()[:8]
    loss: torch.Tensor = torch.nn.functional.mse_loss(model(x), y)
    return loss


def test_setting_one_module_up_twice_is_refused(job: Any) -> None:
    cage = cardcage.Cage()
    model = job.make_model()
    cage.setup(model)
    with pytest.raises(MisconfigurationError, match=r"cage\.setup: this Sequential was set up"):
        cage.setup(model)


def test_backward_before_any_setup_is_refused(job: Any) -> None:
    cage = cardcage.Cage()
    with pytest.raises(MisconfigurationError, match=r"cage\.backward: no module was set up"):
        cage.backward(loss_of(job.make_model(), job))


def test_clip_gradients_takes_exactly_one_of_max_norm_and_clip_val(job: Any) -> None:
    cage = cardcage.Cage()
    model = job.make_model()
    model, optimizer = cage.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cage.backward(loss_of(model, job))
    for given in ({"max_norm": 1.0, "clip_val": 0.5}, {}):
        with pytest.raises(MisconfigurationError, match=r"cage\.clip_gradients\(.*exactly one"):
            cage.clip_gradients(model, optimizer, **given)


def test_clip_gradients_clips_and_returns_the_norm_before(job: Any) -> None:
    """The valid calls next to the refused ones: the total norm comes back, then is 1."""
    cage = cardcage.Cage()
    model = job.make_model()
    model, optimizer = cage.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cage.backward(loss_of(model, job) * 100)
    norm = cage.clip_gradients(model, optimizer, max_norm=1.0)
    assert norm is not None and float(norm) > 1.0
    after = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert float(after) == pytest.approx(1.0, rel=1e-4)
    assert cage.clip_gradients(model, optimizer, clip_val=0.01) is None
    assert max(float(p.grad.abs().max()) for p in model.parameters()) <= 0.01


def test_a_flag_of_the_trainers_loop_is_refused_by_name() -> None:
    with pytest.raises(MisconfigurationError) as raised:
        cardcage.Cage(max_epochs=3)
    message = str(raised.value)
    assert message.startswith("Cage(max_epochs=3):")
    assert "Trainer's loop" in message and "Leave it out" in message


def test_an_unknown_flag_is_refused_offering_the_cages_flags() -> None:
    """The misspelt flag is named, the Cage's own flag suggested; a flag of the Trainer's
    loop, which the Cage refuses too, is not offered."""
    with pytest.raises(MisconfigurationError) as raised:
        cardcage.Cage(num_process=2)
    message = str(raised.value)
    assert "num_process=2" in message and "'num_processes'" in message
    assert "max_epochs" not in message, message
    with pytest.raises(MisconfigurationError) as raised:
        cardcage.Cage(max_epoch=2)
    assert "max_epoch=2" in str(raised.value)
    assert "'max_epochs'" not in str(raised.value), raised.value


def test_a_per_process_call_outside_launch_is_refused_when_launch_starts_processes(
    job: Any,
) -> None:
    cage = cardcage.Cage(distributed_backend="ddp_spawn", num_processes=2)
    with processes.watching_children() as started:
        for call in (lambda: cage.setup(job.make_model()), lambda: cage.barrier()):
            with pytest.raises(MisconfigurationError, match="inside the function you pass to"):
                call()
    assert not started


def test_explain_is_the_selections_text() -> None:
    cage = cardcage.Cage(distributed_backend="ddp_spawn", num_processes=2)
    text = cage.explain()
    assert isinstance(text, str)
    assert (
        text
        == cage.selection.explain()
        == cardcage.select(distributed_backend="ddp_spawn", num_processes=2).explain()
    )
    assert text.startswith("selected 'ddp_spawn'")


# -- under ddp_spawn, two real processes: one launch per mistake, in one script ------------------

MISTAKES = ("original-module", "no-loader", "unpicklable")


def misuse_job(harness: Harness) -> dict[str, Any]:
    args = ["--backend", "ddp_spawn", "--num-processes", "2", "--job", "misuse"]
    run, out = start(harness, *args, "--misuse", ",".join(MISTAKES))
    run.check()
    harness.assert_no_leftovers()
    return outputs(out)


SCENARIOS = {"ddp_spawn": misuse_job}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["ddp_spawn"])
def test_backward_of_the_module_that_was_not_set_up_is_refused(
    scenarios: Any, scenario: str
) -> None:
    found = scenarios.result(scenario)["misuse-original-module"]
    assert found["type"] == "MisconfigurationError"
    assert found["message"].startswith(
        "cage.backward: the loss was not computed by a module that cage.setup returned"
    )
    assert "model = cage.setup(model, ...)" in found["message"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["ddp_spawn"])
def test_training_without_a_loader_set_up_is_refused(scenarios: Any, scenario: str) -> None:
    found = scenarios.result(scenario)["misuse-no-loader"]
    assert found["type"] == "MisconfigurationError"
    assert found["message"].startswith(
        "cage.backward: 2 processes train, but no loader went through cage.setup_dataloaders"
    )
    assert "replace_sampler_ddp=False" in found["message"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["ddp_spawn"])
def test_a_value_that_cannot_come_back_is_named_with_the_fix(scenarios: Any, scenario: str) -> None:
    found = scenarios.result(scenario)["misuse-unpicklable"]
    assert found["launch_raised"] in ("MisconfigurationError", "RankFailedError"), found
    assert "cage.launch: the function returned a NotPlain" in found["message"]
    assert "Return plain data" in found["message"]
