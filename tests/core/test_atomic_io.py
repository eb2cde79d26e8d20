"""Atomic writes: all or nothing, and the file mode a plain open() would give."""

from __future__ import annotations

import os
import stat

import pytest

from certkv.atomic_io import atomic_write, write_text_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old", encoding="utf-8")
    with pytest.raises(RuntimeError), atomic_write(target) as fh:
        fh.write("half of the new")
        raise RuntimeError("killed mid-write")
    assert target.read_text(encoding="utf-8") == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_text_and_binary_writes_replace_the_target(tmp_path):
    write_text_atomic(tmp_path / "a" / "b.txt", "é\n")
    assert (tmp_path / "a" / "b.txt").read_bytes() == "é\n".encode()
    with atomic_write(tmp_path / "c.bin", "wb") as fh:
        fh.write(b"\x00\x01")
    assert (tmp_path / "c.bin").read_bytes() == b"\x00\x01"
    with pytest.raises(ValueError, match="mode"), atomic_write(tmp_path / "d", "a"):
        pass


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_file_mode_follows_the_umask_like_open(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "atomic.txt", "x")
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "atomic.txt").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o666 & ~umask
