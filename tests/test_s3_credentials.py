"""S3 credentials that rotate during a run: the mirror's client takes botocore's refreshing providers (here a
`credential_process` whose keys last a minute, re-run as they near expiry) and an expired credential is a
warning and a retry on the credential chain read afresh, not a lost upload. Against a real S3 server (moto)."""

import os
import sys
from pathlib import Path

from maxtrain.checkpoint.remote import MARKER, S3Mirror
from s3_proxy import S3Proxy
from test_checkpoint import s3_server  # noqa: F401 - a fixture

ISSUER = """import datetime, json, pathlib, sys
count = pathlib.Path(sys.argv[1])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60)
print(json.dumps({"Version": 1, "AccessKeyId": f"ROTATED{n}", "SecretAccessKey": f"secret{n}",
                  "SessionToken": f"token{n}", "Expiration": expires.isoformat()}))
"""


def step_dir(tmp_path: Path) -> Path:
  step = tmp_path / "7"
  (step / "state").mkdir(parents=True)
  (step / "state" / "data").write_bytes(os.urandom(4096))
  (step / "meta.json").write_text("{}")
  return step


def keys(client, prefix):
  return {o["Key"] for o in client.list_objects_v2(Bucket="ckpts", Prefix=prefix).get("Contents", [])}


def test_rotating_process_credentials_are_picked_up_without_a_restart(tmp_path, s3_server, monkeypatch):
  issuer, count = tmp_path / "issuer.py", tmp_path / "issued"
  issuer.write_text(ISSUER)
  config = tmp_path / "aws_config"
  config.write_text(f"[default]\nregion = us-east-1\ncredential_process = {sys.executable} {issuer} {count}\n")
  for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
    monkeypatch.delenv(key)
  monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
  monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
  mirror = S3Mirror("s3://ckpts/rot")
  issued_at_start = int(count.read_text())
  mirror.upload(step_dir(tmp_path), 7, keep=[7]).result()
  mirror.close()
  # Keys that expire within botocore's refresh window are fetched again as requests go out: the one client
  # built at start signed later requests with newer keys.
  assert issued_at_start >= 1 and int(count.read_text()) > issued_at_start
  assert "rot/7/" + MARKER in keys(s3_server, "rot/")


def test_expired_credentials_are_retried_not_a_lost_upload(tmp_path, s3_server, monkeypatch, caplog):
  host, port = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
  proxy = S3Proxy((host, int(port)), b"/ckpts/exp/", "expire", count=1)
  monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
  try:
    mirror = S3Mirror("s3://ckpts/exp", max_attempts=1)
    mirror.upload(step_dir(tmp_path), 7, keep=[7]).result()
    mirror.close()
    assert proxy.hits == 1
    assert "the S3 credentials expired (ExpiredToken); reading the credential chain afresh and retrying" in caplog.text
    assert "exp/7/" + MARKER in keys(s3_server, "exp/")

    proxy.left = 10  # they stay expired: a clear error naming what to do; the upload fails, training would not
    mirror = S3Mirror("s3://ckpts/exp", max_attempts=1)
    future = mirror.upload(step_dir(tmp_path / "again"), 8, keep=[7, 8])
    error = future.exception()
    mirror.close()
  finally:
    proxy.close()
  assert "credentials expired (ExpiredToken)" in str(error) and "renew the credentials" in str(error)
  assert "exp/8/" + MARKER not in keys(s3_server, "exp/")
