"""dp's reduction of its replicas' outputs, driven on the CPU: the replicas' step outputs are
computed by the same ``StepRunner`` dp wraps in DataParallel, on the chunks DataParallel would
give each GPU, gathered as DataParallel gathers them, and reduced by the function dp's step
uses. One optimizer step from that must equal plain PyTorch's step on the whole batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cardcage.sdk import StepRunner, reduce_replica_outputs, replica_shares

LR = 0.5


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        return {"loss": loss, "error": (self.layer(x) - y).abs().mean().detach()}


def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(size, 4, generator=generator)
    return x, 3 * x[:, :1] - x[:, 1:2] + 1


def replicated_step(model: Regressor, data: Any, gpus: int, weighted: bool = True) -> Any:
    """dp's step on the CPU: each replica runs ``training_step`` on its chunk (``chunk``
    along dimension 0, as DataParallel's scatter cuts), the scalars are gathered into one
    value per replica (DataParallel's gather), then reduced."""
    runner = StepRunner(model)
    chunks = list(zip(*(tensor.chunk(gpus) for tensor in data), strict=True))
    outputs = [runner("training_step", chunk, 0) for chunk in chunks]
    gathered = {key: torch.stack([o[key] for o in outputs]) for key in outputs[0]}
    shares = replica_shares(data, gpus) if weighted else None
    return reduce_replica_outputs(gathered, shares)


def stepped(model: Regressor, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def plain_step(size: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = Regressor()
    out = model.training_step(batch(size), 0)
    return stepped(model, out["loss"]), out


@pytest.mark.parametrize(("size", "gpus"), [(3, 2), (5, 4), (7, 3), (8, 4), (1, 2)])
def test_a_step_over_replicas_equals_the_plain_step_on_the_whole_batch(
    size: int, gpus: int
) -> None:
    """3 samples on 2 GPUs (2 + 1), 5 on 4 (2 + 2 + 1: three replicas), and even splits: the
    weights after one step, the loss and a logged scalar equal plain PyTorch's."""
    wanted, plain = plain_step(size)
    model = Regressor()
    reduced = replicated_step(model, batch(size), gpus)
    torch.testing.assert_close(reduced["loss"], plain["loss"], rtol=0, atol=1e-6)
    torch.testing.assert_close(reduced["error"], plain["error"], rtol=0, atol=1e-6)
    got = stepped(model, reduced["loss"])
    for key, value in wanted.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)


def test_an_unweighted_mean_of_an_uneven_split_is_not_the_plain_step() -> None:
    """What the weighting fixes: averaging the 2 + 1 replicas' losses as equals moves the
    weights away from the plain step (by far more than the kit's 1e-5)."""
    wanted, _ = plain_step(3)
    model = Regressor()
    got = stepped(model, replicated_step(model, batch(3), 2, weighted=False)["loss"])
    worst = max((got[k] - wanted[k]).abs().max().item() for k in wanted)
    assert worst > 1e-2, worst


@pytest.mark.parametrize("size", range(1, 12))
@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_shares_are_the_chunks_dataparallel_scatters(size: int, gpus: int) -> None:
    data = {"x": [torch.zeros(size, 2)], "meta": "not a tensor"}
    chunks = torch.zeros(size).chunk(gpus)
    assert replica_shares(data, gpus) == [len(c) for c in chunks]


def test_outputs_that_are_not_one_scalar_per_replica_are_averaged_as_before() -> None:
    """Per-sample values gathered from the replicas (3 values for 2 + 1) are the mean of
    all samples, and a lone replica's scalar (one GPU) is returned as it is."""
    values = torch.tensor([1.0, 2.0, 6.0])
    assert reduce_replica_outputs(values, [2, 1]).item() == pytest.approx(3.0)
    lone = torch.tensor(5.0)
    assert reduce_replica_outputs(lone, [3]) is lone
