"""The compiled steps' cache under its size limit (step_cache.py): the least recently used
packages go first, each with its library; packages in use, writes in progress and recipes stay."""
import os
import zipfile

import pytest

from mindspec.modeling import step_cache
from mindspec.modeling.aoti_runner import open_released
from mindspec.modeling.step_cache import CACHE_GB_ENV, cache_limit_bytes, mark_used, prune


def _package(directory, stem, size, used_at, library=True):
    """A stand-in package of ``size`` bytes (half of it its library), last used at ``used_at``."""
    files = [directory / f"{stem}.pt2"] + ([directory / f"{stem}.so"] if library else [])
    for f in files:
        f.write_bytes(b"x" * (size // len(files)))
        os.utime(f, (used_at, used_at))


def _stems(directory):
    return sorted({p.stem for p in directory.iterdir() if not p.name.startswith(".")})


def test_the_least_recently_used_packages_go_first_with_their_libraries(tmp_path):
    for i, stem in enumerate(["decode-a", "prefill-b", "speculative-c", "decode-d"]):
        _package(tmp_path, stem, 1000, used_at=1_000_000 + i, library=stem != "prefill-b")
    (tmp_path / ".decode-e.pt2.123.tmp").write_bytes(b"x" * 5000)  # a write in progress
    (tmp_path / ".recipes").mkdir()
    assert prune(tmp_path, limit_bytes=4000, keep=()) == []
    assert prune(tmp_path, limit_bytes=2500, keep=()) == ["decode-a", "prefill-b"]
    assert _stems(tmp_path) == ["decode-d", "speculative-c"]
    assert not (tmp_path / "decode-a.so").exists() and (tmp_path / ".decode-e.pt2.123.tmp").exists()
    assert (tmp_path / ".recipes").is_dir()


def test_packages_in_use_stay_past_the_limit(tmp_path, caplog):
    for i, stem in enumerate(["decode-a", "decode-b", "decode-c"]):
        _package(tmp_path, stem, 1000, used_at=1_000_000 + i)
    assert prune(tmp_path, limit_bytes=1500, keep={"decode-a", "decode-c"}) == ["decode-b"]
    assert _stems(tmp_path) == ["decode-a", "decode-c"]
    assert "more than $MINDSPEC_CACHE_GB" in caplog.text


def test_a_load_marks_a_package_used_without_extracting_its_library_again(tmp_path):
    package = tmp_path / "decode-a.pt2"
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr("data/aotinductor/model/model.so", b"not a library")
    open_released(package)  # extracts the library beside the package (loading it then fails here)
    library = package.with_suffix(".so")
    assert library.read_bytes() == b"not a library"
    for f in (package, library):
        os.utime(f, (1_000_000, 1_000_000))
    _package(tmp_path, "decode-b", 1000, used_at=2_000_000)

    mark_used(package)
    assert package.stat().st_mtime == library.stat().st_mtime > 2_000_000
    stamp = package.stat().st_mtime
    library.write_bytes(b"extracted before")
    os.utime(library, (stamp, stamp))
    open_released(package)
    assert library.read_bytes() == b"extracted before"  # not older than its package: not extracted again
    a_size = package.stat().st_size + library.stat().st_size
    assert prune(tmp_path, limit_bytes=a_size, keep=()) == ["decode-b"]


@pytest.mark.parametrize("value", ["0", "-1", "ten", "inf", "nan"])
def test_a_bad_limit_is_one_clear_error(monkeypatch, value):
    monkeypatch.setenv(CACHE_GB_ENV, value)
    with pytest.raises(ValueError, match=r"\$MINDSPEC_CACHE_GB: .* a number > 0; got"):
        cache_limit_bytes()


def test_the_limit_defaults_to_ten_gb(monkeypatch):
    monkeypatch.delenv(CACHE_GB_ENV, raising=False)
    assert cache_limit_bytes() == 10 * 2**30 == step_cache.DEFAULT_CACHE_GB * 2**30
    monkeypatch.setenv(CACHE_GB_ENV, "0.5")
    assert cache_limit_bytes() == 2**29
