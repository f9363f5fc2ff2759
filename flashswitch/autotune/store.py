"""Per-device tuned configs: JSON files, run-time lookup (exact, nearest, default), atomic writes.

File: `<config dir>/<device name>.json`, the folder being FLASHSWITCH_CONFIG_DIR or the package's
`autotune/configs/`. Layout::

    {"device": ..., "capability": [9, 0], "versions": {...}, "created": ...,
     "ops": {op: {bucket_key: {"features": {...}, "best": backend,
                               "backends": {backend: {"config": {...}, "ms": 0.123}}}}}}
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import math
import os
import re
import time
import uuid
import warnings
from pathlib import Path
from typing import Optional

from flashswitch.autotune import schema, space

PACKAGE_CONFIGS = Path(__file__).resolve().parent / "configs"
generation = 0  # bumped by every write of this process: caches of lookups (call_plan) start over at once


def config_dir() -> Path:
    return Path(os.environ.get("FLASHSWITCH_CONFIG_DIR") or PACKAGE_CONFIGS)


def device_name() -> Optional[str]:
    import torch
    if not torch.cuda.is_available():
        return None
    return _device_name(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    import torch
    return torch.cuda.get_device_name(index)


def device_slug(name: str) -> str:
    """A file-name-safe form of a device name ("NVIDIA H200" -> "NVIDIA_H200")."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def device_file(name: Optional[str] = None, folder: Optional[Path] = None) -> Optional[Path]:
    name = name or device_name()
    if name is None:
        return None
    return (folder or config_dir()) / (device_slug(name) + ".json")


def config_files(folder: Optional[Path] = None) -> list[Path]:
    """The tuned-config files in the config folder, sorted by name."""
    folder = folder or config_dir()
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def bucket_key(feats: dict) -> str:
    return "|".join(f"{k}={feats[k]}" for k in sorted(feats))


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> dict:
    """The file's valid part, read and checked against the schema once per version of the file: one
    warning names what was dropped (an unreadable file gives {"ops": {}})."""
    try:
        with open(path) as fh:
            data, problems = schema.clean(json.load(fh))
    except (OSError, ValueError, RecursionError) as err:
        warnings.warn(f"flashswitch: ignoring unreadable tuned-config file {path} ({type(err).__name__}: "
                      f"{str(err)[:200]}); using heuristic defaults", RuntimeWarning, stacklevel=3)
        return {"ops": {}}
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        warnings.warn(f"flashswitch: tuned-config file {path}: ignoring {len(problems)} invalid entries, whose "
                      f"buckets use the nearest valid entry or the defaults: {'; '.join(problems[:3])}{more}",
                      RuntimeWarning, stacklevel=3)
    return data


