"""Two environments with the same torch (two venvs, a CI clone's) share the extension cache without
rebuilding each other's build: each builds once in its own directory, then only loads. Before,
torch's build file named torch's install path, the directory did not, and ninja rebuilt whenever
the other environment had used it last (restarts of 27-41 s instead of 3-6 s, nothing logged).
Environment B is this torch imported through a symlink: another install path, the same files. A
trivial source keeps the builds to about a second; torch's build file is the same kind."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = 'extern "C" int moeflow_cache_test_answer() { return 42; }\n'
PROBE = """
import json, os, sys
from moeflow.model.extension import load_extension
ext = load_extension("moeflow_cache_test", sys.argv[1])
print("RESULT " + json.dumps({"built": ext.built, "dir": ext.build_dir, "mtime": os.stat(ext.library).st_mtime_ns}))
"""


def _load(env: dict, source: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, source], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), out.stderr


@pytest.mark.slow  # two builds of the extension (~25 s): make test-slow
def test_two_environments_with_one_torch_do_not_rebuild_each_other(tmp_path):
    source = tmp_path / "cache_test.cpp"
    source.write_text(SOURCE)
    other = tmp_path / "env_b"
    other.mkdir()
    os.symlink(os.path.dirname(torch.__file__), other / "torch")  # torch at another path
    base = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "MOEFLOW_LOGGING_LEVEL": "INFO"}
    path = base.get("PYTHONPATH", "")
    envs = {"a": {**base, "PYTHONPATH": ROOT + os.pathsep + path},
            "b": {**base, "PYTHONPATH": str(other) + os.pathsep + ROOT + os.pathsep + path}}
    first = {k: _load(env, str(source)) for k, env in envs.items()}
    for k, (r, log) in first.items():
        assert r["built"] and "no build yet for this source" in log and str(other if k == "b" else "") in log, log
    assert first["a"][0]["dir"] != first["b"][0]["dir"]
    for k in ("a", "b"):  # each after the other: each only loads its own build
        r, log = _load(envs[k], str(source))
        assert not r["built"] and r["mtime"] == first[k][0]["mtime"] and "build" not in log, log
    # a rebuild ninja decides on under the same key is logged with its reason
    os.remove(os.path.join(first["a"][0]["dir"], ".ninja_log"))
    r, log = _load(envs["a"], str(source))
    assert r["built"] and "rebuilt the moeflow_cache_test extension" in log and "ninja found" in log, log
