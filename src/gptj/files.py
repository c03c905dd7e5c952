"""Files users hand in, and folders gptj writes: read with one-line errors, write atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
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


def temp_sibling(target: Path) -> Path:
    """A new empty folder beside `target`, to be filled and then moved into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))


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
