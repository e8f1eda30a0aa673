"""A 2-process job whose rank 1 SIGKILLs itself at global step 7 of 8 (2 epochs of 4 steps,
checkpoint every 2 steps): ``python restart_job.py OUT BACKEND MODE [MAX_RESTARTS] [KEY=VALUE...]``.

MODE ``straight`` never kills; ``once`` kills on the first attempt only (a marker file in
OUT); ``always`` kills at every attempt. Rank 0 writes ``OUT/result.json``: the weights,
``trainer.restarts`` and the global step. Under torchrun, torchrun does the restarts
(``--max-restarts``) and the Trainer's ``max_restarts`` stays 0.

Options: ``every=N`` (``checkpoint_every_n_steps``, 2), ``root=DIR`` (``default_root_dir``;
under torchrun ``OUT/root`` by default, else none), ``lr=X`` (Adam's, 0.01), ``hidden=N``
(the hidden layer's width, 16: another width is another model shape), ``leave=STATUS``
(rank 1 exits with ``os._exit(STATUS)`` where it would SIGKILL itself), and ``write=die`` or
``write=stall``: rank 0 stops inside its first checkpoint write, after the temporary file
was made (its scheduler's state holds an object whose pickling SIGKILLs the process, or
sleeps, 0.1 s at a time, until the process is stopped; ``OUT/in-write`` marks the moment).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import cardcage


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class Net(torch.nn.Module):
    def __init__(self, out: str, mode: str, options: dict[str, str]) -> None:
        super().__init__()
        torch.manual_seed(0)
        hidden = int(options.get("hidden", 16))
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden),
            torch.nn.Tanh(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(hidden, 1),
        )
        # The global step, in the model's state: a resumed attempt knows where it is.
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.out, self.mode = out, mode
        self.lr = float(options.get("lr", 0.01))
        self.write = options.get("write")
        self.leave = options.get("leave")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.step += 1
        if rank() == 1 and int(self.step) == 7 and self.mode != "straight":
            marker = Path(self.out, "killed")
            if self.mode == "always" or not marker.exists():
                marker.touch()
                if self.leave is not None:
                    os._exit(int(self.leave))  # leaves without a word, as a callback may
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        if self.write is None:
            return optimizer
        return [optimizer], [StopInsideWrite(optimizer, self.out, self.write)]


class StopInsideWrite:
    """A scheduler that changes nothing; its state, pickled inside ``torch.save``, stops
    rank 0 there (``die``: SIGKILL; ``stall``: sleep until stopped from outside)."""

    def __init__(self, optimizer: torch.optim.Optimizer, out: str, how: str) -> None:
        self.optimizer, self.out, self.how = optimizer, out, how

    def step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"stop": _Stop(self.out, self.how)} if rank() == 0 else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _Stop:
    def __init__(self, out: str, how: str) -> None:
        self.out, self.how = out, how

    def __reduce__(self) -> Any:
        Path(self.out, "in-write").write_text(str(os.getpid()))
        if self.how == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        for _ in range(6000):  # a long write: back in Python between its pieces, as torch's is
            time.sleep(0.1)
        return (dict, ())


def main() -> None:
    out, backend, mode = sys.argv[1:4]
    rest = sys.argv[4:]
    restarts = int(rest.pop(0)) if rest and rest[0].isdigit() else 2
    options = dict(arg.split("=", 1) for arg in rest)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, generator=generator)
    data = DataLoader(TensorDataset(x, x[:, :1] * x[:, 1:2]), batch_size=4, shuffle=True)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    root = options.get("root") or (str(Path(out, "root")) if torchrun else None)
    trainer = cardcage.Trainer(
        distributed_backend=backend,
        num_processes=2,
        max_epochs=2,
        checkpoint_every_n_steps=int(options.get("every", 2)),
        max_restarts=0 if torchrun else restarts,
        default_root_dir=root,
        progress_bar=False,
    )
    model = Net(out, mode, options)
    trainer.fit(model, data)
    if int(os.environ.get("RANK", "0")) == 0:
        weights = [float(v) for p in model.parameters() for v in p.detach().reshape(-1)]
        result = {"weights": weights, "restarts": trainer.restarts, "step": trainer.global_step}
        Path(out, "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
