"""pipeline.storage on local paths and on s3:// (a real S3 API server on loopback), same tests."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from _s3 import allow_all_but

from pipeline import storage
from pipeline.errors import ConfigError, StorageError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A folder URL to work in: a local temp folder, or a prefix in a fresh S3 bucket."""
    if request.param == "local":
        return str(tmp_path / "root")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/root"


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (another process, as a Dask worker would be)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env={**os.environ, **(env or {})},
        capture_output=True, text=True, timeout=120,
    )


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


# --- reads and writes ----------------------------------------------------------------------


def test_bytes_json_parquet_round_trip(root: str) -> None:
    storage.write_bytes(storage.join(root, "a", "blob.bin"), b"\x00\x01payload")
    storage.write_json(storage.join(root, "meta.json"), {"b": [1, 2], "a": "x"})
    table = pa.table({"id": pa.array([3, 1, 2], pa.int64()), "text": ["c", "a", "b"]})
    storage.write_parquet(storage.join(root, "t.parquet"), table)

    assert storage.read_bytes(storage.join(root, "a/blob.bin")) == b"\x00\x01payload"
    assert storage.read_json(storage.join(root, "meta.json")) == {"a": "x", "b": [1, 2]}
    assert storage.read_parquet(storage.join(root, "t.parquet")).equals(table)
    assert storage.read_parquet(storage.join(root, "t.parquet"), columns=["id"]).column_names \
        == ["id"]
    pf = storage.parquet_file(storage.join(root, "t.parquet"))
    assert pf.metadata.num_rows == 3
    assert storage.exists(storage.join(root, "t.parquet"))
    assert not storage.exists(storage.join(root, "nope.parquet"))


def test_overwrite_replaces_whole_object_and_leaves_no_temporaries(root: str) -> None:
    url = storage.join(root, "part-0.parquet")
    storage.write_bytes(url, b"first version, longer than the second")
    storage.write_bytes(url, b"second")
    assert storage.read_bytes(url) == b"second"
    assert storage.list_files(root) == [url]
    if not storage.is_remote(root):
        assert os.listdir(root) == ["part-0.parquet"]  # no hidden .tmp-* left behind


def test_readers_never_see_a_partial_object(root: str) -> None:
    """A reader polling while a writer replaces a 2 MiB object sees only whole versions."""
    url = storage.join(root, "big.bin")
    versions = [bytes([i]) * (2 * 2**20) for i in range(1, 6)]
    seen: list[bytes | None] = []
    done = threading.Event()

    def read_until_done() -> None:
        while not done.is_set():
            try:
                seen.append(storage.read_bytes(url))
            except StorageError:
                seen.append(None)  # not written yet

    reader = threading.Thread(target=read_until_done)
    reader.start()
    try:
        for data in versions:
            storage.write_bytes(url, data)
    finally:
        done.set()
        reader.join()
    assert seen, "the reader never ran"
    assert all(s is None or s in versions for s in seen)
    assert storage.read_bytes(url) == versions[-1]


