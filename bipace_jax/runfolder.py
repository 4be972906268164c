"""The run folder: every file a run writes or reads goes through ``etils.epath``, local or ``gs://``.

A run folder is a local folder (made absolute) or a ``gs://bucket/path`` URL. GCS has no append and
no atomic rename of a folder, so files here are written whole (one object write each, and locally a
temporary file renamed over the old one). Writers that only take a local folder (``save_pretrained``,
``save_hf_checkpoint``, TensorBoard's event writer) write into a local staging folder (``staged``) that
is copied up and removed; readers that need one read a local copy (``local_copy``; ``local_folder`` for
a model folder: copied once per process, kept until it exits).

One run at a time: ``RunLock`` is a lock file in the run folder that a second run (or command) refuses
on, and that a crashed run's resume takes over (its process is gone, or its heartbeat stopped).

``gs://`` needs the ``[gcp]`` extra (``pip install -e '.[gcp]'``: gcsfs for etils.epath,
google-cloud-storage for orbax) and credentials (``gcloud auth application-default login`` or the VM's
service account).
"""

from __future__ import annotations

import atexit
import contextlib
import fnmatch
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator

from etils import epath

#: The URL schemes a run folder may use (orbax writes arrays with TensorStore, which has GCS only).
REMOTE_PREFIXES = ("gs://",)
EXPECTED = "a writable local folder or a gs://bucket/path URL"
_CHUNK = 16 * 1024 * 1024  # bytes per read when copying (HF shard files reach 5 GiB)


class RunFolderError(ValueError):
    """The run folder cannot be used: a scheme other than gs://, a missing package, no write access."""


class RunFolderBusy(RunFolderError):
    """Another live run (or command) holds the run folder's lock (``RunLock``)."""


def is_remote(path: str | os.PathLike) -> bool:
    """True for a URL (``gs://...``), False for a local path."""
    return "://" in os.fspath(path)


def path(folder: str | os.PathLike, flag: str = "--workdir") -> epath.Path:
    """``folder`` as an ``epath.Path``: a local path made absolute, or a ``gs://`` URL as given.

    Raises:
      RunFolderError: ``folder`` is a URL of another scheme (it would silently become a local folder
        named after the scheme), or is empty; the message names ``flag``.
    """
    s = os.fspath(folder)
    if not s:
        raise RunFolderError(f"{flag}: expected {EXPECTED}, got ''")
    if is_remote(s):
        if not s.startswith(REMOTE_PREFIXES):
            raise RunFolderError(f"{flag}: expected {EXPECTED}, got {s!r} (unsupported scheme)")
        return epath.Path(s)
    return epath.Path(os.path.abspath(s))


