"""Checkpoint manifests on real Orbax checkpoints: every file of a step, every kind of damage."""

import json
import pickle
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from maxtrain.checkpoint import manifest
from maxtrain.errors import UserError

DATA = {"next_window": 3, "source": "tiny"}
META = {"config": {"seed": 0}, "step": 1}


def _state():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  # Random values do not compress, so `w` (64 KiB) lands in an OCDBT data file rather than inline in
  # a tree node (which OCDBT checksums itself): the case where a flipped byte restores silently.
  return {"params": {"w": jax.device_put(jax.random.normal(jax.random.key(0), (256, 64)), sharded),
                     "b": jnp.full((16,), 3.0)},
          "step": jnp.array(1, jnp.int32)}


def _save(root: Path, steps=(1,), max_to_keep=None) -> ocp.CheckpointManager:
  manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=True, max_to_keep=max_to_keep))
  for step in steps:
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_state()),
                                               data=ocp.args.JsonSave(DATA), meta=ocp.args.JsonSave(META)))
    manager.wait_until_finished()
  return manager


def _restore(step_dir: Path):
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), _state())
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(step_dir, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))


def _same_as_saved(restored) -> bool:
  leaves_ok = jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                                        restored.state, _state()))
  return leaves_ok and restored.data == DATA and restored.meta == META


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
  """A finished step directory with its manifest (never modified: tests work on copies)."""
  root = tmp_path_factory.mktemp("ckpt")
  _save(root).close()
  manifest.write(root / "1")
  return root / "1"


@pytest.fixture
def step(saved, tmp_path) -> Path:
  copy = tmp_path / "1"
  shutil.copytree(saved, copy)
  return copy


def _data_files(step_dir: Path) -> list[str]:
  return sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*")
                if p.is_file() and p.name != manifest.MANIFEST_NAME)


