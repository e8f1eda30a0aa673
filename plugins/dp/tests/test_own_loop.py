"""A user's own loop on dp through ``cardcage.Cage``, on the GPUs of this machine: the module
``setup`` returns runs the model in DataParallel replicas (each gets its chunk of the
batch), its output and the batches are on the root GPU, and a step equals the plain CPU
step on the whole batch, an uneven split (5 samples) included. Needs a CUDA GPU: skipped,
with the reason, without one."""

from __future__ import annotations

import pytest
import torch

import cardcage

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="dp's own loop trains on CUDA GPUs; none here"
)
ALONE = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "dp"}


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_a_step_through_dataparallel_equals_the_plain_step_on_the_whole_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in ALONE.items():
        monkeypatch.setenv(key, value)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    y = x[:, :1] - x[:, 1:2]
    plain = net()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        optimizer.step()

    cage = cardcage.Cage(distributed_backend="dp", gpus=-1)
    model = net()
    model, optimizer = cage.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert isinstance(model.module, torch.nn.Sequential)  # the user's module, no wrapper
    data = torch.utils.data.TensorDataset(x, y)
    loader = cage.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=5))
    for _ in range(2):
        for xb, yb in loader:
            assert xb.device == yb.device == cage.device  # the root GPU
            optimizer.zero_grad()
            out = model(xb)
            assert out.device == cage.device and out.shape == (5, 1)  # gathered
            cage.backward(torch.nn.functional.mse_loss(out, yb))
            optimizer.step()
    for mine, theirs in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(mine.cpu(), theirs, atol=1e-5, rtol=0)
