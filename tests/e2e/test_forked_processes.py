"""The forked processes of tests/e2e/forked_processes.py leave as fresh interpreters would: the
exit code of ``sys.exit``, 1 and a traceback after an uncaught exception, killed by SIGINT after an
uncaught KeyboardInterrupt, ``-N`` when killed by signal N, output and environment their own."""

from __future__ import annotations

import os

import pytest
from conftest import REPO
from forked_processes import run_script

CASES = {
    "exit_3": ("import sys; print('out'); sys.exit(3)", 3, "out"),
    "raises": ("raise ValueError('broken on purpose')", 1, "ValueError: broken on purpose"),
    "interrupted": ("raise KeyboardInterrupt", -2, ""),
    "killed": ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, ""),
    "environment": ("import os, sys, torch; print(os.environ['ONLY_HERE'], torch.get_num_threads(), sys.argv[1:])", 0,
                    "yes 1 ['a', 'b']"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_forked_script_exits_as_a_fresh_interpreter(name, tmp_path):
    source, code, text = CASES[name]
    script = tmp_path / f"{name}.py"
    script.write_text(source + "\n")
    env = dict(os.environ, ONLY_HERE="yes", OMP_NUM_THREADS="1")
    res = run_script(script, ["a", "b"], cwd=REPO, env=env, timeout=120)
    assert res.returncode == code, (res.returncode, res.stderr[-2000:])
    assert text in (res.stderr if code == 1 else res.stdout), (res.stdout, res.stderr)
    if code == 1:
        assert "Traceback" in res.stderr
