"""The compiled steps' cache directory, kept under a size limit.

A package's key holds everything that changes what it computes (exported_step.py), so a new torch,
a changed model file or an edited source leaves the old packages behind, never read again: the
shipped model's take 50-100 MB each (the package and its library, extracted beside it). After a
package is written the directory is cut back to ``$MINDSPEC_CACHE_GB`` (default 10) by deleting
the least recently used packages, by modification time: loading a package stamps it. Packages
the process runs are never deleted, even past the limit.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

CACHE_GB_ENV = "MINDSPEC_CACHE_GB"
DEFAULT_CACHE_GB = 10.0
SUFFIXES = (".pt2", ".so")  # a package and the library extracted from it (aoti_runner.open_released)


def cache_limit_bytes() -> int:
    """``$MINDSPEC_CACHE_GB`` in bytes (DEFAULT_CACHE_GB when unset)."""
    raw = os.environ.get(CACHE_GB_ENV, "").strip()
    if not raw:
        return int(DEFAULT_CACHE_GB * 2**30)
    try:
        gb = float(raw)
    except ValueError:
        gb = -1.0
    if not gb > 0 or gb == float("inf"):
        raise ValueError(f"${CACHE_GB_ENV}: the compiled steps' cache size in GB, a number > 0; got {raw!r}")
    return int(gb * 2**30)


def mark_used(package: Path) -> None:
    """Stamp a package and its library as used now. Both get the same time: a library older than
    its package is extracted again."""
    now = time.time()
    for path in _files(package):
        try:
            os.utime(path, (now, now))
        except OSError:  # deleted by another process meanwhile: nothing to mark
            pass


def prune(directory: Path, limit_bytes: int, keep: Iterable[str]) -> list[str]:
    """Delete the least recently used packages of ``directory`` (each with its library) until
    they total at most ``limit_bytes``, but none named in ``keep`` (package stems). Returns the
    deleted stems, oldest first."""
    keep = set(keep)
    packages = _packages(directory)
    total = sum(size for _, size in packages.values())
    deleted = []
    for stem, (_, size) in sorted(packages.items(), key=lambda item: item[1][0]):
        if total <= limit_bytes:
            break
        if stem in keep:
            continue
        for path in _files(directory / f"{stem}.pt2"):
            path.unlink(missing_ok=True)
        total -= size
        deleted.append(stem)
    if deleted:
        log.info("deleted %d compiled steps unused longest from %s (over $%s)", len(deleted), directory, CACHE_GB_ENV)
    if total > limit_bytes:
        log.warning("the compiled steps in use take %.1f GB, more than $%s = %.1f GB", total / 2**30, CACHE_GB_ENV,
                    limit_bytes / 2**30)
    return deleted


def _files(package: Path) -> list[Path]:
    return [package.with_suffix(s) for s in SUFFIXES if package.with_suffix(s).is_file()]


def _packages(directory: Path) -> dict[str, tuple[float, int]]:
    """stem -> (last used: the newest modification time of its files, their total size). Hidden
    files (writes in progress, recipes) are not packages."""
    out: dict[str, tuple[float, int]] = {}
    for suffix in SUFFIXES:
        for path in directory.glob(f"*{suffix}"):
            if path.name.startswith("."):
                continue
            try:
                st = path.stat()
            except OSError:
                continue
            used, size = out.get(path.stem, (0.0, 0))
            out[path.stem] = (max(used, st.st_mtime), size + st.st_size)
    return out
