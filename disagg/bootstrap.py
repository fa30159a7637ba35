"""The bootstrap channel: the prefill server binds a ZMQ ROUTER on
`--disaggregation-bootstrap-port`; each decode server connects one DEALER per prefill server
it hears of (from the `bootstrap_host/port` a request carries). Decode sends `KVRegister` (and
`KVCancel` when it gives a room up), prefill answers `KVTransferDone` (or `KVCancelAck`) on
the same connection; one connection keeps a room's messages in order. Messages are pickled
dataclasses from `disagg/base.py`.
"""

from __future__ import annotations

from typing import Any

import zmq


class BootstrapServer:
    """Prefill side."""

    def __init__(self, host: str, port: int) -> None:
        # The process-wide context: a private one would block in term() when garbage
        # collected with this socket still open.
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{host}:{port}")

    def recv_all(self) -> list[tuple[bytes, Any]]:
        out = []
        while True:
            try:
                identity, payload = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append((identity, _loads(payload)))

    def send(self, identity: bytes, msg: Any) -> None:
        self.sock.send_multipart([identity, _dumps(msg)])

    def close(self) -> None:
        self.sock.close()


class BootstrapClient:
    """Decode side: one DEALER per prefill bootstrap address."""

    def __init__(self) -> None:
        self.dealers: dict[tuple[str, int], zmq.Socket] = {}

    def send(self, host: str, port: int, msg: Any) -> None:
        sock = self.dealers.get((host, port))
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
            self.dealers[(host, port)] = sock
        sock.send(_dumps(msg))

    def recv_all(self) -> list[Any]:
        out = []
        for sock in self.dealers.values():
            while True:
                try:
                    out.append(_loads(sock.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return out


def _dumps(msg: Any) -> bytes:
    import pickle

    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _loads(data: bytes) -> Any:
    import pickle

    return pickle.loads(data)
