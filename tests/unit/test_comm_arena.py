"""The payload-arena seam under the mailbox: flags and headers stay host words, the payload bytes
live in an arena, and every release store (flag, progress, clearing) first settles the arena's
copies. The deferred arena (copies land only at release, as on a CUDA stream) is the fake that
shows the ordering: a store made without the release publishes stale bytes."""
from __future__ import annotations

import uuid

import pytest
import torch

from moeflow.comm import CommConfig, CommSpec, cleanup
from moeflow.comm.arena import ARENAS, CudaIpcArena
from moeflow.comm.mailbox import Mailbox, MailboxLayout
from moeflow.comm.segment import segment_path
from moeflow.config import ConfigError

LAYOUT = dict(num_lanes=2, num_slots=2, header_words=4, rows=8, hidden=16, dtype="float32")


@pytest.fixture
def pair():
    """(reader, writer) of one deferred-arena mailbox, both ends in this process."""
    dep = f"a{uuid.uuid4().hex[:10]}"
    layout = MailboxLayout(**LAYOUT, arena="deferred")
    reader = Mailbox.create(segment_path(dep, "box"), layout)
    writer = Mailbox.attach(segment_path(dep, "box"), layout, timeout_s=5)
    yield reader, writer
    writer.close()
    reader.close()
    cleanup(dep)


