"""Framed messages between the server and its worker processes.

Each message is a pickled object behind an 8-byte length, over a Unix
stream socket. Both ends are our own processes, so pickle is safe here.
"""

import pickle
import socket
import struct
import threading

_HEADER = struct.Struct("!Q")


class ChannelClosed(Exception):
    """The other end went away."""


class Channel:
    """A message channel over a connected socket; `send` is thread-safe."""

    def __init__(self, sock):
        """Wrap a connected stream socket."""
        self.sock = sock
        self._send_lock = threading.Lock()

    @classmethod
    def connect(cls, path):
        """Connect to the server's Unix socket at `path`."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        return cls(sock)

    def fileno(self):
        """The socket's descriptor (for select)."""
        return self.sock.fileno()

    def send(self, message):
        """Send one message; raises ChannelClosed if the peer is gone."""
        data = pickle.dumps(message, protocol=5)
        try:
            with self._send_lock:
                self.sock.sendall(_HEADER.pack(len(data)) + data)
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None

    def _read(self, n):
        """Read exactly n bytes."""
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:])
            except OSError as exc:
                raise ChannelClosed(str(exc)) from None
            if k == 0:
                raise ChannelClosed("end of stream")
            got += k
        return buf

    def recv(self):
        """Receive one message (blocking); raises ChannelClosed at end of stream."""
        (size,) = _HEADER.unpack(self._read(_HEADER.size))
        return pickle.loads(self._read(size))

    def close(self):
        """Close the socket."""
        try:
            self.sock.close()
        except OSError:
            pass