def _missing_gcp_packages() -> list[str]:
    """The [gcp] extra's packages that do not import (gcsfs backs epath's gs://, orbax lists steps with
    google-cloud-storage)."""
    missing = []
    for module, package in (("gcsfs", "gcsfs"), ("google.cloud.storage", "google-cloud-storage")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    return missing


def missing_extra(folder: str | os.PathLike, flag: str, expected: str = EXPECTED) -> str:
    """The one-line error for a ``gs://`` ``folder`` when the ``[gcp]`` extra's packages do not import
    ("" for a local folder or when they do); names ``flag``, the missing packages and ``expected``."""
    if not is_remote(folder) or not (missing := _missing_gcp_packages()):
        return ""
    return (
        f"{flag}={os.fspath(folder)}: a gs:// folder needs {', '.join(missing)} "
        f"(pip install -e '.[gcp]'); expected {expected}"
    )


def prepare(folder: str | os.PathLike, flag: str = "--workdir") -> epath.Path:
    """Create the run folder and check that this process can write to it; returns ``path(folder)``.

    Call it before anything heavy loads, so a wrong folder fails in seconds. Every process of a
    multi-host run may call it (each writes and deletes its own probe file).

    Raises:
      RunFolderError: an unsupported scheme, a ``gs://`` folder without the ``[gcp]`` packages, or a
        folder that cannot be created or written (the cause is named); the message names ``flag`` and
        the expected value.
    """
    p = path(folder, flag)
    if message := missing_extra(folder, flag):
        raise RunFolderError(message)
    probe = p / f".write_probe.{uuid.uuid4().hex}"
    try:
        if not is_remote(p):  # GCS has no folders, and gcsfs's mkdir would create a misspelt bucket
            p.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except Exception as e:  # noqa: BLE001 (auth, permission and network errors differ by backend)
        detail = str(e).splitlines()[0][:300] if str(e) else ""
        raise RunFolderError(
            f"{flag}={os.fspath(folder)}: cannot create or write the run folder ({type(e).__name__}: {detail}); "
            f"expected {EXPECTED}"
        ) from e
    return p


#: The file naming the command (and its inputs) whose results a results folder holds (``claim_output``).
OWNER_FILE = ".written_by.json"


def claim_output(
    folder: str | os.PathLike, flag: str, command: str, source: str, own_files: tuple[str, ...] = ()
) -> epath.Path:
    """``prepare`` a results folder for ``command`` run on ``source`` (e.g. a checkpoint or study path),
    refusing any folder whose files are another run's or another command's; returns ``path(folder)``.

    A folder is this command's when its ``OWNER_FILE`` names the same ``command`` and ``source`` (a
    re-run replaces its own results), or when it is empty or holds only names among ``own_files``
    (glob patterns of the command's outputs, written before folders were claimed). It is then claimed (``OWNER_FILE``
    written); any other folder is refused before anything is written.

    Raises:
      RunFolderError: as ``prepare``; or one line naming ``flag``, the folder and who wrote it (or the
        first files that would be overwritten).
    """
    p = prepare(folder, flag)
    mine = {"command": command, "source": source}
    text = read_text(p / OWNER_FILE)
    if text is not None:
        try:
            owner = json.loads(text)
        except json.JSONDecodeError:
            owner = {}
        if owner != mine:
            raise RunFolderError(
                f"{flag}={os.fspath(folder)} holds the results of {owner.get('command', '?')} on "
                f"{owner.get('source', '?')}, not of {command} on {source}; use another {flag}"
            )
        return p
    held = sorted(c.name for c in p.iterdir() if not c.name.startswith(".write_probe"))
    foreign = [name for name in held if not any(fnmatch.fnmatch(name, pattern) for pattern in own_files)]
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise RunFolderError(
            f"{flag}={os.fspath(folder)} holds files {command} did not write ({shown}): they would be mixed "
            f"with or overwritten by its results; use another {flag} (a new or empty folder)"
        )
    write_text(p / OWNER_FILE, json.dumps(mine))
    return p


def check_writable(folder: str | os.PathLike, flag: str = "--workdir") -> epath.Path:
    """``prepare``'s check without creating anything (for a dry run): locally a probe file is written
    and removed in the nearest existing folder on the way to ``folder``; a ``gs://`` folder gets
    ``prepare``'s probe object. Returns ``path(folder)``.

    Raises:
      RunFolderError: as ``prepare``.
    """
    p = path(folder, flag)
    if is_remote(p):
        return prepare(folder, flag)
    existing = os.fspath(p)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is not a folder")
        fd, probe = tempfile.mkstemp(prefix=".write_probe.", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise RunFolderError(
            f"{flag}={os.fspath(folder)}: cannot create or write the run folder ({type(e).__name__}: {e}); "
            f"expected {EXPECTED}"
        ) from e
    return p


def read_text(file: str | os.PathLike) -> str | None:
    """The text of ``file``, or None when it does not exist."""
    p = epath.Path(file)
    return p.read_text() if p.exists() else None


def write_text(file: str | os.PathLike, text: str) -> None:
    """Write ``file`` whole, so a reader sees the old or the new text, never a part.

    Locally a temporary file is renamed over ``file``; on GCS one object write is atomic.
    """
    p = epath.Path(file)
    if is_remote(p):
        p.write_text(text)
        return
    tmp = f"{p}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def upload(local_dir: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Copy every file under the local folder ``local_dir`` to ``dest`` (same layout)."""
    dest = epath.Path(dest)
    for root, _, files in os.walk(local_dir):
        rel = os.path.relpath(root, local_dir)
        target = dest if rel == "." else dest / rel
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            with open(os.path.join(root, name), "rb") as src, (target / name).open("wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)


def download(src: str | os.PathLike, local_dir: str | os.PathLike) -> None:
    """Copy the folder ``src`` (any epath folder) into the local folder ``local_dir``."""
    src = epath.Path(src)
    os.makedirs(local_dir, exist_ok=True)
    for child in src.iterdir():
        if child.is_dir():
            download(child, os.path.join(local_dir, child.name))
        else:
            with child.open("rb") as f, open(os.path.join(local_dir, child.name), "wb") as dst:
                shutil.copyfileobj(f, dst, _CHUNK)


@contextlib.contextmanager
def staged(dest: str | os.PathLike) -> Iterator[str]:
    """A local folder for a writer that needs one; its files end up in ``dest``.

    Local ``dest``: ``dest`` itself (created). Remote: a temporary folder, copied to ``dest`` when the
    block ends without an error, and removed in any case.
    """
    if not is_remote(dest):
        os.makedirs(dest, exist_ok=True)
        yield os.fspath(dest)
        return
    tmp = tempfile.mkdtemp(prefix="bipace_stage_")
    try:
        yield tmp
        upload(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def local_copy(src: str | os.PathLike) -> Iterator[str]:
    """A local folder holding the files of ``src``: ``src`` itself when local, else a temporary copy
    removed when the block ends."""
    if not is_remote(src):
        yield os.fspath(src)
        return
    tmp = tempfile.mkdtemp(prefix="bipace_fetch_")
    try:
        download(src, tmp)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_staged_lock = threading.Lock()
_staged: dict[str, str] = {}  # remote folder URL -> its local copy (local_folder)


def local_folder(src: str | os.PathLike) -> str:
    """A local folder holding the files of ``src``, for readers that only open local files
    (safetensors, tokenizers, transformers' configs).

    A local ``src`` is returned as given (no copy). A remote one is copied (``download``, every file
    and subfolder) into a temporary folder on the first call; later calls of this process with the
    same URL return that copy, and it is removed when the process exits (``drop_local_folders``).
    The copy needs the folder's size free under ``tempfile.gettempdir()`` (``$TMPDIR``).

    Raises:
      FileNotFoundError: ``src`` is a remote folder that holds no file (nothing is cached).
      Any error of the filesystem backend (auth, network): nothing is cached, the partial copy is removed.
    """
    s = os.fspath(src)
    if not is_remote(s):
        return s
    key = s.rstrip("/")
    with _staged_lock:
        local = _staged.get(key)
        if local is not None and os.path.isdir(local):
            return local
        tmp = tempfile.mkdtemp(prefix="bipace_fetch_")
        try:
            if not epath.Path(key).is_dir():
                raise FileNotFoundError(f"local_folder: {key} is not a folder")
            download(key, tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _staged[key] = tmp
        return tmp


def drop_local_folders() -> None:
    """Remove every copy ``local_folder`` made in this process (also run when the process exits)."""
    with _staged_lock:
        for local in _staged.values():
            shutil.rmtree(local, ignore_errors=True)
        _staged.clear()


atexit.register(drop_local_folders)


class RunLock:
    """A lock file ``<folder>/.lock.<name>`` held while a run writes the folder (local or ``gs://``).

    The file records the holder (host, process id, command, start time) and a heartbeat, rewritten
    every ``beat_s`` seconds by a daemon thread. A lock is stale, and ``acquire`` takes it over (a
    crashed run's resume), when its holder ran on this host and its process is gone, or ran on
    another host and its heartbeat is older than ``stale_s`` seconds. GCS has no
    exclusive create: a new holder writes its record and reads it back after ``settle_s`` seconds; of
    two starting at once the later write wins and the other refuses.

    Args:
      folder: the run folder (created when missing, locally).
      name: the lock's name: one lock per name (e.g. ``"process_0"``: each process of a run holds its own).
      command: what holds it, for the refusal message (e.g. ``"launch.train"``).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        name: str,
        command: str,
        *,
        flag: str = "--workdir",
        beat_s: float = 10.0,
        stale_s: float = 60.0,
        settle_s: float = 1.0,
    ):
        self.folder, self.flag = os.fspath(folder), flag
        self.file = path(folder, flag) / f".lock.{name}"
        self.command, self.beat_s, self.stale_s, self.settle_s = command, beat_s, stale_s, settle_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> dict:
        return {
            "token": self.token,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "command": self.command,
            "heartbeat": time.time(),
        }

    def holder(self) -> str | None:
        """A line naming the live holder of the lock (its command, host, pid, heartbeat age), or None
        when the lock is free or stale."""
        try:
            held = json.loads(read_text(self.file) or "null")
        except json.JSONDecodeError:  # a write cut short: that holder is gone
            return None
        if not isinstance(held, dict) or held.get("token") == self.token:
            return None
        age = time.time() - float(held.get("heartbeat", 0))
        if held.get("host") == socket.gethostname():  # this host: its process decides, whatever its heartbeat
            if not _process_alive(int(held.get("pid", -1))):
                return None
        elif age > self.stale_s:
            return None
        return (
            f"{held.get('command', '?')} (host {held.get('host')}, pid {held.get('pid')}, "
            f"heartbeat {max(age, 0):.0f} s ago)"
        )

    def busy_message(self, who: str) -> str:
        return (
            f"{self.flag}={self.folder} is in use by {who}; wait for it to end, or use another {self.flag} "
            f"(a crashed run's lock {self.file.name} is taken over once its process is gone or "
            f"{self.stale_s:.0f} s after its last heartbeat)"
        )

    def acquire(self) -> RunLock:
        """Take the lock (see the class) and start its heartbeat; returns self.

        Raises:
          RunFolderBusy: a live holder has it (one line naming it and the folder).
        """
        if (who := self.holder()) is not None:
            raise RunFolderBusy(self.busy_message(who))
        record = json.dumps(self._record())
        if is_remote(self.file):
            self.file.write_text(record)
            time.sleep(self.settle_s)  # another starter's later write wins: read back who holds it
            if (who := self.holder()) is not None:
                raise RunFolderBusy(self.busy_message(who))
        else:
            os.makedirs(self.file.parent, exist_ok=True)
            try:  # exclusive create: of two starters, one wins
                fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                with os.fdopen(fd, "w") as f:
                    f.write(record)
            except FileExistsError:  # a stale holder's file (checked above): take it over, then check
                write_text(self.file, record)
                time.sleep(self.settle_s)  # of two taking it over at once, the later write wins
                if (who := self.holder()) is not None:
                    raise RunFolderBusy(self.busy_message(who)) from None
        self._thread = threading.Thread(target=self._beat, name=f"runlock-{self.file.name}", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                write_text(self.file, json.dumps(self._record()))
            except Exception:  # noqa: BLE001 (a missed beat only ages the lock; the next one retries)
                pass

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still this holder's. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.beat_s + 5)
            self._thread = None
            try:
                held = json.loads(read_text(self.file) or "null")
                if isinstance(held, dict) and held.get("token") == self.token:
                    self.file.unlink()
            except Exception:  # noqa: BLE001 (a lock left behind is stale once this process is gone)
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
