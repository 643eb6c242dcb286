"""Who can read and plant things in a store (issue 12, findings 1, 3 and 4), with real processes and files.

A store holds users' token ids and hidden states. These tests play the other local user of a shared
GPU host (a real second user made with ``useradd`` where the tests run as root) and the careless
operator: a store directory someone else made first, links planted where the store writes, a
directory open to others, the user's own ``*.tmp`` files beside the store, and who may read it.
"""

from __future__ import annotations

import os
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hscapture.errors import AccessError
from hscapture.export import ExportOptions, export
from hscapture.store.reader import open_store
from hscapture.store.writer import StoreWriter
from tests.conftest import OtherUser, run_cli
from tests.storefeed import Feed, make_layout, make_request, shard_bytes


def modes(root: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.lstat().st_mode) for p in root.iterdir()}


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory under /tmp that every user may enter (not write), for stores another user tries to read."""
    folder = Path(f"/tmp/hsc-access-{uuid.uuid4().hex[:10]}")
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=False)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of ours that a planted link points at; nothing may ever be written into it."""
    path = tmp_path / "victim"
    path.write_text("precious\n")
    path.chmod(0o600)
    return path


def assert_untouched(victim: Path) -> None:
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600


# ------------------------------------------------------------------ finding 1: foreign directories, links


def test_a_store_directory_another_user_made_is_refused_and_its_links_never_followed(
    other_user: OtherUser, victim: Path, tiny_model: Path
) -> None:
    """Another user makes ``--out`` first (0777) with ``.lock`` and ``index.jsonl`` linked to a file of ours:
    ``consume`` and ``extract`` refuse the directory at once and write nothing through the links."""
    foreign = Path(f"/tmp/hsc-foreign-{uuid.uuid4().hex[:10]}")
    other_user.run(f"mkdir -m 0777 {foreign} && ln -s {victim} {foreign}/.lock && ln -s {victim} {foreign}/index.jsonl")
    endpoint = f"ipc:///tmp/hsc-test-{uuid.uuid4().hex[:10]}/ep"
    try:
        consumed = run_cli(
            "consume", "--out", str(foreign), "--endpoint", endpoint, "--quiet", in_process=False, timeout=60
        )
        assert consumed.returncode == 1, consumed.stderr
        assert f"store directory {foreign} belongs to uid {other_user.uid}" in consumed.stderr
        assert "Traceback" not in consumed.stderr
        extracted = run_cli("extract", "--out", str(foreign), "--model", str(tiny_model), "--limit", "1")
        assert extracted.returncode == 1 and f"belongs to uid {other_user.uid}" in extracted.stderr, extracted.stderr
        assert_untouched(victim)
        assert sorted(os.listdir(foreign)) == [".lock", "index.jsonl"], "nothing of ours was written there"
    finally:
        subprocess.run(["rm", "-rf", str(foreign)], check=False)


@pytest.mark.parametrize("planted", [".lock", "index.jsonl"])
def test_a_link_planted_in_a_store_of_ours_is_refused_not_followed(tmp_path: Path, victim: Path, planted: str) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    (root / planted).symlink_to(victim)
    with pytest.raises(AccessError, match=rf"{root / planted} is a symbolic link, which hscapture never follows"):
        StoreWriter(root, shard_bytes("float32"), lock_timeout_s=0.2)
    assert_untouched(victim)


def test_a_store_directory_others_may_write_into_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(AccessError, match=rf"store directory {root} has mode 0777, open to other users; .*chmod go-w"):
        StoreWriter(root, shard_bytes("float32"), lock_timeout_s=0.2)
    assert os.listdir(root) == []


def test_an_export_never_writes_through_a_planted_manifest_link(tiny_store: Path, tmp_path: Path, victim: Path) -> None:
    out = tmp_path / "export"
    out.mkdir(mode=0o700)
    (out / "hscapture-export.jsonl").symlink_to(victim)
    options = ExportOptions(tiny_store, out, "specforge", progress=False, limit=1)
    with pytest.raises(AccessError, match=r"export manifest .* is a symbolic link"):
        export(options)
    assert_untouched(victim)


# ------------------------------------------------------------------ finding 3: private by default, shared on request


