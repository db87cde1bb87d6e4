"""Temporary files of atomic saves, named so that an interrupted save's leftovers can be found and removed.

Every temporary sibling that an atomic save builds before renaming it into place is called
``.{target name}.tmp-{host}-{pid}-{random}`` (a directory for checkpoints, a file for indexes and other
files). A save that is killed leaves it behind; the next save or load of the same target calls
:func:`sweep_tmp`, which removes every such sibling whose writer is gone: written on this host by a
process that no longer runs. Siblings of a live process, or of another host, are left alone.

No tempokern imports here (``tempokern._util`` uses this module)."""
from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path
from typing import List

_HOST_RE = re.compile(r"[^A-Za-z0-9_.]")


def host_name() -> str:
    """This machine's name, reduced to characters safe in a file name ('-' is the field separator)."""
    return _HOST_RE.sub("_", socket.gethostname() or "localhost")


def tmp_prefix(name: str) -> str:
    """Prefix for ``tempfile.mkdtemp`` / ``mkstemp`` of a temporary sibling of the target called `name`."""
    return f".{name}.tmp-{host_name()}-{os.getpid()}-"


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (a process owned by another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def sweep_tmp(target) -> List[Path]:
    """Remove the temporary siblings of `target` left by interrupted saves (module docstring): those
    named by :func:`tmp_prefix` on this host whose process is gone. Returns the paths removed."""
    target = Path(target)
    parent = target.parent if str(target.parent) else Path(".")
    head = f".{target.name}.tmp-{host_name()}-"
    removed: List[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for e in entries:
        if not e.name.startswith(head):
            continue
        pid_s = e.name[len(head):].split("-", 1)[0]
        if not pid_s.isdigit() or pid_alive(int(pid_s)):
            continue
        p = Path(e.path)
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
        except OSError:   # not ours to remove (permissions): left in place
            pass
    return removed


#: what `tempokern train` writes into its --out folder (every method): a run's outputs
RUN_OUTPUTS = ("best", "last", "model", "log.jsonl", "summary.json")


def run_outputs(folder) -> List[str]:
    """The names of :data:`RUN_OUTPUTS` present in `folder` (a previous run's outputs)."""
    folder = Path(folder)
    return [n for n in RUN_OUTPUTS if os.path.lexists(folder / n)]


def clear_run_outputs(folder) -> List[str]:
    """Remove a previous run's outputs (:data:`RUN_OUTPUTS`, their ``.old`` copies and temporary siblings)
    from `folder`; nothing else in it is touched. Returns the names removed."""
    folder = Path(folder)
    gone = []
    if not folder.is_dir():
        return gone
    for e in list(os.scandir(folder)):
        base = e.name
        if base.startswith("."):     # .best.old, .last.tmp-...: a save's leftovers
            base = base[1:].split(".old", 1)[0].split(".tmp-", 1)[0]
            if base not in RUN_OUTPUTS:
                continue
        elif base not in RUN_OUTPUTS:
            continue
        p = Path(e.path)
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(p)
        else:
            p.unlink()
        gone.append(e.name)
    return sorted(gone)
