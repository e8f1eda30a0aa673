"""Failing early on the environment: rank variables against each other, cardcage's own
``CARDCAGE_*`` variables, the plugin settings, and the rendezvous host, each refused in the
calling process with a message that names the variable, its value and the fix.

The cases of the table in test_misconfiguration.py are the one-line ones; here are the
cases that need a whole scenario, what must still pass, and what needs more than ``select``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import types
import warnings
from pathlib import Path
from typing import Any

import plugin_install
import pytest

import cardcage
from cardcage import MisconfigurationError, select
from cardcage.backend.launch import rendezvous
from cardcage.config import variables
from cardcage.environments.base import ClusterEnvironment
from cardcage.plugins import manager as plugins
from cardcage.plugins.manager import PluginManager

UNRESOLVABLE = "no-such-host.invalid"  # RFC 2606: .invalid never resolves

# --- rank variables --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "5", "RANK": "1"},
            ("LOCAL_RANK=5", "LOCAL_WORLD_SIZE=2", "0..1"),
        ),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "7"}, ("RANK=7", "WORLD_SIZE=2")),
        ({"WORLD_SIZE": "2", "RANK": "7"}, ("RANK=7", "WORLD_SIZE=2", "LOCAL_RANK unset")),
        (
            {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "7"},
            ("SLURM_PROCID=7", "SLURM_NTASKS=2", "srun"),
        ),
        (
            {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "9"},
            ("SLURM_LOCALID=9", "SLURM_NTASKS=2"),
        ),
    ],
    ids=["LOCAL_RANK", "RANK", "RANK without LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID"],
)
def test_a_rank_out_of_range_is_refused_by_select(
    cuda_count_0: int, env: dict[str, str], says: tuple[str, ...]
) -> None:
    # `cardcage explain` showed "global rank 7" for these, and the job hung.
    with pytest.raises(MisconfigurationError) as error:
        select(env=env, distributed_backend="ddp", num_processes=2)
    for fragment in says:
        assert fragment in str(error.value)


def test_slurm_localid_is_checked_against_the_tasks_of_the_busiest_node(cuda_count_0: int) -> None:
    env = {"SLURM_NTASKS": "3", "SLURM_PROCID": "2", "SLURM_NODEID": "1"}
    env["SLURM_TASKS_PER_NODE"] = "2(x1),1"  # SLURM's compressed form: [2, 1]
    assert select(env={**env, "SLURM_LOCALID": "1"}, num_processes=3).local_rank == 1
    with pytest.raises(MisconfigurationError, match=r"SLURM_LOCALID=2 .*SLURM_TASKS_PER_NODE=2"):
        select(env={**env, "SLURM_LOCALID": "2"}, num_processes=3)


def test_variables_the_detected_environment_does_not_read_are_not_checked(
    cuda_count_0: int,
) -> None:
    # A LOCAL_RANK left over in a SLURM task (no WORLD_SIZE, so not torchelastic): SLURM's
    # ranks count, and the stale variable is not held against them.
    env = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "LOCAL_RANK": "9"}
    selection = select(env={**env, "LOCAL_WORLD_SIZE": "1"}, num_processes=2)
    assert (selection.cluster, selection.global_rank, selection.local_rank) == ("slurm", 1, 1)
    # torchrun inside a SLURM allocation: torchrun's ranks count, not stale SLURM ones.
    torchrun = {"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    torchrun.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # as torchrun sets them
    stale_slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": "9", "SLURM_LOCALID": "9"}
    assert select(env={**stale_slurm, **torchrun}).global_rank == 1


def test_consistent_launch_variables_still_select(cuda_count_0: int) -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "r", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}
    torchrun.update(GROUP_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="29500")
    assert select(env=torchrun, num_nodes=2).global_rank == 3
    slurm = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "3"}
    slurm.update(SLURM_LOCALID="1", SLURM_NODEID="1", SLURM_JOB_NUM_NODES="2")
    assert select(env=slurm, num_nodes=2, num_processes=2).global_rank == 3
    assert select(env={"WORLD_SIZE": "2", "RANK": "1"}).global_rank == 0  # cardcage starts them


class BadScheduler(ClusterEnvironment):
    """A plugin's environment that passes on what its variables say, unchecked."""

    name = "badscheduler"
    order = 250
    creates_processes = True
    variables = ("BAD_SIZE", "BAD_RANK")

    @classmethod
    def detect(cls, env: Any, expected_world_size: int) -> bool:
        return "BAD_SIZE" in env

    def world_size(self) -> int:
        return int(self.env["BAD_SIZE"])

    def global_rank(self) -> int:
        return int(self.env["BAD_RANK"])


