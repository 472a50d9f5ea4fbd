"""Compiled kernels: a content-keyed disk cache over NVRTC (runtime/nvrtc.py), and prebuilt
(ahead-of-time) kernels.

Where a unit's cubin comes from (:func:`compile_cached`), in this order:

1. the prebuilt folder ``SKUFORGE_PREBUILT`` (``python -m codegen compile --out DIR``: cubins +
   ``index.json``), looked up by cache key. The index is validated (schema, generator version, field
   types, each file exactly the name ``compile --out`` gives it, resolved inside the folder); one that
   is missing, malformed or foreign is ignored with one :class:`CacheWarning`;
2. the disk cache ``$SKUFORGE_CACHE_DIR`` (default: the platform's user cache folder, e.g.
   ``$XDG_CACHE_HOME/skuforge``) / ``cubin-v2`` / ``sm_<arch>`` / ``<unit-name>-<key>.cubin`` (after
   FlashInfer's JIT), or this process's memory where the cache cannot be used;
3. NVRTC, unless ``SKUFORGE_DISABLE_JIT=1`` (then :class:`KernelNotPrebuiltError`).

``key`` = sha256 of (source, options, arch, generator version): it is computed without NVRTC, so
neither a prebuilt kernel nor a cache hit loads NVRTC. The NVRTC version that produced an entry is
recorded inside it (and in the prebuilt index); ``python -m codegen status --clear-cache`` empties
the cache after an NVRTC upgrade. An entry is written to a temporary file and ``os.replace``d
into place (atomic, after CuPy's compiler cache), under a per-entry ``filelock`` so that concurrent
processes compile once. Every entry carries its unit, arch, key and the sha256 of its payload; one
that is corrupt, or holds another entry (copied or linked into place), is rebuilt with one
:class:`CacheWarning`. Faults, each with one :class:`CacheWarning`: a cache folder that cannot be
created or written (read-only, a file in its place) makes this process keep its kernels in memory;
a directory in the place of one entry (or its lock) keeps that unit in memory only; a lock still
held after ``SKUFORGE_LOCK_TIMEOUT`` (a live holder: a dead one releases it) makes the waiter
compile for itself and store the entry only if the lock is free by then. Temporary files older than
:data:`ORPHAN_AGE_S` (a process killed while writing) are removed.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .axes import GENERATOR_VERSION
from .config import settings
from .errors import CacheWarning, InvalidProblemError, KernelNotPrebuiltError
from .nvrtc import (BASE_OPTIONS, CompileError, builds_for,  # noqa: F401  (NVRTC's names, importable from here)
                    compile_with_report, full_options, local_memory_use, nvrtc_compile, nvrtc_version, pinned_target,
                    resource_report, supported_archs)

_MAGIC = b"SKUFORGE-CUBIN2\n"
CACHE_LAYOUT = "cubin-v2"      # <cache_dir>/cubin-v2/sm_<arch>/<unit>-<key>.cubin
ORPHAN_AGE_S = 600             # temporary files older than this are a killed writer's leftovers
INDEX = "index.json"           # the prebuilt folder's index


def cache_dir() -> Path:
    """The cache folder, absolute (resolved once, when the settings are read)."""
    return Path(settings().cache_dir).absolute()


def cache_key(source: str, arch: int, options=()) -> str:
    """sha256 of (source, options, arch, generator version): found without NVRTC."""
    h = hashlib.sha256()
    for part in (source, "\0".join((*BASE_OPTIONS, *options)), f"sm_{arch}", GENERATOR_VERSION):
        h.update(part.encode())
        h.update(b"\x1f")
    return h.hexdigest()


@dataclass
class CompileResult:
    cubin: bytes
    path: Optional[Path]          # None: held in memory only
    cached: bool                  # True: not compiled by this call
    origin: str = "compiled"      # "prebuilt" | "cache" | "memory" | "compiled"


def _stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name.rsplit(".", 1)[0])


def _entry_path(name: str, arch: int, key: str) -> Path:
    return cache_dir() / CACHE_LAYOUT / f"sm_{arch}" / f"{_stem(name)}-{key[:24]}.cubin"


def _meta(source: str, name: str, arch: int, options, key: str, cubin: bytes) -> dict:
    major, minor = nvrtc_version()
    return {"unit": name, "arch": arch, "nvrtc_options": full_options(arch, options),
            "nvrtc_version": f"{major}.{minor}", "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
            "cache_key": key, "generator": GENERATOR_VERSION, "cubin_sha256": hashlib.sha256(cubin).hexdigest()}


def _entry_blob(meta: dict, cubin: bytes) -> bytes:
    return _MAGIC + json.dumps(meta, sort_keys=True).encode() + b"\n" + cubin


def _read_file(path: Path) -> bytes:
    """The bytes of a regular file; OSError for anything else (a directory; a FIFO, which would block)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return Path(path).read_bytes()


