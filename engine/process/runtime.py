"""The engine's runtime folder: files its processes need only while they live.

A front end's Unix socket for its engine cores and the temp dir of a local Ray started for
tensor-parallel workers live under one folder per user, so that what a killed server
leaves (a SIGKILL runs no cleanup) is found and removed by the next start, and nothing is
written to ``/tmp/engine-core-*`` or ``/tmp/ray``::

    <root>/                                  --runtime-dir, else $XDG_RUNTIME_DIR/engine,
      |                                      else <tmp>/engine-<uid>; 0700, ours
      cores-<pid>-<start>-<random>/core.sock a front end's socket for its engine cores
      ray/                                   Ray's temp dir (ray.init(_temp_dir=...))
        session_<date>_<pid>/                a local Ray started by process <pid>

A folder of ours names its owner by pid and the owner's start time (``/proc/<pid>/stat``),
so a pid the kernel has since given to another process never passes for the owner. Ray
names its session folders after the pid that started them; a pid only tells whether some
process holds it, so a leftover whose pid was reused waits for a later start (the safe
side: a live server's files are never removed). Every start sweeps the folder: a
leftover whose owner is dead is removed, and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.errors import ConfigError

logger = logging.getLogger("engine")

# A folder of ours: <kind>-<pid>-<start time in clock ticks since boot>-<mkdtemp's suffix>.
_OURS = re.compile(r"^[a-z]+-(\d+)-(\d+)-")
# Ray's session folders: session_<date>_<time>_<microseconds>_<pid of the process that
# started that Ray>.
_RAY_SESSION = re.compile(r"^session_.*_(\d+)$")
# The longest path Ray puts under its temp dir, its plasma socket:
# "/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store" (a pid has at most
# 7 digits: pid_max is at most 2**22). An AF_UNIX path holds 107 bytes on Linux.
_RAY_SOCKET_TAIL = 64
_UNIX_PATH_MAX = 107


def default_runtime_root() -> Path:
    """``$XDG_RUNTIME_DIR/engine`` (a per-user tmpfs the login session owns), else
    ``engine-<uid>`` in the temp dir (``$TMPDIR`` or ``/tmp``).

    The one place the engine reads the environment for it; ``--runtime-dir`` (the
    ``runtime_dir`` option) takes precedence."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "engine"
    return Path(tempfile.gettempdir()) / f"engine-{os.getuid()}"


def runtime_root(configured: str | os.PathLike[str] | None = None) -> Path:
    """The runtime folder (``configured``, else :func:`default_runtime_root`), made if
    missing. Refused (:class:`ConfigError` naming ``runtime_dir``) unless it is a real
    folder owned by this user: in a shared temp dir another user could have made it
    first. Its mode is set to 0700."""
    root = Path(configured).expanduser() if configured else default_runtime_root()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(root)
    except OSError as exc:
        raise ConfigError(f"the runtime folder {root} cannot be made: {exc.strerror}",
                          field="runtime_dir") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(f"the runtime folder {root} is not a folder of this user (uid "
                          f"{os.getuid()}); give --runtime-dir a folder of yours",
                          field="runtime_dir")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(root, 0o700)
    return root


def sweep_at_start(configured: str | None) -> None:
    """A server's start: sweep the runtime folder if there is one (a server that needs no
    runtime file makes none), so that a killed server's leftovers go whatever the next
    one runs."""
    root = Path(configured).expanduser() if configured else default_runtime_root()
    if root.is_dir():
        sweep(runtime_root(configured))


def owner_tag(pid: int | None = None) -> str | None:
    """``<pid>-<start time>`` of a live process (this one by default), None if none has
    that pid. The start time (clock ticks after boot, field 22 of ``/proc/<pid>/stat``)
    tells a process from a later one given the same pid."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if fields[0] == b"Z":
        return None  # a zombie has exited; only its parent's wait() is pending
    return f"{pid}-{int(fields[19])}"  # after the ")": state is field 3, starttime 22


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process holds that pid
    return owner_tag(pid) is not None  # not a zombie


def sweep(root: Path) -> list[Path]:
    """Remove what dead engine processes left under ``root`` (see the module docstring);
    the paths removed. Never touches a live owner's files, nor anything else."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = _OURS.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False) \
                and owner_tag(int(match.group(1))) != f"{match.group(1)}-{match.group(2)}":
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    removed += forget_ray_sessions(root / "ray", lambda pid: not _pid_alive(pid))
    if removed:
        logger.info("runtime folder %s: removed %d leftover(s) of engine processes that died "
                    "without cleaning up: %s", root, len(removed),
                    ", ".join(p.name for p in removed))
    return removed


def forget_ray_sessions(ray_dir: Path, dead: Callable[[int], bool]) -> list[Path]:
    """Remove the Ray session folders under ``ray_dir`` whose starting pid ``dead``
    says is gone, and ``session_latest`` if it then points nowhere."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(ray_dir))
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = _RAY_SESSION.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and dead(int(match.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    latest = ray_dir / "session_latest"
    if latest.is_symlink() and not latest.exists():
        latest.unlink(missing_ok=True)
    return removed


@contextlib.contextmanager
def runtime_folder(configured: str | None, kind: str) -> Iterator[Path]:
    """A fresh folder ``<kind>-<pid>-<start>-*`` of this process under the runtime root,
    removed on the way out; the root is swept first (this is a start)."""
    root = runtime_root(configured)
    sweep(root)
    tag = owner_tag()
    assert tag is not None  # this process lives
    path = Path(tempfile.mkdtemp(prefix=f"{kind}-{tag}-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def ray_temp_dir(configured: str | None) -> Path:
    """Where a local Ray started by this process keeps its sessions (``_temp_dir``):
    ``<root>/ray``, after sweeping the root. Refused when the path would make Ray's
    socket paths longer than a Unix socket's path may be."""
    root = runtime_root(configured)
    sweep(root)
    path = root / "ray"
    if len(os.fsencode(path)) + _RAY_SOCKET_TAIL > _UNIX_PATH_MAX:
        raise ConfigError(f"the runtime folder {root} is too long a path for Ray's sockets "
                          f"(at most {_UNIX_PATH_MAX - _RAY_SOCKET_TAIL - 4} bytes); give "
                          "--runtime-dir a shorter one", field="runtime_dir")
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def forget_own_ray_sessions(ray_dir: Path) -> list[Path]:
    """After ``ray.shutdown()``: remove the sessions this process's Ray wrote (their
    logs and sockets), as a clean exit leaves nothing behind."""
    me = os.getpid()
    return forget_ray_sessions(ray_dir, lambda pid: pid == me)
