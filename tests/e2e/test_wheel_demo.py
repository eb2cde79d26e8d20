"""`certkv demo` from an installed wheel, run from a folder that is neither the checkout nor the venv.

Slow (a wheel build, a venv, a 6-request demo: about half a minute) but run by default; it belongs to
the `model` selection (``pytest -m "not model"`` leaves it out). The venv borrows the dependencies
of the environment that runs pytest (a venv of its own, or the machine's Python), so nothing is
downloaded: see :func:`_borrow_site_packages`. The wheel is installed into the venv itself, ahead of
the borrowed folders on ``sys.path``, so it shadows the editable install of the checkout.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

#: What the wheel is built from: the package and the project files setuptools reads.
_SOURCES = ("certkv", "pyproject.toml", "README.md")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "runs", "certkv-demo")
#: The demo's requests: a few run every step (calibrate, certify, validate, report) from the wheel, as
#: thirty would; each one more is the whole demo ladder's candidates on the embedded model.
DEMO_REQUESTS = 6


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert res.returncode == 0, (cmd, res.returncode, res.stdout[-2000:], res.stderr[-4000:])
    return res


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` but bytecode (the interpreter may cache it), with size and mtime."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """(wheel, venv folder): the checkout built into a wheel and installed into a fresh venv."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy, so the build writes nothing into the shared checkout
    src.mkdir()
    for name in _SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=_IGNORE)
        else:
            shutil.copy2(path, src / name)
    _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist")],
         timeout=300)
    (wheel,) = (tmp / "dist").glob("certkv-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = venv / "bin" / "python"
    _borrow_site_packages(python)
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", "-q", str(wheel)],
         timeout=300)
    return wheel, venv


def _borrow_site_packages(python: Path) -> None:
    """Make the running environment's packages importable in the venv of `python`, after its own.

    ``--system-site-packages`` would not do: it borrows the *base* interpreter's packages, which in
    a venv lack everything pip installed there (typer, torch, ...). A ``.pth`` file in the new
    venv's site-packages calls :func:`site.addsitedir` on each site folder of this interpreter,
    which appends them to ``sys.path`` and runs their own ``.pth`` files, as Python does for its
    own site folders.
    """
    own = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    ours = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    borrowed = [p for p in dict.fromkeys(ours) if Path(p).is_dir()]
    lines = [f"import site; site.addsitedir({p!r})" for p in borrowed]
    (Path(own) / "zz_certkv_test_borrowed_site.pth").write_text("\n".join(lines) + "\n")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    return env


def test_wheel_ships_typing_marker_model_and_demo(wheel_venv):
    wheel, _ = wheel_venv
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "certkv/py.typed" in names
    embedded = {f"certkv/embedded/{p.name}" for p in (REPO / "certkv" / "embedded").iterdir()
                if p.suffix in (".json", ".safetensors")}
    assert "certkv/embedded/model.safetensors" in embedded and embedded <= names, embedded - names
    with zipfile.ZipFile(wheel) as zf:
        for name in ("demo.yaml", "demo.jsonl"):
            assert zf.read(f"certkv/demo/{name}") == (REPO / "certkv" / "demo" / name).read_bytes(), name
    assert "certkv/demo/__init__.py" in names


def test_demo_runs_from_the_installed_wheel_in_any_folder(wheel_venv, tmp_path):
    _, venv = wheel_venv
    python = venv / "bin" / "python"
    where = _run([str(python), "-c", "import certkv; print(certkv.__file__)"], cwd=tmp_path, env=_env()).stdout.strip()
    package = Path(where).resolve().parent
    assert package.is_relative_to(venv.resolve()), f"certkv imported from {where}, not from the venv"
    assert not package.is_relative_to(REPO), where

    before = _snapshot(package)
    work = tmp_path / "elsewhere"
    work.mkdir()
    res = subprocess.run([str(venv / "bin" / "certkv"), "demo", "--limit", str(DEMO_REQUESTS), "--quiet"], cwd=work,
                         env={**_env(), "COLUMNS": "80"}, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    run = work / "certkv-demo"
    assert (run / "demo.yaml").read_bytes() == (package / "demo" / "demo.yaml").read_bytes()
    assert (run / "runs" / "demo" / "operating_point.json").is_file()
    assert (run / "runs" / "demo" / "report" / "report.html").is_file()
    assert "certkv-demo/demo.yaml" in res.stdout  # it says which contract to pass later
    assert "measures nothing for eviction" not in res.stderr  # the demo holds only answered tasks
    assert _snapshot(package) == before, "certkv demo wrote into the installed package"
    assert not (package / "demo" / "runs").exists()
    # Readable in a log: 80 columns, nothing cut; only a path longer than that may stick out whole.
    wide = [line for line in res.stdout.splitlines() if len(line) > 80 and str(work) not in line]
    assert not wide, wide[:5]
    assert "…" not in res.stdout
