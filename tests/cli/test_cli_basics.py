"""The command line: generate, clean errors (exit 2, one line, no traceback), cheap imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import run_cli, run_here


def test_generate_writes_requests(tmp_path):
    out = tmp_path / "reqs.jsonl"
    res = run_cli("generate", "builtin:demo", "--n", "12", "--seed", "4", "--context-length", "128-256", "-o", str(out))
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 12
    assert {r["task"] for r in rows} <= {"single_needle", "multi_key"}
    assert set(rows[0]) == {"id", "task", "context", "question", "answers"}


def test_accuracy_reports_the_tasks_the_model_fails_at_full_kv(capsys):
    """The embedded model answers single_needle and fails multi_value with the full cache; the table
    says which, and a line names the failing task."""
    res = run_here(capsys, "accuracy", "builtin:single_needle=1,multi_value=1", "--n", "8", "--seed", "2",
                   "--context-length", "64-96")
    assert res.returncode == 0, res.stderr
    rows = {line.split()[1]: line for line in res.stdout.splitlines() if line.startswith("│ ") and "_" in line}
    assert "answers" in rows["single_needle"] and "fails" in rows["multi_value"], res.stdout
    assert "fails 1 task(s) with the full cache" in res.stdout and "multi_value;" in " ".join(res.stdout.split())


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


def test_accuracy_with_unavailable_hub_model_is_one_line(tmp_path, capsys):
    res = run_here(capsys, "accuracy", "builtin:demo", "--n", "2", "--model", "certkv-tests/no-such-model")
    _assert_clean_error(res, "'certkv-tests/no-such-model' is not available offline")


def test_import_certkv_and_help_do_not_import_torch():
    code = (
        "import sys, certkv, certkv.cli.app, certkv.requests.request_set, certkv.requests.builtin_tasks;"
        "from certkv.cli.app import app;"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules and 'kvpress' not in sys.modules,"
        " sorted(m for m in sys.modules if m.split('.')[0] in ('torch','transformers','kvpress'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _help_text(res) -> str:
    """Help output with rich's box drawing and line wrapping taken out."""
    return " ".join(res.stdout.replace("│", " ").split())


def test_generate_help_says_which_tasks_the_embedded_model_answers():
    from certkv.requests.builtin_tasks import MIXES, TASKS

    res = run_cli("generate", "--help")
    assert res.returncode == 0, res.stderr
    text = _help_text(res)
    answered = ", ".join(MIXES["demo"])
    failed = ", ".join(t for t in TASKS if t not in MIXES["demo"])
    assert f"demo = {answered}, the tasks the embedded model answers" in text, text
    assert f"adding {failed}, which the embedded model fails even with the full cache" in text, text


def test_calibrate_warns_about_tasks_the_model_fails_with_the_full_cache(tmp_path, capsys, monkeypatch):
    """builtin:all on the embedded model: the tasks it fails at full KV measure nothing for
    eviction. The warning must name exactly the tasks whose full-cache rows are all 0 (read here
    through the store's public reader), and none that the model answers."""
    from certkv.calibration.store import CalibrationStore

    contract = tmp_path / "all.yaml"
    contract.write_text(
        "name: all\nmodel: embedded\nrequests:\n  source: builtin:all\n  context_length: 128-256\n  limit: 25\n"
        "utility: exact_match\ntolerance: 0.0\nrisk: 0.1\nconfidence: 0.9\n"
        "policies:\n  - press: streaming_llm\n    kv_retained: [0.5]\n"
    )
    monkeypatch.chdir(tmp_path)  # the store is runs/all, next to where certkv runs
    res = run_here(capsys, "calibrate", str(contract), "--quiet")
    assert res.returncode == 0, res.stderr
    with CalibrationStore.read(tmp_path / "runs" / "all") as store:
        full = [r for r in store.records() if r["policy"] == "full"]
    by_task: dict[str, list[float]] = {}
    for row in full:
        by_task.setdefault(row["task"], []).append(row["utility"])
    failed = {task for task, utilities in by_task.items() if max(utilities) == 0.0}
    answered = set(by_task) - failed
    assert failed and answered, by_task  # the check below must be able to fail both ways
    warnings = [line for line in res.stderr.splitlines() if "measures nothing for eviction" in line]
    warned = {line.split("task ", 1)[1].split(" ", 1)[0] for line in warnings}
    assert warned == failed, res.stderr
    for line in warnings:
        assert line.startswith("certkv: warning: task ") and "fails it even with the full cache" in line, line
        task = line.split("task ", 1)[1].split(" ", 1)[0]
        n = len(by_task[task])
        assert f"utility 0 on {'its only request' if n == 1 else f'all {n} of its requests'})" in line, line


def test_demo_never_overwrites_an_edited_copy(tmp_path):
    from certkv.demo import DEMO_CONTRACT

    folder = tmp_path / "mine"
    folder.mkdir()
    edited = DEMO_CONTRACT.read_text().replace("risk: 0.05", "risk: 0.10", 1)
    (folder / "demo.yaml").write_text(edited)
    _assert_clean_error(run_cli("demo", "--dir", str(folder), cwd=tmp_path), "demo.yaml", "another --dir", "remove it")
    assert (folder / "demo.yaml").read_text() == edited  # the user's edit is untouched
    assert not (folder / "demo.jsonl").exists() and not (folder / "runs").exists()
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    _assert_clean_error(run_cli("demo", "--dir", str(not_a_folder), cwd=tmp_path), "is a file, not a folder")


def test_copy_demo_copies_then_reuses_identical_files(tmp_path):
    from certkv.demo import DEMO_FILES, copy_demo

    contract = copy_demo(tmp_path / "d")
    assert contract == tmp_path / "d" / "demo.yaml"
    for source in DEMO_FILES:
        assert (tmp_path / "d" / source.name).read_bytes() == source.read_bytes()
    # Stamp every copy with a time long past (2001): a rewrite, in place or by a rename, would give
    # the file the time of now or a new inode, whatever the file system's timestamp resolution.
    past = 1_000_000_000 * 10**9
    for p in (tmp_path / "d").iterdir():
        os.utime(p, ns=(past, past))
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (tmp_path / "d").iterdir()}
    assert {mtime for _, mtime in stamps.values()} == {past}
    assert copy_demo(tmp_path / "d") == contract  # identical copies: reused, not rewritten
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (tmp_path / "d").iterdir()} == stamps
    assert sorted(stamps) == sorted(s.name for s in DEMO_FILES)  # no temporary file left behind
