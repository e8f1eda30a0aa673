"""What a Trainer's ``fit`` and a Cage's ``launch`` do alike around the backend.

Both check what a launch needs before any process, port or CUDA context exists
(:func:`prepare_launch`), set the process-wide flags in each training process
(:func:`apply_process_flags`), and send the backend to spawned workers without the
environment the selection was made in (:func:`portable_backend`).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

import torch

from cardcage import devices
from cardcage.backend.launch import rendezvous
from cardcage.environments import inherited
from cardcage.selection.engine import probe_pending_gpus

if TYPE_CHECKING:
    from cardcage.backend.accelerator import Accelerator
    from cardcage.backend.selection_types import Selection
    from cardcage.config.flags import Flags


def prepare_launch(selection: Selection, accelerator: Accelerator) -> Selection:
    """In the calling process, before anything starts: the GPUs ``auto_select_gpus`` left to
    probe (``select`` creates no CUDA context), the CUDA environment for the chosen GPUs,
    and the rendezvous address, port and process count. Returns the selection to launch
    with (the probed one, which the accelerator then holds too)."""
    probed = probe_pending_gpus(selection)
    if probed is not selection:
        accelerator.selection = probed
    if probed.gpu_ids:
        devices.apply_cuda_environment(
            probed.gpu_ids, slurm_managing_tasks=probed.cluster == "slurm"
        )
    rendezvous.check_launch(probed, accelerator.needs_rendezvous)
    return probed


def apply_process_flags(flags: Flags) -> None:
    """``benchmark`` and ``deterministic`` in a training process (the caller's own settings
    come back when its fit or launch returns: :mod:`cardcage.train.process_state`), and
    ``CARDCAGE_RANK_PID``: the rank variables of this process are its own, not those of a
    subprocess it starts (:mod:`cardcage.environments.inherited`)."""
    inherited.mark()
    if flags.benchmark:
        torch.backends.cudnn.benchmark = True
    if flags.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def portable_backend(
    selection: Selection, accelerator: Accelerator
) -> tuple[Selection, Accelerator]:
    """The selection and a copy of the accelerator as workers receive them: without the
    environment the selection was made in (it holds ``os.environ``)."""
    portable = dataclasses.replace(selection, environment=None)
    copied = copy.copy(accelerator)
    copied.selection = portable
    return portable, copied
