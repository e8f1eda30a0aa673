"""Small files replaced whole (``metrics.csv``, ``hparams.yaml``), and write errors that
name the file.

:func:`write_atomically` writes a temporary file beside the target and renames it over the
target, so a reader sees the old file or the new one. The temporary file is made by
``tempfile.mkstemp``: ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name, so a file or a
symbolic link planted in the folder is never opened, and its target never written. Its name
names the writer as a partial checkpoint's does (``.<name>.<pid>.<start>@<host>.<random>.tmp``).
A failed write (a full disk, a read-only one) removes it and raises an ``OSError`` that names
the file, the cause and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile

from cardcage.config import owners

_ADVICE = {
    errno.ENOSPC: "free space on that disk, or write elsewhere",
    errno.EDQUOT: "free space within your disk quota, or write elsewhere",
    errno.EACCES: "make that folder writable for this user, or write elsewhere",
    errno.EPERM: "make that folder writable for this user, or write elsewhere",
    errno.EROFS: "that disk is mounted read-only: write elsewhere",
}


def write_error(path: str, cause: OSError) -> OSError:
    """An ``OSError`` with ``cause``'s errno whose message names ``path`` and the fix."""
    code = cause.errno
    reason = os.strerror(code) if code else (str(cause) or type(cause).__name__)
    message = f"could not write {path}: {reason[:1].lower()}{reason[1:]}"
    advice = _ADVICE.get(code) if code else None
    if advice:
        message += f". Fix: {advice}"
    # str(): "[Errno 28] could not write <path>: no space left on device. Fix: ..."
    return OSError(code, message + ".") if code else OSError(message + ".")


def write_all(handle: int, data: bytes, at: int | None = None) -> None:
    """Write all of ``data`` to the open file ``handle`` (at offset ``at``, or where it is);
    a short write goes on, a failed one raises its ``OSError``."""
    view = memoryview(data)
    while view:
        done = os.write(handle, view) if at is None else os.pwrite(handle, view, at)
        view = view[done:]
        if at is not None:
            at += done


def write_atomically(path: str, data: bytes) -> None:
    """Replace ``path`` by a file holding ``data`` (readers see the old file or the new one).

    The folder must exist. A failure removes the temporary file, leaves ``path`` as it was
    and raises :func:`write_error`'s ``OSError``.
    """
    folder, name = os.path.split(path)
    try:
        handle, temporary = tempfile.mkstemp(
            prefix=f".{name}.{owners.owner()}.", suffix=".tmp", dir=folder or "."
        )
    except OSError as error:
        raise write_error(path, error) from error
    try:
        try:
            os.fchmod(handle, 0o644)  # mkstemp's 0600 would hide the logs from others
            write_all(handle, data)
        finally:
            os.close(handle)
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise write_error(path, error) from error
        raise
