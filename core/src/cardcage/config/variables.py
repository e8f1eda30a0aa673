"""cardcage's own environment variables: each one read and checked in one place.

Every ``CARDCAGE_*`` variable a user may set is listed in :data:`VARIABLES` with what it
means; :func:`check_variables` checks all of them in the calling process before any process
starts (``select``, and so the ``Trainer`` constructor), so that a bad value is a
:class:`~cardcage.errors.MisconfigurationError` naming the variable, its value and the fix,
never a failure of a training process minutes later.

The parsers live here and the modules that act on a variable call them: the switches
(:func:`env_switch`, also the SDK's), the requeue signal (:func:`parse_signal`), the
plugin settings (:mod:`cardcage.plugins.manager`). Two kinds of ``CARDCAGE_*`` variable are
not here:

- a backend's own: ``CARDCAGE_HOROVOD_SCALE_LR``, the horovod plugin's, and
  ``CARDCAGE_FSDP_STATE_DICT``, read by the SDK's ``ShardedAccelerator``
  (:mod:`cardcage.backend.sharded`) for every backend built on it (``fsdp``'s and others').
  The backend checks it, in its constructor, which the ``Trainer`` constructor calls;
- the internal ones (:data:`INTERNAL`), which cardcage sets for the processes it starts.
"""

from __future__ import annotations

import math
import os
import signal
import tempfile
from collections.abc import Mapping
from pathlib import Path

from cardcage.errors import MisconfigurationError

INIT_TIMEOUT = "CARDCAGE_INIT_TIMEOUT"
TIMEOUT = "CARDCAGE_TIMEOUT"
STUCK_WARN = "CARDCAGE_STUCK_WARN"
GPUS = "CARDCAGE_GPUS"
PLUGINS = "CARDCAGE_PLUGINS"
DISABLE_PLUGINS = "CARDCAGE_DISABLE_PLUGINS"
PLUGINS_AUTOLOAD = "CARDCAGE_PLUGINS_AUTOLOAD"
STRICT_PLUGINS = "CARDCAGE_STRICT_PLUGINS"
REQUEUE_SIGNAL = "CARDCAGE_REQUEUE_SIGNAL"
REQUEUE_DIR = "CARDCAGE_REQUEUE_DIR"
CHECKPOINT_DIR = "CARDCAGE_CHECKPOINT_DIR"
RESTART_FROM = "CARDCAGE_RESTART_FROM"

#: The variables a user sets, with what each one means (``cardcage`` checks all of them).
VARIABLES: dict[str, str] = {
    INIT_TIMEOUT: "seconds every rank may take to reach the rendezvous (default 300)",
    TIMEOUT: "seconds a rank may keep the others waiting before the job fails (default 1800)",
    STUCK_WARN: "seconds of waiting after which the rank that keeps the others waiting is "
    "named, with its stack (default 60, or half of CARDCAGE_TIMEOUT when shorter)",
    GPUS: "overrides the gpus flag (its string form: '1' is GPU 1, '2,3', '-1' all); checked "
    "by select() against the GPUs this machine has (cardcage.devices.parse_gpu_ids)",
    PLUGINS: "comma-separated entry-point names of plugins to load even with autoload off; a "
    "name no distribution provides warns",
    DISABLE_PLUGINS: "comma-separated entry-point names of plugins never to load; a name no "
    "distribution provides warns",
    PLUGINS_AUTOLOAD: "0 loads no entry-point plugin but those in CARDCAGE_PLUGINS (a switch, "
    "default 1)",
    STRICT_PLUGINS: "1 makes a plugin that fails to load an error (a switch, default 0)",
    REQUEUE_SIGNAL: "the signal that asks a job to checkpoint and requeue itself: a name "
    "(USR1), a number, or none (default: the cluster environment's, SIGUSR1 under SLURM)",
    REQUEUE_DIR: "the folder of the requeue checkpoint (a folder that is or can be made writable)",
    CHECKPOINT_DIR: "the folder of step checkpoints when default_root_dir is None (fit sets "
    "it for the processes it starts; a folder that is or can be made writable)",
    RESTART_FROM: "the checkpoint a restarted process resumes from (cardcage sets it for a "
    "restart; an existing file)",
}

