"""Files users hand in, and files and folders gptj writes: read with one-line errors, write atomically."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from gptj.errors import GptjError


def read_text(path: Path, what: str = "input file") -> str:
    """A whole UTF-8 text file (a leading BOM dropped); a one-line GptjError naming it otherwise."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise GptjError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise GptjError(f"{path}: is a directory, not a{'n' if what[0] in 'aeiou' else ''} {what}") from None
    except UnicodeDecodeError as e:
        raise GptjError(f"{path}: not valid UTF-8 (byte {e.start})") from None
    except OSError as e:
        raise GptjError(f"{path}: cannot read: {e.strerror or e}") from None


# --- files inside a model folder: a link may point elsewhere inside it, never out of it -----------


def model_file(folder: str | os.PathLike, name: str | os.PathLike) -> Path:
    """`folder / name`, a file gptj is about to read from a model (or adapter) folder, once its real
    path (every link resolved) is found to lie inside the folder's real path; a one-line GptjError
    naming the file otherwise. A root check on the folder alone would still follow a `config.json`
    linked to /etc/passwd. The path returned is the one given (error messages keep naming it); a
    file that does not exist passes (its reader reports it)."""
    folder = Path(folder)
    path = folder / name
    try:
        base = folder.resolve()
        real = path.resolve()
    except (OSError, RuntimeError):  # a link loop (pathlib raises RuntimeError for it before 3.13)
        raise GptjError(f"{path}: a link that cannot be resolved (a loop?); it must stay inside the model "
                        f"folder") from None
    if base not in real.parents:
        raise GptjError(f"{path}: leaves the model folder {folder} (it resolves to {real}); a model folder's "
                        f"files must lie inside it")
    return path


# --- a full disk: one line naming what was being written -----------------------------------------
#
# A write that runs out of space surfaces as an OSError (ENOSPC, or EDQUOT past a quota), or wrapped by
# a library: safetensors raises SafetensorError("... No space left on device (os error 28)"), and
# torch.save into a file object raises the OSError with torch's own RuntimeError as its context.
# (torch.save given a path writes through C++ streams and reports only "unexpected pos": gptj hands
# it a file object, see save_torch.)
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_NO_SPACE_TEXTS = ("no space left on device", "disk quota exceeded",
                   f"(os error {errno.ENOSPC})", f"(os error {errno.EDQUOT})")


def is_no_space(e: BaseException | None) -> bool:
    """Whether `e`, or an exception it was raised from or while handling, says the disk is full."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS:
            return True
        if any(text in str(e).lower() for text in _NO_SPACE_TEXTS):
            return True
        e = e.__cause__ or e.__context__
    return False


def no_space_error(path: str | os.PathLike) -> GptjError:
    return GptjError(f"{path}: cannot write: no space left on device (nothing was written there; free some "
                     f"space and run again)")


@contextlib.contextmanager
def no_space_is_an_error(path: str | os.PathLike) -> Iterator[None]:
    """Within the body, a write failing for lack of space becomes no_space_error(path). Nested, the
    outermost names its path: what the caller asked to write, not a temporary file inside it."""
    try:
        yield
    except Exception as e:
        if is_no_space(e):
            raise no_space_error(path) from None
        raise


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append `line` and a newline to a log (metrics.jsonl) in one write. If the write fails (a full
    disk: no_space_error), the file is cut back to its size before it, so no half line is left for
    a reader (a resumed run's) to trip on."""
    data = memoryview((line + "\n").encode("utf-8"))
    with no_space_is_an_error(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            size = os.fstat(fd).st_size
            try:
                while data:
                    data = data[os.write(fd, data):]
            except BaseException:
                with contextlib.suppress(OSError):  # (a device, a pipe: nothing to cut back)
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)


def save_torch(obj: object, path: str | os.PathLike) -> None:
    """torch.save(obj) to `path` through a Python file object, so that a full disk surfaces as
    OSError(ENOSPC) (is_no_space) rather than as torch's "unexpected pos"."""
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)


# --- single files: a reader sees the old file or the whole new one, never half of it ---------------


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    with no_space_is_an_error(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the result is an ordinary file
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: object) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")


# --- folders: filled beside their target, then moved into place ------------------------------------
#
# A temporary folder's name records its owner: `.TARGET.tmp-HOST-PID-XXXXXXXX` (XXXXXXXX:
# mkdtemp's random part), so that a later run can tell a leftover of a killed run (its pid dead on
# this host) from a folder a live run is still filling. One without an owner it can check (another
# host sharing the folder, or a name from before owners were recorded) is a leftover only once
# nothing in it has changed for STALE_S: a live writer touches its files far more often.
_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
STALE_S = 3600.0


def temp_sibling(target: Path) -> Path:
    """A new empty folder beside `target`, to be filled and then moved into place. Leftovers of
    killed runs writing the same target are removed first (see remove_leftovers)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target.parent, re.escape(target.name))
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{_HOST}-{os.getpid()}-", dir=target.parent))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, OSError):  # not a pid this system can have
        return False
    return True


def _last_change(folder: Path) -> float:
    """The newest mtime of the folder and everything in it."""
    newest = folder.lstat().st_mtime
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
            except OSError:
                pass
    return newest


def remove_leftovers(parent: Path, target_re: str, stale_s: float | None = None) -> list[Path]:
    """Remove the temporary folders temp_sibling made in `parent` for targets whose name matches
    the regular expression `target_re` and whose run is gone: recorded on this host with a pid that
    is no longer running, or (owner unknown) unchanged for `stale_s` seconds (STALE_S). Nothing
    else is touched: not another name, not a file or link, not a live run's folder. Returns those
    removed."""
    stale_s = STALE_S if stale_s is None else stale_s
    pattern = re.compile(rf"\.(?:{target_re})\.tmp-(?:(?P<host>[A-Za-z0-9]+)-(?P<pid>[0-9]+)-)?[a-z0-9_]{{8}}")
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            if m["pid"] is not None and m["host"] == _HOST:
                gone = int(m["pid"]) != os.getpid() and not _pid_alive(int(m["pid"]))
            else:
                gone = now - _last_change(entry) > stale_s
        except OSError:  # removed meanwhile (by a concurrent run cleaning the same leftovers)
            continue
        if gone:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def move_into_place(tmp: Path, target: Path) -> None:
    """Give `tmp` (from temp_sibling) ordinary permissions and rename it to `target`, replacing
    an existing `target` only once the new folder is complete."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the result is an ordinary folder
    for f in tmp.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)
    if target.exists():
        backup = target.parent / f".{target.name}.old-{os.getpid()}"
        os.replace(target, backup)
        os.replace(tmp, target)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, target)


@contextlib.contextmanager
def atomic_folder(target: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `target` (temp_sibling) to fill; when the body succeeds, move it
    into place (replacing `target`). On any failure, KeyboardInterrupt included, the temporary
    folder is removed and `target` is left as it was; a write that fails for lack of space is one
    line naming `target` (no_space_error)."""
    with no_space_is_an_error(target):
        tmp = temp_sibling(target)
        try:
            yield tmp
            move_into_place(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
