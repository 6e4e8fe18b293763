"""A TCP proxy in front of the tests' S3 server (moto) that misbehaves on checkpoint uploads: every PUT below
`prefix` (the lease object aside) is held without an answer until the proxy closes ("stall": a stalled
bucket), or the first `count` of them are answered 400 ExpiredToken ("expire": credentials that expired
mid-run). Everything else passes through."""

import socket
import threading

EXPIRED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ExpiredToken</Code>'
           b"<Message>The provided token has expired.</Message></Error>")


class S3Proxy:
  def __init__(self, upstream: tuple[str, int], prefix: bytes, mode: str, count: int = 1):
    self.upstream, self.prefix, self.mode, self.left = upstream, prefix, mode, count
    self.listener = socket.create_server(("127.0.0.1", 0))
    self.port = self.listener.getsockname()[1]
    self.released = threading.Event()
    self.hits = 0  # uploads stalled or refused
    self._lock = threading.Lock()
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self):
    while True:
      try:
        client, _ = self.listener.accept()
      except OSError:
        return
      threading.Thread(target=self._serve, args=(client,), daemon=True).start()

  def _misbehave(self, data: bytes) -> bool:
    first_line = data.split(b"\r\n", 1)[0]
    if not data.startswith(b"PUT " + self.prefix) or b".maxtrain.lease" in first_line:
      return False
    with self._lock:
      if self.mode == "expire" and self.left <= 0:
        return False
      self.left -= 1
      self.hits += 1
    return True

  def _serve(self, client):
    upstream = socket.create_connection(self.upstream)
    threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
    with client, upstream:
      while data := client.recv(1 << 16):
        if self._misbehave(data):
          if self.mode == "stall":
            self.released.wait()  # the stall itself: no answer until the test ends
          else:
            client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/xml\r\nContent-Length: "
                           + str(len(EXPIRED)).encode() + b"\r\nConnection: close\r\n\r\n" + EXPIRED)
          return
        upstream.sendall(data)

  @staticmethod
  def _pump(source, sink):
    try:
      while data := source.recv(1 << 16):
        sink.sendall(data)
    except OSError:
      pass

  def close(self):
    self.released.set()
    self.listener.close()