#: ``CARDCAGE_*`` variables that cardcage (or its test kit) sets for the processes it starts,
#: not a user: not checked, and not to be set by hand.
INTERNAL: tuple[str, ...] = (
    # where a started rank writes its traceback (cardcage.backend.launch.error_files)
    "CARDCAGE_ERROR_FILE",
    # the launcher hosts the rendezvous store (cardcage.backend.launch.rendezvous)
    "CARDCAGE_HOSTED_STORE",
    # the folder of the ranks' progress counts (cardcage.backend.launch.watchdog)
    "CARDCAGE_HEARTBEAT",
    # the pid of the training process whose rank variables these are
    # (cardcage.environments.inherited)
    "CARDCAGE_RANK_PID",
    # marks the processes of a job's own service (a local Ray) for its reaper
    # (cardcage.backend.launch.reaper)
    "CARDCAGE_REAPED",
    "CARDCAGE_RUN_ID",  # the fit a started process belongs to (cardcage.backend.launch.restarts)
    "CARDCAGE_RESTARTS",  # the restart a started process is on (cardcage.backend.launch.restarts)
    "CARDCAGE_SUBMIT_RUN",  # the run a job submitted by cardcage-submit belongs to
    "CARDCAGE_TEST_*",  # the conformance kit's and the tests' own
    "CARDCAGE_KIT_*",
)

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
#: Values of CARDCAGE_REQUEUE_SIGNAL that turn checkpoint-and-requeue off.
REQUEUE_OFF = ("", "0", "none", "off", "no", "false")


#: The longest duration a ``CARDCAGE_*`` variable may hold, in seconds (about 31 years).
#: torch's gloo process group and TCPStore turn a timeout into a deadline of now + timeout
#: in int64 nanoseconds since 1970; past that (measured: 7.4e9 s in 2026, 7.5e9 s fails)
#: the deadline overflows and every wait times out at once ("Timed out waiting
#: 10000000030000ms" for 1e10), and ``timedelta`` itself refuses 1e308 (OverflowError).
#: Python's thread waits stop at ``threading.TIMEOUT_MAX`` (9.2e9 s). 1e9 s is under all of
#: them with room to spare (the collective timeout adds 30 s; the overflow nears as the
#: clock advances: 1e9 s fits until the year 2230).
MAX_SECONDS = 1e9


