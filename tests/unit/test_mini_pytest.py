"""verify/mini_pytest.py, the GPU check's stand-in where pytest is missing: it collects what pytest
collects (same ids, marks selected the same way) and runs tests with their fixtures, skips and
failures as pytest would. Each run is a fresh interpreter, as on the GPU machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNNER = os.path.join(ROOT, "verify", "mini_pytest.py")

CONFTEST = """
import os
import pytest

VALUE = 3


@pytest.fixture(scope="session")
def events(tmp_path_factory):
    log = os.environ["EVENTS"]
    def note(what):
        with open(log, "a") as f:
            f.write(what + "\\n")
    note("session-setup")
    yield note
    note("session-teardown")
"""

TEST_A = """
import pytest
from conftest import VALUE

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def mod(events):
    events("module-setup")
    yield 5
    events("module-teardown")


@pytest.mark.parametrize("b", [1, (2, 3)])
@pytest.mark.parametrize("a", ["x", "y"])
def test_product(a, b, mod, events):
    events(f"product-{a}-{b}")
    assert mod == 5 and VALUE == 3


@pytest.mark.parametrize("n,m", [(1, 2), (3, 4)], ids=["small", "big"])
def test_pairs(n, m):
    assert m == n + 1


def test_fails():
    assert 1 == 2, "one is not two"


@pytest.mark.skipif(True, reason="never here")
def test_skipped():
    raise RuntimeError


def test_skips_inside():
    pytest.skip("decided inside")


def test_raises_and_tmp_path(tmp_path):
    with pytest.raises(ValueError, match="bad"):
        raise ValueError("a bad thing")
    assert tmp_path.is_dir()
"""

TEST_B = """
import pytest

pytestmark = [pytest.mark.slow]


def test_only_slow():
    pass
"""


def _tree(tmp_path) -> str:
    d = tmp_path / "tests"
    d.mkdir()
    (d / "conftest.py").write_text(CONFTEST)
    (d / "test_a.py").write_text(textwrap.dedent(TEST_A))
    (d / "test_b.py").write_text(TEST_B)
    (d / "test_c.py").write_text("import no_such_module_here\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  fast\n  slow\n")
    return str(d)


def _run(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "result.json"
    env = {**os.environ, "EVENTS": str(tmp_path / "events.log")}
    r = subprocess.run([sys.executable, RUNNER, *args, "--json", str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    return r, json.loads(out.read_text())


def _ids(lines: str) -> list[str]:
    return sorted(line.strip() for line in lines.splitlines() if "::" in line and not line.startswith("ERROR"))


def test_collects_the_ids_pytest_collects(tmp_path):
    tests = _tree(tmp_path)
    for mark in ("fast", "not fast"):
        ours, _ = _run(tmp_path, "-m", mark, "--collect-only", tests)
        theirs = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                                 "-m", mark, "tests/test_a.py", "tests/test_b.py"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=60)
        assert _ids(ours.stdout) == _ids(theirs.stdout) and _ids(ours.stdout), (ours.stdout, theirs.stdout)
    assert "tests/test_a.py::test_product[x-2]" not in ours.stdout  # a tuple value gets pytest's name+index id


def test_runs_fixtures_skips_and_failures(tmp_path):
    r, result = _run(tmp_path, "-m", "fast", _tree(tmp_path))
    assert r.returncode == 1  # a failure and a module that does not import
    outcomes = {t["id"].split("::")[1]: t["outcome"] for t in result["tests"]}
    assert outcomes == {"test_product[x-1]": "passed", "test_product[x-b1]": "passed", "test_product[y-1]": "passed",
                        "test_product[y-b1]": "passed", "test_pairs[small]": "passed", "test_pairs[big]": "passed",
                        "test_fails": "failed", "test_skipped": "skipped", "test_skips_inside": "skipped",
                        "test_raises_and_tmp_path": "passed"}
    assert (result["passed"], result["failed"], result["skipped"], result["errors"]) == (7, 1, 2, 1)
    assert result["collection_errors"][0].endswith("test_c.py") and "no_such_module_here" in r.stdout
    assert "one is not two" in r.stdout and "SKIPPED tests/test_a.py::test_skipped (0.00 s): never here" in r.stdout
    events = (tmp_path / "events.log").read_text().split()
    assert events[:2] == ["session-setup", "module-setup"] and events[-2:] == ["module-teardown", "session-teardown"]
    assert events.count("session-setup") == 1 and len([e for e in events if e.startswith("product-")]) == 4


def test_stops_at_the_first_failure_with_x(tmp_path):
    tests = _tree(tmp_path)
    os.remove(os.path.join(tests, "test_c.py"))
    r, result = _run(tmp_path, "-x", os.path.join(tests, "test_a.py"))
    assert r.returncode == 1 and result["tests"][-1]["id"].endswith("test_fails")
    assert result["failed"] == 1 and result["collected"] == 10 and len(result["tests"]) < 10
    assert (tmp_path / "events.log").read_text().split()[-1] == "session-teardown"  # torn down all the same
