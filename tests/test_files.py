"""Temporary folders of killed runs: the next convert / train removes its own kind of leftovers
(owner's pid dead, or unchanged for long), never a live run's folder nor anything else."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from gptj import files
from gptj.cli import main

HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32]  # as the name temp_sibling writes
LONG_AGO = time.time() - 30 * 86400  # far beyond any age a live writer's folder could have


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def plant(parent: Path, name: str, old: bool = False, folder: bool = True) -> Path:
    path = parent / name
    if folder:
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"half of it")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    if old:
        for p in [*path.rglob("*"), path] if folder else [path]:
            os.utime(p, (LONG_AGO, LONG_AGO))
    return path


def plant_kinds(parent: Path, target: str) -> tuple[list[Path], list[Path]]:
    """(leftovers that must go, look-alikes that must stay) beside `parent / target`."""
    dead = dead_pid()
    leftovers = [
        plant(parent, f".{target}.tmp-{HOST}-{dead}-ab_cd123"),  # killed on this host: pid dead
        plant(parent, f".{target}.tmp-x0y1z2ab", old=True),  # from before owners were recorded, long unchanged
        plant(parent, f".{target}.tmp-otherhost-{os.getpid()}-abcd1234", old=True),  # another host's, long unchanged
    ]
    survivors = [
        plant(parent, f".{target}.tmp-{HOST}-{os.getpid()}-livelive", old=True),  # a live run's, however old
        plant(parent, f".{target}.tmp-otherhost-{dead}-fresh123"),  # another host's, changed just now
        plant(parent, f".{target}.tmp-fresh456"),  # owner unknown, changed just now
        plant(parent, f".other.tmp-{HOST}-{dead}-abcd1234"),  # another target's
        plant(parent, f"{target}.tmp-{HOST}-{dead}-abcd1234", old=True),  # not hidden: not ours
        plant(parent, f".{target}.tmp-{HOST}-{dead}-abcd1234.bak", old=True),  # a longer name
        plant(parent, f".{target}.tmp-{HOST}-{dead}-filefile", old=True, folder=False),  # a file
        plant(parent, f".{target}.old-{dead}", old=True),
        plant(parent, "notes.txt", old=True, folder=False),
    ]
    link = parent / f".{target}.tmp-{HOST}-{dead}-linklink"
    link.symlink_to(survivors[0])
    return leftovers, [*survivors, link]


def assert_cleaned(leftovers: list[Path], survivors: list[Path]) -> None:
    assert [p.name for p in leftovers if os.path.lexists(p)] == []
    assert [p.name for p in survivors if not os.path.lexists(p)] == []


def test_temp_sibling_removes_only_dead_or_stale_leftovers_of_its_target(tmp_path):
    leftovers, survivors = plant_kinds(tmp_path, "model")
    tmp = files.temp_sibling(tmp_path / "model")
    assert_cleaned(leftovers, survivors)
    assert tmp.name.startswith(f".model.tmp-{HOST}-{os.getpid()}-") and tmp.is_dir()
    # the folder this process is filling survives a second run's cleaning (a concurrent writer)
    files.temp_sibling(tmp_path / "model")
    assert tmp.is_dir()


def test_convert_cleans_its_leftovers_beside_out(tmp_path, capsys):
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path / "tiny"), "--seed", "1"]) == 0
    leftovers, survivors = plant_kinds(tmp_path, "conv")
    assert main(["convert", str(tmp_path / "tiny"), "--out", str(tmp_path / "conv"), "--quiet"]) == 0
    assert_cleaned(leftovers, survivors)
    assert (tmp_path / "conv" / "config.json").is_file()


def test_train_cleans_its_checkpoint_leftovers(tmp_path):
    from gptj.train.config import load_config
    from gptj.train.trainer import train

    (tmp_path / "t.txt").write_text("the red fox runs to the old barn. " * 40)
    cfg = {"model": {"preset": "tiny"}, "data": {"train": {"text": [str(tmp_path / "t.txt")]}, "seq_len": 16},
           "batch_size": 2, "max_steps": 2, "seed": 1, "out": str(tmp_path / "run")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    checkpoints = tmp_path / "run" / "checkpoints"
    dead = dead_pid()
    leftovers = [plant(checkpoints, f".step-0000005.tmp-{HOST}-{dead}-abcd1234"),
                 plant(tmp_path / "run", f"..final.tmp.tmp-{HOST}-{dead}-abcd1234")]
    survivors = [plant(checkpoints, f".step-0000005.tmp-{HOST}-{os.getpid()}-abcd1234"),
                 plant(checkpoints, f".stepx-0000005.tmp-{HOST}-{dead}-abcd1234"),
                 plant(tmp_path / "run", f".checkpoints.tmp-{HOST}-{dead}-abcd1234")]
    train(load_config(tmp_path / "c.yaml"), progress=False)
    assert_cleaned(leftovers, survivors)
    assert (checkpoints / "step-0000002").is_dir()


def test_a_sigkilled_writer_leaves_a_folder_the_next_run_removes(tmp_path):
    """A real SIGKILL: a child fills a temporary folder and is killed mid-write; the folder stays,
    and the next temp_sibling for the same target removes it."""
    code = ("import sys; from pathlib import Path; from gptj import files\n"
            "tmp = files.temp_sibling(Path(sys.argv[1]))\n"
            "(tmp / 'model.safetensors').write_bytes(b'partial')\n"
            "print(tmp, flush=True)\n"
            "sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "out")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    left = Path(child.stdout.readline().strip())
    assert left.parent == tmp_path and (left / "model.safetensors").is_file()
    files.temp_sibling(tmp_path / "out")  # its writer still runs: kept
    assert left.is_dir()
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdin.close()
    child.stdout.close()
    assert left.is_dir()  # nothing cleaned up after the kill
    files.temp_sibling(tmp_path / "out")
    assert not left.exists()


def test_model_file_keeps_reads_inside_the_folder(tmp_path):
    """gptj.files.model_file: a file (or a link to one) inside the folder passes as given; a link
    whose target, or a name whose `..`, leaves the folder, and a link loop, are one-line GptjErrors."""
    import pytest

    from gptj.errors import GptjError

    d = tmp_path / "model"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "real.json").write_text("{}")
    (tmp_path / "secret").write_text("x")
    (d / "inside.json").symlink_to(Path("sub") / "real.json")
    (d / "out.json").symlink_to(tmp_path / "secret")
    (d / "up").symlink_to(tmp_path)
    (d / "loop").symlink_to(d / "loop")
    assert files.model_file(d, "inside.json") == d / "inside.json"
    assert files.model_file(d, "sub/real.json") == d / "sub" / "real.json"
    assert files.model_file(d, "missing.json") == d / "missing.json"  # its reader says it is missing
    for name in ("out.json", "../secret", "up/secret", "loop", "."):
        with pytest.raises(GptjError) as e:
            files.model_file(d, name)
        assert str(e.value).startswith(f"{d / name}: ") and "model folder" in str(e.value), e.value
        assert "\n" not in str(e.value)
    linked_folder = tmp_path / "linked"  # the folder itself may be a link: its files are judged by its target
    linked_folder.symlink_to(d)
    assert files.model_file(linked_folder, "inside.json") == linked_folder / "inside.json"


def test_a_full_disk_is_recognised_however_it_is_wrapped():
    import errno

    from safetensors import SafetensorError

    wrapped = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    full = OSError(errno.ENOSPC, "No space left on device")
    full.__context__ = wrapped  # torch.save into a file object: the OSError, torch's error its context
    outer = ValueError("saving failed")
    outer.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert files.is_no_space(full) and files.is_no_space(outer)
    assert files.is_no_space(SafetensorError("Error while serializing: I/O error: No space left on device "
                                             "(os error 28)"))
    for other in (wrapped, OSError(errno.EACCES, "Permission denied"), ValueError("os error 280"), None):
        assert not files.is_no_space(other)


def test_atomic_writes_on_a_full_disk_are_one_line_and_leave_the_old_file(tmp_path, monkeypatch):
    """The write fails half-way: GptjError naming the file, the old content kept, no temporary left."""
    import errno

    import pytest

    from gptj.errors import GptjError

    target = tmp_path / "config.json"
    target.write_text("old")
    real_fdopen = os.fdopen

    class HalfWriter:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fdopen", lambda fd, mode: HalfWriter(real_fdopen(fd, mode)))
    with pytest.raises(GptjError) as e:
        files.atomic_write_json(target, {"new": "x" * 100})
    assert str(e.value).startswith(f"{target}: cannot write: no space left on device") and "\n" not in str(e.value)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_append_line_on_a_full_disk_leaves_no_half_line(tmp_path, monkeypatch):
    """metrics.jsonl: a line that cannot be written whole is not left half-written (a resumed run
    parses every line)."""
    import errno

    import pytest

    from gptj.errors import GptjError

    log = tmp_path / "metrics.jsonl"
    files.append_line(log, '{"step": 1}')
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "write", half_then_full)
    with pytest.raises(GptjError, match=rf"^{re.escape(str(log))}: cannot write: no space left on device"):
        files.append_line(log, '{"step": 2, "loss": 1.5}')
    assert log.read_text() == '{"step": 1}\n'