def seconds(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """The positive, finite number of seconds, at most :data:`MAX_SECONDS`, the variable
    ``name`` holds (``default`` when unset or empty) in ``env`` (default: ``os.environ``)."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise MisconfigurationError(
            f"environment variable {name}={raw!r} is not a positive number of seconds. "
            f"Set it to one (for example {name}={default:g}, the default), or unset it."
        )
    if value > MAX_SECONDS:
        raise MisconfigurationError(
            f"environment variable {name}={raw!r} is longer than torch can wait: the largest "
            f"value that works is {MAX_SECONDS:.0f} seconds (about 31 years). Beyond about "
            "7.4e9 s, torch's gloo and TCPStore deadlines (now + the timeout, in nanoseconds) "
            "overflow and every wait times out at once; 1e308 overflows timedelta. Set "
            f"{name} to at most {MAX_SECONDS:.0f}, or unset it (default {default:g})."
        )
    return value


def init_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds every rank may take to arrive (``CARDCAGE_INIT_TIMEOUT``, default 300)."""
    return seconds(INIT_TIMEOUT, 300.0, env)


def job_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds a rank may keep the others waiting before the job fails
    (``CARDCAGE_TIMEOUT``, default 1800)."""
    return seconds(TIMEOUT, 1800.0, env)


def stuck_warn(env: Mapping[str, str] | None = None) -> float:
    """Seconds of waiting after which the rank that keeps the others waiting is named
    (``CARDCAGE_STUCK_WARN``, default 60, or half of ``CARDCAGE_TIMEOUT`` when that is
    shorter: the watcher names a rank only once this much has passed, and the process group
    gives up soon after ``CARDCAGE_TIMEOUT``). A value above ``CARDCAGE_TIMEOUT`` is refused
    for the same reason."""
    timeout = job_timeout(env)
    warn = seconds(STUCK_WARN, min(60.0, timeout / 2), env)
    if warn > timeout:
        source = os.environ if env is None else env
        raise MisconfigurationError(
            f"environment variable {STUCK_WARN}={source.get(STUCK_WARN, '').strip()!r} is longer "
            f"than {TIMEOUT}={timeout:g}: a stuck rank would never be named, as the process "
            f"group gives up first. Set {STUCK_WARN} to at most {timeout:g} (or unset it: the "
            f"default is min(60, {TIMEOUT}/2) = {min(60.0, timeout / 2):g})."
        )
    return warn


def env_switch(
    env: Mapping[str, str],
    name: str,
    default: bool,
    on: str = "",
    off: str = "",
    *,
    empty: bool | None = None,
) -> bool:
    """A 1/0 environment variable (also true/false, yes/no, on/off), or ``default`` when
    unset; an empty value is ``empty`` (``default`` when not given). Anything else is an
    error saying what 1 (``on``) and 0 (``off``) do."""
    raw = env.get(name)
    if raw is None:
        return default
    word = raw.strip().lower()
    if not word:
        return default if empty is None else empty
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise MisconfigurationError(
        f"environment variable {name}={raw!r} is not valid: set it to 1"
        + (f" to {on}" if on else "")
        + ", or 0"
        + (f" to {off}" if off else "")
        + "."
    )


def plugins_autoload(env: Mapping[str, str]) -> bool:
    """``CARDCAGE_PLUGINS_AUTOLOAD``: whether every installed plugin loads (default yes)."""
    return env_switch(
        env,
        PLUGINS_AUTOLOAD,
        True,
        "load every installed plugin (the default)",
        f"load only the plugins {PLUGINS} names",
        empty=True,
    )


def strict_plugins(env: Mapping[str, str]) -> bool:
    """``CARDCAGE_STRICT_PLUGINS``: whether a plugin that fails to load is an error."""
    return env_switch(
        env,
        STRICT_PLUGINS,
        False,
        "make a plugin that fails to load an error",
        "skip it and list it in `cardcage plugins` (the default)",
        empty=True,
    )


def plugin_names(env: Mapping[str, str], name: str) -> set[str]:
    """The entry-point names in the comma-separated variable ``name`` (``CARDCAGE_PLUGINS``,
    ``CARDCAGE_DISABLE_PLUGINS``); whether they are installed is for plugin loading to say."""
    return {piece.strip() for piece in (env.get(name) or "").split(",") if piece.strip()}


def parse_signal(value: str, source: str = REQUEUE_SIGNAL) -> signal.Signals | None:
    """A signal named like ``USR1``, ``SIGUSR1`` or ``10``; ``None`` for ``none``/``off``/``0``."""
    text = value.strip()
    if text.lower() in REQUEUE_OFF:
        return None
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        name = text.upper()
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        pass
    raise MisconfigurationError(
        f"{source}={value!r} is not a signal. Use a name such as USR1 or USR2 (the one given "
        "to sbatch --signal), a number, or none to turn checkpoint-and-requeue off."
    )


def folder(env: Mapping[str, str], name: str) -> Path | None:
    """The folder the variable ``name`` holds (``None`` when unset or empty), checked to be a
    folder that is writable or can be made in a writable one."""
    raw = env.get(name, "")
    if not raw.strip():
        return None
    path = Path(raw).expanduser()
    fix = f"Set {name} to a folder you can write to, or unset it."
    if path.exists() and not path.is_dir():
        raise MisconfigurationError(
            f"environment variable {name}={raw!r} is a file, not a folder. {fix}"
        )
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise MisconfigurationError(
            f"environment variable {name}={raw!r} cannot be made: {str(existing)!r} is a file, "
            f"not a folder. {fix}"
        )
    try:  # a real file, not the permission bits: root passes those in /proc too
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError:
        where = "is" if existing == path else f"would be made in {str(existing)!r}, which is"
        raise MisconfigurationError(
            f"environment variable {name}={raw!r} {where} not writable. {fix}"
        ) from None
    return path


def existing_file(env: Mapping[str, str], name: str) -> Path | None:
    """The file the variable ``name`` holds (``None`` when unset or empty), checked to exist."""
    raw = env.get(name, "")
    if not raw.strip():
        return None
    path = Path(raw).expanduser()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise MisconfigurationError(
            f"environment variable {name}={raw!r} {what}: it names the checkpoint to resume "
            f"from. Unset {name} to start afresh (or use resume_from_checkpoint=path)."
        )
    return path


def check_variables(env: Mapping[str, str] | None = None) -> None:
    """Check every ``CARDCAGE_*`` variable that is set in ``env`` (default:
    ``os.environ``); raise :class:`~cardcage.errors.MisconfigurationError` for the first bad
    one.

    ``CARDCAGE_GPUS`` is checked by ``select`` (it needs the GPU count), the names in
    ``CARDCAGE_PLUGINS`` and ``CARDCAGE_DISABLE_PLUGINS`` by plugin loading (a warning
    for a name that is not installed), a plugin's own variables by the plugin.
    """
    env = os.environ if env is None else env
    init_timeout(env)
    job_timeout(env)
    stuck_warn(env)
    plugins_autoload(env)
    strict_plugins(env)
    if REQUEUE_SIGNAL in env:
        parse_signal(env[REQUEUE_SIGNAL])
    folder(env, REQUEUE_DIR)
    folder(env, CHECKPOINT_DIR)
    existing_file(env, RESTART_FROM)
