"""Writing where a user pointed potluck: never through a symbolic link, atomically, and
with one line when the file system says no.

A run directory (``potluck train --out``) may be shared, copied or handed over; a link
planted in it (``trace.json`` pointing at ``~/.bashrc``, ``checkpoints`` at another run)
must not carry potluck's writes or deletions outside it. Every writer into a run
directory, and every output file (``plan -o``, ``calibrate -o``, ``export --out``), comes
here:

- :func:`write_text` and :func:`write_with` write a temporary file beside the target
  (created with ``O_EXCL | O_NOFOLLOW``, so never through a link) and rename it over the target, so a
  reader sees the old file or the new one, never half of one; a target that is a link is
  refused, as is a link among the folders between ``root`` and the target.
- :func:`open_append` appends with ``O_NOFOLLOW``.
- :func:`real_dir` makes a folder (and its parents) and refuses one that is a link.
- :func:`remove_tree` deletes a folder of potluck's, never a link or what it points at.
- :func:`output_error` turns an ``OSError`` (disk full, read-only, permission denied, a
  folder where a file goes) into one :class:`~potluck.errors.ConfigError` line that
  names the path; :func:`os_error_text` is the CLI's last resort for one that escaped.

The run directory itself may be a link (a scratch disk mounted elsewhere): ``root`` is
where the checks start, and the folders above it are the user's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from potluck.errors import ConfigError

_FIXES = {
    errno.ENOSPC: "the disk is full: free space there or write elsewhere",
    errno.EDQUOT: "the disk quota is used up: free space there or write elsewhere",
    errno.EROFS: "the file system is read-only: write elsewhere",
    errno.EACCES: "permission denied: write elsewhere or change the folder's permissions",
    errno.EPERM: "not permitted: write elsewhere or change the folder's permissions",
    errno.EISDIR: "it is a directory: give a file name",
    errno.ENOTDIR: "a part of the path is a file, not a directory: give another path",
    errno.ENOENT: "its folder does not exist: create it or give another path",
    errno.ELOOP: "it is a symbolic link, which potluck never writes through: remove it",
    errno.EEXIST: "a file is in the way of a folder: give another path",
}


def output_error(path: str | Path, err: OSError, action: str = "write") -> ConfigError:
    """``cannot write PATH: the disk is full: ... (OSError: [Errno 28] ...)``, one line."""
    fix = _FIXES.get(err.errno or 0)
    reason = err.strerror or type(err).__name__
    detail = f"{fix} ({reason})" if fix else reason
    return ConfigError(f"cannot {action} {path}: {detail}")


def os_error_text(err: OSError) -> str:
    """One line for an ``OSError`` nothing else explained: its path, its reason, the fix."""
    path = f"{err.filename}: " if err.filename else ""
    fix = _FIXES.get(err.errno or 0)
    reason = err.strerror or str(err) or type(err).__name__
    return f"{path}{fix} ({reason})" if fix else f"{path}{reason}"


@contextlib.contextmanager
def writing(path: str | Path, action: str = "write") -> Iterator[None]:
    """An ``OSError`` inside becomes :func:`output_error`'s one line about ``path``."""
    try:
        yield
    except OSError as err:
        raise output_error(path, err, action) from None


def check_no_link(path: str | Path, root: str | Path | None = None) -> None:
    """Refuse ``path`` when it, or a folder between ``root`` (default: its parent) and it,
    is a symbolic link."""
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    try:
        inner = path.relative_to(root)
    except ValueError:
        inner = Path(path.name)
        root = path.parent
    current = root
    for part in inner.parts:
        current = current / part
        if current.is_symlink():
            raise ConfigError(f"{current} is a symbolic link; potluck never follows links in "
                              "a run directory (one could carry its writes and deletions "
                              "elsewhere): remove the link, or give another directory")


def real_dir(path: str | Path, root: str | Path | None = None) -> Path:
    """Make folder ``path`` (and its parents) unless it exists; refuse a link under ``root``."""
    path = Path(path)
    check_no_link(path, root)
    with writing(path, "create the folder"):
        path.mkdir(parents=True, exist_ok=True)
    check_no_link(path, root)  # made by someone else meanwhile
    return path


def write_with(path: str | Path, write: Callable[[IO[bytes]], None], *,
               root: str | Path | None = None, sync: bool = False) -> Path:
    """Write ``path`` atomically, ``write(file)`` filling a temporary file beside it, then a
    rename over it (``sync``: flushed to disk first, and the folder's entry too)."""
    path = Path(path)
    real_dir(path.parent, root if root is not None else path.parent)
    check_no_link(path, root)
    with writing(path):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             0o666)  # new, never a link; the umask sets its mode
        try:
            with os.fdopen(descriptor, "wb") as file:
                write(file)
                file.flush()
                if sync:
                    os.fsync(file.fileno())
            os.replace(temporary, path)
        finally:
            Path(temporary).unlink(missing_ok=True)
        if sync:
            sync_dir(path.parent)
    return path


def write_text(path: str | Path, text: str, *, root: str | Path | None = None,
               sync: bool = False) -> Path:
    """Write ``text`` (UTF-8) to ``path`` as :func:`write_with` does."""
    data = text.encode()
    return write_with(path, lambda file: file.write(data), root=root, sync=sync)


def open_append(path: str | Path, *, root: str | Path | None = None) -> IO[str]:
    """``path`` opened for appending text, created if missing, never through a link."""
    path = Path(path)
    real_dir(path.parent, root if root is not None else path.parent)
    check_no_link(path, root)
    with writing(path):
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                                 0o666)
        except OSError as err:
            if err.errno == errno.ELOOP:  # made a link since the check
                check_no_link(path, root)
            raise
        return os.fdopen(descriptor, "a")


def remove_tree(path: str | Path, root: str | Path | None = None, *,
                missing_ok: bool = False) -> None:
    """Delete folder (or file) ``path``, refusing a link to one (under ``root``)."""
    path = Path(path)
    check_no_link(path, root)
    if missing_ok and not path.exists():
        return
    with writing(path, "delete"):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def sync_dir(path: str | Path) -> None:
    """Flush a folder's entries (a rename in it) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