def test_stores_and_exports_are_private_by_default(other_user: OtherUser, shared_tmp: Path, tiny_model: Path) -> None:
    """A store ``extract`` creates is 0700 with 0600 files; the other user can neither list nor read it."""
    store = shared_tmp / "store"
    done = run_cli("extract", "--out", str(store), "--model", str(tiny_model), "--limit", "3", "--no-progress")
    assert done.returncode == 0, done.stderr
    found = modes(store)
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    assert set(found.values()) == {0o600}, found
    assert {".lock", "index.jsonl", "meta.json", "shard-000000.safetensors"} <= set(found)
    for command in (f"ls {store}", f"cat {store}/index.jsonl", f"cat {store}/shard-000000.safetensors"):
        with pytest.raises(subprocess.CalledProcessError):
            other_user.run(command + " > /dev/null 2>&1")

    out = shared_tmp / "export"
    assert export(ExportOptions(store, out, "specforge", progress=False)).written == 3
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}


def test_share_group_lets_that_group_read_the_store_and_no_one_else(
    other_user: OtherUser, shared_tmp: Path, tiny_model: Path
) -> None:
    store = shared_tmp / "store"
    args = ["extract", "--out", str(store), "--model", str(tiny_model), "--limit", "2", "--no-progress"]
    done = run_cli(*args, "--share-group", str(other_user.gid))
    assert done.returncode == 0, done.stderr
    info = store.stat()
    assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o2750, other_user.gid)
    for path in store.iterdir():
        assert (stat.S_IMODE(path.stat().st_mode), path.stat().st_gid) == (0o640, other_user.gid), path.name
    other_user.run(f"cat {store}/index.jsonl {store}/shard-000000.safetensors > /dev/null")  # a member reads it
    outsider = subprocess.run(
        ["cat", str(store / "index.jsonl")], user=other_user.uid, group=65534, extra_groups=[], capture_output=True
    )
    assert outsider.returncode != 0 and b"Permission denied" in outsider.stderr
    again = run_cli(*args[:-1], "--limit", "4", "--no-progress")  # appending keeps the store shared
    assert again.returncode == 0, again.stderr
    assert {stat.S_IMODE(p.stat().st_mode) for p in store.iterdir()} == {0o640}


def test_share_group_must_be_a_group_of_the_user(tmp_path: Path, tiny_model: Path) -> None:
    done = run_cli("extract", "--out", str(tmp_path / "s"), "--model", "/nonexistent", "--share-group", "no-such-grp")
    assert done.returncode == 2 and "share_group: no group 'no-such-grp'" in done.stderr, done.stderr
    assert not (tmp_path / "s").exists()


# ------------------------------------------------------------------ finding 4: the user's own temp files


def test_a_writer_removes_only_the_temp_files_the_store_names(tmp_path: Path) -> None:
    """The user's ``*.tmp`` files beside the store survive; a dead writer's own temp files go."""
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    mine = {"notes.tmp": b"a draft", "data.jsonl.tmp": b"{}", ".editor.swp.tmp": b"x", "shard-notes.tmp": b"y"}
    for name, data in mine.items():
        (root / name).write_bytes(data)
    stale = [".hscapture-shard-000003.safetensors.999999999.0123456789ab.tmp", "shard-000002.safetensors.tmp"]
    for name in stale:
        (root / name).write_bytes(b"half a shard")
    rng = np.random.default_rng(4)
    writer = StoreWriter(root, shard_bytes("float32"))
    writer.begin_run(*make_layout())
    feed = Feed(writer, {"a": make_request(9, "float32", rng)})
    feed.chunk([("a", range(9))])
    feed.finish("a", num_tokens=9)
    writer.close()
    assert {name: (root / name).read_bytes() for name in mine} == mine
    assert not [name for name in stale if (root / name).exists()]
    assert open_store(root).keys(complete_only=True) == ["a"]


# ------------------------------------------------------------------ issue 30.10: the store directory is pinned


