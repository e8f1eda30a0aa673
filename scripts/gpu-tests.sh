#!/usr/bin/env bash
# Run the GPU-only tests (tests/gpu, marker `gpu`) on a machine with a CUDA GPU.
#
#   scripts/gpu-tests.sh [extra pytest arguments]
#
# It makes a virtual environment ($VENV, default $TMPDIR/cardcage-gpu-venv) that also sees the system's
# packages, so a CUDA build of torch that a GPU image already has is used as it is. What is
# missing is installed with pip: torch==2.13.0 (from PyPI on Linux x86-64 that is a CUDA build;
# unlike a development setup, no CPU wheel index is named here), pytest, pluggy, numpy,
# packaging and tqdm. cardcage itself (the core and the eight backend plugins) is installed
# editable with pip when its build backend (hatchling) is at hand; on a machine that cannot
# reach a package index, the sources are put on the path instead, with the package metadata
# (entry points included) that plugin discovery reads.
#
# It fails when CUDA is not available (every test would only be skipped), unless
# GPU_TESTS_ALLOW_CPU=1.
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

# Third-party packages the tests need, installed only where missing.
missing=()
for spec in torch==2.13.0 pytest pluggy numpy packaging tqdm; do
    module=${spec%%==*}
    if ! "$py" -c "import $module" >/dev/null 2>&1; then
        missing+=("$spec")
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
    if [ "${GPU_TESTS_ALLOW_CPU:-0}" != "1" ]; then
        echo "gpu-tests: CUDA is not available here: every GPU test would be skipped." >&2
        echo "gpu-tests: run this on a machine with an NVIDIA GPU (or GPU_TESTS_ALLOW_CPU=1)." >&2
        exit 1
    fi
fi

exec "$py" -m pytest -p no:cacheprovider -m gpu tests/gpu -v "$@"
