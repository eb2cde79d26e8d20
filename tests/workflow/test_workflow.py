"""The workflow's steps (certkv/workflow.py) called as functions: typed results, nothing printed.

The commands print these results (tests/core/test_certify_cli.py checks the printing); here the steps
are called the way the demo and a program call them, on the synthetic store of test_certify_cli.
Calibration is covered by the calibrating tests (a model); these steps are torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_certify_cli import build_store

from certkv import workflow
from certkv.calibration.validation_file import VALIDATION_FILE
from certkv.contract.loading import load_contract
from certkv.core.operating_point import load_operating_point
from certkv.errors import CertkvError


@pytest.fixture
def contract(tmp_path):
    return load_contract(build_store(tmp_path / "wf"))


def test_certify_returns_the_point_it_writes_and_prints_nothing(contract, capsys):
    result = workflow.certify(contract)
    assert isinstance(result, workflow.Certification)
    assert result.path == contract.resolved_store_path() / workflow.OPERATING_POINT_FILE
    stored = load_operating_point(result.path)
    assert stored.policy == result.operating_point.policy == "snapkv@0.50"
    assert stored.records_sha256 == result.operating_point.records_sha256 == result.evidence.records_sha256
    assert result.pooled is None  # no strata: nothing to compare
    assert capsys.readouterr() == ("", "")


def test_validate_then_report_reuses_the_validation_file(contract, tmp_path, capsys):
    validation = workflow.validate(contract, splits=40, seed=3)
    assert validation.path == contract.resolved_store_path() / VALIDATION_FILE
    assert json.loads(validation.path.read_text())["records_sha256"] == validation.evidence.records_sha256
    told: list[str] = []
    report = workflow.report(contract, output=tmp_path / "page", splits=40, seed=3, notify=told.append)
    assert told == [], "an up-to-date validation.json is reused, not recomputed"
    assert report.folder == tmp_path / "page" and report.paths["report.html"].is_file()
    assert all(Path(p).is_file() for p in report.paths.values())
    assert capsys.readouterr() == ("", "")


def test_report_without_validation_says_so_before_running_the_splits(contract, tmp_path):
    told: list[str] = []
    report = workflow.report(contract, output=tmp_path / "page", splits=30, notify=told.append)
    assert told == [f"no up-to-date {VALIDATION_FILE}; running 30 validation splits"]
    assert (report.folder / VALIDATION_FILE).is_file()


def test_a_missing_store_is_one_line_naming_the_label(tmp_path):
    contract = load_contract(build_store(tmp_path / "empty", n=0))
    with pytest.raises(CertkvError) as info:
        workflow.certify(contract, contract_label="my/contract.yaml")
    assert "\n" not in str(info.value) and "my/contract.yaml" in str(info.value)


def test_report_recomputes_a_validation_file_of_another_format_version_and_says_so(contract, tmp_path):
    """validation.json is a cache of a computation the report can redo: one of another format
    version (an earlier build's, none) is named, passed over and recomputed, not a dead end."""
    stored = workflow.validate(contract, splits=30, seed=3).path
    data = json.loads(stored.read_text())
    del data["format_version"]
    stored.write_text(json.dumps(data))
    told: list[str] = []
    report = workflow.report(contract, output=tmp_path / "page", splits=30, seed=3, notify=told.append)
    assert told == [
        f"{stored}: format_version none (written by an earlier certkv build), this certkv reads 1: not reused",
        f"no up-to-date {VALIDATION_FILE}; running 30 validation splits",
    ]
    assert json.loads((report.folder / VALIDATION_FILE).read_text())["format_version"] == 1
