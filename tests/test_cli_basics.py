"""The command line: generate, clean errors (exit 2, one line, no traceback), cheap imports."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import run_cli


def test_generate_writes_requests(tmp_path):
    out = tmp_path / "reqs.jsonl"
    res = run_cli("generate", "builtin:demo", "--n", "12", "--seed", "4", "--context-length", "128-256", "-o", str(out))
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 12
    assert {r["task"] for r in rows} <= {"single_needle", "multi_key"}
    assert set(rows[0]) == {"id", "task", "context", "question", "answers"}


def _assert_clean_error(res, *fragments):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_generate_bad_input_is_one_line_exit_2(tmp_path):
    _assert_clean_error(run_cli("generate", "builtin:nope", "-o", str(tmp_path / "x.jsonl")), "unknown task or mix 'nope'")
    _assert_clean_error(
        run_cli("generate", "builtin:demo", "--context-length", "10", "-o", str(tmp_path / "x.jsonl")),
        "context length '10'",
    )
    _assert_clean_error(run_cli("generate", "requests.jsonl", "-o", str(tmp_path / "x.jsonl")), "not a built-in mix")


def test_accuracy_with_unavailable_hub_model_is_one_line(tmp_path):
    res = run_cli("accuracy", "builtin:demo", "--n", "2", "--model", "certkv-tests/no-such-model")
    _assert_clean_error(res, "'certkv-tests/no-such-model' is not available offline")


def test_import_certkv_and_help_do_not_import_torch():
    code = (
        "import sys, certkv, certkv.cli.app, certkv.requests.request_set, certkv.requests.builtin_tasks;"
        "from certkv.cli.app import app;"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules and 'kvpress' not in sys.modules,"
        " sorted(m for m in sys.modules if m.split('.')[0] in ('torch','transformers','kvpress'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
