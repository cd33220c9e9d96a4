"""Server-side input files: only regular files under the allowed roots, checked where they
are opened (the gateway at submit, the worker again when it reads the file)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO


class PathNotAllowed(ValueError):
    """A path outside the allowed roots, missing, or not a regular file."""


def _real_roots(roots: Sequence[Path]) -> list[Path]:
    return [Path(os.path.realpath(root)) for root in roots]


def _inside(real: Path, real_roots: list[Path]) -> bool:
    return any(real == root or root in real.parents for root in real_roots)


def _candidates(raw: str, roots: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """(the paths `raw` may mean, the resolved roots); PathNotAllowed for a malformed path."""
    if not roots:
        raise PathNotAllowed("server-side paths are disabled (no allowed roots configured)")
    if "\x00" in raw:
        raise PathNotAllowed("the path contains a NUL byte")
    candidate = Path(raw)
    if ".." in candidate.parts:
        raise PathNotAllowed("the path may not contain '..'")
    real_roots = _real_roots(roots)
    if candidate.is_absolute():
        return [candidate], real_roots
    return [root / candidate for root in real_roots], real_roots


def resolve_allowed_path(raw: str, roots: Sequence[Path]) -> Path:
    """A regular file strictly under one of `roots`, after resolving every symlink."""
    options, real_roots = _candidates(raw, roots)
    under_a_root = False
    for option in options:
        real = Path(os.path.realpath(option))  # (not strict: a loop or a long name resolves)
        if not _inside(real, real_roots):
            continue
        under_a_root = True
        try:
            mode = real.stat().st_mode
        except OSError:  # missing, a name too long for the file system, a symlink loop …
            continue
        if not stat.S_ISREG(mode):
            raise PathNotAllowed("the path is not a regular file")
        return real
    # outside every root whether or not it exists: the reply tells nothing of other files
    if not under_a_root:
        raise PathNotAllowed("the path is outside the allowed roots")
    raise PathNotAllowed("no such file under the allowed roots")


@contextlib.contextmanager
def open_allowed(raw: str, roots: Sequence[Path]) -> Iterator[BinaryIO]:
    """Open `raw` for reading, then check what was opened: a regular file under `roots`.

    Resolving a path and then opening it leaves a window in which any component (the file or
    a directory above it) can be swapped for a symlink; O_NOFOLLOW guards the last component
    only. So the check runs on the open descriptor: /proc/self/fd/N names the file it really
    refers to, and fstat says what it is. Where /proc is missing, the resolved path is opened
    with O_NOFOLLOW and compared with the descriptor's inode.
    """
    real = resolve_allowed_path(raw, roots)
    # O_NONBLOCK: a FIFO swapped in must not block the open (it fails the S_ISREG check)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise PathNotAllowed(f"cannot open the file ({exc.strerror})") from None
    try:
        opened = _fd_path(fd)
        if opened is not None and not _inside(opened, _real_roots(roots)):
            raise PathNotAllowed("the path is outside the allowed roots")
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PathNotAllowed("the path is not a regular file")
        if opened is None:
            again = os.stat(real, follow_symlinks=False)
            if (again.st_dev, again.st_ino) != (info.st_dev, info.st_ino):
                raise PathNotAllowed("the file changed while it was opened")
        os.set_blocking(fd, True)
        handle = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with handle:
        yield handle


def _fd_path(fd: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class AllowedFile:
    """A server-side input a task names: checked against `roots` again when it is opened,
    since what the path points at may have changed since the submit was checked."""

    raw: str
    roots: tuple[Path, ...]

    def open(self) -> contextlib.AbstractContextManager[BinaryIO]:
        return open_allowed(self.raw, self.roots)