def _flip(path: Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
  with open(path, "r+b") as f:
    f.truncate(path.stat().st_size // 2)


def test_intact_checkpoint_verifies_and_still_restores(saved):
  result = manifest.verify(saved, strict=True)
  assert result.verified and result.num_files == len(_data_files(saved)) and result.extra_files == ()
  assert result.num_bytes == sum((saved / n).stat().st_size for n in _data_files(saved))
  assert _same_as_saved(_restore(saved))  # Orbax ignores the manifest file beside its items
  assert manifest.verify(saved, strict=True).verified  # and restoring added no file


def test_manifest_records_every_file_and_is_written_atomically(saved):
  recorded = json.loads((saved / manifest.MANIFEST_NAME).read_text())
  assert recorded["format"] == manifest.FORMAT and recorded["version"] == manifest.VERSION
  assert recorded["algorithm"] == manifest.default_algorithm()
  assert sorted(recorded["files"]) == _data_files(saved)
  assert not [p for p in saved.iterdir() if p.name.startswith(".")]  # no temp file left behind


def test_every_file_flipped_truncated_or_deleted_is_named(saved, tmp_path):
  names = _data_files(saved)
  assert {n.split("/")[0] for n in names} >= {"state", "data", "meta"}
  assert any(n.startswith("state/ocdbt.process_0/d/") for n in names)  # array data files are covered
  misses = []
  for i, name in enumerate(names):
    for damage in (_flip, _truncate, Path.unlink):
      copy = tmp_path / f"{i}-{damage.__name__}"
      shutil.copytree(saved, copy)
      damage(copy / name)
      try:
        manifest.verify(copy)
        misses.append(f"{damage.__name__} {name}: not detected")
      except manifest.CorruptCheckpoint as e:
        if e.first_bad_file != name:
          misses.append(f"{damage.__name__} {name}: blamed {e.first_bad_file} ({e.reason})")
      shutil.rmtree(copy)
  assert not misses, "\n".join(misses)


def test_reasons_and_message(step):
  name = _data_files(step)[-1]
  (step / name).unlink()
  with pytest.raises(manifest.CorruptCheckpoint, match="missing") as e:
    manifest.verify(step)
  assert "\n" not in str(e.value) and name in str(e.value) and str(step) in str(e.value)
  assert isinstance(e.value, UserError)  # an explicit resume of it exits 2
  again = pickle.loads(pickle.dumps(e.value))
  assert (again.step_dir, again.first_bad_file, again.reason) == (e.value.step_dir, name, e.value.reason)


def test_size_and_checksum_reasons(step):
  big = max(_data_files(step), key=lambda n: (step / n).stat().st_size)
  _flip(step / big)
  with pytest.raises(manifest.CorruptCheckpoint, match="checksum") as e:
    manifest.verify(step)
  assert e.value.first_bad_file == big
  _truncate(step / big)
  with pytest.raises(manifest.CorruptCheckpoint, match="size") as e:
    manifest.verify(step)
  assert e.value.first_bad_file == big


@pytest.mark.parametrize("field", ["size", "checksum"])
def test_a_manifest_that_lies_is_caught(step, field):
  path = step / manifest.MANIFEST_NAME
  recorded = json.loads(path.read_text())
  name = sorted(recorded["files"])[0]
  entry = recorded["files"][name]
  entry[field] = entry[field] + 1 if field == "size" else format(int(entry[field], 16) ^ 1, f"0{len(entry[field])}x")
  path.write_text(json.dumps(recorded))
  with pytest.raises(manifest.CorruptCheckpoint, match=field) as e:
    manifest.verify(step)
  assert e.value.first_bad_file == name


@pytest.mark.parametrize("text, reason", [
    ("{not json", "not valid JSON"),
    ("", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    ('{"format": "something-else"}', "not a maxtrain-checkpoint-manifest"),
    ('{"format": "maxtrain-checkpoint-manifest", "version": 1, "algorithm": "crc32"}', "no 'files' table"),
    ('{"format": "maxtrain-checkpoint-manifest", "version": 1, "algorithm": "md4", "files": {}}', "unknown checksum"),
    ('{"format": "maxtrain-checkpoint-manifest", "version": 1, "algorithm": "crc32", '
     '"files": {"../x": {"size": 1, "checksum": "0"}}}', "outside the step directory"),
])
def test_an_unreadable_manifest_is_corrupt(step, text, reason):
  path = step / manifest.MANIFEST_NAME
  path.write_bytes(text if isinstance(text, bytes) else text.encode())
  with pytest.raises(manifest.CorruptCheckpoint, match=reason) as e:
    manifest.verify(step)
  assert e.value.first_bad_file == manifest.MANIFEST_NAME


def test_cut_manifest_is_corrupt(step):
  _truncate(step / manifest.MANIFEST_NAME)
  with pytest.raises(manifest.CorruptCheckpoint, match="unreadable manifest") as e:
    manifest.verify(step)
  assert e.value.first_bad_file == manifest.MANIFEST_NAME


def test_a_manifest_this_install_cannot_check_is_not_corruption(step, monkeypatch):
  path = step / manifest.MANIFEST_NAME
  recorded = json.loads(path.read_text())
  path.write_text(json.dumps({**recorded, "version": manifest.VERSION + 1}))
  with pytest.raises(manifest.UnsupportedManifest, match="newer"):
    manifest.verify(step)
  path.write_text(json.dumps(recorded))
  monkeypatch.setattr(manifest, "_hasher", lambda algorithm: None)
  with pytest.raises(manifest.UnsupportedManifest, match="pip install|needs") as e:
    manifest.verify(step)
  assert not isinstance(e.value, manifest.CorruptCheckpoint)  # the caller must not move it aside


def test_no_manifest_is_unverified_not_an_error(step):
  (step / manifest.MANIFEST_NAME).unlink()
  assert manifest.verify(step) == manifest.Verification(verified=False)


def test_missing_step_directory(tmp_path):
  with pytest.raises(manifest.CorruptCheckpoint, match="does not exist"):
    manifest.verify(tmp_path / "7")


def test_extra_files_are_reported_and_strict_refuses_them(step):
  (step / "notes.txt").write_text("hello")
  (step / "state" / "stray").write_bytes(b"x")
  result = manifest.verify(step)
  assert result.verified and result.extra_files == ("notes.txt", "state/stray")
  with pytest.raises(manifest.CorruptCheckpoint, match="not in the manifest") as e:
    manifest.verify(step, strict=True)
  assert e.value.first_bad_file == "notes.txt"


@pytest.mark.parametrize("algorithm", manifest.available_algorithms())
def test_each_available_checksum(step, algorithm):
  manifest.write(step, algorithm=algorithm, workers=1)
  assert json.loads((step / manifest.MANIFEST_NAME).read_text())["algorithm"] == algorithm
  assert manifest.verify(step, workers=1).verified and manifest.verify(step, workers=4).verified
  big = max(_data_files(step), key=lambda n: (step / n).stat().st_size)
  _flip(step / big)
  for workers in (1, 4):
    with pytest.raises(manifest.CorruptCheckpoint, match="checksum") as e:
      manifest.verify(step, workers=workers)
    assert e.value.first_bad_file == big


def test_checksums_are_the_reference_values(tmp_path):
  path = tmp_path / "f"
  path.write_bytes(b"123456789" * 3_000_000)  # 27 MB: several read chunks
  import zlib
  assert manifest.file_checksum(path, "crc32") == (27_000_000, f"{zlib.crc32(path.read_bytes()):08x}")
  one = tmp_path / "check"
  one.write_bytes(b"123456789")
  if "crc32c" in manifest.available_algorithms():
    assert manifest.file_checksum(one, "crc32c") == (9, "e3069283")  # the CRC-32C check value (RFC 3720)


def test_without_a_manifest_a_flipped_array_byte_restores_silently(step):
  """Why manifests exist: Orbax restores a damaged array data file without a word."""
  data_file = max((n for n in _data_files(step) if n.startswith("state/")), key=lambda n: (step / n).stat().st_size)
  _flip(step / data_file)
  restored = _restore(step)  # no error...
  assert not _same_as_saved(restored)  # ...but the parameters are not the saved ones
  with pytest.raises(manifest.CorruptCheckpoint) as e:
    manifest.verify(step)
  assert e.value.first_bad_file == data_file


def test_move_aside_hides_the_step_from_orbax_and_deletes_nothing(tmp_path):
  root = tmp_path / "run"
  _save(root, steps=(1, 2)).close()
  files_before = _data_files(root / "2")
  moved = manifest.move_aside(root / "2")
  assert moved.parent == root and moved.name.startswith("2.corrupt-")
  assert not (root / "2").exists() and _data_files(moved) == files_before
  manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=1))
  assert manager.all_steps() == [1] and manager.latest_step() == 1
  # The run goes on: it saves step 2 again and keeps one step; Orbax never touches the moved one.
  for step in (2, 3):
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_state()),
                                               data=ocp.args.JsonSave(DATA), meta=ocp.args.JsonSave(META)))
    manager.wait_until_finished()
  manager.close()
  assert ocp.CheckpointManager(root).all_steps() == [3]
  assert moved.is_dir() and _data_files(moved) == files_before
  twice = []
  for content in ("first", "second"):  # one step moved aside twice within a second: nothing overwritten
    (root / "9").mkdir()
    (root / "9" / "f").write_text(content)
    twice.append(manifest.move_aside(root / "9"))
  assert twice[0] != twice[1] and [(p / "f").read_text() for p in twice] == ["first", "second"]


def test_version_1_manifests_still_verify_and_files_that_end_in_their_crc_are_told_apart(step, tmp_path):
  """A CRC-32C of data that ends in its own CRC-32C is one constant: version 1 cannot tell two such
  files apart; version 2 can. A version-1 manifest (as old checkpoints have) is still checked."""
  import google_crc32c

  def ends_in_crc(seed: int) -> bytes:
    body = np.random.default_rng(seed).bytes(4096)
    return body + google_crc32c.value(body).to_bytes(4, "little")

  for name, algorithm, caught in (("v1", "crc32c", False), ("v2", manifest.default_algorithm(), True)):
    root = tmp_path / name
    root.mkdir()
    (root / "f").write_bytes(ends_in_crc(0))
    manifest.write(root, algorithm=algorithm)
    assert json.loads((root / manifest.MANIFEST_NAME).read_text())["version"] == (1 if name == "v1" else 2)
    (root / "f").write_bytes(ends_in_crc(1))  # same size, other bytes
    if caught:
      with pytest.raises(manifest.CorruptCheckpoint):
        manifest.verify(root)
    else:
      assert manifest.verify(root).verified
  manifest.write(step, algorithm="crc32c")
  assert manifest.verify(step).verified and _same_as_saved(_restore(step))
