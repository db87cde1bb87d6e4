"""Small helpers shared across tempokern's layers (no tempokern imports here, so every module can use them)."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from ._files import sweep_tmp, tmp_prefix

CACHE_MAX = 16  # module-level caches hold at most this many entries, the oldest goes first


def cache_put(cache: dict, key, value, limit: int = CACHE_MAX):
    """Insert into a bounded module-level cache (at most `limit` entries, evicting the oldest) and return the
    value."""
    while len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def sha256_file(path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks (checkpoint manifests, packaged data)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def trace_constant(fn):
    """Marks fn so that torch.compile records its result as a constant of the trace (what
    ``torch.compiler.assume_constant_result`` does: it sets this attribute), without importing torch._dynamo when
    tempokern is imported (that import alone costs seconds). tests/test_dispatch.py checks that torch's decorator
    still sets the same attribute."""
    fn._dynamo_marked_constant = True
    return fn


# ---- durable, atomic file system updates ----------------------------------------------------------------

def fsync_path(path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames inside it durable)."""
    fd = os.open(str(path), os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    except OSError:   # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def fsync_tree(root) -> None:
    """fsync every file and directory under root (bottom-up), then root."""
    for d, _, files in os.walk(str(root), topdown=False):
        for f in files:
            fsync_path(os.path.join(d, f))
        fsync_path(d)


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)     # elsewhere: read it by setting it, and put it back
    os.umask(mask)
    return mask


def default_mode(directory: bool = False) -> int:
    """The permissions a plain ``open(path, "w")`` / ``mkdir`` gives (0644 / 0755 under the usual umask 022):
    ``tempfile.mkstemp`` / ``mkdtemp`` make 0600 / 0700 entries, which an atomic write then renames into place."""
    return (0o777 if directory else 0o666) & ~_umask()


def plain_permissions(root) -> None:
    """Give `root` (a directory built under ``mkdtemp``, or a file) and everything below it a plain write's
    permissions (``default_mode``); some writers (safetensors) create their files 0600."""
    root = Path(root)
    os.chmod(root, default_mode(root.is_dir()))
    if root.is_dir():
        for dirpath, dirnames, filenames in os.walk(root):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), default_mode(True))
            for f in filenames:
                os.chmod(os.path.join(dirpath, f), default_mode())


def atomic_write(path, data, *, encoding: str = "utf-8") -> None:
    """Write text or bytes to `path` atomically and durably: a temporary file in the same directory,
    fsync, rename over `path`, fsync the directory. A crash leaves the old file or the new one. The file gets
    the permissions of a plain write (``default_mode``: 0644 under umask 022)."""
    path = Path(path)
    sweep_tmp(path)
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=tmp_prefix(path.name))
    try:
        os.fchmod(fd, default_mode())     # mkstemp's 0600 would survive the rename
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode(encoding) if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    if not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(AT_FDCWD, os.fsencode(str(a)), AT_FDCWD, os.fsencode(str(b)), RENAME_EXCHANGE)
    return rc == 0


def replace_dir(tmp: Path, path: Path) -> None:
    """Put the complete directory `tmp` at `path`. With an existing `path`: an atomic swap where the
    OS has one (Linux renameat2), so `path` always holds the old or the new checkpoint; elsewhere the
    old one moves to `.{name}.old` first and :func:`recover_dir` restores it if a crash came between
    the two renames."""
    parent = path.parent
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory; refusing to replace it")
    if path.exists() and _exchange(tmp, path):
        fsync_path(parent)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = parent / f".{path.name}.old"
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
        fsync_path(parent)
    os.replace(tmp, path)
    fsync_path(parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def recover_dir(path: Path) -> None:
    """After a crash inside :func:`replace_dir`'s fallback: `path` is missing and `.{name}.old` holds
    the previous checkpoint; put it back. Also removes the temporary siblings of `path` that an interrupted
    save left (:func:`tempokern._files.sweep_tmp`)."""
    sweep_tmp(path)
    old = path.parent / f".{path.name}.old"
    if not path.exists() and old.is_dir():
        os.replace(old, path)
        fsync_path(path.parent)
