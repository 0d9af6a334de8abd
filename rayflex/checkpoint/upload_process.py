"""Checkpoint uploads from a separate process, off the training process's GIL.

A save stages each tensor into host buffers on the training thread (one copy per tensor,
as with thread uploads); here those buffers are views of one shared-memory block. DCP
still plans the save in the training process (the plan is agreed over the checkpoint
group), but the bytes are written by an uploader process that maps the same block: it
serialises each shard and writes it through fsspec (file://, s3://, gs://, az://) while
the training process only waits on a socket, holding no lock training needs.

The uploader runs at a lower CPU priority (``RAYFLEX_UPLOAD_NICE``), never touches a GPU
(``CUDA_VISIBLE_DEVICES`` is emptied before it imports torch) and has no process group,
so it outlives attempts: a restarted or resized mesh only shares its new block. Commit
is unchanged: DCP's ``.metadata`` is written once every rank's uploader has answered,
and rank 0 writes the marker after it.

One uploader per training process (:func:`uploader`), a plain ``python -m`` child on a
socket pair (not a multiprocessing spawn: that would re-run the parent's main module —
Ray's worker script, a user's unguarded notebook code); one block per attempt's staging
(:class:`SharedBlock`), a file in /dev/shm both map by name, unlinked once both have it.
"""

from __future__ import annotations

import glob
import io
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import traceback
from typing import Any, Optional

log = logging.getLogger(__name__)

ALIGN = 64  # bytes: every view starts aligned for any dtype (and for vectorised copies)
SHM_DIR = "/dev/shm"


