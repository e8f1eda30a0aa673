"""Device parsing (the seed's tables), GPU picking and the CUDA environment."""

from __future__ import annotations

import pytest

from cardcage import MisconfigurationError
from cardcage.devices import (
    apply_cuda_environment,
    determine_root_gpu_device,
    parse_gpu_ids,
    parse_tpu_cores,
    pick_multiple_gpus,
)


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [
        (None, None),
        (0, None),
        (3, [0, 1, 2]),
        (-1, [0, 1, 2, 3]),
        ("-1", [0, 1, 2, 3]),
        (" -1 ", [0, 1, 2, 3]),
        ([0], [0]),
        ([1, 3], [1, 3]),
        ((1, 3), [1, 3]),
        ("0", [0]),
        ("3", [3]),
        ("1, 3", [1, 3]),
        ("2,", [2]),
        (",2,,3,", [2, 3]),
    ],
)
def test_gpus_table(gpus: object, expected: list[int] | None) -> None:
    assert parse_gpu_ids(gpus, device_count=4) == expected  # type: ignore[arg-type]


def test_a_count_and_a_string_of_the_same_digit_mean_different_things() -> None:
    # The seed's table, kept on purpose: 2 means two GPUs, "2" means GPU number 2.
    assert parse_gpu_ids(2, device_count=4) == [0, 1]
    assert parse_gpu_ids("2", device_count=4) == [2]


def test_callable_gpus_means_cpu_as_in_the_seed() -> None:
    assert parse_gpu_ids(lambda: 2, device_count=4) is None  # type: ignore[arg-type]


def test_device_count_is_read_from_torch_when_not_given(cuda_count_2: int) -> None:
    assert parse_gpu_ids(-1) == [0, 1]
    with pytest.raises(MisconfigurationError, match=r"requests GPU\(s\) \[2\]"):
        parse_gpu_ids([2])


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        ([0, 0], r"gpus=\[0, 0\] names a GPU more than once"),
        ("1,1", r"gpus='1,1' names a GPU more than once"),
        ([4], r"gpus=\[4\] requests GPU\(s\) \[4\], but this machine has GPUs \[0, 1, 2, 3\]"),
        ("1, 5", r"gpus='1, 5' requests GPU\(s\) \[5\]"),
        (5, r"gpus=5 requests GPU\(s\) \[4\]"),
        (True, r"gpus=True has type bool"),
        ([True], r"gpus=\[True\] has type list"),
        (1.5, r"gpus=1.5 has type float"),
        ((0.5, 1.5), r"gpus=\(0.5, 1.5\) has type tuple"),
        (("a",), r"gpus=\('a',\) has type tuple"),
        ({0, 1}, r"gpus=\{0, 1\} has type set"),
        (-2, r"gpus=-2 is not a GPU count"),
        ("-2", r"gpus='-2' holds a negative id"),
        ([0, -1], r"gpus=\[0, -1\] holds a negative id"),
        ([], r"gpus=\[\] names no GPU"),
        ("", r"gpus='' names no GPU"),
        (",", r"gpus=',' names no GPU"),
        ("a,b", r"gpus='a,b' is not a list of integers"),
    ],
)
def test_bad_gpus(gpus: object, message: str) -> None:
    with pytest.raises(MisconfigurationError, match=message):
        parse_gpu_ids(gpus, device_count=4)  # type: ignore[arg-type]


def test_all_gpus_on_a_machine_without_gpus_is_an_error() -> None:
    with pytest.raises(MisconfigurationError, match=r"gpus=-1 asks for all GPUs.*has none"):
        parse_gpu_ids(-1, device_count=0)
    with pytest.raises(MisconfigurationError, match=r"this machine has no GPU"):
        parse_gpu_ids(1, device_count=0)


def test_error_names_the_override_variable_when_given() -> None:
    with pytest.raises(MisconfigurationError, match=r"CARDCAGE_GPUS='x'"):
        parse_gpu_ids("x", device_count=2, flag="CARDCAGE_GPUS")


