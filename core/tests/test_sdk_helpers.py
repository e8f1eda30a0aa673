"""Helpers of the SDK that backends reuse, first written for the horovod backend."""

from __future__ import annotations

import torch

from cardcage.sdk import named_parameters


def test_named_parameters_use_the_models_names_and_name_the_rest() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    extra = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([extra, *model[1].parameters()], lr=0.1)
    named = named_parameters(model, optimizer)
    assert [name for name, _ in named] == ["1.weight", "1.bias", "unnamed.0"]
    assert [p for _, p in named] == [model[1].weight, model[1].bias, extra]
    # parameters the optimizer does not hold are not named
    assert named_parameters(model, torch.optim.SGD(model[0].parameters(), lr=0.1)) == [
        ("0.weight", model[0].weight),
        ("0.bias", model[0].bias),
    ]
