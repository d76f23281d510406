"""The first steps of ``verify/gpu_run.sh a``: what the machine is, and whether CUDA IPC behaves as
moeflow relies on, before any moeflow test runs.

    python3 verify/gpu_probe.py facts FILE.json   # versions, the device, nvidia-smi, /dev/shm, the commit
    python3 verify/gpu_probe.py ipc FILE.json     # the CUDA-IPC probe (about 20 s)
    python3 verify/gpu_probe.py summary OUT a|b   # OUT/<call>-summary.md from what the call wrote

The IPC probe (the facts the transports stand on): an owner allocates device memory and exports it;
(1) a second process spawned from it opens the handle, writes, synchronises, and the owner reads the
bytes; (2) a third one reads what the owner wrote; (3) the owner opens its own handle once through
``torch``'s rebuild (CUDA refuses it; moeflow never does it: ``comm/ipc_memory.py``) and once through
moeflow's ``IpcMemory.open`` (its own tensor). Each outcome is recorded, refused or not, with the
error: the probe reports, it does not fail on what CUDA says.

With ``--rehearse`` (any machine): the same steps over ``ipc_memory``'s host rehearsal.
Standard library at the top: torch and moeflow are imported inside the commands.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
    """The commit the copy was made at: git where the tree has it (a ``.gpu-commit`` left from an
    earlier copy must not name this one), else ``.gpu-commit`` (written where git is and carried
    to the GPU machine, which has no .git), else unknown."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    path = os.path.join(ROOT, ".gpu-commit")
    return open(path).read().strip() if os.path.exists(path) else "unknown"


def cmd_facts(path: str) -> int:
    import gpu_check

    info = gpu_check.machine()
    info["commit"] = commit()
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    info["dev_shm_gib"] = None if shm is None else {"total": round(shm.total / 2**30, 1), "free": round(shm.free / 2**30, 1)}
    info["cpus"], info["kernel"] = os.cpu_count(), platform.release()
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    for k, v in info.items():
        print(f"{k}: {v}", flush=True)
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
    return 0


def _device() -> str:
    return "cpu" if os.environ.get("MOEFLOW_GPU_REHEARSAL") else "cuda"


def _child(handle: bytes, op: str, q) -> None:
    """A process that opens ``handle`` and writes (``op`` "write") or reads it."""
    import torch

    from moeflow.comm.ipc_memory import IpcMemory

    try:
        t0 = time.perf_counter()
        mem = IpcMemory.open(handle)
        opened_s = time.perf_counter() - t0
        if op == "write":
            mem.tensor[:1 << 20].copy_(torch.arange(1 << 20, device=mem.tensor.device) % 251)
            if mem.tensor.device.type == "cuda":
                torch.cuda.synchronize()
            q.put({"ok": True, "open_s": opened_s})
        else:
            q.put({"ok": True, "open_s": opened_s, "sum": int(mem.tensor[:1 << 20].sum())})
        mem.close()
    except Exception as e:  # noqa: BLE001  (reported, not raised: the probe records what happened)
        q.put({"ok": False, "error": f"{type(e).__name__}: {e}"})


