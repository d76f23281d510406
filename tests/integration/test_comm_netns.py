"""Two hosts: network namespaces joined by a veth pair, one rank in each, exchanging dispatch and
combine traffic over torch.distributed (gloo). Needs root and ``ip``; skipped otherwise."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
from comm_harness import NETNS_PLAN, assert_matches_reference, netns_spec
from netns import two_hosts

from moeflow.comm import CommConfig

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "comm_harness.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HARNESS)))


@pytest.fixture(scope="module")
def hosts():
    """(namespace, veth, address) for host A and host B; both removed afterwards."""
    with two_hosts() as (a, b):
        yield (a.netns, a.dev, a.addr), (b.netns, b.dev, b.addr)


@pytest.mark.parametrize("transport", ["dist", "p2p"])
def test_dispatch_and_combine_across_namespaces(hosts, transport, tmp_path):
    (ns_a, dev_a, addr_a), (ns_b, dev_b, _) = hosts
    init = f"tcp://{addr_a}:29533"
    procs = []
    try:
        for (ns, dev), role in (((ns_a, dev_a), "attention"), ((ns_b, dev_b), "moe")):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": dev}  # gloo's interface is chosen by env only
            cmd = ["ip", "netns", "exec", ns, sys.executable, HARNESS, role, "0", transport, init,
                   str(tmp_path / f"{role}.pkl")]
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    logs = []
    for role in ("attention", "moe"):
        with open(tmp_path / f"{role}.pkl", "rb") as f:
            logs += pickle.load(f)["log"]
    n = assert_matches_reference(CommConfig(netns_spec(), transport=transport), NETNS_PLAN, logs)
    print(f"netns {transport}: {n} messages between {addr_a} and its peer")
    assert n >= 2 * NETNS_PLAN.num_batches
