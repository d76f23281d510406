"""verify/gpu_check.sh: its dry run passes here (this is how `make test` runs it), and the summary
it writes from a run's files says what each step and test did."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "verify"))

import gpu_check  # noqa: E402  (verify/ is not a package)


def test_the_dry_run_passes_without_a_gpu():
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", "verify/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "FAIL" not in out and out.rstrip().endswith("dry run of verify/gpu_check.sh: ok"), out
    assert "PASS gpu tests collect" in out and "parses (device='cuda')" in out, out


def test_an_unknown_argument_is_refused():
    r = subprocess.run(["bash", "verify/gpu_check.sh", "--fast"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage:" in r.stderr


def _write(path, data) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(data if isinstance(data, str) else json.dumps(data))


def test_the_summary_counts_steps_tests_and_numbers(tmp_path):
    out = str(tmp_path)
    _write(f"{out}/env.json", {"device": "NVIDIA H200", "capability": "9.0", "packages": {"torch": "2.11.0"}})
    _write(f"{out}/steps.tsv", "env\t0\t3\t20\ntests\t1\t150\t190\nbench_decode\t124\t80\t80\n")
    _write(f"{out}/tests.json", {"passed": 40, "failed": 1, "skipped": 2, "errors": 0, "collected": 43, "tests": [
        {"id": "tests/gpu/test_x.py::test_a", "outcome": "failed", "seconds": 1.0, "message": "boom"}]})
    side = {"decode_tok_s": 812.5}
    _write(f"{out}/results/decode_compare_float32_b16_c512.json", {
        "dtype": "float32", "batch": 16, "context": 512, "moeflow": side, "transformers": {"decode_tok_s": 650.0},
        "moeflow_over_transformers": 1.25, "agreeing_tokens": 500, "tokens": 512})
    assert gpu_check.main(["summary", out]) == 0
    md = open(f"{out}/summary.md").read()
    s = json.load(open(f"{out}/summary.json"))
    assert s["ok"] is False and [st["rc"] for st in s["steps"]] == [0, 1, 124]
    assert s["tests"] == {"runner": "mini_pytest", "passed": 40, "failed": 1, "skipped": 2, "errors": 0,
                          "failed_ids": ["tests/gpu/test_x.py::test_a"]}
    assert "NVIDIA H200" in md and "| bench_decode | 124 (timed out) | 80 (80) |" in md
    assert "40 passed, 1 failed, 2 skipped" in md and "failed: tests/gpu/test_x.py::test_a" in md
    assert "| float32 | 16 | 512 | 812.5 | 650.0 | 1.25 | 500/512 |" in md
    assert md.rstrip().endswith("overall: FAILED")


def test_the_summary_reads_pytests_junit_xml(tmp_path):
    out = str(tmp_path)
    _write(f"{out}/steps.tsv", "tests\t0\t10\t190\n")
    _write(f"{out}/pytest.xml", '<testsuites><testsuite><testcase classname="t" name="a"/>'
                                '<testcase classname="t" name="b"><skipped/></testcase>'
                                '<testcase classname="t" name="c"><failure/></testcase></testsuite></testsuites>')
    gpu_check.main(["summary", out])
    s = json.load(open(f"{out}/summary.json"))
    assert s["tests"] == {"runner": "pytest", "passed": 1, "failed": 1, "skipped": 1, "errors": 0, "failed_ids": ["t::c"]}
    assert s["ok"] is True and s["bench_decode"] is None and s["decode_compare"] == []


def test_a_bench_command_runs_where_the_servers_packages_cannot_be_imported(tmp_path):
    """The GPU machine has no fastapi, uvicorn, prometheus_client or httpx: `moeflow bench decode` must
    run without them (``gpu_check.py bare`` refuses them in its process, as the dry run does)."""
    out = tmp_path / "decode.json"
    r = subprocess.run([sys.executable, "verify/gpu_check.py", "bare", "--", "bench", "decode", "--model", "tiny",
                        "--context", "64", "--batch", "2", "--steps", "4", "--repeats", "1", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.load(open(out))["results"]
    refused = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'verify'); import gpu_check; "
                              "sys.meta_path.insert(0, gpu_check._Refuse(gpu_check.SERVER_ONLY)); import fastapi"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "refused: the GPU machine lacks it" in refused.stderr


def test_gpu_run_refuses_what_it_does_not_know_and_sums_up_a_call(tmp_path):
    for args in ([], ["c"], ["a", "--fast"]):
        r = subprocess.run(["bash", "verify/gpu_run.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "usage:" in r.stderr, args
    import gpu_probe

    out = str(tmp_path)
    _write(f"{out}/a-steps.tsv", "facts\t0\t2\t20\nipc\t0\t9\t45\ntests\t124\t170\t170\n")
    _write(f"{out}/a-facts.json", {"device": "NVIDIA H200", "nvidia_smi": "NVIDIA H200, 570.1", "commit": "abc",
                                   "packages": {"torch": "2.11.0"}})
    _write(f"{out}/a-ipc.json", {"device": "cuda", "peer_writes": {"ok": True, "bytes_equal": True},
                                 "peer_reads": {"ok": True, "bytes_equal": True},
                                 "same_process_raw_open": {"refused": True, "error": "RuntimeError: invalid context"},
                                 "same_process_moeflow_open": {"own_tensor": True}})
    _write(f"{out}/a-tests.xml", '<testsuites><testsuite><testcase classname="t" name="a"/>'
                                 '<testcase classname="t" name="c"><failure/></testcase></testsuite></testsuites>')
    assert gpu_probe.main(["summary", out, "a"]) == 0
    md = open(f"{out}/a-summary.md").read()
    assert "| tests | 124 (timed out) | 170 (170) |" in md and "NVIDIA H200" in md and "commit abc" in md
    assert "refused (RuntimeError: invalid context)" in md and "its own tensor" in md
    assert "1 passed, 1 failed" in md and "failed: t::c" in md and md.rstrip().endswith("overall: FAILED")