@pytest.mark.parametrize(
    ("tpu_cores", "expected"),
    [
        (None, None),
        (1, 1),
        (8, 8),
        ([1], [1]),
        ([8], [8]),
        ((5,), [5]),
        ("1", 1),
        ("8", 8),
        (" 8 ", 8),
        ("1,", [1]),
        ("3", [3]),
        ("8,", [8]),
    ],
)
def test_tpu_cores_table(tpu_cores: object, expected: int | list[int] | None) -> None:
    result = parse_tpu_cores(tpu_cores)  # type: ignore[arg-type]
    assert result == expected
    assert type(result) is type(expected)  # 1 (one core, any) is not [1] (core number 1)


@pytest.mark.parametrize(
    ("tpu_cores", "message"),
    [
        (0, r"tpu_cores=0 is not a TPU core selection"),
        (3, r"tpu_cores=3 is not a TPU core selection"),
        (2, r"tpu_cores=2 "),
        ([1, 2], r"tpu_cores=\[1, 2\] "),
        ([9], r"tpu_cores=\[9\] "),
        ([0], r"tpu_cores=\[0\] "),
        ("9", r"tpu_cores='9' "),
        ("1,2", r"tpu_cores='1,2' "),
        ("", r"tpu_cores='' "),
        ("eight", r"tpu_cores='eight' is not a list of integers"),
        (True, r"tpu_cores=True has type bool"),
        (8.0, r"tpu_cores=8.0 has type float"),
    ],
)
def test_bad_tpu_cores(tpu_cores: object, message: str) -> None:
    with pytest.raises(MisconfigurationError, match=message):
        parse_tpu_cores(tpu_cores)  # type: ignore[arg-type]


def test_determine_root_gpu_device() -> None:
    assert determine_root_gpu_device(None) is None
    assert determine_root_gpu_device([2, 0]) == 2
    with pytest.raises(MisconfigurationError, match="non-empty list"):
        determine_root_gpu_device([])
    with pytest.raises(MisconfigurationError, match="non-empty list"):
        determine_root_gpu_device(3)  # type: ignore[arg-type]


def _no_probe(device: int) -> bool:
    raise AssertionError("the probe must not run when NVML answered")


def test_pick_ranks_gpus_by_free_nvml_memory() -> None:
    free = [10, 400, 50, 300]
    picked = pick_multiple_gpus(2, free_memory=lambda: free, probe=_no_probe, device_count=4)
    assert picked == [1, 3]
    assert pick_multiple_gpus(-1, free_memory=lambda: free, probe=_no_probe, device_count=4) == [
        0,
        1,
        2,
        3,
    ]


def test_pick_ignores_nvml_when_it_counts_other_gpus_than_torch() -> None:
    # CUDA_VISIBLE_DEVICES hides GPUs from torch but not from NVML: NVML indices are not
    # torch's, so the probe decides.
    picked = pick_multiple_gpus(
        1, free_memory=lambda: [0, 0, 0, 900], probe=lambda d: True, device_count=2
    )
    assert picked == [0]


def test_pick_falls_back_to_the_probe_without_nvml() -> None:
    probed: list[int] = []

    def probe(device: int) -> bool:
        probed.append(device)
        return device != 0  # GPU 0 is busy (exclusive mode)

    picked = pick_multiple_gpus(
        2, free_memory=lambda: None, probe=probe, device_count=3, sleep=_no_sleep
    )
    assert picked == [1, 2]
    assert probed == [0, 1, 2]


def _no_sleep(seconds: float) -> None:
    raise AssertionError("no back-off when the first attempt succeeds")


