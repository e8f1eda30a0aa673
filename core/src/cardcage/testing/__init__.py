"""``cardcage.testing``: the conformance kit every backend plugin runs against itself.

In a plugin's tests, one class is enough::

    from cardcage.testing import BackendSuite, Launch

    class TestAcme(BackendSuite):
        backend = "acme"
        launches = {"two_processes": Launch({"distributed_backend": "acme",
                                             "num_processes": 2}, world_size=2)}

pytest (through the ``cardcage.testing`` plugin, registered with the ``pytest11`` entry
point) then runs the contract's checks against the backend: it loads alone and strictly;
its names are its own; selection and availability start no process, thread or socket and
create no CUDA context; selections in fake environments (plain, torchrun rank 1, SLURM,
horovodrun, two nodes) are explained or refused with a message, with the rank, world size
and rule each one calls for; and, for each launch, a job whose every rank (each built from
its own seed) trains this backend like a plain PyTorch loop at batch = world size x
per-process batch (SGD with momentum, Adam with a scheduler, shuffled or not, uneven
data, ``drop_last``, two optimizers, ``max_steps`` mid-epoch, gradient accumulation,
clipping, a step-interval scheduler, and an early stop asked by one rank that every rank
obeys at the same step), with the lifecycle in its
order, the user's model whole after ``fit``, validation reduced across ranks, checkpoints
after fit, between steps
and from inside ``training_step`` that load with ``weights_only=True``, record their step
and hold its weights and the optimizer state of every parameter, and resume other weights
to the uninterrupted run's, a failing rank named with no process left, and no process or
temporary folder left behind. The same job then trains through :class:`cardcage.Cage`, a
loop the user writes (one more ``launch``, every rank reporting its own result): momentum
SGD, Adam on shuffled data and clipping (by norm, after ``no_backward_sync`` accumulation,
and by value) like the plain loop at world size x batch, ``no_backward_sync`` accumulation
that leaves each rank its own gradients until the last micro-batch, ``save`` then ``load``
into other weights resuming Adam to the uninterrupted run's with a file that loads with
``weights_only=True`` (the net's own ``state_dict``, the whole optimizer state),
``all_reduce``, ``all_gather``, ``broadcast`` and ``barrier``, rank 0's return value in every
process that called ``launch``, and a failing rank named with no process left. A suite may
declare ``sharded_optimizer_state = True`` (each rank holds only part of the optimizer
state) and ``resume_world_sizes`` (a checkpoint saved at one world size resumes at another):
see docs/testing-a-backend.md.
"""

from __future__ import annotations

from cardcage.testing.own_loop_checks import OwnLoopChecks
from cardcage.testing.selection_checks import SelectionChecks
from cardcage.testing.suite import Launch

__all__ = ["BackendSuite", "Launch"]


class BackendSuite(SelectionChecks, OwnLoopChecks):
    """The whole conformance suite; subclass it as ``Test<Backend>`` (see the module)."""