# ----------------------------------------------------------------- the staging block
class SharedBlock:
    """One shared-memory byte block carved into the staging buffers of a save. On a GPU
    host it is page-locked (``cudaHostRegister``) so device-to-host copies stay
    asynchronous, as with pinned buffers."""

    _next_key = 0

    @staticmethod
    def layout(specs: list[tuple[tuple, Any]]) -> tuple[list[int], int]:
        """(byte offset of each buffer, the block's size): each buffer starts ALIGN-aligned."""
        offsets, total = [], 0
        for shape, dtype in specs:
            offsets.append(total)
            total += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        return offsets, total

    @classmethod
    def size_of(cls, specs: list[tuple[tuple, Any]]) -> int:
        return cls.layout(specs)[1]

    def __init__(self, specs: list[tuple[tuple, Any]], *, pin: bool):
        """``specs``: (shape, dtype) of each buffer, in the order :meth:`take` hands them out."""
        import torch

        offsets, total = self.layout(specs)
        self.nbytes = total
        SharedBlock._next_key += 1
        self.key = (os.getpid(), SharedBlock._next_key)
        self.path = _block_path(*self.key)
        _sweep_stale_blocks()
        self.block = torch.from_file(self.path, shared=True, size=max(total, ALIGN), dtype=torch.uint8)
        self.linked = True
        self._views = [self.block[o:o + math.prod(s) * d.itemsize].view(d).view(s) for o, (s, d) in zip(offsets, specs)]
        self._next = 0
        self._registered = False
        if pin:
            self._register()

    def take(self):
        """The next buffer, in the order of ``specs``."""
        view = self._views[self._next]
        self._next += 1
        return view

    def locate(self, tensor) -> Optional[tuple[int, int]]:
        """(byte offset, byte length) of ``tensor`` in the block, None when it is not a
        contiguous view of it."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() \
                or tensor.untyped_storage().data_ptr() != self.block.untyped_storage().data_ptr():
            return None
        return tensor.storage_offset() * tensor.element_size(), tensor.numel() * tensor.element_size()

    def _register(self) -> None:
        """Page-lock the block for asynchronous device-to-host copies. Without it (a
        driver that refuses shared mappings) copies are synchronous but still correct."""
        import torch

        try:
            err = torch.cuda.cudart().cudaHostRegister(self.block.data_ptr(), self.block.numel(), 0)
            ok = int(err) == 0
        except Exception as e:  # noqa: BLE001 - an API this torch lacks: unpinned, as above
            ok, err = False, e
        if ok:
            self._registered = True
        else:
            log.warning("could not page-lock the %d-byte staging block (%s): device-to-host copies into it "
                        "are synchronous", self.block.numel(), err)

    def unlink(self) -> None:
        """Remove the block's name (both processes keep their mappings): its memory goes
        back with the last mapping, even if a process is killed."""
        if self.linked:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.linked = False

    def __del__(self):
        # Unpin before the mapping goes: a freed mapping left registered makes the next
        # block mapped at the same address fail to register ("resource already mapped",
        # seen on an H200 when a second run started in the same process).
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def close(self) -> None:
        """Unpin and unlink (the memory is freed once the uploader drops its mapping too)."""
        self.unlink()
        if getattr(self, "_registered", False):
            import torch

            torch.cuda.synchronize()  # no copy into the block may still be in flight
            torch.cuda.cudart().cudaHostUnregister(self.block.data_ptr())
            self._registered = False


def _block_path(pid: int, n: int) -> str:
    return os.path.join(SHM_DIR, f"rayflex-staging-{pid}-{n}")


def _sweep_stale_blocks() -> None:
    """Remove blocks whose process is gone before they were unlinked (killed between
    creating a block and the uploader mapping it): /dev/shm is memory."""
    for path in glob.glob(os.path.join(SHM_DIR, "rayflex-staging-*")):
        try:
            pid = int(os.path.basename(path).split("-")[2])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except (ValueError, IndexError, PermissionError):
            continue


def shm_room_for(nbytes: int, directory: str = SHM_DIR) -> tuple[bool, str]:
    """Whether ``directory`` (where torch puts shared memory) can hold ``nbytes`` with a
    10% margin: a full /dev/shm kills the process with SIGBUS on first touch instead of
    failing an allocation, so it is checked first. (ok, why not)."""
    try:
        st = os.statvfs(directory)
    except OSError as e:
        return False, f"{directory} unavailable ({e})"
    free = st.f_bavail * st.f_frsize
    if free < nbytes * 1.1:
        return False, (f"{directory} has {free / 2**30:.2f} GiB free, a staging block needs {nbytes / 2**30:.2f} GiB "
                       f"(+10%); give the container more shared memory (docker --shm-size, a Kubernetes "
                       f"emptyDir with medium: Memory) or use CheckpointConfig(upload='thread')")
    return True, ""


# ----------------------------------------------------------------- the uploader process
class UploadProcess:
    """A ``python -m rayflex.checkpoint.upload_process`` child that writes DCP save plans from
    shared blocks; one request at a time, over a socket pair."""

    def __init__(self, nice: int = 0):
        from multiprocessing.connection import Connection

        parent, child = socket.socketpair()
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="",  # no CUDA context in the uploader
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # what this process imports
        self.process = subprocess.Popen([sys.executable, "-m", "rayflex.checkpoint.upload_process",
                                         str(child.fileno()), str(int(nice))],
                                        pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        child.close()
        self._conn = Connection(parent.detach())
        self._lock = threading.Lock()
        self._shared_key = None
        self._call(("ping",))

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def write(self, block: SharedBlock, request: dict) -> list:
        """Write one rank's share of a save (``request``: see ``process_upload_writer``);
        the write results DCP gathers for ``.metadata`` (packed: ``save_plan.PackedWriteResults``)."""
        with self._lock:
            if self._shared_key != block.key:
                if not block.linked:
                    raise RuntimeError("the staging block was unlinked before this uploader mapped it")
                self._call(("share", block.key, block.path, block.block.numel()))
                self._shared_key = block.key
                block.unlink()  # both map it now: nothing is left in /dev/shm if either dies
            return self._call(("write", block.key, request))

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            with self._lock:
                self._conn.send(("exit",))
        except (OSError, ValueError):
            pass
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._conn.close()

    def _call(self, message: tuple):
        try:
            self._conn.send(message)
            status, value = self._conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"the checkpoint uploader process (pid {self.process.pid}) is gone "
                               f"(exit code {self.process.poll()}): {type(e).__name__}: {e}") from None
        if status == "error":
            raise RuntimeError(f"checkpoint upload failed in the uploader process: {value}")
        return value


_UPLOADER: Optional[UploadProcess] = None
_UPLOADER_LOCK = threading.Lock()
_STARTING = threading.Event()  # a background start is under way (it holds the lock meanwhile)


def uploader() -> UploadProcess:
    """This process's uploader, started on first use and again if it died."""
    global _UPLOADER
    from rayflex.constants import knob

    with _UPLOADER_LOCK:
        if _UPLOADER is None or not _UPLOADER.alive:
            if _UPLOADER is not None:
                log.warning("checkpoint uploader (pid %s) died (exit code %s); starting a new one",
                            _UPLOADER.process.pid, _UPLOADER.process.poll())
            _UPLOADER = UploadProcess(nice=int(knob("UPLOAD_NICE")))
        return _UPLOADER


def ready() -> bool:
    """This process's uploader is up and answering (never blocks: a save that finds it
    still starting uploads from a thread instead of waiting seconds for its imports)."""
    current = _UPLOADER  # read without the lock, which a start holds for seconds
    return current is not None and not _STARTING.is_set() and current.alive


def can_write(block: SharedBlock) -> bool:
    """Whether an upload from ``block`` can go ahead: the live uploader maps it, or it
    still has its name for a new uploader to map (an uploader that died took the only
    other mapping of an unlinked block: its staging must be made again)."""
    with _UPLOADER_LOCK:
        live = _UPLOADER is not None and _UPLOADER.alive and _UPLOADER._shared_key == block.key
    return live or block.linked


