"""The process-creation role of a backend: how its training processes come to exist.

A :class:`Launcher` is made by ``Accelerator.train`` in the process that called ``fit``; its
``launch(trainer)`` makes sure that ``trainer.run_fit_loop()`` runs once in every training
process of this node and returns what ``fit`` returns. The core ships:

- :class:`InProcessLauncher`: this process is the only one (cpu, gpu, dp, one TPU core);
- :class:`ScriptLauncher`: this process trains as local rank 0 and re-runs the user's script
  for the other local ranks, or joins the processes a cluster (torchrun, SLURM, mpirun)
  already made (ddp, ddp2);
- :class:`~cardcage.backend.launch.workers.WorkerLauncher` and
  :class:`~cardcage.backend.launch.workers.SpawnLauncher`: workers that receive the pickled
  trainer and hand the trained state back (ddp_spawn; the base of horovod's and tpu's
  launchers, which only say how to start N workers).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

from cardcage.backend.launch import relaunch
from cardcage.backend.launch.error_files import departure, write_error_file
from cardcage.backend.launch.rendezvous import DEFAULT_ADDRESS

if TYPE_CHECKING:
    from cardcage.backend.strategy.strategy import Strategy
    from cardcage.backend.trainer_protocol import TrainerProtocol as Trainer


class Launcher(abc.ABC):
    """Creates the training processes of one ``fit`` and runs the loop in each."""

    #: Whether this launcher owns every process of the job, so that ``max_restarts`` can
    #: start them again after a rank died (:mod:`cardcage.backend.launch.restarts`).
    restartable: ClassVar[bool] = False

    def __init__(self, accelerator: Strategy):
        self.accelerator = accelerator

    def reset(self) -> None:
        """Forget a failed attempt before :meth:`launch` runs again (``max_restarts``)."""
        return None  # nothing to forget here

    @abc.abstractmethod
    def launch(self, trainer: Trainer) -> Any:
        """Run ``trainer.run_fit_loop()`` in every training process of this node.

        Called once, in the process that called ``fit``. When it returns there,
        ``trainer.model`` holds the trained weights of rank 0 (workers hand them back) and
        what it returns is what ``fit`` returns.
        """


class InProcessLauncher(Launcher):
    """Train in this process: it is the job's only one."""

    def launch(self, trainer: Trainer) -> Any:
        return trainer.run_fit_loop()


class ScriptLauncher(Launcher):
    """Script relaunch, or the processes a cluster made.

    Unless a cluster (or an earlier ``fit`` of this script) created the processes, this
    process re-runs the user's script once per extra local rank (``python script.py args``
    or ``python -m module args``) and trains as local rank 0; the children are supervised.
    """

    @property
    def restartable(self) -> bool:  # type: ignore[override]
        """Restartable when this process starts every rank: one node, no cluster."""
        selection = self.accelerator.selection
        return selection.num_nodes == 1 and not selection.processes_created_outside

    def reset(self) -> None:
        """Leave the failed attempt's process group and forget its (stopped) children."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        relaunch.forget()

    def launch(self, trainer: Trainer) -> Any:
        selection = self.accelerator.selection
        supervisor = relaunch.current_supervisor()
        if supervisor is None and not selection.processes_created_outside:
            supervisor = relaunch.relaunch_script(
                node_rank=selection.node_rank,
                processes_per_node=selection.num_processes,
                num_nodes=selection.num_nodes,
                master_address=selection.master_address or DEFAULT_ADDRESS,
                master_port=selection.master_port,
                gpu_ids=selection.gpu_ids,
            )
        if supervisor is None:
            try:
                return trainer.run_fit_loop()
            except BaseException as error:
                # A relaunched child: its traceback goes to the launcher's RankFailedError.
                write_error_file(error)
                # No launcher of ours watches (torchrun, srun): a peer that left is named.
                if selection.processes_created_outside and isinstance(error, Exception):
                    gone = departure(stopped=stopped_by(selection.cluster))
                    if gone is not None:
                        raise gone from error
                raise
        return supervisor.run(trainer.run_fit_loop)


def stopped_by(cluster: str) -> str:
    """Who stops the other ranks of a job whose processes ``cluster``'s launcher started
    (cardcage stops none of them there), as :class:`~cardcage.errors.RankFailedError`
    says it."""
    if cluster == "torchelastic":
        return "torchrun stops the other ranks (cardcage did not start them)"
    if cluster == "slurm":
        return (
            "srun stops the other ranks only with --kill-on-bad-exit (cardcage did not start "
            "them); else each fails at its next collective"
        )
    return (
        f"the launcher of cluster {cluster!r} stops the other ranks (cardcage did not start "
        "them); else each fails at its next collective"
    )
