"""Files and directories only this user can touch: where the cache keeps what it trusts.

The cache unpickles the values it reads once their digest checks out, so its directories must be
writable by this user alone and its digest key readable by this user alone.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile

DIGEST_KEY_FILE = "digest.key"
DIGEST_KEY_BYTES = 32
JOB_DIRECTORY_PREFIX = "bagua-job-cache-"


def private_directory(path: str) -> str:
    """Return ``path``, created 0700 if missing; it must be this user's and writable by nobody else.

    The cache unpickles what it reads, so only this user may write there; a symbolic link is
    refused, since what it points to may change.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"cache directory {path!r} must be a directory (not a link) of this user, not writable by others"
        )
    return path


def read_private_file(path: str) -> bytes:
    """Return the contents of ``path``, which must be this user's and readable by nobody else."""
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{path!r} must belong to this user and be readable by nobody else")
    with open(path, "rb") as f:
        return f.read()


def write_private_file(path: str, data: bytes) -> None:
    """Create ``path`` (it must not exist) readable and writable by this user only, holding ``data``."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as f:
        f.write(data)


def digest_key_in(directory: str) -> bytes:
    """Return the digest key kept in ``directory``, first generating it (0600) if it has none.

    Several processes may call this at once: the key is written to a file of its own and linked
    into place, so every caller reads the same complete key.
    """
    path = os.path.join(directory, DIGEST_KEY_FILE)
    if not os.path.exists(path):
        draft = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        write_private_file(draft, secrets.token_bytes(DIGEST_KEY_BYTES))
        try:
            os.link(draft, path)
        except FileExistsError:
            pass  # another process linked its key first: everyone uses that one
        finally:
            os.unlink(draft)
    key = read_private_file(path)
    if len(key) != DIGEST_KEY_BYTES:
        raise ValueError(f"{path!r} must hold a {DIGEST_KEY_BYTES}-byte key, found {len(key)} bytes")
    return key


def job_directory() -> str:
    """Make a fresh 0700 directory for the job this process runs, named after its pid.

    The caller removes it when the job ends; the directories of jobs whose process died without
    doing so (SIGKILL, a crash) are removed here first.
    """
    remove_orphaned_job_directories()
    return tempfile.mkdtemp(prefix=f"{JOB_DIRECTORY_PREFIX}{os.getpid()}-")


def remove_orphaned_job_directories() -> None:
    """Remove this user's job directories (:func:`job_directory`) whose process no longer runs."""
    for entry in os.scandir(tempfile.gettempdir()):
        if not entry.name.startswith(JOB_DIRECTORY_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        pid = entry.name.removeprefix(JOB_DIRECTORY_PREFIX).split("-")[0]
        if entry.stat(follow_symlinks=False).st_uid == os.getuid() and pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(entry.path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process holds the pid: keep the directory
    return True
