"""A raw HTTP/2 client (prior knowledge, over a plain socket) that reads frames but never
acknowledges data: it opens a flow-control window of the size it is given and never
widens it. For the tests of clients that do not let the server write."""

from __future__ import annotations

import json
import socket
import time

import h2.config
import h2.connection
import h2.events
import h2.settings


class H2Client:
    def __init__(self, address: tuple[str, int], window: int = 0) -> None:
        self.sock = socket.create_connection(address)
        self.sock.settimeout(0.1)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.events: list[h2.events.Event] = []
        self.closed = False

    def request(self, body: dict, path: str = "/v1/completions") -> int:
        data = json.dumps(body).encode()
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, [
            (":method", "POST"), (":path", path), (":scheme", "http"),
            (":authority", "x"), ("content-type", "application/json"),
            ("content-length", str(len(data)))])
        self.conn.send_data(stream_id, data, end_stream=True)
        return stream_id

    def flush(self) -> None:
        data = self.conn.data_to_send()
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.closed = True  # the server closed first: what it sent is still read

    def pump(self, until: float) -> None:
        """Read frames (never acknowledging data) until ``until`` or the connection ends."""
        while time.monotonic() < until:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                data = b""
            if not data:
                self.closed = True
                break
            self.events.extend(self.conn.receive_data(data))
            self.flush()  # SETTINGS and PING acknowledgements only

    def pump_until_reset(self, streams: list[int], deadline: float) -> None:
        """Pump until every one of ``streams`` is reset, the connection ends, or ``deadline``."""
        while (not set(streams) <= set(self.resets()) and not self.closed
               and time.monotonic() < deadline):
            self.pump(min(deadline, time.monotonic() + 0.2))

    def resets(self) -> dict[int, int]:
        return {e.stream_id: e.error_code for e in self.events
                if isinstance(e, h2.events.StreamReset)}

    def received(self, stream_id: int) -> int:
        """Bytes of DATA received on ``stream_id``."""
        return sum(len(e.data) for e in self.events
                   if isinstance(e, h2.events.DataReceived) and e.stream_id == stream_id)

    def close(self) -> None:
        self.sock.close()
