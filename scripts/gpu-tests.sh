#!/usr/bin/env bash
# Run the GPU tests on a machine with a CUDA GPU: the GPU-marked tests (tests/gpu, marker
# `gpu`) and the gpu and dp plugins' own tests with their conformance-kit checks
# (plugins/gpu/tests, plugins/dp/tests), which train on the GPU there.
#
#   scripts/gpu-tests.sh [extra pytest arguments]
#
# It makes a virtual environment ($VENV, default $TMPDIR/cardcage-gpu-venv) that also sees the
# system's packages. torch is the version requirements-dev.txt pins, as a CUDA build: a torch
# the venv or the system already has is used only when it is that version and built with
# CUDA; otherwise the pinned version is installed into the venv with pip (from PyPI, whose
# Linux x86-64 wheels are CUDA builds; $TORCH_INDEX_URL names another index, e.g.
# https://download.pytorch.org/whl/cu128), and the script fails if what it got is not that
# CUDA build. pytest, pluggy, numpy, packaging and tqdm are installed where missing.
# cardcage itself (the core and the nine backend plugins) is installed editable with pip when
# its build backend (hatchling) is at hand; on a machine that cannot reach a package index,
# the sources are put on the path instead, with the package metadata (entry points included)
# that plugin discovery reads.
#
# It fails when CUDA is not available (every test would only be skipped), unless
# GPU_TESTS_ALLOW_CPU=1 (which also accepts a CPU build of torch).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-${TMPDIR:-/tmp}/cardcage-gpu-venv}

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L || true
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi
py="$VENV/bin/python"

# torch: requirements-dev.txt's pin, as a CUDA build.
torch_pin=$(sed -n 's/^torch==\([^[:space:];#]*\).*/\1/p' requirements-dev.txt | head -n 1)
if [ -z "$torch_pin" ]; then
    echo "gpu-tests: requirements-dev.txt pins no torch (a line torch==VERSION)" >&2
    exit 1
fi
# Whether the torch this venv imports is the pin (a local label like +cu128 aside) and, unless
# a CPU run is allowed, a CUDA build. Prints what it found.
torch_check="import sys
try:
    import torch
except ImportError:
    print('no torch'); sys.exit(1)
cuda = torch.version.cuda
print(f'torch {torch.__version__} (CUDA {cuda})')
same = torch.__version__.split('+')[0] == sys.argv[1]
sys.exit(0 if same and (cuda or sys.argv[2] == '1') else 1)"
allow_cpu=${GPU_TESTS_ALLOW_CPU:-0}
if found=$("$py" -c "$torch_check" "$torch_pin" "$allow_cpu" 2>&1); then
    echo "gpu-tests: using $found"
else
    echo "gpu-tests: found ${found##*$'\n'}; installing torch==$torch_pin (a CUDA build)"
    index=()
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        index=(--index-url "$TORCH_INDEX_URL")
    fi
    # --ignore-installed: a torch of the system's (another version, or a CPU build of the
    # same one) is shadowed by the venv's instead of counting as already there.
    "$py" -m pip install --ignore-installed "${index[@]}" "torch==$torch_pin"
    if ! found=$("$py" -c "$torch_check" "$torch_pin" "$allow_cpu" 2>&1); then
        echo "gpu-tests: after installing torch==$torch_pin, found ${found##*$'\n'}:" \
            "not the pinned CUDA build. Name a CUDA wheel index in TORCH_INDEX_URL" \
            "(e.g. https://download.pytorch.org/whl/cu128)." >&2
        exit 1
    fi
    echo "gpu-tests: using $found"
fi

# The other third-party packages the tests need, installed only where missing.
missing=()
for module in pytest pluggy numpy packaging tqdm; do
    if ! "$py" -c "import $module" >/dev/null 2>&1; then
        missing+=("$module")
    fi
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "gpu-tests: installing ${missing[*]}"
    "$py" -m pip install "${missing[@]}"
fi

# cardcage: the core and every plugin, the way requirements-dev.txt lists them.
projects=(core plugins/cpu plugins/gpu plugins/dp plugins/ddp plugins/ddp2 plugins/spawn
          plugins/horovod plugins/tpu plugins/fsdp)
here_check="import pathlib, sys, cardcage, cardcage_gpu, cardcage_dp
sys.exit(not pathlib.Path(cardcage.__file__).resolve().is_relative_to(pathlib.Path('core').resolve()))"
if "$py" -c "$here_check" >/dev/null 2>&1; then
    echo "gpu-tests: cardcage is already installed in $VENV"
elif "$py" -c "import hatchling" >/dev/null 2>&1; then
    editable=()
    for project in "${projects[@]}"; do editable+=(-e "./$project"); done
    "$py" -m pip install --no-deps --no-build-isolation "${editable[@]}"
else
    echo "gpu-tests: no hatchling here; putting the sources on the path instead"
    "$py" - "${projects[@]}" <<'PY'
import pathlib
import re
import sys
import sysconfig
import tomllib

site = pathlib.Path(sysconfig.get_paths()["purelib"])
paths = []
for project in map(pathlib.Path, sys.argv[1:]):
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    meta = pyproject["project"]
    source = project / "src" if (project / "src").is_dir() else project
    paths.append(str(source.resolve()))
    name, version = meta["name"], meta.get("version")
    if version is None:  # dynamic (the core's): the file hatch reads it from
        version_file = project / pyproject["tool"]["hatch"]["version"]["path"]
        version = re.search(r'__version__ = "([^"]+)"', version_file.read_text()).group(1)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("scripts/gpu-tests.sh\n")
    groups = dict(meta.get("entry-points", {}))
    if meta.get("scripts"):
        groups["console_scripts"] = meta["scripts"]
    text = "".join(
        f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in entries.items()) + "\n"
        for group, entries in groups.items()
    )
    (info / "entry_points.txt").write_text(text)
(site / "cardcage_gpu_tests.pth").write_text("\n".join(paths) + "\n")
PY
fi

"$py" - <<'PY'
import torch

import cardcage

print(f"gpu-tests: torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"{torch.cuda.device_count()} GPU(s), cardcage {cardcage.__version__}")
for index in range(torch.cuda.device_count()):
    print(f"gpu-tests:   {index}: {torch.cuda.get_device_name(index)}")
PY
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [ "$allow_cpu" != "1" ]; then
        echo "gpu-tests: CUDA is not available here: every GPU test would be skipped." >&2
        echo "gpu-tests: run this on a machine with an NVIDIA GPU (or GPU_TESTS_ALLOW_CPU=1)." >&2
        exit 1
    fi
fi

# Both runs, whatever the first one's outcome; the status is the first failure's.
status=0
"$py" -m pytest -p no:cacheprovider -m gpu tests/gpu -v "$@" || status=$?
"$py" -m pytest -p no:cacheprovider plugins/gpu/tests plugins/dp/tests -v "$@" || {
    rc=$?
    [ "$status" -ne 0 ] || status=$rc
}
exit "$status"