def test_a_same_process_open_gets_the_owners_memory_and_any_other_is_refused_as_on_cuda(pair, tmp_path):
    """CUDA refuses to open a memory handle in the process that exported it; the owner's own writer
    (dep attaches every rank's mailbox, its own included) must get the owner's tensor instead. The
    rehearsal refuses a same-process open that bypasses that, and another process maps the memory."""
    import subprocess
    import sys

    from moeflow.comm import ipc_memory
    from moeflow.comm.ipc_memory import IpcMemory

    reader, writer = pair
    assert writer.arena.base.data_ptr() == reader.arena.base.data_ptr()  # not a second mapping
    mem = IpcMemory.allocate(4096, "cpu", segment_path(f"a{uuid.uuid4().hex[:10]}", "mem"))
    try:
        assert IpcMemory.open(mem.handle).tensor.data_ptr() == mem.tensor.data_ptr()
        own = ipc_memory._OWN.pop(mem.handle)  # as if the exporter had not kept it
        with pytest.raises(RuntimeError, match="cannot open a memory handle it exported itself"):
            IpcMemory.open(mem.handle)
        ipc_memory._OWN[mem.handle] = own
        script = ("import sys, torch; from moeflow.comm.ipc_memory import IpcMemory; "
                  "m = IpcMemory.open(bytes.fromhex(sys.argv[1])); m.tensor[:4] = torch.tensor([1, 2, 3, 4]); m.close()")
        p = subprocess.run([sys.executable, "-c", script, mem.handle.hex()], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert mem.tensor[:4].tolist() == [1, 2, 3, 4]
    finally:
        mem.close()
    assert ipc_memory.exported() == 1  # the pair's mailbox only


def test_the_flag_store_releases_the_writers_copy(pair):
    reader, writer = pair
    src = torch.arange(8 * 16, dtype=torch.float32).view(8, 16)
    writer.arena.copy_in(writer.payload(1, 1), src)
    assert reader.payload(1, 1).abs().sum() == 0, "the fake ran a copy before any release"
    writer.set_flag(1, 1, 1)
    assert reader.flag(1, 1) == 1 and torch.equal(reader.payload(1, 1), src)
    assert writer.arena.num_deferred == 1


def test_a_flag_stored_without_release_publishes_stale_bytes(pair):
    """What the fake catches: a writer that stores its flag without settling its copies."""
    reader, writer = pair
    writer.arena.copy_in(writer.payload(0, 1), torch.ones(8, 16))
    writer._words[writer._flag0 + 1] = 1  # a bare store: no arena.release() before it
    assert reader.flag(0, 1) == 1
    assert reader.payload(0, 1).abs().sum() == 0, "the reader saw the payload without a release"


def test_the_clearing_store_waits_for_the_readers_copy(pair):
    reader, writer = pair
    src = torch.full((8, 16), 3.0)
    writer.arena.copy_in(writer.payload(0, 0), src)
    writer.set_flag(0, 0, 2)
    private = torch.zeros(8, 16)
    reader.arena.copy_out(private, reader.payload(0, 0))
    assert private.sum() == 0
    reader.clear_flag(0, 0)  # the writer may overwrite the slot after this: the copy is done first
    assert torch.equal(private, src) and reader.flag(0, 0) == 0


def test_progress_stores_release_streamed_rows(pair):
    reader, writer = pair
    writer.arena.copy_in(writer.payload(0, 1)[:4], torch.ones(4, 16))
    writer.set_progress(0, 1, 1, 4)
    assert reader.progress(0, 1, 1) == 4 and reader.payload(0, 1)[:4].sum() == 64


def test_the_host_layout_is_unchanged_and_device_arenas_keep_payload_out_of_the_segment():
    host = MailboxLayout(**LAYOUT)
    headers_end = host.headers_offset + 2 * 2 * host.header_stride
    assert host.payload_offset == -(-headers_end // 4096) * 4096
    assert host.size_bytes == host.payload_offset + 2 * 2 * host.slot_bytes
    ipc = MailboxLayout(**LAYOUT, arena="cuda_ipc")
    assert ipc.size_bytes == ipc.payload_offset >= ipc.handle_offset + CudaIpcArena.handle_bytes
    assert host.key != ipc.key, "a writer of one arena must not attach to a mailbox of another"
    assert set(ARENAS) == {"host", "deferred", "cuda_ipc"}


def test_bad_arenas_are_refused_by_name():
    spec = CommSpec(num_regions=1, lanes_per_region=1, num_expert_ranks=1, num_experts=2, top_k=1, hidden_size=16,
                    max_batch_tokens=4)
    with pytest.raises(ConfigError, match="arena must be one of"):
        CommConfig(spec, arena="nvlink")
    with pytest.raises(ConfigError, match="transport 'dist' moves payloads through host memory"):
        CommConfig(spec, transport="dist", arena="deferred")
    with pytest.raises(ConfigError, match="compute_device must be a CUDA device, got 'cpu'"):
        CommConfig(spec, arena="cuda_ipc")
    with pytest.raises(ValueError, match="arena must be one of"):
        MailboxLayout(**LAYOUT, arena="gpu")
    with pytest.raises(ValueError, match="needs a CUDA compute device, got 'cpu'"):
        CudaIpcArena.allocate(MailboxLayout(**LAYOUT, arena="cuda_ipc"), "cpu", "/dev/shm/moeflow-x.box")


def test_the_cuda_transport_is_refused_where_it_cannot_run():
    from moeflow import LLM
    from moeflow.comm.cuda_weights import CudaIpcWeightStore

    with pytest.raises(ConfigError, match="transport 'cuda-ipc' keeps payloads in device memory: it needs device "
                                          "cuda, got 'cpu'"):
        LLM("tiny", mode="dep", dp=2, device="cpu", transport="cuda-ipc")
    spec = CommSpec(num_regions=1, lanes_per_region=1, num_expert_ranks=1, num_experts=2, top_k=1, hidden_size=16,
                    max_batch_tokens=4)
    with pytest.raises(ValueError, match="weight store needs a CUDA compute device .or the CPU, to rehearse., got 'meta'"):
        CudaIpcWeightStore(CommConfig(spec, transport="cuda-ipc", compute_device="meta"))
    from types import SimpleNamespace

    from moeflow.comm.cuda_ipc import check_engine
    from moeflow.config import ClusterConfig

    with pytest.raises(ConfigError, match="transport 'deferred' is cuda-ipc's rehearsal on the CPU: it needs device "
                                          "cpu, got 'cuda:0'"):
        check_engine(SimpleNamespace(transport="deferred", device="cuda:0", cluster=ClusterConfig()))
