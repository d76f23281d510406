"""One-sided communication (ASAP 3.2): buffers of regions x lanes x slots, and tensors through them.

Knows nothing of requests or models. Start with ``transport.py`` (the nouns, how each mode maps
onto them, the dispatch/combine primitives and their contract), then ``mailbox.py`` (the shared
buffer and its slot protocol).
"""
from moeflow.comm import cuda_ipc, dist, handshake, links, p2p, pairs, reference, shm  # noqa: F401  (register the transports)
from moeflow.comm.config import CommConfig
from moeflow.comm.message import (CombineMessage, CombineSegment, DispatchMessage, DispatchRow, ProtocolError,
                                  SendStats)
from moeflow.comm.segment import cleanup, list_segments
from moeflow.layout.comm_spec import CommSpec
from moeflow.comm.transport import TRANSPORTS, Transport, mailbox_bytes, make_transport
from moeflow.comm.wait import POLICIES, WaitPolicy

__all__ = ["CommConfig", "CommSpec", "WaitPolicy", "POLICIES", "Transport", "TRANSPORTS", "make_transport", "mailbox_bytes",
           "DispatchMessage", "DispatchRow", "CombineMessage", "CombineSegment", "SendStats", "ProtocolError",
           "cleanup", "list_segments"]
