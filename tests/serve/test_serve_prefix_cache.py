"""`certkv serve --prefix-cache-mib` on a point that cannot reuse a compressed context: one line, exit 2.

(A real server answering repeated contexts from its prefix cache: tests/serve/test_serve.py, server A.)
"""

from __future__ import annotations

from conftest import run_here
from endpoint_servers import free_port
from test_serve import _operating_point


def test_a_point_that_cannot_reuse_a_context_is_refused_in_one_line(tmp_path, capsys):
    path = _operating_point(0.5, 0.5).model_copy(update={"query_aware": True}).write_json(tmp_path / "op.json")
    port = str(free_port())
    result = run_here(capsys, "serve", str(path), "--port", port, "--prefix-cache-mib", "4")
    assert result.returncode == 2
    assert "--prefix-cache-mib" in result.stderr and "query-aware" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = run_here(capsys, "serve", str(path), "--port", port, "--prefix-cache-mib", "-1")
    assert result.returncode == 2 and "non-negative number of MiB" in result.stderr
