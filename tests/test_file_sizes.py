"""Files a reader can hold: no Python library file over 450 lines, no C++ file over 700."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON_PACKAGES = ("bagua_common", "bagua_jax", "bagua_torch", "bagua_launch")
NATIVE_FOLDERS = ("xla_ffi", "bagua_net")
PYTHON_LIMIT = 450
CPP_LIMIT = 700
CPP_SUFFIXES = {".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"}


def files_over_limits(root: Path) -> dict[str, int]:
    """Each library file under ``root`` longer than its limit, by path relative to ``root``, with its line count."""
    found = {}
    candidates = [(p, PYTHON_LIMIT) for package in PYTHON_PACKAGES for p in (root / package).rglob("*.py")]
    candidates += [
        (p, CPP_LIMIT) for folder in NATIVE_FOLDERS for p in (root / folder).rglob("*") if p.suffix in CPP_SUFFIXES
    ]
    for path, limit in candidates:
        lines = path.read_bytes().count(b"\n")
        if lines > limit:
            found[path.relative_to(root).as_posix()] = lines
    return found


def test_no_library_file_is_over_its_limit():
    over = files_over_limits(ROOT)
    assert not over, f"split these files (Python at most {PYTHON_LIMIT} lines, C++ {CPP_LIMIT}): {over}"


def test_the_count_finds_a_file_one_line_over(tmp_path):
    """The checker can fail: a file one line over its limit is found, one at the limit is not."""
    for folder, name, limit in (("bagua_jax", "long.py", PYTHON_LIMIT), ("xla_ffi", "long.cc", CPP_LIMIT)):
        (tmp_path / folder / "deep").mkdir(parents=True)
        (tmp_path / folder / "deep" / name).write_text("x\n" * (limit + 1))
        (tmp_path / folder / f"fits{Path(name).suffix}").write_text("x\n" * limit)
    assert files_over_limits(tmp_path) == {
        "bagua_jax/deep/long.py": PYTHON_LIMIT + 1,
        "xla_ffi/deep/long.cc": CPP_LIMIT + 1,
    }
