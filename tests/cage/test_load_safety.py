"""``cage.load`` reads a file only as ``torch.load(weights_only=True)`` does, through the
checkpoint reader the Trainer uses: an unsafe, truncated, empty or missing file is a
MisconfigurationError naming the file and what is not allowed, and never suggests
``weights_only=False``; nothing in the file runs."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import cardcage


class Planted:
    """Unpickling it would create ``path``: what a malicious file would run instead."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.mkdir, (str(self.path),))


def load(job: Any, path: Path) -> str:
    cage = cardcage.Cage()
    model = job.make_model()
    model, optimizer = cage.setup(model, job.sgd(model))
    with pytest.raises(cardcage.MisconfigurationError) as raised:
        cage.load(path, {"model": model, "optimizer": optimizer})
    message = str(raised.value)
    assert "weights_only=False" not in message, message
    assert message.startswith(f"cage.load: {str(path)!r} "), message
    return message


def test_a_file_holding_an_object_is_refused_and_nothing_in_it_runs(
    tmp_path: Path, job: Any
) -> None:
    planted = tmp_path / "planted"
    path = tmp_path / "unsafe.ckpt"
    torch.save({"model": job.make_model().state_dict(), "extra": Planted(planted)}, path)
    message = load(job, path)
    assert "was refused by torch.load(weights_only=True)" in message
    assert "it holds an object of posix.mkdir" in message, message
    assert "cardcage never loads one" in message
    assert "Give a checkpoint written by cage.save" in message
    assert not planted.exists()


def test_a_plain_pickle_truncated_empty_missing_or_folder_is_refused_by_name(
    tmp_path: Path, job: Any
) -> None:
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"model": 1}))
    assert "is truncated or not a torch file" in load(job, plain)
    whole = tmp_path / "whole.ckpt"
    torch.save({"model": job.make_model().state_dict()}, whole)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(whole.read_bytes()[:100])
    assert "is truncated or not a torch file" in load(job, cut)
    empty = tmp_path / "empty.ckpt"
    empty.touch()
    assert "is empty (0 bytes)" in load(job, empty)
    assert load(job, tmp_path / "none.ckpt").endswith(
        "does not exist. Give the path of a checkpoint written by cage.save."
    )
    assert "is a folder" in load(job, tmp_path)
    tensor = tmp_path / "tensor.ckpt"
    torch.save(torch.zeros(2), tensor)
    assert "holds a Tensor, not the dict that cage.save writes" in load(job, tensor)


def test_a_file_cage_save_wrote_still_loads(tmp_path: Path, job: Any) -> None:
    cage = cardcage.Cage()
    model = job.make_model()
    model, optimizer = cage.setup(model, job.sgd(model))
    cage.save(tmp_path / "good.ckpt", {"model": model, "optimizer": optimizer, "epoch": 3})
    other = job.make_model(1)
    other, other_optimizer = cage.setup(other, job.sgd(other))
    rest = cage.load(tmp_path / "good.ckpt", {"model": other, "optimizer": other_optimizer})
    assert rest == {"epoch": 3}
    assert job.weights(other) == job.weights(model)
