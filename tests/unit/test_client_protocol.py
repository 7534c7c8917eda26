"""Framing of the attach protocol: length-prefixed JSON with descriptors, and what a receiver refuses."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from ferry.client import protocol as p

pytestmark = pytest.mark.unit


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_round_trip_with_descriptors(pair):
    a, b = pair
    r, w = os.pipe()
    p.send_frame(a, {"op": "x", "n": [1, 2]}, [r, w])
    p.send_frame(a, {"op": "y"})  # a second frame does not pick up the first one's descriptors
    message, fds = p.recv_frame(b, max_bytes=1024, max_fds=2)
    assert message == {"op": "x", "n": [1, 2]} and len(fds) == 2
    os.write(w, b"hi")
    assert os.read(fds[0], 2) == b"hi"  # the received descriptor is the same pipe
    assert p.recv_frame(b, max_bytes=1024, max_fds=2) == ({"op": "y"}, [])
    p.close_all(fds)
    os.close(r)
    os.close(w)
    a.close()
    with pytest.raises(p.Closed):
        p.recv_frame(b, max_bytes=1024)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (struct.pack(">I", 1 << 30), "at most 1024"),
        (struct.pack(">I", 3) + b"\xff\xfe\x00", "not JSON"),
        (struct.pack(">I", 4) + b"null", "not a JSON object"),
        (struct.pack(">I", 9) + b"{}", "mid-frame"),
        (b"\x00\x00", "mid-frame"),
    ],
)
def test_broken_frames(pair, data, match):
    a, b = pair
    a.sendall(data)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(p.ProtocolError, match=match):
        p.recv_frame(b, max_bytes=1024)


def test_more_descriptors_than_allowed_are_closed_and_refused(pair):
    a, b = pair
    pipes = [os.pipe() for _ in range(3)]
    p.send_frame(a, {}, [fd for pipe in pipes for fd in pipe])
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(p.ProtocolError, match="descriptors"):
        p.recv_frame(b, max_bytes=1024, max_fds=2)
    assert len(os.listdir("/proc/self/fd")) == before  # nothing received is leaked
    for pipe in pipes:
        for fd in pipe:
            os.close(fd)


def test_a_sender_cannot_exceed_scm_max_fd(pair):
    with pytest.raises(ValueError, match="253"):
        p.send_frame(pair[0], {}, list(range(p.MAX_FDS + 1)))
