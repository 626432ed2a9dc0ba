"""The wire between a front end and its engine cores: frames, authentication, handshake.

A core process connects to its front end (a Unix-domain socket for a core the front end
spawned, TCP for a core started with ``serve --headless`` on another machine). Everything
after the handshake travels as length-prefixed frames::

    +----------------+---------------------------------------------+
    | length: u32 BE | msgpack payload: a tuple of messages        |
    +----------------+---------------------------------------------+

A frame carries every message one side had ready when it wrote: a core writes one frame a
step (the step's :class:`~engine.messages.StepOutputs` for all its requests, the aborts it
made, and a :class:`~engine.messages.CoreStatistics`), never one per token.

Handshake, before any msgpack is decoded::

    front end                                   core
      | -- nonce (32 raw bytes) ------------------> |
      | <-------- HMAC-SHA256(secret, nonce) ------ |   (32 raw bytes; a wrong one: dropped)
      | <-------- frame: (CoreHello,) ------------- |   (the front end checks it, see below)
      | -- frame: (CoreAccepted,) ----------------> |
      | <== frames both ways until either closes => |

Frames from a peer are bounded (``max_frame_bytes``; nesting by msgpack's own unpacker
stack, 1024 levels, past which it raises; no extension types), and decoding builds nothing but the types registered in
:mod:`engine.messages`: a frame whose top level is anything but a tuple of messages is a
:class:`WireError`, and so is an unknown type or field.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import trio

from engine import messages
from engine.messages import CoreHello

HEADER = struct.Struct("!I")
NONCE_BYTES = 32
DIGEST_BYTES = hashlib.sha256().digest_size
# A frame holds one step's outputs or a batch of admitted requests; the largest is a
# request whose prompt fills a long context (1M tokens at ~5 bytes each packed is 5 MB,
# with its detokenizer twin). 64 MiB bounds what a peer can make us buffer.
DEFAULT_MAX_FRAME_BYTES = 64 * 2**20


class WireError(Exception):
    """A peer broke the protocol: bad length, bad msgpack, unknown message, bad secret."""


def new_secret() -> bytes:
    """A random secret for a front end whose cores are all its own children (text: it
    travels to them in an environment variable)."""
    return os.urandom(32).hex().encode()


def auth_digest(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


class FrameStream:
    """Frames over a trio stream. ``send`` may be called from several tasks (a lock keeps
    frames whole); ``receive`` from one."""

    def __init__(self, stream: trio.abc.Stream, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.stream = stream
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._send_lock = trio.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.frames_received = 0

    async def receive_exactly(self, n: int) -> bytes:
        """``n`` raw bytes; raises :class:`EOFError` if the peer closed first."""
        while len(self._buffer) < n:
            chunk = await self.stream.receive_some(max(65536, n - len(self._buffer)))
            if not chunk:
                raise EOFError("the peer closed the connection")
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    async def send_raw(self, data: bytes) -> None:
        async with self._send_lock:
            await self.stream.send_all(data)

    async def send(self, batch: tuple[object, ...]) -> None:
        """Pack ``batch`` (messages) as one frame and write it."""
        payload = messages.pack(tuple(batch))
        if len(payload) > self.max_frame_bytes and len(batch) > 1:
            # Several admitted requests with images can outgrow one frame together: send
            # the batch as more frames, in order (one message alone must still fit).
            half = len(batch) // 2
            await self.send(tuple(batch[:half]))
            await self.send(tuple(batch[half:]))
            return
        if len(payload) > self.max_frame_bytes:
            raise WireError(f"a frame of {len(payload)} bytes exceeds the limit of "
                            f"{self.max_frame_bytes}")
        frame = HEADER.pack(len(payload)) + payload
        lock = self._send_lock
        if type(self.stream) is trio.SocketStream and not lock.locked():
            # Nobody else is writing: the kernel takes the frame now, without the lock's
            # and trio's send checkpoints (a pass of the run loop each, every step). What
            # the socket does not take follows under the lock, taken here with no
            # checkpoint in between, so no other frame can come between the two parts.
            try:
                frame = frame[os.write(self.stream.socket.fileno(), frame):]
            except OSError:
                pass  # send_all below meets the same error and raises it as trio does
            if frame:
                lock.acquire_nowait()
                try:
                    await self.stream.send_all(frame)
                finally:
                    lock.release()
        else:
            async with lock:
                await self.stream.send_all(frame)
        self.bytes_sent += HEADER.size + len(payload)
        self.frames_sent += 1

    async def receive(self) -> tuple[object, ...]:
        """The next frame's messages; :class:`EOFError` when the peer closed cleanly,
        :class:`WireError` for a frame that breaks the protocol."""
        (length,) = HEADER.unpack(await self.receive_exactly(HEADER.size))
        if length > self.max_frame_bytes:
            raise WireError(f"the peer announced a frame of {length} bytes; the limit is "
                            f"{self.max_frame_bytes}")
        payload = await self.receive_exactly(length)
        self.bytes_received += HEADER.size + length
        self.frames_received += 1
        return decode_frame(payload, self.max_frame_bytes)

    async def aclose(self) -> None:
        await self.stream.aclose()


def decode_frame(payload: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> tuple[object, ...]:
    """A frame's messages, or :class:`WireError`: never anything but message types."""
    import msgpack

    try:
        batch = msgpack.unpackb(
            payload, object_hook=messages.from_builtin, use_list=False, raw=False,
            strict_map_key=True, max_bin_len=max_bytes, max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError, RecursionError) as exc:
        raise WireError(f"undecodable frame: {exc}") from None
    if not isinstance(batch, tuple) or not all(messages.is_message(m) for m in batch):
        raise WireError("a frame must be a tuple of messages")
    return batch


# --- the handshake --------------------------------------------------------------------------


async def authenticate_peer(frames: FrameStream, secret: bytes) -> None:
    """Front end side: challenge the peer; :class:`WireError` if it does not know ``secret``.
    Nothing the peer sends is decoded before this returns."""
    nonce = os.urandom(NONCE_BYTES)
    await frames.send_raw(nonce)
    answer = await frames.receive_exactly(DIGEST_BYTES)
    if not hmac.compare_digest(answer, auth_digest(secret, nonce)):
        raise WireError("the peer does not know the shared secret")


async def answer_challenge(frames: FrameStream, secret: bytes) -> None:
    """Core side of :func:`authenticate_peer`."""
    nonce = await frames.receive_exactly(NONCE_BYTES)
    await frames.send_raw(auth_digest(secret, nonce))


def hello_mismatch(expected: CoreHello, got: CoreHello) -> str | None:
    """What differs between two cores' announcements that a front end cannot serve
    across (None when they agree). The core's address and KV pool placement may differ;
    its model, limits and the engine's version may not (each core's KV pool is its own,
    so the pool sizes may differ)."""
    fields = ("version", "model", "served_model_name", "max_model_len", "vocab_size",
              "block_size", "eos_token_ids", "dtype", "quantization")
    diffs = [f"{name}: {getattr(expected, name)!r} here, {getattr(got, name)!r} from the core"
             for name in fields if getattr(expected, name) != getattr(got, name)]
    return "; ".join(diffs) or None


async def connect(address: str) -> trio.abc.Stream:
    """``unix:PATH`` or ``tcp:HOST:PORT`` (``HOST:PORT`` alone means TCP)."""
    if address.startswith("unix:"):
        return await trio.open_unix_socket(address.removeprefix("unix:"))
    host, _, port = address.removeprefix("tcp:").rpartition(":")
    return await trio.open_tcp_stream(host.strip("[]"), int(port))
