"""Checkpoints on disk: atomic directories, a manifest written last, verification on resume with
fallback to the previous checkpoint, rotation.

``<run>/checkpoints/step_NNNNNN/`` holds the trainer's files (``model.safetensors``, ``config.json``,
``optimizer.rank<r>.pt``, ``trainer.json``), the replay buffer (``buffer.pt``), the controller's
state (``controller.json``: step, rollout batch counter, refills, data position, fault counters;
:func:`write_state`, :func:`read_state`) and, written last, ``manifest.json``:
``{"step", "files": {relative path: {"bytes", "sha256"}}}``. The directory is
written as ``step_NNNNNN.tmp`` and renamed, so a save cut short (a crash, a full disk) never looks
like a checkpoint; the previous one stays as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from typing import Optional

import torch

MANIFEST, CONTROLLER, BUFFER = "manifest.json", "controller.json", "buffer.pt"


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_state(path: str, state: dict, episodes: list) -> None:
    """Finish the checkpoint directory ``path`` (the trainer's files already in it): the replay
    buffer's ``episodes`` (``buffer.pt``: ``{"episodes": [...]}``), the controller's ``state``
    (``controller.json``, from ``Controller.state_dict``; its ``step`` names the checkpoint) and,
    last, the manifest (:func:`write_manifest`). Raises OSError or RuntimeError (a short
    ``torch.save`` write) when the disk fails; see :func:`disk_full`."""
    torch.save({"episodes": episodes}, os.path.join(path, BUFFER))
    with open(os.path.join(path, CONTROLLER), "w") as f:
        json.dump(state, f)
    write_manifest(path, state["step"])


def read_state(path: str) -> tuple[dict, list]:
    """``(controller state, replay buffer episodes)`` of the checkpoint at ``path``, as
    :func:`write_state` wrote them. Raises OSError for a missing file, ValueError for a damaged
    ``controller.json``."""
    with open(os.path.join(path, CONTROLLER)) as f:
        state = json.load(f)
    return state, torch.load(os.path.join(path, BUFFER), weights_only=False)["episodes"]


def commit(tmp: str, keep: int) -> str:
    """Make the finished checkpoint ``tmp`` (``step_NNNNNN.tmp``) the checkpoint ``step_NNNNNN``
    (an earlier one of that name replaced) and delete all but the newest ``keep`` (:func:`rotate`).
    Returns the checkpoint's path."""
    final = tmp.removesuffix(".tmp")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    rotate(os.path.dirname(final), keep)
    return final


def write_manifest(path: str, step: int) -> dict:
    """Write ``manifest.json`` (sizes in bytes and sha256 of every other file under ``path``),
    fsynced, as the last file of a checkpoint. Returns the manifest."""
    paths = [os.path.join(root, n) for root, _, names in os.walk(path) for n in sorted(names)]
    man = {"step": step, "files": {os.path.relpath(p, path): {"bytes": os.path.getsize(p), "sha256": _sha256(p)}
                                   for p in paths if os.path.relpath(p, path) != MANIFEST}}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(man, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return man


def verify(path: str) -> Optional[str]:
    """Why the checkpoint at ``path`` is damaged (a missing file, a size or checksum mismatch), or
    None when it matches its manifest. A checkpoint without a manifest (older runs) returns None;
    see :func:`has_manifest`."""
    if not has_manifest(path):
        return None
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable manifest ({e})"
    for rel, want in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if os.path.getsize(full) != want["bytes"]:
            return f"{rel} has {os.path.getsize(full)} bytes, the manifest says {want['bytes']}"
        if _sha256(full) != want["sha256"]:
            return f"{rel} does not match its sha256 in the manifest"
    return None


def has_manifest(path: str) -> bool:
    """True when the checkpoint carries a manifest (written by this version or later)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def complete(root: str) -> list[str]:
    """Checkpoint directories under ``root`` (a ``controller.json`` present, not ``.tmp``), oldest first."""
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root)) if d.startswith("step_")
            and not d.endswith(".tmp") and os.path.isfile(os.path.join(root, d, CONTROLLER))]


def resume_point(root: str) -> Optional[str]:
    """The newest checkpoint under ``root`` that verifies; a damaged one is skipped with a warning
    naming it and why, a manifest-less one (an older run) is used with a warning that it cannot be
    verified. None when there is none."""
    for path in reversed(complete(root)):
        if (why := verify(path)) is None:
            if not has_manifest(path):
                warn(f"checkpoint {path} has no manifest (written by an older version): resuming from it "
                     f"without verifying it")
            return path
        warn(f"checkpoint {path} is damaged ({why}); falling back to the previous checkpoint")
    return None


def rotate(root: str, keep: int) -> None:
    """Delete all but the newest ``keep`` (at least 1) checkpoints."""
    for path in complete(root)[:-max(keep, 1)]:
        shutil.rmtree(path, ignore_errors=True)


def disk_full(e: BaseException, path: Optional[str] = None, low_bytes: int = 16 << 20) -> bool:
    """Whether ``e`` (an OSError, or an actor's error carrying one as text) says the disk is full,
    or, when ``path`` is given, the write failed with the filesystem of ``path`` (nearly) full:
    ``torch.save`` reports a short write only as ``RuntimeError: [enforce fail at
    inline_container.cc] ... unexpected pos``, without the errno."""
    says = ("No space left on device", "Errno 28", "code: 28", "StorageFull", "Disk quota exceeded")
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or any(s in str(e) for s in says):
        return True
    try:
        return path is not None and shutil.disk_usage(path).free < low_bytes
    except OSError:
        return False


def warn(msg: str) -> None:
    """Print a warning line on stderr (visible above the progress bar)."""
    print(f"[forge] warning: {msg}", file=sys.stderr, flush=True)