@functools.lru_cache(maxsize=8)
def _check_provenance(path: str, mtime: float) -> None:
    """Warn once per file version when it was tuned on another device, capability or library version
    than this process runs: its configs still load, but may no longer be the fastest."""
    import torch
    data = _load(path, mtime)
    here = {"device": device_name(),
            "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None}
    try:
        import triton
        here["triton"] = triton.__version__
    except Exception:
        here["triton"] = None
    here["torch"] = torch.__version__
    theirs = {"device": data.get("device"), "capability": data.get("capability"),
              **{k: (data.get("versions") or {}).get(k) for k in ("torch", "triton")}}
    diff = [f"{k} {theirs[k]} (here {here[k]})" for k in here if theirs.get(k) is not None and theirs[k] != here[k]]
    if diff:
        warnings.warn(f"flashswitch: tuned-config file {path} was made with {', '.join(diff)}; its configs are "
                      f"used but may not be the fastest here (re-run `flashswitch autotune`)", RuntimeWarning,
                      stacklevel=4)


# Every kernel call looks its config up: a file is stat'ed at most once a second per process
# (a stat costs tens of microseconds on some filesystems, as much as a small kernel).
_STAT_INTERVAL_S = 1.0
_stat_cache: dict = {}  # path -> (monotonic time of the stat, mtime or None when missing)


def _mtime(path: str) -> Optional[float]:
    now = time.monotonic()
    hit = _stat_cache.get(path)
    if hit is not None and now - hit[0] < _STAT_INTERVAL_S:
        return hit[1]
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        mtime = None
    _stat_cache[path] = (now, mtime)
    return mtime


def load(path: Optional[Path] = None) -> dict:
    """The tuned table for this device ({"ops": {}} when there is none)."""
    path = path or device_file()
    mtime = None if path is None else _mtime(str(path))
    if mtime is None:
        return {"ops": {}}
    return _load(str(path), mtime)


def save(data: dict, path: Path) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one. The file is
    created with the process's umask as any new file is (the umask itself is left alone)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)
        _stat_cache.pop(str(path), None)  # this process sees its own write at once
        _file_memo.clear()
        global generation
        generation += 1
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive advisory lock on the config folder (flock on the folder itself: no lock file)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def update(path: Path, tables: dict, header: Optional[dict] = None) -> dict:
    """Merge `tables` ({table: {bucket key: entry}}) and `header` into the file at `path` and write it
    atomically, under a lock on its folder: two tuners writing at once each re-read the other's buckets
    before writing, so neither loses any. Returns the merged data (the valid part of the old file plus
    the updates)."""
    with _folder_lock(path.parent):
        data = {"ops": {}}
        if path.exists():
            try:
                with open(path) as fh:
                    data, _ = schema.clean(json.load(fh))
            except (OSError, ValueError, RecursionError):
                data = {"ops": {}}  # an unreadable file is replaced (load() has warned about it)
        data = {**data, **(header or {}), "ops": dict(data["ops"])}
        for table, entries in tables.items():
            data["ops"][table] = {**data["ops"].get(table, {}), **entries}
        save(data, path)
    return data


def _distance(a: dict, b: dict) -> float:
    """inf unless categorical features match; else the L1 distance of log2 of numeric ones."""
    if a.keys() != b.keys():
        return math.inf
    d = 0.0
    for k, x in a.items():
        y = b[k]
        if isinstance(x, (str, bool)) or isinstance(y, (str, bool)):
            if x != y:
                return math.inf
        else:
            d += abs(math.log2(max(x, 1)) - math.log2(max(y, 1)))
    return d


_entry_memo: dict = {}  # (file, mtime, op, bucket, backend) -> entry: one search per bucket per process


_file_memo: dict = {}  # (config dir env, device index) -> (monotonic time, path)


def _current_file() -> Optional[Path]:
    """device_file(), re-derived at most once a second per config folder and device: it sits on
    every kernel call, and the device-name query and path building cost more than the kernel
    launch on a slow host."""
    import torch
    key = (os.environ.get("FLASHSWITCH_CONFIG_DIR"),
           torch.cuda.current_device() if torch.cuda.is_initialized() else -1)
    now = time.monotonic()
    hit = _file_memo.get(key)
    if hit is None or now - hit[0] >= _STAT_INTERVAL_S:
        hit = _file_memo[key] = (now, device_file())
    return hit[1]


def _entry(op: str, feats: dict, backend: Optional[str] = None) -> Optional[dict]:
    path = _current_file()
    mtime = None if path is None else _mtime(str(path))
    key = (str(path), mtime, op, bucket_key(feats), backend)
    if key not in _entry_memo:
        if mtime is not None:
            _check_provenance(str(path), mtime)
        if len(_entry_memo) > 4096:
            _entry_memo.clear()
        _entry_memo[key] = _search(load(path) if mtime is not None else {"ops": {}}, op, feats, backend)
    return _entry_memo[key]


def _usable(entry: dict, op: str, feats: dict, backend: Optional[str]) -> bool:
    """Whether `entry` holds a config of `backend` that fits a problem of bucket `feats` (any entry
    when no backend is asked for)."""
    if backend is None:
        return True
    cfg = entry.get("backends", {}).get(backend)
    if cfg is None:
        return False
    return not isinstance(cfg.get("config"), dict) or space.config_fits(op, backend, feats, cfg["config"])


def _search(data: dict, op: str, feats: dict, backend: Optional[str]) -> Optional[dict]:
    table = data["ops"].get(op, {})
    hit = table.get(bucket_key(feats))
    if hit is not None and _usable(hit, op, feats, backend):
        return hit
    best, best_d = None, math.inf
    for entry in table.values():
        if not _usable(entry, op, feats, backend):
            continue
        d = _distance(feats, entry.get("features", {}))
        if d < best_d:
            best, best_d = entry, d
    return best


def tuned_config(path: Path, op: str, backend: str, feats: dict) -> Optional[dict]:
    """The config `lookup` would take from the config file at `path` (exact or nearest fitting
    bucket), or None when the file holds none for `backend`: what a device with that file runs."""
    entry = _search(load(path), op, feats, backend)
    cfg = None if entry is None else entry["backends"][backend].get("config")
    return dict(cfg) if isinstance(cfg, dict) else None


def lookup(op: str, backend: str, feats: dict) -> dict:
    """Config for `backend` on this bucket: exact bucket, else the nearest tuned bucket whose config
    fits this one (space.config_fits), else default."""
    entry = _entry(op, feats, backend)
    if entry is not None:
        cfg = entry["backends"][backend].get("config")
        if isinstance(cfg, dict):
            return dict(cfg)
    return space.default_config(op, backend, feats)


def best_backend(op: str, feats: dict) -> Optional[str]:
    entry = _entry(op, feats)
    return entry.get("best") if entry else None