def register_bad_scheduler(inprocess_plugins: Any) -> None:
    module = types.ModuleType("cardcage_badscheduler")
    module.cardcage_cluster_environments = cardcage.hookimpl(lambda: [BadScheduler])  # type: ignore[attr-defined]
    inprocess_plugins(module, "badscheduler")


def test_a_plugin_environments_rank_out_of_range_is_refused(
    inprocess_plugins: Any, cuda_count_0: int
) -> None:
    register_bad_scheduler(inprocess_plugins)
    port = {"MASTER_PORT": "29500"}
    assert select(env={"BAD_SIZE": "2", "BAD_RANK": "1", **port}).global_rank == 1
    with pytest.raises(MisconfigurationError) as error:
        select(env={"BAD_SIZE": "2", "BAD_RANK": "7", **port})
    message = str(error.value)
    assert "'badscheduler'" in message and "global rank 7" in message
    assert "BAD_SIZE, BAD_RANK" in message


def test_a_plugin_environment_without_a_port_is_refused_at_select(
    inprocess_plugins: Any, cuda_count_0: int
) -> None:
    # It claims to give a rendezvous but has no MASTER_PORT for the processes it started:
    # select and `explain` accepted it, then every rank died in training with
    # "RuntimeError: no MASTER_PORT for the process group".
    register_bad_scheduler(inprocess_plugins)
    with pytest.raises(MisconfigurationError) as error:
        select(env={"BAD_SIZE": "2", "BAD_RANK": "1"})
    message = str(error.value)
    assert "started by 'badscheduler'" in message and "MASTER_PORT is not set" in message
    assert "Export MASTER_PORT" in message


