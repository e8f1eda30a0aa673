"""The hooks a cardcage plugin may implement.

Implement a hook with a module-level function of the same name decorated with
:data:`cardcage.hookimpl`, and point the ``cardcage`` entry-point group at the module::

    [project.entry-points.cardcage]
    foo = "cardcage_foo"

Every hook here is typed and documented; a test fails when one is not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from cardcage.backend.accelerator import Accelerator
    from cardcage.backend.trainer_protocol import TrainerProtocol as Trainer
    from cardcage.environments.base import ClusterEnvironment
    from cardcage.loggers.base import Logger
    from cardcage.plugins.commands import Commands

NAME = "cardcage"
_spec = pluggy.HookspecMarker(NAME)
hookimpl = pluggy.HookimplMarker(NAME)


@_spec
def cardcage_accelerators() -> list[type[Accelerator]]:
    """Register backends.

    Called once per plugin when plugins are loaded. Each returned class becomes selectable by
    its ``name`` and ``aliases`` and takes part in automatic selection through its ``rules``.
    Two plugins claiming one name or alias is an error naming both distributions.

    :return: the :class:`~cardcage.Accelerator` subclasses this plugin provides.
    """
    raise AssertionError("hookspec")  # pragma: no cover


@_spec
def cardcage_cluster_environments() -> list[type[ClusterEnvironment]]:
    """Register cluster environments (schedulers or launchers that create processes).

    Environments are detected in ascending ``order`` before the built-in fallback to the
    local machine; the built-in ones are horovodrun/mpirun (100), torchelastic (200) and
    SLURM (300), so pick an order that places yours where it belongs.

    :return: the :class:`~cardcage.environments.builtin.ClusterEnvironment` subclasses this plugin
        provides.
    """
    raise AssertionError("hookspec")  # pragma: no cover


@_spec
def cardcage_loggers() -> list[type[Logger]]:
    """Register loggers that ``Trainer(logger="<name>")`` selects by name.

    Called once per plugin when plugins are loaded. Each returned class is a concrete
    :class:`~cardcage.sdk.Logger` subclass, registered under its ``logger_name`` (without
    regard to case); ``Trainer(logger="<logger_name>")`` builds it as
    ``cls(save_dir=default_root_dir)``, so every other argument of its constructor needs a
    default. A name that a built-in logger (``csv``, ``tensorboard``) or another plugin
    already has is an error naming both; a class that is not a concrete ``Logger`` subclass
    with a ``logger_name``, or cannot be built with ``save_dir`` alone, makes the plugin fail
    to load (listed by ``cardcage plugins``). A logger instance needs no registration:
    ``Trainer(logger=MyLogger(...))`` takes any ``Logger``.

    :return: the :class:`~cardcage.sdk.Logger` subclasses this plugin provides.
    """
    raise AssertionError("hookspec")  # pragma: no cover


@_spec
def cardcage_env_report() -> dict[str, str]:
    """Add lines to ``cardcage env``, the text a bug report needs.

    Called only by ``cardcage env``; it may import heavy modules.

    :return: a mapping of label to value, shown under the plugin's name.
    """
    raise AssertionError("hookspec")  # pragma: no cover


@_spec(firstresult=True)
def cardcage_setup(trainer: Trainer, accelerator: Accelerator) -> bool | None:
    """Prepare a run in the process that called ``fit``, before any training process starts.

    Called once per ``fit``, before :func:`cardcage_train`, in the calling process, for every
    backend. The core's own implementation runs last and calls
    ``accelerator.setup(trainer)``; wrap it with ``@hookimpl(wrapper=True)`` to observe or
    extend it without subclassing a backend.

    :param trainer: the :class:`~cardcage.Trainer` being fitted, or the job of a
        :meth:`cardcage.Cage.launch` (its ``flags``, ``selection`` and ``accelerator``).
    :param accelerator: the backend instance selected for the run.
    :return: ``True`` once set up (first result wins).
    """
    raise AssertionError("hookspec")  # pragma: no cover


@_spec(firstresult=True)
def cardcage_train(trainer: Trainer, accelerator: Accelerator) -> object:
    """Run the training of ``trainer.fit`` in the process that called it.

    Called once per ``fit``, after :func:`cardcage_setup`. The core's own implementation
    runs last and calls ``accelerator.train(trainer)``, which trains here or starts the
    processes that do. Wrap it with ``@hookimpl(wrapper=True)`` to time, log or guard a
    whole run; what it returns is what ``fit`` returns.

    :param trainer: the :class:`~cardcage.Trainer` being fitted, or the job of a
        :meth:`cardcage.Cage.launch`.
    :param accelerator: the backend instance selected for the run.
    :return: the backend's result (``None`` for the built-in backends).
    """
    raise AssertionError("hookspec")  # pragma: no cover


@_spec(firstresult=True)
def cardcage_setup_process(trainer: Trainer, accelerator: Accelerator) -> bool | None:
    """Set up one training process of a ``fit``: join the job, place and wrap the model.

    Called once in every process that a Trainer trains in (the caller itself for
    one-process backends, each relaunched, spawned or cluster-started process otherwise),
    before
    ``configure_optimizers`` and before a checkpoint is restored. The core's own
    implementation runs last and calls ``accelerator.setup_process(trainer)``. A
    :class:`cardcage.Cage` calls the backend's ``setup_environment`` and ``setup_module``
    itself (the user's function sets its modules up), not this hook.

    :param trainer: the :class:`~cardcage.Trainer` in this process.
    :param accelerator: the backend instance in this process (its ranks are this
        process's once the core's implementation has run).
    :return: ``True`` once set up (first result wins).
    """
    raise AssertionError("hookspec")  # pragma: no cover


@_spec(firstresult=True)
def cardcage_teardown_process(trainer: Trainer, accelerator: Accelerator) -> bool | None:
    """Tear down one training process when its training ends, also after a failure.

    Called once in every process that ran :func:`cardcage_setup_process`, whether training
    finished, failed or was interrupted. The core's own implementation runs last and calls
    ``accelerator.teardown(trainer)``.

    :param trainer: the :class:`~cardcage.Trainer` in this process.
    :param accelerator: the backend instance in this process.
    :return: ``True`` once torn down (first result wins).
    """
    raise AssertionError("hookspec")  # pragma: no cover


@_spec
def cardcage_cli_commands(commands: Commands) -> None:
    """Add subcommands to the ``cardcage`` command line (llm's ``register_commands``).

    Called once per plugin each time the ``cardcage`` command builds its parser, with a
    registrar; call ``commands.add(name, run, help=..., arguments=...)`` for each command::

        @cardcage.hookimpl
        def cardcage_cli_commands(commands):
            commands.add("hello", run_hello, help="say hello", arguments=add_hello_arguments)

    ``run(args)`` gets the parsed :class:`argparse.Namespace` and returns the exit status; a
    :class:`~cardcage.MisconfigurationError` it raises becomes one line on stderr and exit
    status 2. ``arguments(parser)`` adds the command's arguments to its subparser
    (``cardcage.plugins.commands.add_trainer_flags`` adds the Trainer flags). Import heavy modules
    inside ``run``, not here: every ``cardcage`` command calls this hook. A name that a
    built-in command or another plugin already has is an error naming both plugins.

    :param commands: the registrar (:class:`~cardcage.plugins.commands.Commands`); its ``add``
        method adds one command.
    """
    raise AssertionError("hookspec")  # pragma: no cover