def test_local_write_failing_midway_keeps_old_version(tmp_path: Path) -> None:
    """A write that dies half-way (file size limit hit: EFBIG) leaves the old file intact."""
    url = str(tmp_path / "part-0.parquet")
    storage.write_bytes(url, b"old")
    proc = run_python(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
        from pipeline import storage
        from pipeline.errors import StorageError
        try:
            storage.write_bytes({url!r}, b"n" * (3 * 2**20))
        except StorageError as exc:
            print("FAILED:", exc)
    """)
    assert "FAILED: cannot write" in proc.stdout, proc.stderr
    assert storage.read_bytes(url) == b"old"
    assert os.listdir(tmp_path) == ["part-0.parquet"]


def test_a_local_write_is_durable_in_order_file_then_its_rename(tmp_path: Path,
                                                                monkeypatch) -> None:
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(src: str, dst: str) -> None:
        events.append(("rename", dst))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    target = tmp_path / "sets" / "mean" / "_done" / "a.json"
    storage.write_json(str(target), {"rows": 3})
    # the data, then the rename, then the folder holding the rename: a marker written next is
    # never durable before this file is
    assert [kind for kind, _ in events] == ["fsync", "rename", "fsync"]
    assert events[1][1] == str(target) and events[2][1] == str(target.parent)


def test_a_file_system_that_cannot_sync_a_folder_still_takes_the_write(tmp_path: Path,
                                                                        monkeypatch) -> None:
    import errno
    import stat

    fsync = os.fsync

    def no_folder_sync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")  # some FUSE and network mounts
        fsync(fd)

    monkeypatch.setattr(os, "fsync", no_folder_sync)
    storage.write_json(str(tmp_path / "a.json"), {"rows": 3})
    assert storage.read_json(str(tmp_path / "a.json")) == {"rows": 3}


def test_s3_transient_upload_failure_is_retried(s3_server, s3_bucket: str) -> None:
    """An upload that dies half-way once is retried by the client and lands whole."""
    url = f"s3://{s3_bucket}/out/part-0.parquet"
    with s3_server.faults.failing_uploads(f"{s3_bucket}/out/part-0", times=1) as fault:
        storage.write_bytes(url, b"x" * 10_000)
    assert fault.hits == 1
    assert storage.read_bytes(url) == b"x" * 10_000


def test_s3_upload_failing_midway_keeps_old_version(s3_server, s3_bucket, monkeypatch) -> None:
    """A persistent half-way failure (retries off) raises, and readers still see version 1."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = f"s3://{s3_bucket}/out/part-0.parquet"
    storage.write_bytes(url, b"version 1")
    with s3_server.faults.failing_uploads(f"{s3_bucket}/out/part-0") as fault, \
            pytest.raises(StorageError) as exc:
        storage.write_bytes(url, b"version 2" * 1000)
    assert fault.hits == 1
    assert "InternalError" in one_line(exc) or "internal error" in str(exc.value)
    assert url in str(exc.value)
    assert storage.read_bytes(url) == b"version 1"
    assert storage.list_files(f"s3://{s3_bucket}/out") == [url]


def test_s3_multipart_upload_failing_midway_leaves_nothing(s3_server, s3_bucket, monkeypatch):
    """Over 100 MiB goes up in parts; part 2 dying aborts the upload: no object, no pending
    upload, the old version intact."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = f"s3://{s3_bucket}/big.bin"
    storage.write_bytes(url, b"old")
    with s3_server.faults.failing_uploads(f"{s3_bucket}/big.bin", let_through=1) as fault, \
            pytest.raises(StorageError, match="cannot write"):
        storage.write_bytes(url, bytes(101 * 2**20))
    assert fault.hits >= 1
    assert s3_server.faults.uploads.count(f"{s3_bucket}/big.bin") >= 2  # old + part 1
    assert s3_server.pending_multipart_uploads(s3_bucket) == []
    assert storage.read_bytes(url) == b"old"


# --- listing ---------------------------------------------------------------------------------


def test_list_files_and_dirs(root: str) -> None:
    for name in ("b.parquet", "a.parquet", "_SET.json", ".hidden.parquet", "sub/c.parquet"):
        storage.write_bytes(storage.join(root, name), b"x")
    assert storage.list_files(root, ".parquet") == [
        storage.join(root, "a.parquet"), storage.join(root, "b.parquet")
    ]
    assert storage.list_files(root) == [
        storage.join(root, n) for n in ("_SET.json", "a.parquet", "b.parquet", "sub")
    ]
    assert storage.list_dirs(root) == [storage.join(root, "sub")]
    assert storage.list_files(storage.join(root, "missing")) == []
    assert storage.list_dirs(storage.join(root, "missing")) == []


def test_listing_sees_writes_and_removals_from_other_processes(root: str) -> None:
    folder = storage.join(root, "sets", "mean")
    storage.write_bytes(storage.join(folder, "part-0.parquet"), b"x")
    assert storage.list_files(folder) == [storage.join(folder, "part-0.parquet")]

    proc = run_python(f"""
        from pipeline import storage
        storage.write_bytes({storage.join(folder, "part-1.parquet")!r}, b"y")
        storage.remove({storage.join(folder, "part-0.parquet")!r})
    """)
    assert proc.returncode == 0, proc.stderr
    assert storage.list_files(folder) == [storage.join(folder, "part-1.parquet")]
    assert storage.expand_parquet(folder) == [storage.join(folder, "part-1.parquet")]
    assert not storage.exists(storage.join(folder, "part-0.parquet"))


def test_remove_recursive(root: str) -> None:
    storage.write_bytes(storage.join(root, "d", "x.bin"), b"1")
    storage.write_bytes(storage.join(root, "d", "e", "y.bin"), b"2")
    storage.remove(storage.join(root, "d"), recursive=True)
    assert storage.list_files(storage.join(root, "d")) == []
    storage.remove(storage.join(root, "never-there"))  # removing nothing is fine


# --- corpus expansion ------------------------------------------------------------------------


def _write_tiny_parquet(url: str) -> None:
    storage.write_parquet(url, pa.table({"id": [1], "text": ["a"]}))


def test_expand_parquet_file_folder_glob(root: str) -> None:
    names = ["c/a.parquet", "c/b.parquet", "c/deep/d.parquet", "c/_tmp/x.parquet",
             "c/.hidden.parquet", "c/_SUCCESS.parquet"]
    for name in names:
        _write_tiny_parquet(storage.join(root, name))
    storage.write_bytes(storage.join(root, "c", "README.txt"), b"not parquet")
    j = lambda *p: storage.join(root, *p)  # noqa: E731

    assert storage.expand_parquet(j("c/a.parquet")) == [j("c/a.parquet")]
    assert storage.expand_parquet(j("c")) == [j("c/a.parquet"), j("c/b.parquet"),
                                              j("c/deep/d.parquet")]
    assert storage.expand_parquet(j("c") + "/") == storage.expand_parquet(j("c"))
    assert storage.expand_parquet(j("c/*.parquet")) == [j("c/a.parquet"), j("c/b.parquet")]


def test_a_corpus_named_like_a_pattern_is_read_as_it_is(root: str) -> None:
    """``run [1]/`` exists: it is that folder, not the glob matching ``run 1/`` beside it."""
    for name in ("run [1]/corpus/a.parquet", "run 1/corpus/a.parquet", "q?/b.parquet"):
        _write_tiny_parquet(storage.join(root, name))
    j = lambda *p: storage.join(root, *p)  # noqa: E731
    folder = j("run [1]", "corpus")
    assert storage.expand_parquet(folder) == [j("run [1]/corpus/a.parquet")]
    assert storage.expand_parquet(j("run [1]/corpus/a.parquet")) == [
        j("run [1]/corpus/a.parquet")]
    assert storage.expand_parquet(j("q?/b.parquet")) == [j("q?/b.parquet")]
    assert storage.expand_parquet(j("run [1]/corpus/*.parquet")) == [j("run 1/corpus/a.parquet")]
    assert not storage.is_pattern(folder) and storage.is_pattern(j("run*"))


def test_expand_parquet_errors_name_the_url(root: str) -> None:
    storage.write_bytes(storage.join(root, "docs", "README.txt"), b"no parquet here")
    for url, reason in [(storage.join(root, "docs"), "no Parquet files under"),
                        (storage.join(root, "docs", "*.parquet"), "no Parquet files under"),
                        (storage.join(root, "absent"), "not found")]:
        with pytest.raises(StorageError) as exc:
            storage.expand_parquet(url)
        assert reason in one_line(exc) and url in str(exc.value)


def test_non_parquet_file_is_a_storage_error(root: str) -> None:
    url = storage.join(root, "fake.parquet")
    storage.write_bytes(url, b"this is not parquet")
    for read in (storage.parquet_file, storage.read_parquet):
        with pytest.raises(StorageError, match="not a readable Parquet file") as exc:
            read(url)
        assert url in str(exc.value)


# --- whole folders ---------------------------------------------------------------------------


# --- S3 configuration and bad input ----------------------------------------------------------


def test_endpoint_from_standard_variable_and_hostname(s3_server, s3_bucket, monkeypatch) -> None:
    """AWS_ENDPOINT_URL works too, and a hostname endpoint (MinIO-style) uses path-style URLs."""
    monkeypatch.delenv("EMBEDPIPE_S3_ENDPOINT")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://localhost:{s3_server.port}")
    url = f"s3://{s3_bucket}/via-hostname.bin"
    storage.write_bytes(url, b"ok")
    assert storage.read_bytes(url) == b"ok"
    assert s3_server.client().get_object(Bucket=s3_bucket, Key="via-hostname.bin")[
        "Body"].read() == b"ok"


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "minio", "ftp://minio:21", "http://"])
def test_an_endpoint_that_is_not_a_url_is_one_line(s3_bucket, monkeypatch, endpoint) -> None:
    """``minio:9000`` without its scheme: one line naming the variable, not the S3 client's
    ``ValueError: Invalid endpoint`` traceback."""
    monkeypatch.setenv("EMBEDPIPE_S3_ENDPOINT", endpoint)
    with pytest.raises(ConfigError, match=r"^EMBEDPIPE_S3_ENDPOINT=.* is not an S3 endpoint "
                                          r"URL: expected http\(s\)://host\[:port\]$"):
        storage.read_bytes(f"s3://{s3_bucket}/x.bin")


@pytest.mark.parametrize("call", ["read", "write", "list", "expand", "size"])
def test_missing_bucket(s3_server, call: str, tmp_path: Path) -> None:
    url = "s3://no-such-bucket-embedpipe/corpus/part.parquet"
    actions = {
        "read": lambda: storage.read_bytes(url),
        "write": lambda: storage.write_bytes(url, b"x"),
        "list": lambda: storage.list_files(url),
        "expand": lambda: storage.expand_parquet(url),
        "size": lambda: storage.size(url),
    }
    with pytest.raises(StorageError) as exc:
        actions[call]()
    assert "bucket 'no-such-bucket-embedpipe' does not exist" in one_line(exc)
    assert url in str(exc.value)


def test_missing_credentials(s3_bucket: str, monkeypatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    url = f"s3://{s3_bucket}/corpus/"
    with pytest.raises(StorageError) as exc:
        storage.expand_parquet(url)
    assert "no AWS credentials found" in one_line(exc) and url in str(exc.value)


def test_access_denied_by_policy(s3_server, s3_bucket: str, monkeypatch) -> None:
    """A key whose IAM policy denies reads and writes of the bucket (moto checks IAM)."""
    creds = s3_server.user_with_policy(
        "no-access", allow_all_but(["s3:GetObject", "s3:PutObject"],
                                   [f"arn:aws:s3:::{s3_bucket}/*"])
    )
    url = f"s3://{s3_bucket}/corpus/a.parquet"
    _write_tiny_parquet(url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", creds.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", creds.secret)
    with s3_server.iam_enforced():
        for call in (storage.read_bytes, storage.read_parquet, storage.parquet_file,
                     lambda u: storage.read_files([u]), lambda u: storage.write_bytes(u, b"x")):
            with pytest.raises(StorageError) as exc:
                call(url)
            reason = one_line(exc).split("access denied ", 1)[1]
            assert reason in ("(PermissionError: Access Denied)",  # GET, PUT: S3's XML error
                              "(PermissionError: Forbidden)"), reason  # HEAD: status only
            assert url in str(exc.value)


def test_access_denied_for_unknown_key(s3_server, s3_bucket: str, monkeypatch) -> None:
    """Listings too (moto refuses an access key it does not know, before any signature check)."""
    _write_tiny_parquet(f"s3://{s3_bucket}/corpus/a.parquet")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    with s3_server.iam_enforced():
        for url, call in [(f"s3://{s3_bucket}/corpus/", storage.expand_parquet),
                          (f"s3://{s3_bucket}/corpus", storage.list_files),
                          (f"s3://{s3_bucket}/corpus/a.parquet", storage.read_bytes)]:
            with pytest.raises(StorageError) as exc:
                call(url)
            assert "access denied" in one_line(exc) and url in str(exc.value)
            assert "does not exist in our records" in str(exc.value) \
                or "Forbidden" in str(exc.value)


def test_bad_secret_never_appears_in_errors_or_logs(s3_server, s3_bucket, monkeypatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    creds = s3_server.user_with_policy("reader", allow_all_but([], []))
    secret = "Sup3rSecretValueThatMustNotLeak0123456789"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", creds.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    url = f"s3://{s3_bucket}/x.bin"
    caplog.set_level(logging.DEBUG)
    with s3_server.iam_enforced(), pytest.raises(StorageError) as exc:
        storage.read_bytes(url)
    assert "access denied" in one_line(exc) and url in str(exc.value)
    assert secret not in str(exc.value)
    assert caplog.records, "debug logging captured nothing"
    assert all(secret not in r.getMessage() for r in caplog.records)
    # control: the same key with its real secret may read, so the secret was the only problem
    storage.write_bytes(url, b"ok")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", creds.secret)
    with s3_server.iam_enforced():
        assert storage.read_bytes(url) == b"ok"


def test_changed_credentials_take_effect_without_restart(s3_server, s3_bucket, monkeypatch):
    """Clients are cached per credential environment: a change is never served stale."""
    url = f"s3://{s3_bucket}/x.bin"
    storage.write_bytes(url, b"1")
    creds = s3_server.user_with_policy("denied", allow_all_but(["s3:*"], ["*"]))
    with s3_server.iam_enforced():
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", creds.key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", creds.secret)
        with pytest.raises(StorageError, match="access denied"):
            storage.read_bytes(url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert storage.read_bytes(url) == b"1"


def test_only_linked_folders_writers_write_in_are_refused(tmp_path):
    """A link a writer never writes through (notes kept beside the sets) is the user's."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    (out / "sets" / "mean").mkdir(parents=True)
    elsewhere.mkdir()
    (out / "notes").symlink_to(elsewhere, target_is_directory=True)
    storage.refuse_linked_folders(str(out))
    (out / "sets" / "mean" / "_done").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(StorageError, match=r"_done' is a symbolic link to"):
        storage.refuse_linked_folders(str(out))


@pytest.mark.parametrize("scheme", ["file://", "file:", "local://", "local:"])
def test_every_spelling_of_a_local_path_is_that_path(tmp_path: Path, scheme: str) -> None:
    """fsspec reads each scheme as a local path; so must every check of where a path lies
    (``file:/…`` passed for a path outside OUT, and was written inside it)."""
    plain = tmp_path / "out"
    url = scheme + str(plain)
    assert not storage.is_remote(url) and storage.canonical(url) == str(plain)
    assert storage.is_under(f"{url}/sets/a.json", str(plain))
    storage.write_bytes(f"{url}/sets/a.json", b"{}")  # atomic: through a temporary and rename
    assert [p.name for p in (plain / "sets").iterdir()] == ["a.json"]
    assert storage.read_bytes(f"{url}/sets/a.json") == b"{}"


def test_a_chained_url_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    url = f"simplecache::file://{tmp_path}/a.json"
    with pytest.raises(StorageError) as exc:
        storage.write_bytes(url, b"{}")
    assert one_line(exc) == (f"cannot open {url}: chained URLs are not supported; give a local "
                             "path or an s3:// URL")
    assert list(tmp_path.iterdir()) == []