def _read_entry(path: Path, key: str, name: str, arch: int) -> tuple:
    """(payload, None) for a good entry of this key, unit and arch; (None, None) where there is none;
    (None, what is wrong) for a corrupt one, or one that holds another entry (copied or linked there)."""
    try:
        data = _read_file(path)
    except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache folder: a file in its place)
        return None, None
    except OSError as e:
        return None, f"unreadable: {e}"
    if not data.startswith(_MAGIC):
        return None, "not a skuforge cache entry (bad header)"
    nl = data.find(b"\n", len(_MAGIC))
    try:
        meta = json.loads(data[len(_MAGIC):nl])
        payload = data[nl + 1:]
        ok = nl > 0 and hashlib.sha256(payload).hexdigest() == meta["cubin_sha256"]
    except (ValueError, KeyError, TypeError):
        return None, "unreadable header"
    if not ok:
        return None, "checksum mismatch (truncated or modified)"
    named = (meta.get("cache_key"), meta.get("unit"), meta.get("arch"))
    if named != (key, name, arch):
        return None, (f"it holds another entry: unit {named[1]!r:.80}, arch {named[2]!r:.20}, key {named[0]!r:.30}, "
                      f"not {name} for sm_{arch}")
    return payload, None


def entry_meta(path: Path) -> Optional[dict]:
    """The metadata recorded in a cache entry (unit, key, NVRTC version, options, sha256s), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
        return json.loads(head[len(_MAGIC):head.index(b"\n", len(_MAGIC))]) if head.startswith(_MAGIC) else None
    except (OSError, ValueError):
        return None


# -- faults: one warning each ------------------------------------------------------------------
class _ProcessState:
    """What this process remembers of the compile cache and the prebuilt folders: kernels kept in
    memory, folders found unusable, warnings given, folders swept, prebuilt indexes read."""

    def __init__(self):
        self.lock = threading.Lock()
        self.memory: dict = {}      # (cache root, key) -> cubin, kept in memory (unusable folder or entry, busy lock)
        self.unusable: dict = {}    # cache root -> why (warned once)
        self.warned: set = set()    # corrupt entries / prebuilt folders / busy locks already warned about
        self.cleaned: set = set()   # folders already swept for orphans
        self.indexes: dict = {}     # index path -> (stat stamp, {cache key: entry}, problem or None)

    def reset(self) -> None:
        with self.lock:
            for held in (self.memory, self.unusable, self.warned, self.cleaned, self.indexes):
                held.clear()


STATE = _ProcessState()


def _disable(root: Path, err: BaseException) -> None:
    with STATE.lock:
        if root in STATE.unusable:
            return
        STATE.unusable[root] = err
    warnings.warn(f"skuforge compile cache {root} is not usable ({type(err).__name__}: {err}); compiled kernels "
                  f"are kept in memory for this process (set SKUFORGE_CACHE_DIR to a writable folder)",
                  CacheWarning, stacklevel=3)


def _warn_once(tag, message: str) -> None:
    with STATE.lock:
        if tag in STATE.warned:
            return
        STATE.warned.add(tag)
    warnings.warn(message, CacheWarning, stacklevel=3)


def _in_the_way(root: Path, path: Path) -> bool:
    """Whether a directory stands where the file ``path`` (an entry or its lock) must go: then that one
    unit is kept in memory, with one warning, and the cache serves every other unit as usual."""
    if not os.path.isdir(path):
        return False
    _warn_once(("in the way", str(path)),
               f"a directory is in the place of the compile-cache file {path}: this unit is compiled and kept in "
               f"memory by this process, the rest of the cache {root} is used as usual (remove the directory)")
    return True


def _fault(root: Path, path: Path, err: OSError) -> None:
    """A write into the cache failed: only this entry is affected where a directory is in its way,
    else the whole folder is unusable for this process."""
    if not _in_the_way(root, path):
        _disable(root, err)


def reset_faults() -> None:
    """Forget the remembered faults (unusable folders, warnings given) and the in-memory kernels (tests)."""
    STATE.reset()


def clean_orphans(folder: Path, max_age_s: float = ORPHAN_AGE_S) -> list:
    """Remove ``.tmp-*.cubin`` files older than ``max_age_s`` (left by a killed writer)."""
    removed, now = [], time.time()
    try:
        for p in folder.glob(".tmp-*.cubin"):
            try:
                if now - p.stat().st_mtime > max_age_s:
                    p.unlink()
                    removed.append(p)
            except OSError:
                pass
    except OSError:
        pass
    return removed


def is_entry(path: Path) -> bool:
    """A cache entry (not a temporary file or a lock)."""
    return path.suffix == ".cubin" and not path.name.startswith(".tmp-")


def _write_atomic(path: Path, blob: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# -- prebuilt kernels ----------------------------------------------------------------------------
INDEX_SCHEMA = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
_ENTRY_FIELDS = (("unit", str), ("arch", int), ("cache_key", str), ("cubin_sha256", str), ("file", str))


def prebuilt_file(unit: str, arch: int, key: str) -> str:
    """Where ``compile --out`` writes a unit's cubin, relative to the prebuilt folder; the only file
    name an index entry may give."""
    return f"sm_{arch}/{_stem(unit)}-{key[:24]}.cubin"


def _entry_problem(e) -> Optional[str]:
    if not isinstance(e, dict):
        return f"{e!r:.60} is not an object"
    for name, kind in _ENTRY_FIELDS:
        value = e.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{name} is {value!r:.80}, not a{'n' if kind is int else ''} {kind.__name__}"
    for name in ("cache_key", "cubin_sha256"):
        if not _SHA256.fullmatch(e[name]):
            return f"{name} {e[name]!r:.80} is not a sha256 in hex"
    want = prebuilt_file(e["unit"], e["arch"], e["cache_key"])
    if e["file"] != want:
        return f"file {e['file']!r:.120} is not {want!r}, the file `compile --out` writes for it"
    return None


def _index_problem(data) -> Optional[str]:
    """What makes a parsed index.json unusable (None: nothing)."""
    if not isinstance(data, dict):
        return f"not a JSON object but {type(data).__name__}"
    schema = data.get("schema")
    if schema != INDEX_SCHEMA or isinstance(schema, bool):
        return f"schema {schema!r:.40}; this skuforge reads schema {INDEX_SCHEMA}"
    if data.get("generator") != GENERATOR_VERSION:
        return (f"written by generator {data.get('generator')!r:.40}, this is {GENERATOR_VERSION} "
                f"(its cache keys cannot match)")
    entries = data.get("entries")
    if not isinstance(entries, list):
        return f"entries is {entries!r:.40}, not a list"
    for i, e in enumerate(entries):
        problem = _entry_problem(e)
        if problem is not None:
            return f"entries[{i}]: {problem}"
    return None


def _load_index(folder: Path) -> tuple:
    """({cache key: entry}, None) of a prebuilt folder's valid index, or ({}, why it is not usable);
    never raises. Re-read when index.json changes."""
    path = folder / INDEX
    try:
        st = os.stat(path)
    except OSError as e:
        return {}, f"no readable {INDEX} ({e.strerror or e}): write it with `python -m codegen compile --out {folder}`"
    stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    hit = STATE.indexes.get(path)
    if hit is None or hit[0] != stamp:
        entries = {}
        try:
            data = json.loads(_read_file(path))
        except (OSError, ValueError, RecursionError) as e:
            problem = f"{path} is unreadable ({type(e).__name__}: {e})"
        else:
            problem = _index_problem(data)
            if problem is None:
                entries = {e["cache_key"]: e for e in data["entries"]}
            else:
                problem = f"{path}: {problem}"
        hit = STATE.indexes[path] = (stamp, entries, problem)
    return hit[1], hit[2]


@dataclass(frozen=True)
class PrebuiltState:
    """A prebuilt folder as the runtime sees it (``python -m codegen status``)."""
    folder: Path
    entries: int                  # usable entries (0 where the index is ignored)
    problem: Optional[str]        # why the index is ignored, or None

    def __str__(self) -> str:
        return f"{self.folder}: {self.entries} entries" + (f" (ignored: {self.problem})" if self.problem else "")


def prebuilt_status(folder) -> PrebuiltState:
    """The state of a prebuilt folder, without raising or warning (for ``status``)."""
    entries, problem = _load_index(Path(folder))
    return PrebuiltState(Path(folder), len(entries), problem)


def _prebuilt_index(folder: Path) -> dict:
    """cache key -> index entry of a prebuilt folder; an index that is missing, malformed or foreign
    (another schema or generator) is ignored with one :class:`CacheWarning`: kernels then come from
    the compile cache or NVRTC (with JIT disabled: :class:`KernelNotPrebuiltError`)."""
    entries, problem = _load_index(Path(folder))
    if problem is not None:
        _warn_once(("prebuilt", str(folder), problem),
                   f"the prebuilt folder SKUFORGE_PREBUILT={folder} is ignored: {problem}; kernels come from the "
                   f"compile cache or NVRTC")
    return entries


def _inside(folder: Path, path: Path) -> bool:
    """Whether ``path`` resolves (symlinks followed) to a place inside ``folder``."""
    try:
        return Path(path).resolve().is_relative_to(Path(folder).resolve())
    except (OSError, RuntimeError):  # a symlink loop
        return False


def prebuilt_lookup(folder: Path, key: str):
    """(path, cubin) of a prebuilt entry with this cache key, or None. A file that resolves outside the
    folder, is unreadable or does not match its index entry's sha256 is ignored with one warning."""
    folder = Path(folder)
    entry = _prebuilt_index(folder).get(key)
    if entry is None:
        return None
    path = folder / entry["file"]
    try:
        if not _inside(folder, path):
            raise OSError(errno.EACCES, f"it resolves to {path.resolve()}, outside {folder}")
        cubin = _read_file(path)
    except OSError as e:
        _warn_once(("prebuilt", str(path)), f"prebuilt kernel {path} is unreadable ({e.strerror or e}); ignored")
        return None
    if hashlib.sha256(cubin).hexdigest() != entry["cubin_sha256"]:
        _warn_once(("prebuilt", str(path)), f"prebuilt kernel {path} does not match its index entry; ignored")
        return None
    return path, cubin


