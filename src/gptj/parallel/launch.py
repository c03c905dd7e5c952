"""Start N ranks of a job: under torchrun (this process is one rank) or spawned by gptj itself.

    run_parallel(job, world, payload) -> rank 0's return value (in the calling process)

`job(rank, world, payload)` runs in every rank after torch.distributed is initialized: gloo on
CPU, NCCL on CUDA (each rank on cuda:LOCAL_RANK). Spawned ranks meet through a file in a private
temporary folder, split the CPU's threads between them, and hand rank 0's JSON-able result (or
a GptjError's one line) back through that folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from gptj.errors import GptjError

Job = Callable[[int, int, Any], Any]
NOT_RANK0 = object()  # under torchrun, what run_parallel returns on ranks other than 0 (they print nothing)


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str) -> str:
    """cuda -> cuda:LOCAL_RANK (one GPU per rank: gptj.device.rank_device); cpu stays cpu."""
    from gptj.device import rank_device as on_rank

    return on_rank(device, int(os.environ.get("LOCAL_RANK", "0")))


def _use_rank_device(device: str) -> None:
    if device.startswith("cuda"):  # NCCL works on the current device: one GPU per rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _spawned(rank: int, job: Job, world: int, payload: Any, folder: str, device: str) -> None:
    # Ctrl-C on a terminal reaches every process of the group; the parent hands it to rank 0 alone
    # (as SIGTERM: _signals_to_rank0), which stops the others in step. A rank that took it itself
    # would die mid-collective and leave its peers waiting.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["LOCAL_RANK"] = str(rank)
    # tqdm's default lock is a multiprocessing semaphore; a rank leaves with os._exit (below), which
    # skips its clean-up, and the parent's resource tracker then warns of a leaked semaphore.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    _use_rank_device(device)
    dist.init_process_group(backend_for(device), init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=world)
    try:
        result, error = job(rank, world, payload), None
    except GptjError as e:
        result, error = None, str(e)
    except Exception as e:  # noqa: BLE001 - one line for the parent; the traceback with --debug
        result, error = None, f"rank {rank}: {type(e).__name__}: {e}"
        if payload.get("debug") if isinstance(payload, dict) else False:
            traceback.print_exc()
    finally:
        dist.destroy_process_group()
    if rank == 0 or error is not None:
        out = Path(folder) / f"rank{rank}.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"result": result, "error": error}))
        tmp.replace(out)
    # Leave now: tearing down gloo's threads in the interpreter's exit sometimes aborts the process
    # ("terminate called without an active exception") after the work is done and reported.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def _signals_to_rank0(context):  # noqa: ANN001, ANN202 - torch's ProcessContext
    """SIGINT/SIGTERM to gptj go to rank 0 (a server drains, then stops the other ranks), not to the
    parent alone, which would leave the ranks behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(sig, frame) -> None:  # noqa: ANN001
        rank0 = context.processes[0]
        if rank0.is_alive():
            os.kill(rank0.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_parallel(job: Job, world: int, payload: Any, device: str = "cpu") -> Any:
    """Run `job` on `world` ranks; return rank 0's result. A rank's GptjError is raised here."""
    if world < 1:
        raise GptjError(f"--tp / --pp must be a positive integer, got {world}")
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise GptjError(f"torchrun started {os.environ['WORLD_SIZE']} processes but --tp / --pp asks for {world}")
        _use_rank_device(device)
        dist.init_process_group(backend_for(device))
        rank = dist.get_rank()
        try:
            result = job(rank, world, payload)
        finally:
            dist.destroy_process_group()
        return result if rank == 0 else NOT_RANK0
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gptj-tp-") as folder:
        try:
            context = mp.start_processes(_spawned, args=(job, world, payload, folder, device), nprocs=world,
                                         join=False, start_method="spawn")
            with _signals_to_rank0(context):
                while not context.join(timeout=0.5):
                    pass
        except mp.ProcessExitedException as e:
            raise GptjError(f"a rank of the parallel job died (exit code {e.exit_code})") from None
        reports = {p.stem: json.loads(p.read_text()) for p in Path(folder).glob("rank*.json")}
        errors = [r["error"] for r in reports.values() if r["error"]]
        if errors:
            raise GptjError(errors[0])
        if "rank0" not in reports:
            raise GptjError("rank 0 of the parallel job reported nothing")
        return reports["rank0"]["result"]


class LeadRanks:
    """This process as rank 0 of `world` ranks, the others spawned as its children running `job`
    (a Ray Serve replica that spans several devices: the replica is rank 0 and leads).

    On return the process group is initialized here. `alive()` says whether every child still
    runs; `close()` waits for them (after rank 0 told them to stop), ends those that do not
    stop, and returns the first error a child reported (or None)."""

    def __init__(self, job: Job, world: int, payload: Any, device: str = "cpu") -> None:
        import multiprocessing

        if dist.is_initialized():
            raise GptjError("this process already belongs to a process group")
        self.folder = tempfile.mkdtemp(prefix="gptj-ranks-")
        spawn = multiprocessing.get_context("spawn")
        self.children = [spawn.Process(target=_spawned, args=(rank, job, world, payload, self.folder, device),
                                       daemon=True, name=f"gptj-rank{rank}") for rank in range(1, world)]
        for child in self.children:
            child.start()
        try:
            os.environ["LOCAL_RANK"] = "0"
            _use_rank_device(device)
            dist.init_process_group(backend_for(device), init_method=f"file://{self.folder}/rendezvous", rank=0,
                                    world_size=world)
        except BaseException:
            self.close(timeout=0)  # leave no rank behind
            raise

    def alive(self) -> bool:
        return all(child.is_alive() for child in self.children)

    def close(self, timeout: float = 30.0) -> str | None:
        deadline = time.monotonic() + timeout
        for child in self.children:
            child.join(max(0.0, deadline - time.monotonic()))
        for child in self.children:
            if child.is_alive():
                child.kill()
                child.join()
        errors = [json.loads(p.read_text())["error"] for p in sorted(Path(self.folder).glob("rank*.json"))]
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a peer that died can make gloo's teardown complain
                dist.destroy_process_group()
        shutil.rmtree(self.folder, ignore_errors=True)
        return next((e for e in errors if e), None)