def prewarm_uploader() -> None:
    """Start this process's uploader in the background, once (Python and torch imports
    take seconds, many more beside busy training processes): called when a worker starts,
    so its imports overlap the rendezvous and the build."""
    if ready() or _STARTING.is_set():
        return
    _STARTING.set()
    threading.Thread(target=_prewarm, name="rayflex-uploader-start", daemon=True).start()


def _prewarm() -> None:
    try:
        uploader()
    except Exception as e:  # noqa: BLE001 - the next save tries again and reports why
        log.warning("could not start the checkpoint uploader process: %s", e)
    finally:
        _STARTING.clear()


def stop_uploader() -> None:
    global _UPLOADER
    with _UPLOADER_LOCK:
        if _UPLOADER is not None:
            _UPLOADER.close()
            _UPLOADER = None


# ----------------------------------------------------------------- the DCP writer
def process_upload_writer(path: str, block: SharedBlock, plans=None, **writer_kwargs):
    """A DCP storage writer for ``path`` whose ``write_data`` runs in the uploader process.
    ``writer_kwargs``: the :class:`~rayflex.checkpoint.dcp_io.CheckpointWriter` options
    (``single_file_per_rank``, ``thread_count``, fsspec options...), used on both sides;
    ``plans``: the checkpointer's ``SavePlanCache`` (this side's ``.metadata``)."""
    from rayflex.checkpoint.dcp_io import CheckpointWriter

    class ProcessUploadWriter(CheckpointWriter):
        def write_data(self, plan, planner):
            import torch
            from torch.distributed.checkpoint.planner import WriteItemType
            from torch.futures import Future

            tensors, blobs = {}, {}
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    blobs[item.index] = data.getvalue()
                    continue
                where = block.locate(data)
                if where is None:  # not staged in the block (never for rayflex's own state): its bytes travel
                    data = data.detach().cpu().contiguous()
                    tensors[item.index] = ("bytes", data.view(-1).view(torch.uint8).numpy().tobytes(), data.dtype,
                                           tuple(data.shape))
                else:
                    tensors[item.index] = ("block", *where, data.dtype, tuple(data.shape))
            request = {"path": path, "writer_kwargs": writer_kwargs, "plan": plan, "tensors": tensors,
                       "blobs": blobs}
            results = uploader().write(block, request)
            future: Future = Future()
            future.set_result(results)
            return future

    return ProcessUploadWriter(path, plans=plans, **writer_kwargs)


# ----------------------------------------------------------------- the child
def _serve(conn, nice: int) -> None:
    """The uploader's loop: share / write / exit requests until the parent goes."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch: no CUDA context in the uploader
    import torch

    import rayflex.checkpoint.dcp_io  # noqa: F401 - DCP and fsspec: imported before the first save needs them

    torch.set_num_threads(1)
    # Lowered once ready: the imports above are what a first save waits for, and at a low
    # priority beside busy training processes they would take many times longer.
    if nice and hasattr(os, "nice"):
        try:
            os.nice(nice)
        except OSError:
            pass
    blocks: dict = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the training process is gone
        kind = message[0]
        if kind == "exit":
            conn.send(("ok", None))
            return
        try:
            if kind == "ping":
                value = os.getpid()
            elif kind == "share":
                blocks.clear()  # one attempt's block at a time: the previous one is unmapped
                _, key, path, size = message
                blocks[key] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                value = None
            elif kind == "write":
                value = _write(blocks[message[1]], message[2])
            else:
                raise ValueError(f"unknown request {kind!r}")
            conn.send(("ok", value))
        except BaseException as e:  # noqa: BLE001 - reported to the training process, which decides
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))


def _write(block, request: dict) -> list:
    import torch

    from rayflex.checkpoint.dcp_io import CheckpointWriter

    raw = block.numpy()
    tensors = {}
    for index, (kind, *rest) in request["tensors"].items():
        if kind == "block":
            offset, length, dtype, shape = rest
            data = raw[offset:offset + length]
        else:
            payload, dtype, shape = rest
            data, length = bytearray(payload), len(payload)
        # A tensor whose storage is exactly its bytes: DCP would copy a view of a larger one.
        t = torch.frombuffer(data, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
        tensors[index] = t.view(dtype).view(shape)
    blobs = request["blobs"]

    class Resolved:
        """The one planner call DCP's writer makes: the data of a write item."""

        @staticmethod
        def resolve_data(item):
            if item.index in blobs:
                return io.BytesIO(blobs[item.index])
            return tensors[item.index]

    writer = CheckpointWriter(request["path"], **request["writer_kwargs"])
    return writer.write_data(request["plan"], Resolved()).wait()


if __name__ == "__main__":  # python -m rayflex.checkpoint.upload_process FD NICE (UploadProcess starts it)
    from multiprocessing.connection import Connection

    _serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
