"""Mirroring checkpoints to S3-compatible object storage.

Orbax writes each checkpoint to a local staging directory as usual (fast, atomic by rename); once a
step is complete on local disk it is uploaded in the background, file by file, and a marker object
`<prefix>/<step>/_MAXTRAIN_COMPLETE` is written last. A remote step without its marker is an
interrupted upload and is never restored. On resume, a step that exists only remotely is downloaded
into the staging directory first. The training loop never waits on the network except at exit.

Why not let Orbax/TensorStore write to S3 directly: on this kind of machine a local save completes
in well under a second and the upload then runs off the critical path; a direct write would turn
every network hiccup into a failed or slow save, and staging makes resume after a node restart
read locally when the disk survived. The endpoint comes from the standard AWS configuration
(`AWS_ENDPOINT_URL`, credentials, region), so MinIO, Ceph or a local test server work the same way.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

from maxtrain.errors import UserError

log = logging.getLogger("maxtrain")
MARKER = "_MAXTRAIN_COMPLETE"
CREDENTIAL_ATTEMPTS = 3  # an upload whose credentials expired: tried on fresh credentials this many times in all
_EXPIRED = ("ExpiredToken", "ExpiredTokenException", "RequestExpired", "TokenRefreshRequired", "InvalidToken")


def expired_credentials(error: BaseException) -> str | None:
  """The error code when `error` says the request's credentials expired, else None (boto3's upload_file wraps
  the ClientError in S3UploadFailedError, whose message names the code)."""
  response = getattr(error, "response", None)
  code = (response.get("Error") or {}).get("Code") if isinstance(response, dict) else None
  if code in _EXPIRED:
    return code
  text = str(error)
  return next((c for c in _EXPIRED if f"({c})" in text), None)


def staged_path(root: Path, key: str, rel: str) -> Path:
  """Where the object `key` (`rel` below the step's prefix) goes under `root`; UserError when the
  key would land outside it (an absolute part, `..`, `.` or an empty segment: `5//abs/path`)."""
  parts = rel.split("/")
  if not rel or any(p in ("", ".", "..") for p in parts) or "\\" in rel or "\0" in rel:
    raise UserError(f"checkpoint download: object key {key!r} does not name a file inside the checkpoint "
                    f"(empty, '.' or '..' segments); refusing to write it outside {root}. Remove the object "
                    "from the bucket or point checkpoint.dir elsewhere.")
  target = root.joinpath(*parts).resolve()
  if not target.is_relative_to(root.resolve()):
    raise UserError(f"checkpoint download: object key {key!r} resolves to {target}, outside {root}; refusing it")
  return target


class S3Bucket:
  """A checkpoint prefix in an S3-compatible bucket: its client (bounded waits, credentials read afresh when they
  expire), its complete steps (the marker written last), deleting, moving aside and downloading a step."""

  def __init__(self, url: str, connect_timeout_s: float = 10.0, read_timeout_s: float = 60.0, max_attempts: int = 5):
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
      raise UserError(f"checkpoint.dir={url!r}: expected s3://BUCKET/PREFIX")
    try:
      import boto3  # noqa: F401 - here for the clear error below; clients come from _new_client
      import botocore.exceptions
    except ImportError:
      raise UserError("checkpoint.dir is an s3:// URL but boto3 is not installed: pip install 'maxtrain[s3]'") from None
    self.url, self.bucket, self.prefix = url, parsed.netloc, parsed.path.strip("/")
    from botocore.config import Config

    # Explicit, bounded waits: botocore's defaults (60 s connect and read, retried) block for minutes on a
    # stalled endpoint before anything is said.
    self._config = Config(connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
                          retries={"total_max_attempts": max_attempts, "mode": "standard"})
    self._client = self._new_client()
    try:
      self._client.head_bucket(Bucket=self.bucket)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
      raise UserError(f"checkpoint.dir={url}: bucket {self.bucket!r} is not reachable ({e}); check the "
                      "bucket name, credentials and AWS_ENDPOINT_URL") from None

  def _new_client(self):
    """A client on a new session: the standard credential chain read afresh. Its web-identity, container,
    process and SSO credentials refresh themselves before they expire (botocore's refreshing providers);
    keys from the environment or the credentials file are read once per session, so an expired one is
    retried on a new session (`_with_fresh_credentials`), which picks up keys rotated in place."""
    import boto3

    return boto3.session.Session().client("s3", config=self._config)

  def _with_fresh_credentials(self, what: str, fn: Callable, *args):
    """`fn(*args)`, retried on a new client when the endpoint says the credentials expired."""
    for attempt in range(1, CREDENTIAL_ATTEMPTS + 1):
      try:
        return fn(*args)
      except Exception as e:  # noqa: BLE001 - only an expired credential is retried; the rest propagate
        code = expired_credentials(e)
        if code is None:
          raise
        if attempt == CREDENTIAL_ATTEMPTS:
          raise RuntimeError(f"{what}: the S3 credentials expired ({code}) and {CREDENTIAL_ATTEMPTS - 1} fresh "
                             "reads of the credential chain (environment, ~/.aws files, web identity, container, "
                             "process) did not renew them: renew the credentials or the role; the local checkpoint "
                             "is intact") from e
        log.warning("%s: the S3 credentials expired (%s); reading the credential chain afresh and retrying (%d/%d)",
                    what, code, attempt, CREDENTIAL_ATTEMPTS - 1)
        self._client = self._new_client()

  def _key(self, *parts: str) -> str:
    return "/".join(p for p in (self.prefix, *parts) if p)

  def complete_steps(self) -> list[int]:
    steps = []
    paginator = self._client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key("") + ("/" if self.prefix else ""),
                                   Delimiter="/"):
      for common in page.get("CommonPrefixes", []):
        name = common["Prefix"].rstrip("/").rsplit("/", 1)[-1]
        if name.isdigit() and self._exists(self._key(name, MARKER)):
          steps.append(int(name))
    return sorted(steps)

  def _exists(self, key: str) -> bool:
    return "Contents" in self._client.list_objects_v2(Bucket=self.bucket, Prefix=key, MaxKeys=1)

  def _delete(self, step: int) -> None:
    # The marker goes first: a half-deleted step is then an incomplete one, never restored.
    self._client.delete_object(Bucket=self.bucket, Key=self._key(str(step), MARKER))
    paginator = self._client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(str(step)) + "/"):
      for obj in page.get("Contents", []):
        self._client.delete_object(Bucket=self.bucket, Key=obj["Key"])

  def move_aside(self, step: int, name: str) -> str:
    """Moves a complete remote step to `<prefix>/<name>/` (server-side copies, then the step is deleted, its
    marker first): no longer a step number, so never listed, restored or rotated; nothing is lost."""
    paginator = self._client.get_paginator("list_objects_v2")
    prefix = self._key(str(step)) + "/"
    for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
      for obj in page.get("Contents", []):
        self._client.copy_object(Bucket=self.bucket, Key=self._key(name, obj["Key"][len(prefix):]),
                                 CopySource={"Bucket": self.bucket, "Key": obj["Key"]})
    self._delete(step)
    return f"s3://{self.bucket}/{self._key(name)}"

  def download(self, step: int, local_step_dir: Path) -> None:
    """Fetches a complete remote step into a temporary directory, renamed into place when done."""
    tmp = local_step_dir.with_name(f"{local_step_dir.name}.download-tmp")
    paginator = self._client.get_paginator("list_objects_v2")
    prefix = self._key(str(step)) + "/"
    for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
      for obj in page.get("Contents", []):
        rel = obj["Key"][len(prefix):]
        if rel == MARKER:
          continue
        target = staged_path(tmp, obj["Key"], rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._client.download_file(self.bucket, obj["Key"], str(target))
    tmp.rename(local_step_dir)

  def lease(self) -> "S3Lease":
    """Takes the prefix's lease (UserError naming the holder if another live run has it)."""
    return S3Lease(self).acquire()


class S3Mirror(S3Bucket):
  """Uploads complete local checkpoints in the background, one at a time, newest first when the bucket is behind;
  `on_progress` is called as each file is up (the watchdog watches the wait at exit)."""

  def __init__(self, url: str, connect_timeout_s: float = 10.0, read_timeout_s: float = 60.0, max_attempts: int = 5,
               on_progress: Callable[[], None] | None = None):
    super().__init__(url, connect_timeout_s, read_timeout_s, max_attempts)
    self.on_progress = on_progress or (lambda: None)
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="s3-upload")
    self._uploads: list[concurrent.futures.Future] = []
    self._uploaded: list[tuple[int, int, float]] = []  # (step, bytes, seconds) of finished uploads, not yet reported
    self._uploaded_lock = threading.Lock()
    self._queued: list[int] = []  # steps submitted and not yet started
    self._upload_step: dict[concurrent.futures.Future, tuple[int, threading.Event]] = {}  # step, cancelled
    self._marker_lock = threading.Lock()

  def upload(self, local_step_dir: Path, step: int, keep: list[int]) -> concurrent.futures.Future:
    """Uploads a complete local checkpoint in the background, then drops remote steps not in `keep`."""
    self._queued.append(step)
    cancelled = threading.Event()
    future = self._pool.submit(self._upload, local_step_dir, step, keep, cancelled)
    self._uploads.append(future)
    self._upload_step[future] = (step, cancelled)
    return future

  def cancel_after(self, step: int) -> list[int]:
    """Uploads of steps newer than `step` not finished yet will never be marked complete (a restore to `step`
    abandoned them); returns their steps. Once this returns, no such upload writes its marker."""
    with self._marker_lock:
      cancelled = []
      for future, (upload_step, flag) in self._upload_step.items():
        if upload_step > step and not future.done():
          flag.set()
          cancelled.append(upload_step)
      return cancelled

  def _upload(self, local_step_dir: Path, step: int, keep: list[int], cancelled: threading.Event) -> float:
    return self._with_fresh_credentials(f"upload of checkpoint step {step} to {self.url}", self._upload_once,
                                        local_step_dir, step, keep, cancelled)

  def _upload_once(self, local_step_dir: Path, step: int, keep: list[int], cancelled: threading.Event) -> float:
    if cancelled.is_set():
      return 0.0
    newer = [s for s in self._queued if s > step]
    if step in self._queued:  # (a retry finds it removed)
      self._queued.remove(step)
    if newer:  # a slow bucket: the newest step is what a restart needs; the older one is not sent
      log.warning("checkpoint step %d not uploaded to %s: step %d is already waiting (the bucket is behind)", step,
                  self.url, max(newer))
      return 0.0
    t0, num_bytes = time.monotonic(), 0
    for path in sorted(p for p in local_step_dir.rglob("*") if p.is_file()):
      self._client.upload_file(str(path), self.bucket, self._key(str(step), str(path.relative_to(local_step_dir))))
      num_bytes += path.stat().st_size
      self.on_progress()  # a file is up: the upload is moving (the watchdog watches the wait at exit)
    with self._marker_lock:  # the marker makes the step complete: never for one a restore abandoned meanwhile
      if cancelled.is_set():
        log.warning("checkpoint step %d: upload to %s abandoned (a restore to an older step); never marked complete",
                    step, self.url)
        self._delete(step)  # its objects: the new timeline's step of this number must not inherit them
        return 0.0
      self._client.put_object(Bucket=self.bucket, Key=self._key(str(step), MARKER), Body=b"")
    seconds = time.monotonic() - t0
    with self._uploaded_lock:
      self._uploaded.append((step, num_bytes, seconds))
    for old in self.complete_steps():
      if old not in keep and old != step:
        self._delete(old)
    log.info("checkpoint step %d uploaded to %s in %.2fs (%.1f MB/s)", step, self.url, seconds,
             num_bytes / 1e6 / max(seconds, 1e-9))
    return seconds

  def uploaded(self) -> list[tuple[int, int, float]]:
    """(step, bytes, seconds) of the uploads finished since the last call."""
    with self._uploaded_lock:
      done, self._uploaded = self._uploaded, []
    return done

  def pending(self) -> int:
    """Saves complete locally but not yet in object storage (queued or uploading)."""
    return sum(not f.done() for f in self._uploads)

  def wait(self) -> None:
    """Blocks until every upload finished; a failed upload is logged (local checkpoints stay)."""
    for future in list(self._uploads):
      try:
        future.result()
      except Exception as e:  # noqa: BLE001 - an upload failure must not lose the local checkpoint
        log.error("checkpoint upload to %s failed: %s: %s", self.url, type(e).__name__, e)
      self._uploads.remove(future)
      del self._upload_step[future]

  def close(self) -> None:
    self.wait()
    self._pool.shutdown()


LEASE = ".maxtrain.lease"
LEASE_S = 60.0  # a lease not renewed for this long is stale (its holder died): the next run takes it over


class S3Lease:
  """The s3:// form of the checkpoint-directory lock (object storage has no flock): an object
  `<prefix>/.maxtrain.lease` naming its holder and an expiry, renewed every LEASE_S / 3 while the run
  lives, deleted at a clean exit, taken over once expired. Last writer wins a simultaneous start, so the
  lease is read back after it is written."""

  def __init__(self, mirror: S3Bucket):
    import os
    import secrets
    import socket

    self.mirror, self.key = mirror, mirror._key(LEASE)
    self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                   "token": secrets.token_hex(8)}
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _read(self) -> dict:
    try:
      body = self.mirror._client.get_object(Bucket=self.mirror.bucket, Key=self.key)["Body"].read()
      holder = json.loads(body)
      return holder if isinstance(holder, dict) else {}
    except self.mirror._client.exceptions.NoSuchKey:
      return {}
    except ValueError:
      return {}

  def _write(self) -> None:
    body = json.dumps({**self.holder, "expires": time.time() + LEASE_S}).encode()
    self.mirror._client.put_object(Bucket=self.mirror.bucket, Key=self.key, Body=body)

  def _refuse(self, holder: dict) -> UserError:
    left = float(holder.get("expires", 0)) - time.time()
    return UserError(f"checkpoint.dir={self.mirror.url} is in use by another trainer (pid {holder.get('pid', '?')} on "
                     f"host {holder.get('host', '?')}; lease s3://{self.mirror.bucket}/{self.key}, renewed while it "
                     f"runs, expires in {left:.0f}s). Two runs saving into one checkpoint.dir would overwrite each "
                     "other: wait for it, stop it, or choose another checkpoint.dir.")

  def acquire(self) -> "S3Lease":
    holder = self._read()
    if holder.get("token") and float(holder.get("expires", 0)) > time.time():
      raise self._refuse(holder)
    if holder.get("token"):
      log.warning("checkpoint.dir %s: taking over the expired lease of pid %s on host %s", self.mirror.url,
                  holder.get("pid"), holder.get("host"))
    self._write()
    time.sleep(0.2)  # a second starter's write lands in this window: the read-back sees the winner
    winner = self._read()
    if winner.get("token") != self.holder["token"]:
      raise self._refuse(winner)
    self._thread = threading.Thread(target=self._renew, name="s3-lease", daemon=True)
    self._thread.start()
    return self

  def _renew(self) -> None:
    while not self._stop.wait(LEASE_S / 3):
      try:
        self._write()
      except Exception as e:  # noqa: BLE001 - a missed renewal is retried; the lease has two more periods
        log.warning("checkpoint.dir %s: renewing the lease failed: %s", self.mirror.url, e)

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    try:
      if self._read().get("token") == self.holder["token"]:
        self.mirror._client.delete_object(Bucket=self.mirror.bucket, Key=self.key)
    except Exception as e:  # noqa: BLE001 - it expires by itself
      log.warning("checkpoint.dir %s: could not delete the lease (%s); it expires in %.0fs", self.mirror.url, e,
                  LEASE_S)
