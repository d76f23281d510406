"""afd's links in the simulator (sim/ports.py): a message holds its sender's out port and its
receiver's in port, FIFO, so a daemon fed by M instances takes M messages through one link."""
from __future__ import annotations

import pytest

from moeflow.sim.ports import Ports

LAT = 0.5


def test_a_daemon_takes_every_instances_rows_through_its_one_link():
    p = Ports(3, 1, 0.0)
    arrive = p.dispatch([0.0, 0.0, 0.0], [[0], [0], [0]], [1.0, 1.0, 1.0], LAT)
    assert arrive == [3.0 + LAT]  # three messages of 1 s in turn, then the latency
    assert p.daemon_in == [3.0] and p.inst_out == [1.0, 2.0, 3.0]


def test_one_instance_and_n_daemons_is_the_senders_link_alone():
    """What the simulator charged before the receivers' ports: latency + N x one message."""
    p = Ports(1, 4, 0.0)
    arrive = p.dispatch([2.0], [[0, 1, 2, 3]], [0.25], LAT)
    assert arrive == [2.25 + LAT, 2.5 + LAT, 2.75 + LAT, 3.0 + LAT]
    got = p.combine([5.0] * 4, [[0]] * 4, [0.5], LAT)
    assert got == [5.0 + 4 * 0.5 + LAT]


def test_messages_go_in_the_order_they_are_ready_and_wait_for_both_ports():
    p = Ports(2, 2, 0.0)
    # instance 1 is ready first: it takes both daemons' links before instance 0
    arrive = p.dispatch([1.0, 0.0], [[0, 1], [0, 1]], [1.0, 1.0], 0.0)
    # 1->d0 [0,1], 1->d1 [1,2]; 0->d0 [1,2] (ready at 1, d0 free at 1), 0->d1 [2,3]
    assert arrive == [2.0, 3.0]
    assert p.inst_out == [3.0, 2.0]


def test_a_daemon_answers_its_instances_in_turn_and_an_instance_waits_for_its_last_answer():
    p = Ports(3, 2, 0.0)
    got = p.combine([1.0, 4.0], [[0, 1, 2], [0, 1, 2]], [1.0, 1.0, 1.0], LAT)
    # d0 (done at 1) answers 0, 1, 2 over [1,2], [2,3], [3,4]; d1 (done at 4) over [4,5], [5,6], [6,7]
    assert got == [5.0 + LAT, 6.0 + LAT, 7.0 + LAT]


def test_ports_shift_with_the_timeline():
    """The afd step's periodic shortcut needs every port's time to move with a uniform shift."""
    a, b = Ports(2, 2, 0.0), Ports(2, 2, 10.0)
    ra = a.dispatch([1.0, 2.0], [[0, 1], [1]], [0.3, 0.7], LAT)
    rb = b.dispatch([11.0, 12.0], [[0, 1], [1]], [0.3, 0.7], LAT)
    assert rb == pytest.approx([x + 10 for x in ra])
    assert b.state() == pytest.approx([x + 10 for x in a.state()])


def test_a_daemon_nobody_sends_to_gets_nothing():
    p = Ports(1, 2, 0.0)
    assert p.dispatch([0.0], [[1]], [1.0], 0.0) == [float("-inf"), 1.0]
