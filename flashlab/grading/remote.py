"""Talking to a sandboxed submission: reading what it wrote as untrusted data.

Everything under a sandbox's writable folder was written by code the grader does not trust: a file there may be a
symbolic link (to a secret of the host), a FIFO (which blocks a reader forever), a device, or gigabytes long.
:func:`read_untrusted` reads one such file safely.
"""

from __future__ import annotations

import os
import stat

#: Bytes read back from one file written in a sandbox unless the caller says otherwise.
DEFAULT_CAP = 64 << 20


class UntrustedFileError(OSError):
    """A file written in the sandbox is not a regular file of acceptable size."""


def read_untrusted(path: str | os.PathLike, cap: int = DEFAULT_CAP) -> bytes:
    """The bytes of ``path``, a regular file of at most ``cap`` bytes, opened without following a symbolic link.

    Raises :class:`UntrustedFileError` (an ``OSError``) for a link, FIFO, device, folder or a file too large,
    and ``OSError`` if it cannot be opened.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise UntrustedFileError(e.errno, f"cannot open {os.fspath(path)!r} safely: {e.strerror}") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedFileError(f"{os.fspath(path)!r} is not a regular file")
        if info.st_size > cap:
            raise UntrustedFileError(f"{os.fspath(path)!r} has {info.st_size} bytes, more than {cap}")
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, cap + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:  # it grew after fstat
                raise UntrustedFileError(f"{os.fspath(path)!r} has more than {cap} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)
