"""The pure helpers of ``cardcage.backend.sharded`` (the FSDP2 strategy that the ``fsdp``
plugin and other launchers' backends subclass): the optimizer state converted between
FSDP2's by-name keys and a plain ``optimizer.state_dict()``'s positions, so that a full
checkpoint resumes under any backend, and a step run through ``__call__`` so that FSDP2's
hooks gather the root's parameters. Training with it is tested by the fsdp plugin's suite."""

from __future__ import annotations

import torch

from cardcage.backend.sharded import by_name, by_position, redirected


def test_optimizer_state_by_position_and_back() -> None:
    named = {
        "state": {"a.weight": {"step": torch.tensor(2.0)}, "scale": {"step": torch.tensor(2.0)}},
        "param_groups": [{"lr": 0.1, "params": ["scale"]}, {"lr": 0.2, "params": ["a.weight"]}],
    }
    plain = by_position(named)
    assert plain["param_groups"] == [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}]
    assert set(plain["state"]) == {0, 1}
    assert by_name(plain, ["scale", "a.weight"]) == named


def test_redirected_runs_a_step_through_call_with_forward_restored() -> None:
    calls: list[str] = []

    class Net(torch.nn.Linear):
        def training_step(self, x: torch.Tensor) -> torch.Tensor:
            return self(x).sum()  # the module's own forward inside

    net = Net(2, 1)
    net.register_forward_pre_hook(lambda module, args: calls.append("hook"))
    loss = redirected(net, "training_step", torch.ones(1, 2))
    assert loss.shape == () and calls == ["hook", "hook"]  # the step's call, then self(x)
    assert "forward" not in net.__dict__
