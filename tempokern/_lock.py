"""One writer per output folder: an advisory lock file.

The commands that write an output folder (``train``, ``benchmark``, ``demo``, ``data``, ``bench``; ``index`` for its
index file) hold ``LOCK_NAME`` in it while they run: a JSON object with the holder's ``pid``, ``host``,
``started`` (UTC, ISO 8601) and ``command``. A second writer fails at once with :class:`OutputInUse`
naming the holder. A lock left by a process that no longer runs (same host, dead pid: a killed run) is
stale: the next writer takes it over and says so. A lock written on another host is never taken over
(remove it by hand once that run is gone).

The lock is created atomically (written to a temporary file, then hard-linked to its name, which fails
if the name exists), so it is never seen half-written."""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Optional

from ._files import host_name, pid_alive, tmp_prefix

#: the lock file's name inside an output folder
LOCK_NAME = ".tempokern.lock"


class OutputInUse(ValueError):
    """Another live process holds the output folder's lock."""


def _describe(info: dict) -> str:
    cmd = info.get("command") or "?"
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')} since {info.get('started', '?')} "
            f"({cmd})")


def read_lock(path) -> Optional[dict]:
    """The holder recorded in lock file `path` ({} if unreadable), None if there is none."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        info = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return info if isinstance(info, dict) else {}


def _stale(info: dict) -> bool:
    """A lock whose holder is gone: written on this host by a pid that no longer runs (or unreadable,
    which only a file damaged by hand can be: the lock is written atomically)."""
    if not info:
        return True
    pid = info.get("pid")
    if info.get("host") != host_name() or not isinstance(pid, int):
        return False
    return pid != os.getpid() and not pid_alive(pid)


class OutputLock:
    """``with OutputLock(lock_path, command):`` holds the lock for the block (module docstring)."""

    def __init__(self, lock_path, command: str = "", *, log=None):
        self.path = Path(lock_path)
        self.command = command
        self.log = log if log is not None else (lambda m: print(m, file=sys.stderr))
        self.held = False

    def acquire(self) -> "OutputLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        info = {"pid": os.getpid(), "host": host_name(),
                "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "command": self.command}
        tmp = self.path.parent / (tmp_prefix(self.path.name) + "lock")
        tmp.write_text(json.dumps(info), encoding="utf-8")
        try:
            for _ in range(3):
                try:
                    os.link(tmp, self.path)
                    self.held = True
                    return self
                except FileExistsError:
                    pass
                holder = read_lock(self.path)
                if holder is None:        # released meanwhile: try again
                    continue
                if not _stale(holder):
                    raise OutputInUse(f"{self.path.parent} is in use by another tempokern run: {_describe(holder)} "
                                      f"(lock file {self.path}; wait for it to finish, or remove the lock if that "
                                      "run is gone)")
                who = _describe(holder) if holder else "an unreadable holder"
                self.log(f"tempokern: taking over the stale lock {self.path} of {who} (that process is gone)")
                try:
                    # take over only the lock we read (a rename keeps a racing writer's fresh lock intact)
                    stale_tmp = self.path.parent / (tmp_prefix(self.path.name) + "stale")
                    os.replace(self.path, stale_tmp)
                    moved = read_lock(stale_tmp)
                    if moved != holder:       # another writer's lock slipped in between: put it back
                        try:
                            os.link(stale_tmp, self.path)
                        except FileExistsError:
                            pass
                    os.unlink(stale_tmp)
                except FileNotFoundError:
                    pass
            raise OutputInUse(f"could not take the lock {self.path} (another tempokern run keeps taking it)")
        finally:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = read_lock(self.path)
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == host_name():
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False


def output_lock(folder, command: str = "", **kw) -> OutputLock:
    """The lock of output folder `folder` (``folder/.tempokern.lock``)."""
    return OutputLock(Path(folder) / LOCK_NAME, command, **kw)


#: commands that write an output folder, and hold its lock while they run
LOCKED_COMMANDS = ("train", "benchmark", "demo", "data", "bench", "index")


def command_lock(args):
    """The lock a CLI command holds while it runs: ``--out/.tempokern.lock`` for train, benchmark, demo,
    data and bench; ``PATH.lock`` next to the index file for ``index --out PATH``. Other commands (and torchrun ranks
    other than 0, which share rank 0's folder) hold none."""
    import contextlib
    out = getattr(args, "out", None)
    if args.command not in LOCKED_COMMANDS or not out or os.environ.get("RANK", "0") != "0":
        return contextlib.nullcontext()
    command = "tempokern " + " ".join(getattr(args, "argv", None) or [args.command])
    if args.command == "index":
        p = Path(out)
        return OutputLock(p.parent / f"{p.name}.lock", command)
    return output_lock(out, command)


def check_fresh_run(args) -> None:
    """``tempokern train`` without ``--resume`` into a folder holding a previous run's outputs: refused
    (CLIError naming them) unless ``--overwrite``, which removes them first. Run under the folder's lock."""
    if args.command == "train" and getattr(args, "resume", False) and getattr(args, "overwrite", False):
        from .cli import CLIError
        raise CLIError("--resume continues the run in --out and --overwrite replaces it: give one")
    if args.command != "train" or getattr(args, "resume", False) or not getattr(args, "out", None) \
            or os.environ.get("RANK", "0") != "0":
        return
    from ._files import clear_run_outputs, run_outputs
    found = run_outputs(args.out)
    if not found:
        return
    if getattr(args, "overwrite", False):
        gone = clear_run_outputs(args.out)
        print(f"tempokern train: --overwrite: removed the previous run's {', '.join(gone)} from {args.out}",
              file=sys.stderr)
        return
    from .cli import CLIError
    raise CLIError(f"--out {args.out} holds a previous run ({', '.join(found)}): give --resume to continue it, "
                   "--overwrite to replace it, or another --out")