def test_a_store_directory_renamed_mid_run_keeps_every_file_of_the_run(tmp_path: Path) -> None:
    """The directory the writer opened gets every file (meta, shards, temp files, index lines), though it is
    renamed twice mid-run and an empty directory is put in its place each time; that store verifies and serves
    every row. (Same user: under the parent rule below, another user can no longer rename it.)"""
    from hscapture.store.verify import verify_store

    root = tmp_path / "store"
    rng = np.random.default_rng(30)
    requests = {f"r{i}": make_request(11, "float32", rng) for i in range(6)}
    writer = StoreWriter(root, shard_bytes("float32"))
    try:
        root.rename(tmp_path / "moved-1")  # before meta.json is written
        root.mkdir(mode=0o700)
        writer.begin_run(*make_layout())
        feed = Feed(writer, requests)
        for i, request_id in enumerate(requests):
            feed.chunk([(request_id, range(11))])
            feed.finish(request_id, num_tokens=11)
            writer.tick()
            if i == 2:  # shards and index lines written, more to come
                (tmp_path / "moved-1").rename(tmp_path / "moved-2")
                root.rename(tmp_path / "decoy")
                root.mkdir(mode=0o700)
    finally:
        writer.close()
    opened = tmp_path / "moved-2"
    assert os.listdir(root) == [] and os.listdir(tmp_path / "decoy") == []
    assert verify_store(opened).ok
    store = open_store(opened)
    assert sorted(store.keys(complete_only=True)) == sorted(requests)  # index lines go in as shards flush
    for request_id, request in requests.items():
        got = store.get(request_id)
        assert all(torch.equal(got[name], request.rows[t]) for t, name in enumerate(store.tensor_names))


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o2775], ids=["0777", "0770", "2775"])
@pytest.mark.parametrize("depth", ["parent", "grandparent"])
def test_out_under_a_directory_others_may_write_into_is_refused_in_one_line(
    tmp_path: Path, mode: int, depth: str
) -> None:
    """Whoever may write into a directory on the way to ``--out`` can rename the store (or a directory above it)
    and put one of theirs in its place, for the user to read later: refused, naming it and the fix."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    root = shared / "store" if depth == "parent" else shared / "mine" / "store"
    with pytest.raises(AccessError) as refused:
        StoreWriter(root, shard_bytes("float32"), lock_timeout_s=0.2)
    message = str(refused.value)
    assert "\n" not in message and f"{shared} has mode {mode:04o}" in message, message
    assert message.startswith(f"store directory {root}: ") and f"chmod +t {shared}" in message, message
    assert os.listdir(shared) == []


def test_out_under_a_sticky_directory_or_through_a_link_of_ours_is_taken(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp: others may add entries, never rename or remove ours
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for root in (sticky / "store", tmp_path / "link" / "store"):
        StoreWriter(root, shard_bytes("float32"), lock_timeout_s=0.2).close()
    assert (tmp_path / "real" / "store" / ".lock").exists() and (sticky / "store" / ".lock").exists()


def test_out_through_another_users_link_is_refused_in_one_line(other_user: OtherUser, tmp_path: Path) -> None:
    """Another user's link on the way to ``--out`` (here in /tmp) can point anywhere, at any time: refused."""
    (tmp_path / "real").mkdir(mode=0o700)
    link = Path(f"/tmp/hsc-link-{uuid.uuid4().hex[:10]}")
    other_user.run(f"ln -s {tmp_path / 'real'} {link}")
    try:
        with pytest.raises(AccessError) as refused:
            StoreWriter(link / "store", shard_bytes("float32"), lock_timeout_s=0.2)
        message = str(refused.value)
        assert "\n" not in message and f"{link} is a symbolic link of uid {other_user.uid}" in message, message
        assert message.startswith(f"store directory {link / 'store'}: ") and os.listdir(tmp_path / "real") == []
    finally:
        link.unlink()


# ------------------------------------------------------------------ issue 30.11: readers never follow a link


@pytest.mark.parametrize("planted", ["index.jsonl", "meta.json", "shard-000000.safetensors"])
def test_readers_refuse_a_store_file_that_is_a_link_in_one_line(tmp_path: Path, planted: str) -> None:
    """A store file replaced by a link (here to the very same bytes elsewhere) is refused by every reader,
    naming the file: ``open_store`` and ``get``, ``verify`` and ``inspect``; never read through."""
    from hscapture.errors import StoreError
    from hscapture.store.verify import verify_store
    from tests.conftest import cli_refusal

    real, root = tmp_path / "real", tmp_path / "store"
    writer = StoreWriter(real, shard_bytes("float32"))
    writer.begin_run(*make_layout())
    feed = Feed(writer, {"a": make_request(5, "float32", np.random.default_rng(11))})
    feed.chunk([("a", range(5))])
    feed.finish("a", num_tokens=5)
    writer.close()
    root.mkdir(mode=0o700)
    for name in os.listdir(real):
        if name == planted:
            (root / name).symlink_to(real / name)
        else:
            (root / name).write_bytes((real / name).read_bytes())
    link = root / planted
    refusal = f"store file {link} is a symbolic link, which hscapture never follows"
    if planted.startswith("shard"):
        with pytest.raises(StoreError, match=rf"{link}: cannot open it \(a symbolic link"):
            open_store(root).get("a")
        report = verify_store(root)
        assert not report.ok and [c.file for c in report.missing] == [planted], report
        assert "a symbolic link, which hscapture never follows" in report.missing[0].problems[0]
        return
    for call in (open_store, verify_store):
        with pytest.raises(StoreError, match=refusal):
            call(root)
    for command in ("verify", "inspect"):
        status, stderr = cli_refusal(command, root)
        assert status == 2 and stderr.count("\n") == 1 and refusal in stderr, stderr