def cmd_ipc(path: str) -> int:
    import pickle

    import torch

    from moeflow.comm.ipc_memory import IpcMemory

    device = _device()
    out: dict = {"device": device, "torch": torch.__version__}
    mem = IpcMemory.allocate(64 << 20, device, f"/dev/shm/moeflow-{os.getpid()}-probe.mem")
    mem.tensor.zero_()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    for name, op in (("peer_writes", "write"), ("peer_reads", "read")):
        if op == "read":
            mem.tensor[:1 << 20].fill_(3)
            if device == "cuda":
                torch.cuda.synchronize()
        t0 = time.perf_counter()
        p = ctx.Process(target=_child, args=(mem.handle, op, q))
        p.start()
        try:
            got = q.get(timeout=60)
        except Exception as e:  # noqa: BLE001
            got = {"ok": False, "error": f"no answer: {type(e).__name__}"}
        p.join(10)
        got["spawn_to_answer_s"] = round(time.perf_counter() - t0, 3)
        if op == "write" and got.get("ok"):
            want = (torch.arange(1 << 20, device=mem.tensor.device) % 251).to(torch.uint8)
            got["bytes_equal"] = bool(torch.equal(mem.tensor[:1 << 20], want))
        if op == "read" and got.get("ok"):
            got["bytes_equal"] = got.pop("sum") == 3 << 20
        out[name] = got
    try:  # what CUDA says to an owner opening its own handle without moeflow's registry
        obj = pickle.loads(mem.handle)
        if device == "cuda":
            rebuild, args = obj
            rebuild(*args)
        else:
            from moeflow.comm import ipc_memory

            own = ipc_memory._OWN.pop(mem.handle)
            try:
                IpcMemory.open(mem.handle)
            finally:
                ipc_memory._OWN[mem.handle] = own
        out["same_process_raw_open"] = {"refused": False}
    except Exception as e:  # noqa: BLE001
        out["same_process_raw_open"] = {"refused": True, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    own = IpcMemory.open(mem.handle)
    out["same_process_moeflow_open"] = {"own_tensor": own.tensor.data_ptr() == mem.tensor.data_ptr()}
    mem.close()
    out["ok"] = all(out[k].get("ok") and out[k].get("bytes_equal") for k in ("peer_writes", "peer_reads")) \
        and out["same_process_moeflow_open"]["own_tensor"]
    print(json.dumps(out, indent=1), flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if out["ok"] else 1


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def cmd_summary(out: str, part: str) -> int:
    """``OUT/<part>-summary.md``: the steps, then what each wrote, in a few lines."""
    import gpu_check

    steps = []
    for line in open(os.path.join(out, f"{part}-steps.tsv")):
        name, rc, seconds, limit = line.rstrip("\n").split("\t")
        steps.append((name, int(rc), int(seconds), int(limit)))
    lines = [f"# GPU run, call {part}", "", "| step | exit | seconds (limit) |", "|---|---|---|"]
    lines += [f"| {n} | {rc}{' (timed out)' if rc == 124 else ''} | {s} ({lim}) |" for n, rc, s, lim in steps]
    facts = _load(os.path.join(out, "a-facts.json")) if part == "a" else None
    if facts:
        pk = facts.get("packages", {})
        lines += ["", f"device: {facts.get('device', 'none')} ({facts.get('nvidia_smi')}); torch {pk.get('torch')} CUDA "
                      f"{facts.get('torch_cuda')}, triton {pk.get('triton')}, pytest {pk.get('pytest')}, python "
                      f"{facts.get('python')}; /dev/shm {facts.get('dev_shm_gib')} GiB; commit {facts.get('commit')}"]
    ipc = _load(os.path.join(out, "a-ipc.json")) if part == "a" else None
    if ipc:
        raw = ipc.get("same_process_raw_open", {})
        lines += ["", f"CUDA-IPC probe ({ipc.get('device')}): a peer writes {_ok(ipc.get('peer_writes'))}, a peer reads "
                      f"{_ok(ipc.get('peer_reads'))}; the owner opening its own handle: "
                      f"{'refused (' + raw.get('error', '') + ')' if raw.get('refused') else 'allowed'}; through "
                      f"moeflow: {'its own tensor' if ipc.get('same_process_moeflow_open', {}).get('own_tensor') else 'NOT its own'}"]
    for name in ("a-ceilings.json", "b-roofline.json"):
        c = (_load(os.path.join(out, name)) or {}).get("ceilings")
        if c:
            gemm, copy = c.get("gemm") or {}, c.get("copy") or {}
            lines += ["", f"ceilings ({name}): GEMM {_rate(gemm.get('flop_per_s'), 'FLOP/s')}, copy "
                          f"{_rate(copy.get('bytes_per_s'), 'B/s')}"]
    tests = gpu_check._test_counts(out, f"{part}-tests.xml") if part == "a" else None
    if tests:
        lines += ["", f"tests: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped, "
                      f"{tests['errors']} errors" + "".join(f"\n- failed: {i}" for i in tests["failed_ids"])]
    for name in ("b-roofline.md", "b-decode.md"):
        if os.path.exists(os.path.join(out, name)):
            lines += ["", f"see {name}"]
    ok = bool(steps) and all(rc == 0 for _, rc, _, _ in steps)
    lines += ["", f"overall: {'ok' if ok else 'FAILED'}", ""]
    md = "\n".join(lines)
    with open(os.path.join(out, f"{part}-summary.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def _rate(x, unit: str) -> str:
    if not x:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:.1f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _ok(r: dict | None) -> str:
    if not r:
        return "not run"
    if not r.get("ok"):
        return f"FAILED ({r.get('error')})"
    return f"ok (bytes {'equal' if r.get('bytes_equal') else 'DIFFER'}, {r.get('spawn_to_answer_s')} s)"


def main(argv: list[str]) -> int:
    if "--rehearse" in argv:
        argv = [a for a in argv if a != "--rehearse"]
        os.environ["MOEFLOW_GPU_REHEARSAL"] = "1"
    if len(argv) == 2 and argv[0] == "facts":
        return cmd_facts(argv[1])
    if len(argv) == 2 and argv[0] == "ipc":
        return cmd_ipc(argv[1])
    if len(argv) == 3 and argv[0] == "summary":
        return cmd_summary(argv[1], argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
