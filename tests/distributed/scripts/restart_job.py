"""A 2-process job whose rank 1 SIGKILLs itself at global step 7 of 8 (2 epochs of 4 steps,
checkpoint every 2 steps): ``python restart_job.py OUT BACKEND MODE [MAX_RESTARTS]``.

MODE ``straight`` never kills; ``once`` kills on the first attempt only (a marker file in
OUT); ``always`` kills at every attempt. Rank 0 writes ``OUT/result.json``: the weights,
``trainer.restarts`` and the global step. Under torchrun, torchrun does the restarts
(``--max-restarts``) and the Trainer's ``max_restarts`` stays 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage


class Net(torch.nn.Module):
    def __init__(self, out: str, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )
        # The global step, in the model's state: a resumed attempt knows where it is.
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.out, self.mode = out, mode

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.step += 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 1 and int(self.step) == 7 and self.mode != "straight":
            marker = Path(self.out, "killed")
            if self.mode == "always" or not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def main() -> None:
    out, backend, mode = sys.argv[1:4]
    restarts = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, generator=generator)
    data = DataLoader(TensorDataset(x, x[:, :1] * x[:, 1:2]), batch_size=4, shuffle=True)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    trainer = cardcage.Trainer(
        distributed_backend=backend,
        num_processes=2,
        max_epochs=2,
        checkpoint_every_n_steps=2,
        max_restarts=0 if torchrun else restarts,
        default_root_dir=str(Path(out, "root")) if torchrun else None,
        progress_bar=False,
    )
    model = Net(out, mode)
    trainer.fit(model, data)
    if int(os.environ.get("RANK", "0")) == 0:
        weights = [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]
        result = {"weights": weights, "restarts": trainer.restarts, "step": trainer.global_step}
        Path(out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
