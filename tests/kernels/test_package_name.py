"""The `kernels/` folder is the `h3kernels` package; from a checkout's root (the current directory on sys.path, as
under `python -m`), a top-level `import kernels` must reach the PyPI `kernels` distribution that transformers and
diffusers import, never this folder."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _import_from_root(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_top_level_kernels_is_the_pypi_distribution_from_the_checkout_root():
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the PyPI `kernels` distribution is not installed here")  # transformers >= 5.25 requires it
    done = _import_from_root("import kernels, h3kernels; print(kernels.__file__); print(h3kernels.__file__)")
    assert done.returncode == 0, done.stderr
    pypi, ours = done.stdout.split()
    assert Path(ours).resolve() == ROOT / "kernels" / "__init__.py"
    assert Path(pypi).resolve() != Path(ours).resolve() and "site-packages" in pypi


def test_transformers_hub_kernels_imports_from_the_checkout_root():
    done = _import_from_root("import transformers.integrations.hub_kernels; print('ok')")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_without_the_distribution_top_level_kernels_reads_as_not_installed():
    """No PyPI `kernels` on the path (the GPU image): the folder must not pose as it -- no file, no attributes -- so
    transformers' availability probe says "absent" and never imports from it."""
    code = ("import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p and 'dist-packages' not in p]; "
            "import kernels; print(kernels.__file__, [n for n in vars(kernels) if not n.startswith('_')])")
    done = _import_from_root(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(None, 1) == ["None", "[]\n"]
