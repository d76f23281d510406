"""C++ CPU extensions (torch operators) built on first use, keyed by their source and this CPU.

NOTE: ``-march=native`` code built on one processor can crash on another (an AVX-512 build runs
into SIGILL on an AVX2 machine), and the processor changes between sessions while the cache
directory stays. And torch's build file names torch's headers and libraries by their install path,
so two environments with the same torch version (two venvs, a CI clone's) that shared a directory
made ninja rebuild whenever the other one had used it last (41 s restarts). So the build
directory's name hashes everything the build file and the compiled code depend on
(``build_inputs``: source, flags, compiler binary, CPU model and flags, torch's version and path,
Python's version and headers): another CPU, source or environment builds afresh in its own
directory, the same one loads what is cached. Every build, and any rebuild ninja still decides on,
is logged with its reason.

Worker processes may build at once. torch serializes them with a lock file, but a builder that
was killed leaves that file behind and every later process would wait on it forever; so each
builder first takes an ``flock`` (which the kernel releases when its holder dies) and, holding
it, deletes a lock file nobody can own any more. A failed build leaves ``FAILED`` with the
compiler's output; later processes report it instead of rebuilding (delete the directory to retry).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import sysconfig
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moeflow.hardware.cpuinfo import cpu_flags, cpu_model
from moeflow.logs import get_logger
from moeflow.settings import cxx_compiler, extension_dir

log = get_logger("moeflow.model.extension")

# -ffp-contract=fast: fuse a * b + c into one FMA (torch builds with -std=c++17, where GCC's default is off);
# -fopenmp: at::parallel_for is inline OpenMP, and the library then shares torch's libgomp.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp")
LDFLAGS = ("-fopenmp",)


class ExtensionError(RuntimeError):
    """The extension cannot be built or loaded here; the message says why."""


@dataclass(frozen=True)
class Extension:
    library: str  # path of the loaded shared library
    build_dir: str
    load_s: float  # time to build (on first use for this source and CPU) or to load the cached build
    built: bool  # this process compiled it; False: a cached build was loaded


def build_inputs(source: str, cflags: tuple[str, ...], cxx: str) -> dict[str, str]:
    """What the build file and the compiled code depend on, by name (``INPUTS.json`` of a build)."""
    path = shutil.which(cxx) or cxx
    try:
        st = os.stat(os.path.realpath(path))
        compiler = f"{os.path.realpath(path)} ({st.st_size} bytes, mtime {st.st_mtime_ns})"  # an upgrade changes it
    except OSError:
        compiler = path
    return {"source_sha256": hashlib.sha256(source.encode()).hexdigest(), "cflags": " ".join(cflags),
            "compiler": compiler, "cpu": cpu_model(), "cpu_flags": " ".join(sorted(cpu_flags())),
            "torch": torch.__version__, "torch_dir": os.path.dirname(os.path.abspath(torch.__file__)),
            "python": platform.python_version(), "python_include": sysconfig.get_paths()["include"],
            "machine": platform.machine()}


def build_key(source: str, cflags: tuple[str, ...], cxx: str) -> str:
    return hashlib.sha256(json.dumps(build_inputs(source, cflags, cxx), sort_keys=True).encode()).hexdigest()


def _mtime_ns(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None


@contextmanager
def _flock(path: str):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel if this process dies while building
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_extension(name: str, source_path: str) -> Extension:
    """Build (once per source and CPU) and load the operators of ``source_path``; raises ExtensionError."""
    from torch.utils import cpp_extension

    cxx = cxx_compiler()
    if shutil.which(cxx) is None:
        raise ExtensionError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX or install g++)")
    if shutil.which("ninja") is None:
        raise ExtensionError("ninja is not on PATH (torch builds extensions with it)")
    with open(source_path) as f:
        source = f.read()
    inputs = build_inputs(source, CFLAGS, cxx)
    build_dir = os.path.join(extension_dir(), f"{name}_{build_key(source, CFLAGS, cxx)[:16]}")
    os.makedirs(build_dir, exist_ok=True)
    failed = os.path.join(build_dir, "FAILED")
    library = os.path.join(build_dir, f"{name}.so")
    with _flock(os.path.join(build_dir, "build.flock")):
        if os.path.exists(failed):
            with open(failed) as f:
                first = f.readline().strip()
            raise ExtensionError(f"an earlier build failed ({failed}; delete {build_dir} to retry): {first}")
        baton = os.path.join(build_dir, "lock")
        if os.path.exists(baton):  # NOTE: we hold the flock, so its builder is gone
            log.warning("removing the lock file %s left by a build that did not finish", baton)
            os.remove(baton)
        before = _mtime_ns(library)
        if before is None:
            log.info("building the %s extension in %s (tens of seconds): no build yet for this source, CPU, "
                     "compiler and torch at %s", name, build_dir, inputs["torch_dir"])
        # NOTE: torch's build file names the source by its path, and a changed path rebuilds: two
        # checkouts of one source (worktrees, CI clones) would rebuild each other's cache in turn.
        # The build directory's own copy has one path for every checkout of this source.
        local = os.path.join(build_dir, os.path.basename(source_path))
        if not os.path.exists(local):
            with open(local + ".tmp", "w") as f:
                f.write(source)
            os.replace(local + ".tmp", local)
        t0 = time.perf_counter()
        try:
            cpp_extension.load(name=name, sources=[local], extra_cflags=list(CFLAGS),
                               extra_ldflags=list(LDFLAGS), build_directory=build_dir, is_python_module=False,
                               verbose=False)
        except Exception as e:  # a compiler error, a missing header, a library that will not load
            with open(failed, "w") as f:
                f.write(f"{type(e).__name__}: {e}\n")
            raise ExtensionError(f"building {name} failed (output in {failed}): "
                                 f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e
        load_s = time.perf_counter() - t0
        built = _mtime_ns(library) != before
        if built:
            recorded = os.path.join(build_dir, "INPUTS.json")
            if before is not None:  # under the same key: a header or the build file changed in place
                log.warning("rebuilt the %s extension in %s (%.1f s): ninja found its build file or a file it "
                            "depends on changed since the last build (same source, flags, CPU, compiler and "
                            "torch at %s)", name, build_dir, load_s, inputs["torch_dir"])
            else:
                log.info("built the %s extension in %.1f s", name, load_s)
            with open(recorded + ".tmp", "w") as f:
                json.dump(inputs, f, indent=1, sort_keys=True)
            os.replace(recorded + ".tmp", recorded)
    return Extension(library, build_dir, load_s, built)