def _remove_written(folder: Path, rel: str) -> None:
    """Remove a cubin an earlier ``compile --out`` wrote (``rel``: a validated index entry's file), never
    anything outside the folder: not through a symlinked subfolder, not a symlink itself."""
    path = folder / rel
    if _inside(folder, path.parent) and path.is_file() and not path.is_symlink():
        try:
            path.unlink()
        except OSError:
            pass


def _previous_entries(folder: Path) -> dict:
    """(unit, arch) -> entry of the index already in ``folder``; a malformed or foreign one is replaced
    (its files are left in place) with one warning."""
    if not os.path.lexists(folder / INDEX):
        return {}
    entries, problem = _load_index(folder)
    if problem is not None:
        _warn_once(("prebuilt", str(folder), problem),
                   f"replacing the prebuilt index in {folder}: {problem}; no file it names is removed")
    return {(e["unit"], e["arch"]): e for e in entries.values()}


def write_prebuilt(folder: Path, items) -> Path:
    """Write cubins and merge their entries into ``folder/index.json``. ``items``: dicts with unit,
    source, arch, options, cubin, skus. Returns the index path. A unit's previous cubin (another key)
    is removed: only a file the previous index listed, inside the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entries = _previous_entries(folder)
    for it in items:
        key = cache_key(it["source"], it["arch"], it["options"])
        rel = prebuilt_file(it["unit"], it["arch"], key)
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        if not _inside(folder, (folder / rel).parent):
            raise InvalidProblemError(f"--out {folder}: {(folder / rel).parent} resolves outside the folder (a "
                                      f"symlink); the runtime loads prebuilt kernels only from inside it")
        _write_atomic(folder / rel, it["cubin"])
        prev = entries.get((it["unit"], it["arch"]))
        if prev is not None and prev["file"] != rel:
            _remove_written(folder, prev["file"])
        entries[(it["unit"], it["arch"])] = {"skus": list(it.get("skus", ())), "file": rel,
                                             **_meta(it["source"], it["unit"], it["arch"], it["options"], key,
                                                     it["cubin"])}
    index = {"schema": INDEX_SCHEMA, "generator": GENERATOR_VERSION,
             "entries": [entries[k] for k in sorted(entries)]}
    _write_atomic(folder / INDEX, (json.dumps(index, indent=1, sort_keys=True) + "\n").encode())
    return folder / INDEX


def store_entry(source: str, name: str, arch: int, options, cubin: bytes) -> Path:
    """Put a cubin compiled elsewhere (``compile --fill-cache``) into the disk cache."""
    key = cache_key(source, arch, options)
    path = _entry_path(name, arch, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, _entry_blob(_meta(source, name, arch, options, key, cubin), cubin))
    return path


def _not_prebuilt(name: str, arch: int, skus, s) -> KernelNotPrebuiltError:
    what = f"{name}" + (f" (SKUs {', '.join(skus[:3])}{', ...' if len(skus) > 3 else ''})" if skus else "")
    pattern = skus[0] if skus else "*"
    where = f"SKUFORGE_PREBUILT={prebuilt_status(s.prebuilt_dir)}" if s.prebuilt_dir else "SKUFORGE_PREBUILT is not set"
    return KernelNotPrebuiltError(
        f"{what} for sm_{arch} is not prebuilt ({where}) nor in the compile cache {cache_dir()}, and run-time "
        f"compilation is off (SKUFORGE_DISABLE_JIT=1): build it with "
        f"`python -m codegen compile --arch sm_{arch} --filter '{pattern}' --out DIR` and set SKUFORGE_PREBUILT=DIR "
        f"(or `--fill-cache`)")


# -- compile_cached ------------------------------------------------------------------------------
def _in_memory(root: Path, key: str, cubin: bytes) -> CompileResult:
    STATE.memory[(root, key)] = cubin
    return CompileResult(cubin, None, False, "compiled")


def _take_lock(lock, timeout: float) -> bool:
    from filelock import Timeout
    try:
        lock.acquire(timeout=timeout)
    except (Timeout, OSError):
        return False
    return True


def _compile_into_cache(source: str, name: str, arch: int, options, key: str, path: Path,
                        timeout: float) -> Optional[CompileResult]:
    """Compile under the entry's lock and store the entry; None where the caller must compile into
    memory (a fault, warned). A lock still held after ``timeout`` s belongs to a live process (one that
    dies releases it): this process then compiles for itself and stores the entry only if the lock is
    free by then."""
    from filelock import FileLock, Timeout

    root = cache_dir()
    lock = FileLock(f"{path}.lock", timeout=timeout)
    cubin = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except Timeout:
        _warn_once(("lock", lock.lock_file),
                   f"the compile-cache lock {lock.lock_file} is still held after {timeout:g} s "
                   f"(SKUFORGE_LOCK_TIMEOUT) by another process, alive and still compiling {name} for sm_{arch} "
                   f"(a process that dies releases its lock): compiling it in this process too")
        cubin = nvrtc_compile(source, name, arch, options)
        if not _take_lock(lock, 0):
            return _in_memory(root, key, cubin)
    except OSError as e:
        _fault(root, Path(lock.lock_file), e)
        return None
    try:
        if cubin is None:
            payload, _ = _read_entry(path, key, name, arch)  # another process may have finished meanwhile
            if payload is not None:
                return CompileResult(payload, path, True, "cache")
            if path.parent not in STATE.cleaned:
                STATE.cleaned.add(path.parent)
                clean_orphans(path.parent)
            cubin = nvrtc_compile(source, name, arch, options)
        try:
            _write_atomic(path, _entry_blob(_meta(source, name, arch, options, key, cubin), cubin))
        except OSError as e:
            _fault(root, path, e)
            return _in_memory(root, key, cubin)
        return CompileResult(cubin, path, False, "compiled")
    finally:
        lock.release()


def compile_cached(source: str, name: str, arch: int, options=(), *, skus=()) -> CompileResult:
    """A unit's cubin for ``sm_<arch>``: prebuilt, cached, or compiled (and cached); safe across threads
    and processes. ``skus`` (for messages) are the SKUs the unit holds."""
    s = settings()
    key = cache_key(source, arch, options)
    if s.prebuilt_dir is not None:
        hit = prebuilt_lookup(s.prebuilt_dir, key)
        if hit is not None:
            return CompileResult(hit[1], hit[0], True, "prebuilt")
    root = cache_dir()
    mem = STATE.memory.get((root, key))
    if mem is not None:
        return CompileResult(mem, None, True, "memory")
    path = _entry_path(name, arch, key)
    payload, problem = _read_entry(path, key, name, arch)
    if payload is not None:
        return CompileResult(payload, path, True, "cache")
    blocked = _in_the_way(root, path)
    if problem is not None and not blocked:
        _warn_once(("corrupt", str(path)), f"corrupt compile-cache entry {path} ({problem}): rebuilding it")
    if s.disable_jit:
        raise _not_prebuilt(name, arch, list(skus), s)
    if root not in STATE.unusable and not blocked:
        res = _compile_into_cache(source, name, arch, options, key, path, s.lock_timeout)
        if res is not None:
            return res
    return _in_memory(root, key, nvrtc_compile(source, name, arch, options))