# --- CARDCAGE_* variables ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "five"])
def test_a_bad_init_timeout_is_refused_by_the_trainer(
    cuda_count_0: int, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    # Refused by the constructor, not later by fit, when processes already exist.
    monkeypatch.setenv("CARDCAGE_INIT_TIMEOUT", value)
    with pytest.raises(MisconfigurationError, match=f"CARDCAGE_INIT_TIMEOUT='{value}'"):
        cardcage.Trainer(distributed_backend="ddp_spawn", num_processes=2)


@pytest.mark.parametrize("value", ["1e10", "1e308"])
@pytest.mark.parametrize(
    "name", ["CARDCAGE_TIMEOUT", "CARDCAGE_INIT_TIMEOUT", "CARDCAGE_STUCK_WARN"]
)
def test_a_duration_longer_than_torch_can_wait_is_refused_with_the_largest_that_works(
    cuda_count_0: int, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    # 1e10 passed and the job's waits timed out at once; 1e308 raised OverflowError from a
    # rank. Refused by select (so by `cardcage explain`) and the Trainer, naming the bound.
    with pytest.raises(MisconfigurationError) as error:
        select(env={name: value}, distributed_backend="ddp_spawn", num_processes=2)
    message = str(error.value)
    assert f"{name}={value!r} is longer than torch can wait" in message
    assert "the largest value that works is 1000000000 seconds" in message
    assert f"Set {name} to at most 1000000000" in message
    monkeypatch.setenv(name, value)
    with pytest.raises(MisconfigurationError, match=f"{name}='{value}'"):
        cardcage.Trainer(distributed_backend="ddp_spawn", num_processes=2)
    monkeypatch.setenv(name, str(variables.MAX_SECONDS))  # the bound itself is accepted
    if name == "CARDCAGE_STUCK_WARN":  # (with a timeout at least as long: see below)
        monkeypatch.setenv("CARDCAGE_TIMEOUT", str(variables.MAX_SECONDS))
    cardcage.Trainer(distributed_backend="ddp_spawn", num_processes=2)


@pytest.mark.parametrize(
    ("env", "warn"),
    [
        ({}, 60.0),
        ({"CARDCAGE_TIMEOUT": "15"}, 7.5),
        ({"CARDCAGE_TIMEOUT": "15", "CARDCAGE_STUCK_WARN": "15"}, 15.0),
    ],
)
def test_the_stuck_warning_comes_before_the_job_timeout(env: dict[str, str], warn: float) -> None:
    # With CARDCAGE_TIMEOUT=15 and the warning's 60 s default, a hung rank was never named:
    # the process group timed out first. The default is now min(60, timeout / 2).
    assert variables.stuck_warn(env) == warn


def test_a_stuck_warning_longer_than_the_timeout_is_refused(
    cuda_count_0: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"CARDCAGE_TIMEOUT": "15", "CARDCAGE_STUCK_WARN": "60"}
    with pytest.raises(MisconfigurationError) as error:
        select(env=env, distributed_backend="ddp_spawn", num_processes=2)
    message = str(error.value)
    assert "CARDCAGE_STUCK_WARN='60' is longer than CARDCAGE_TIMEOUT=15" in message
    assert "at most 15" in message
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MisconfigurationError, match="CARDCAGE_STUCK_WARN='60'"):
        cardcage.Trainer(distributed_backend="ddp_spawn", num_processes=2)


def test_every_user_facing_variable_is_checked(tmp_path: Path) -> None:
    good = {
        "CARDCAGE_INIT_TIMEOUT": "30",
        "CARDCAGE_TIMEOUT": "120.5",
        "CARDCAGE_STUCK_WARN": "5",
        "CARDCAGE_PLUGINS_AUTOLOAD": "yes",
        "CARDCAGE_STRICT_PLUGINS": "off",
        "CARDCAGE_REQUEUE_SIGNAL": "USR2",
        "CARDCAGE_REQUEUE_DIR": str(tmp_path / "not" / "made" / "yet"),
        "CARDCAGE_CHECKPOINT_DIR": str(tmp_path),
        "CARDCAGE_RESTART_FROM": __file__,
    }
    variables.check_variables(good)
    bad = {
        "CARDCAGE_TIMEOUT": "-1",
        "CARDCAGE_STUCK_WARN": "0",
        "CARDCAGE_PLUGINS_AUTOLOAD": "maybe",
        "CARDCAGE_STRICT_PLUGINS": "2",
        "CARDCAGE_REQUEUE_SIGNAL": "SIGNOPE",
        "CARDCAGE_REQUEUE_DIR": __file__,
        "CARDCAGE_CHECKPOINT_DIR": __file__,
        "CARDCAGE_RESTART_FROM": str(tmp_path / "missing.ckpt"),
    }
    for name, value in bad.items():
        with pytest.raises(MisconfigurationError) as error:
            variables.check_variables({**good, name: value})
        assert f"{name}={value!r}" in str(error.value), name
    assert set(bad) | {"CARDCAGE_INIT_TIMEOUT"} <= set(variables.VARIABLES)


@pytest.mark.skipif(
    os.geteuid() == 0,
    reason="root writes into a folder whatever its permission bits; the /proc/sys test covers root",
)
def test_a_folder_that_cannot_be_made_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(MisconfigurationError, match=r"would be made in .*not writable"):
            variables.check_variables({"CARDCAGE_REQUEUE_DIR": str(locked / "requeue")})
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc/sys"), reason="no /proc/sys on this system")
@pytest.mark.parametrize("folder", ["/proc/sys", "/proc"])
def test_a_folder_that_cannot_be_made_is_refused_even_for_root(folder: str) -> None:
    """/proc refuses new entries to everyone, root included, though its permission bits let
    root write in /proc itself: the check creates a file rather than reading the bits."""
    place = f"{folder}/cardcage-requeue"
    with pytest.raises(MisconfigurationError) as error:
        variables.check_variables({"CARDCAGE_REQUEUE_DIR": place})
    assert f"CARDCAGE_REQUEUE_DIR={place!r} would be made in {folder!r}, which is not " in str(
        error.value
    )
    assert not os.path.exists(place)


def test_switches_and_signals_parse_as_documented() -> None:
    # docs/choosing-a-backend.md: 1/true/yes/on (and the empty string) or 0/false/no/off
    assert variables.strict_plugins({"CARDCAGE_STRICT_PLUGINS": ""}) is True
    assert variables.strict_plugins({}) is False
    assert variables.plugins_autoload({"CARDCAGE_PLUGINS_AUTOLOAD": " OFF "}) is False
    with pytest.raises(MisconfigurationError, match=r"set it to 1 to .*, or 0 to "):
        variables.plugins_autoload({"CARDCAGE_PLUGINS_AUTOLOAD": "maybe"})
    assert variables.parse_signal("usr1") is signal.SIGUSR1
    assert variables.parse_signal(str(int(signal.SIGUSR2))) is signal.SIGUSR2
    assert variables.parse_signal("none") is None


# --- plugin settings -------------------------------------------------------------------------


def _records(registry: plugins.Registry) -> dict[str, plugins.PluginRecord]:
    return {record.name: record for record in registry.plugins}


def test_a_plugin_name_that_is_not_installed_warns_with_the_installed_ones() -> None:
    with pytest.warns(UserWarning, match=r"CARDCAGE_PLUGINS names 'nonexistent'") as caught:
        registry = PluginManager({"CARDCAGE_PLUGINS": "nonexistent"}).load()
    message = str(caught[0].message)
    assert "installed: " in message and "cpu" in message and "spawn" in message
    assert _records(registry)["nonexistent"].status == "failed"  # listed by `cardcage plugins`


@pytest.mark.parametrize(
    ("name", "hint"),
    [("spwn", "Did you mean 'spawn'?"), ("ddp_spawn", "a backend of the plugin 'spawn'")],
)
def test_disabling_a_plugin_that_is_not_installed_warns_with_a_hint(name: str, hint: str) -> None:
    with pytest.warns(UserWarning, match="CARDCAGE_DISABLE_PLUGINS names") as caught:
        registry = PluginManager({"CARDCAGE_DISABLE_PLUGINS": name}).load()
    assert hint in str(caught[0].message)
    record = _records(registry)[name]
    assert (record.status, record.error) == ("not installed", str(caught[0].message)[10:])
    assert "ddp_spawn" in registry.accelerators  # nothing was disabled


def test_installed_plugin_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PluginManager({"CARDCAGE_DISABLE_PLUGINS": "tpu", "CARDCAGE_PLUGINS": "cpu"}).load()


def test_with_autoload_off_and_nothing_named_the_error_says_no_backend_is_loaded(
    cuda_count_0: int,
) -> None:
    env = {"CARDCAGE_PLUGINS_AUTOLOAD": "0"}
    with pytest.raises(MisconfigurationError) as error:
        select(env=env)
    message = str(error.value)
    assert "no backend is loaded" in message
    assert "CARDCAGE_PLUGINS_AUTOLOAD='0'" in message and "CARDCAGE_PLUGINS is unset" in message
    assert "(installed: cpu, ddp, " in message
    with pytest.raises(MisconfigurationError) as named:
        select(env=env, distributed_backend="ddp")
    message = str(named.value)
    assert ": ." not in message  # the old message ended "pick an installed backend: ."
    assert "installed but not loaded" in message and "Set CARDCAGE_PLUGINS=ddp" in message


def test_several_processes_with_the_spawn_plugin_disabled_are_refused_naming_it(
    cuda_count_0: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # num_processes=2 with cardcage-spawn disabled selected 'cpu', world size 1, silently.
    env = {"CARDCAGE_DISABLE_PLUGINS": "spawn"}
    with pytest.raises(MisconfigurationError) as error:
        select(env=env, num_processes=2)
    message = str(error.value)
    assert "num_processes=2 asks for 2 processes" in message and "'cpu'" in message
    assert "'spawn' (cardcage-spawn) is installed but disabled" in message
    assert select(env=env, num_processes=1).accelerator == "cpu"
    monkeypatch.setenv("CARDCAGE_DISABLE_PLUGINS", "spawn")
    with pytest.raises(MisconfigurationError, match="num_processes=2 asks for 2"):
        cardcage.Trainer(num_processes=2)


def test_autoload_off_with_only_an_unknown_name_says_so(cuda_count_0: int) -> None:
    env = {"CARDCAGE_PLUGINS_AUTOLOAD": "0", "CARDCAGE_PLUGINS": "nonexistent"}
    with pytest.warns(UserWarning), pytest.raises(MisconfigurationError) as error:
        select(env=env)
    assert "CARDCAGE_PLUGINS='nonexistent' names no installed backend" in str(error.value)


def test_every_backend_disabled_says_which_variable_did_it(cuda_count_0: int) -> None:
    names = [ep.name for ep in metadata.entry_points(group="cardcage")]
    with pytest.raises(MisconfigurationError) as error:
        select(env={"CARDCAGE_DISABLE_PLUGINS": ",".join(names)})
    message = str(error.value)
    assert "no backend is loaded" in message and "CARDCAGE_DISABLE_PLUGINS=" in message


# Run in an environment without cardcage-ddp2: it prints what it found and the error's message.
WITHOUT_DDP2 = """
import importlib.metadata, importlib.util
import cardcage
found = sorted(ep.name for ep in importlib.metadata.entry_points(group="cardcage"))
print("found:", found, importlib.util.find_spec("cardcage_ddp2"))
try:
    cardcage.select(env={}, distributed_backend="ddp2")
except cardcage.MisconfigurationError as error:
    print("refused:", error)
"""


@pytest.mark.slow
def test_a_shipped_backend_that_is_not_installed_names_the_install_command(
    tmp_path: Path,
) -> None:
    """A real environment without cardcage-ddp2: this one less that distribution."""
    python = plugin_install.environment_without(tmp_path / "venv", ["cardcage-ddp2"])
    env = plugin_install.child_env(
        [], plugin_install.STEERING_PREFIXES, plugin_install.STEERING_NAMES
    )
    result = subprocess.run(
        [python, "-c", WITHOUT_DDP2], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, plugin_install.describe(result)
    found, _, refused = result.stdout.partition("\nrefused: ")
    assert "'ddp'" in found and "'ddp2'" not in found and found.endswith(" None"), found
    assert re.search(r"pip install cardcage-ddp2.*pick", refused), refused


@pytest.mark.slow
def test_cardcage_plugins_lists_a_name_that_is_not_installed() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARDCAGE_")}
    env["CARDCAGE_DISABLE_PLUGINS"] = "spwn"
    done = subprocess.run(
        [sys.executable, "-m", "cardcage", "plugins"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    listed = done.stdout.partition("plugins not loaded:")[2]
    assert "spwn  not installed: CARDCAGE_DISABLE_PLUGINS names 'spwn'" in listed
    assert "Did you mean 'spawn'?" in done.stderr  # the warning


# --- the rendezvous host ----------------------------------------------------------------------


def test_an_unresolvable_master_addr_is_refused_naming_it(
    cuda_count_0: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MASTER_ADDR", UNRESOLVABLE)
    selection = select(distributed_backend="ddp_spawn", num_processes=2)  # select never resolves
    with pytest.raises(MisconfigurationError) as error:
        rendezvous.check_master_address(selection, needs_rendezvous=True)
    message = str(error.value)
    assert f"MASTER_ADDR={UNRESOLVABLE!r}" in message and "does not resolve" in message
    assert "Set MASTER_ADDR" in message
    # a job of one process, or a backend that does not meet through MASTER_ADDR: not looked up
    rendezvous.check_master_address(selection, needs_rendezvous=False)
    single = select(distributed_backend="cpu")
    rendezvous.check_master_address(single, needs_rendezvous=True)


def test_a_derived_rendezvous_host_is_checked_too(
    cuda_count_0: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    env = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_NODELIST": f"{UNRESOLVABLE}[1-2]"}
    selection = select(env=env, num_processes=2)
    assert selection.master_address == f"{UNRESOLVABLE}1"
    with pytest.raises(MisconfigurationError, match=r"derived by the 'slurm' cluster"):
        rendezvous.check_master_address(selection, needs_rendezvous=True)


def test_names_that_resolve_pass_and_are_looked_up_once(
    cuda_count_0: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    selection = select(distributed_backend="ddp_spawn", num_processes=2)
    rendezvous.check_master_address(selection, needs_rendezvous=True)
    assert "localhost" in rendezvous._resolved


def test_a_resolver_that_does_not_answer_is_given_up_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # This machine's resolver answers at once; a DNS server that never does is simulated.
    never = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: never.wait(30))
    try:
        said = rendezvous.resolve("slow.example", timeout=0.2)
    finally:
        never.set()
    assert said == "the resolver gave no answer within 0.2s"
    assert "slow.example" not in rendezvous._resolved


# --- where a single-node job meets, and its port ---------------------------------------------

#: TEST-NET-1 (RFC 5737): never this machine's own. Only bound to, never sent a packet.
NOT_HERE = "192.0.2.1"


@pytest.mark.parametrize(
    ("address", "meets"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("127.0.0.2", "127.0.0.2"),
        ("localhost", "127.0.0.1"),
        ("0.0.0.0", "127.0.0.1"),
        ("::1", "::1"),
        ("::", "::1"),
    ],
)
def test_a_single_node_job_meets_on_loopback(address: str, meets: str) -> None:
    # A loopback address is used as it is; a wildcard meets on its family's loopback address.
    if ":" in meets and rendezvous.bind_error("::1") is not None:
        pytest.skip(f"IPv6 loopback is not usable here: {rendezvous.bind_error('::1')}")
    assert rendezvous.meeting_address(address) == meets


def test_an_address_this_machine_does_not_have_is_refused_for_a_single_node_job(
    cuda_count_0: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its ranks would dial another machine and wait there until CARDCAGE_INIT_TIMEOUT.
    monkeypatch.setenv("MASTER_ADDR", NOT_HERE)
    selection = select(distributed_backend="ddp_spawn", num_processes=2)
    with pytest.raises(MisconfigurationError) as error:
        rendezvous.check_launch(selection, needs_rendezvous=True)
    message = str(error.value)
    assert f"MASTER_ADDR={NOT_HERE!r} is not an address of this machine" in message
    assert "Cannot assign requested address" in message  # what binding to it said
    assert "Unset MASTER_ADDR" in message and "num_nodes" in message
    # node 1 of a job of two nodes dials node 0: another machine, as it should be
    node1 = select(
        env={"MASTER_ADDR": NOT_HERE, "MASTER_PORT": "29500", "NODE_RANK": "1"},
        distributed_backend="ddp_spawn",
        num_processes=2,
        num_nodes=2,
    )
    rendezvous.check_launch(node1, needs_rendezvous=True)


def test_a_master_port_in_use_is_refused_where_this_job_would_listen(cuda_count_0: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        here = select(env={"MASTER_PORT": port}, distributed_backend="ddp", num_processes=2)
        with pytest.raises(MisconfigurationError) as error:
            rendezvous.check_launch(here, needs_rendezvous=True)
        assert f"MASTER_PORT={port} is already in use" in str(error.value)
        assert "Address already in use (errno 98)" in str(error.value)
        # torchrun's ranks: the port is its agent's store, listening already
        torchrun = {"MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
        rendezvous.check_launch(
            select(env=torchrun, distributed_backend="ddp", num_processes=2),
            needs_rendezvous=True,
        )
        # node 1 of two: rank 0 listens on node 0, not here
        node1 = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": "1"}
        rendezvous.check_launch(
            select(env=node1, distributed_backend="ddp", num_processes=2, num_nodes=2),
            needs_rendezvous=True,
        )
    free = select(env={"MASTER_PORT": port}, distributed_backend="ddp", num_processes=2)
    rendezvous.check_launch(free, needs_rendezvous=True)  # the port is free again
