"""The demo that ships with certkv: a contract for the embedded model and its request file.

Both are package data, found next to this module, so ``certkv demo`` works from an installed
wheel. ``certkv demo`` never runs them in place (the store would land inside the installation):
it copies them into a folder of the user's choice first (:func:`copy_demo`).
"""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path

from certkv.atomic_io import atomic_write
from certkv.errors import CertkvError

DEMO_DIR = Path(__file__).resolve().parent
#: The packaged demo contract; its relative paths (`demo.jsonl`, `runs/demo`) resolve against its folder.
DEMO_CONTRACT = DEMO_DIR / "demo.yaml"
#: The packaged demo request set (1200 requests of the built-in `demo` mix).
DEMO_REQUESTS = DEMO_DIR / "demo.jsonl"
#: The files `certkv demo` copies, in order.
DEMO_FILES = (DEMO_CONTRACT, DEMO_REQUESTS)
#: The folder `certkv demo` works in unless told otherwise, relative to the working directory.
DEFAULT_DEMO_DIR = "certkv-demo"


def copy_demo(folder: str | Path) -> Path:
    """Copy the packaged demo contract and requests into `folder`; returns the copied contract.

    Files already there that are identical to the packaged ones are reused (a rerun resumes its
    store); a file that differs is never overwritten (it may hold the user's edits): that is a
    one-line :class:`CertkvError`.
    """
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise CertkvError(f"--dir {folder} is a file, not a folder; pass another --dir")
    changed = [
        str(folder / source.name)
        for source in DEMO_FILES
        if (folder / source.name).exists()
        and not ((folder / source.name).is_file() and filecmp.cmp(source, folder / source.name, shallow=False))
    ]
    if changed:
        raise CertkvError(
            f"{' and '.join(changed)}: not the packaged demo (edited?), and `certkv demo` never overwrites "
            "a file; pass another --dir, or remove it to start again from the packaged demo"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for source in DEMO_FILES:
        target = folder / source.name
        if not target.exists():  # atomically: an interrupted copy leaves no half file to trip on
            with atomic_write(target, "wb") as out, source.open("rb") as inp:
                shutil.copyfileobj(inp, out)
    return folder / DEMO_CONTRACT.name
