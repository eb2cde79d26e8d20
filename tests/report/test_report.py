"""`certkv report`: three readable PNGs and one self-contained HTML page (no model, no network)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_main
from test_certify_cli import build_store  # the synthetic store

from certkv.contract.loading import load_contract

FIGURES = ("risk_vs_kv.png", "per_task.png", "validation.png")


@pytest.fixture(scope="module")
def contract_path(tmp_path_factory) -> Path:
    return build_store(tmp_path_factory.mktemp("report"), n=150, seed=2)


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")


def assert_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.is_file() and path.stat().st_size > 10_000, path
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 250 and image.shape[1] > 400 and image.shape[2] in (3, 4)
    assert image.std() > 0.01  # not a blank canvas


def test_report_writes_figures_and_a_self_contained_page(contract_path, tmp_path, capsys):
    out = tmp_path / "rep"
    assert run_main("report", str(contract_path), "-o", str(out), "--splits", "300") == 0
    page = (out / "report.html").read_text(encoding="utf-8")
    for name in FIGURES:
        assert_png(out / name)
        assert base64.b64encode((out / name).read_bytes()).decode("ascii") in page, name
    # Self-contained: no external scripts, styles or images.
    assert not re.search(r'(src|href)\s*=\s*"(https?:|//|[^"d#])', page)
    text = " ".join(re.sub(r"<[^>]+>", " ", page).split())
    for fragment in ("synthetic", "n = 150", "snapkv@0.80", "KV saved", "calibration distribution",
                     "the declared task mix", "not each task", "empirical thresholding", "300 random splits",
                     "stopped at snapkv@0.50", "not tested"):
        assert fragment in text, fragment
    # Validation was computed for the report and kept next to it, bound to these records.
    data = json.loads((out / "validation.json").read_text())
    assert data["n_splits"] == 300 and set(data["methods"]) == {"certkv", "empirical_thresholding"}


def test_report_reuses_an_up_to_date_validation(contract_path, tmp_path, capsys):
    store = load_contract(contract_path).resolved_store_path()
    assert run_main("validate", str(contract_path), "--splits", "40", "-o", str(store / "validation.json")) == 0
    out = tmp_path / "rep2"
    assert run_main("report", str(contract_path), "-o", str(out)) == 0
    assert "running" not in capsys.readouterr().err
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "40 random splits" in page and not (out / "validation.json").exists()


def test_report_figures_for_a_fallback_without_tasks(tmp_path):
    """A table with no task column and nothing certified must still draw readable figures."""
    from certkv.core.certify import certify
    from certkv.core.loss_table import LossTable
    from certkv.core.spec import CertificationSpec
    from certkv.core.validation import validate
    from certkv.report.figures import plot_per_task, plot_risk_vs_kv, plot_validation, save_figure

    rows = [
        {"request_id": f"q{i}", "policy": p, "kv_retained": kv, "loss": float(i % 3 == 0)}
        for i in range(60)
        for p, kv in (("snapkv@0.50", 0.5), ("snapkv@0.30", 0.3))
    ]
    spec = CertificationSpec.parse(
        {"tolerance": 0.0, "risk": 0.05, "confidence": 0.95, "sequences": [["snapkv@0.50", "snapkv@0.30"]]})
    table = LossTable.from_records(rows)
    op = certify(table, spec)
    assert op.fallback
    result = validate(table, spec, n_splits=30)
    for name, fig in (("a.png", plot_risk_vs_kv(op)), ("b.png", plot_per_task(op)), ("c.png", plot_validation(result))):
        path = save_figure(fig, tmp_path / name)
        assert path.stat().st_size > 5_000


def test_importing_reporting_does_not_touch_matplotlib():
    modules = "certkv.report.text, certkv.report.figures, certkv.report.html, certkv.report.console"
    code = f"import sys, {modules}; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_importing_the_report_keeps_the_users_matplotlib_backend():
    """A user's backend survives importing the report modules (only drawing selects Agg)."""
    code = (
        "import matplotlib; matplotlib.use('svg'); import certkv.report.figures, certkv.report.html\n"
        "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_the_page_is_rendered_from_an_autoescaping_template(tmp_path):
    """Names from a loss table (here a task) and notes reach the page escaped, by the template."""
    from test_certify_cli import write_contract

    from certkv.calibration.certification import certify_contract
    from certkv.contract.spec import certification_spec
    from certkv.core.validation import validate
    from certkv.report.html import render_html

    contract = load_contract(write_contract(tmp_path, policies=[{"press": "snapkv", "kv_retained": [0.8, 0.2]}]))
    table = tmp_path / "losses.csv"
    table.write_text("request_id,task,policy,kv_retained,loss\n" + "".join(
        f"q{i},<script>x</script>,{p},{kv},{float(i % 9 == 0 and kv < 0.5)}\n"
        for i in range(60) for p, kv in (("snapkv@0.80", 0.8), ("snapkv@0.20", 0.2))
    ))
    evidence, op = certify_contract(contract, table)
    result = validate(evidence.table, certification_spec(contract), n_splits=20)
    figures = {}
    for name in FIGURES:
        figures[name] = tmp_path / name
        figures[name].write_bytes(name.encode())
    page = render_html(contract, evidence, op, result, figures, notes=["a <note> & more"])
    assert "<script>" not in page and "&lt;script&gt;x&lt;/script&gt;" in page
    assert "a &lt;note&gt; &amp; more" in page
    for name in FIGURES:
        assert f'src="data:image/png;base64,{base64.b64encode(name.encode()).decode()}"' in page


@pytest.mark.parametrize(("kv_cost", "words"), [("kv_retained", "mean KV retained"), ("peak", "mean peak KV"),
                                                 ("time", "mean KV-time"), ("bytes", "mean KV bytes (of a 16-bit cache's)")])
def test_validation_says_what_its_mean_memory_averages(kv_cost, words):
    """A bytes contract's validation averages peak bytes, not KV retained: the line says so."""
    import numpy as np

    from certkv.core.loss_table import LossTable
    from certkv.core.spec import CertificationSpec
    from certkv.core.validation import validate
    from certkv.report.text import validation_line

    rng = np.random.default_rng(0)
    rows = [{"request_id": f"r{i}", "policy": p, "kv_retained": kv, "loss": float(rng.random() < rate), "memory": kv}
            for i in range(60) for p, kv, rate in (("full", 1.0, 0.0), ("a@0.50", 0.5, 0.02))]
    spec = CertificationSpec(tolerance=0.0, risk=0.2, confidence=0.8, sequences=[["a@0.50"]], kv_cost=kv_cost)
    line = validation_line(validate(LossTable.from_records(rows), spec, n_splits=20), "certkv")
    assert f", {words} " in line and ("KV retained" in line) == (kv_cost == "kv_retained"), line
