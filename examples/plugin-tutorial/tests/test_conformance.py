"""cardcage-lsf against cardcage's conformance kit: two ranks started the way jsrun starts
them (one process each, with the JSM_* and LSB_* variables of an LSF job on this host)."""

from __future__ import annotations

import atexit
import shutil
import socket
import tempfile
from pathlib import Path

from cardcage.testing import BackendSuite, Launch

# The job's rank file: the launch node first, then this host once per rank.
_FOLDER = Path(tempfile.mkdtemp(prefix="lsf-job-"))
atexit.register(shutil.rmtree, _FOLDER, True)
RANKFILE = _FOLDER / "rankfile"
_HOST = socket.gethostname().split(".")[0]
RANKFILE.write_text(f"launch01\n{_HOST}\n{_HOST}\n")
JSRUN = {
    "LSB_JOBID": "4242",
    "LSB_DJOB_RANKFILE": str(RANKFILE),
    "JSM_NAMESPACE_SIZE": "2",
    "JSM_NAMESPACE_RANK": "{rank}",
    "JSM_NAMESPACE_LOCAL_RANK": "{rank}",
}


class TestLSF(BackendSuite):
    backend = "lsf"
    launches = {"jsrun": Launch({}, world_size=2, command="ranks", env=JSRUN)}