def test_pick_retries_with_back_off_then_succeeds() -> None:
    attempts = iter([[0], [0], [0, 1]])  # GPU 1 frees up on the third look
    usable: list[int] = []
    sleeps: list[float] = []

    def probe(device: int) -> bool:
        if device == 0:
            usable[:] = next(attempts)
        return device in usable

    picked = pick_multiple_gpus(
        2, free_memory=lambda: None, probe=probe, device_count=2, sleep=sleeps.append
    )
    assert picked == [0, 1]
    assert len(sleeps) == 2
    assert sleeps[0] < sleeps[1]  # the back-off grows


def test_pick_gives_up_after_the_attempts() -> None:
    sleeps: list[float] = []
    with pytest.raises(MisconfigurationError, match=r"gpus=2: only 1 of 2 GPUs accept"):
        pick_multiple_gpus(
            2,
            free_memory=lambda: None,
            probe=lambda device: device == 0,
            device_count=2,
            attempts=3,
            sleep=sleeps.append,
        )
    assert len(sleeps) == 2  # no pointless wait after the last attempt


@pytest.mark.parametrize(
    ("count", "message"),
    [
        (0, r"gpus=0 selects nothing"),
        (3, r"gpus=3 asks for more GPUs than this machine has \(2\)"),
        (-2, r"gpus=-2: gpus must be a positive count"),
        (True, r"gpus=True: gpus must be a positive count"),
    ],
)
def test_pick_rejects_bad_counts(count: int, message: str) -> None:
    with pytest.raises(MisconfigurationError, match=message):
        pick_multiple_gpus(count, free_memory=lambda: [1, 2], probe=_no_probe, device_count=2)


def test_cuda_environment_lists_gpus_up_to_the_highest_id() -> None:
    environ: dict[str, str] = {}
    changed = apply_cuda_environment([1, 3], slurm_managing_tasks=False, environ=environ)
    assert environ == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert changed == environ


def test_cuda_environment_leaves_visible_devices_to_slurm() -> None:
    environ: dict[str, str] = {}
    apply_cuda_environment([0, 1], slurm_managing_tasks=True, environ=environ)
    assert environ == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_cuda_environment_keeps_the_users_value() -> None:
    environ = {"CUDA_VISIBLE_DEVICES": "5", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert apply_cuda_environment([0], slurm_managing_tasks=False, environ=environ) == {}
    assert environ == {"CUDA_VISIBLE_DEVICES": "5", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_cuda_environment_on_the_cpu_sets_only_the_order() -> None:
    environ: dict[str, str] = {}
    apply_cuda_environment(None, slurm_managing_tasks=False, environ=environ)
    assert environ == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_auto_select_without_nvml_probes_the_gpus_when_training_starts(
    cuda_count_4: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    import cardcage
    from cardcage import devices

    monkeypatch.setattr(devices, "nvml_free_memory", lambda: None)
    busy = {0, 2}  # exclusive-mode GPUs taken by another job
    probed: list[int] = []

    def probe(device: int) -> bool:
        probed.append(device)
        return device not in busy

    monkeypatch.setattr(devices, "probe_gpu", probe)
    monkeypatch.setenv("CARDCAGE_GPUS", "")  # recorded, so the variable fit() sets is undone
    monkeypatch.delenv("CARDCAGE_GPUS")
    trainer = cardcage.Trainer(gpus=2, auto_select_gpus=True, distributed_backend="dp")
    assert probed == []  # the constructor creates no CUDA context
    assert trainer.selection.auto_select_pending
    for name in ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES"):  # what fit() sets is undone
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    from cardcage.train.jobs import prepare_launch

    trainer.selection = prepare_launch(trainer.selection, trainer.accelerator)  # fit's first step
    assert trainer.selection.gpu_ids == [1, 3] and trainer.selection.root_gpu == 1
    assert trainer.accelerator.selection is trainer.selection
    assert os.environ["CARDCAGE_GPUS"] == "1,3"  # processes started later agree
    again = cardcage.Trainer(gpus=2, auto_select_gpus=True, distributed_backend="dp")
    assert again.selection.gpu_ids == [1, 3] and not again.selection.auto_select_pending
