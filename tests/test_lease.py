"""The writer lease of an OUT, with real processes, on a local folder and on a real S3 API
server: one holder at a time, a refusal naming the holder, expiry of a dead holder, loss
detected by a holder that was paused past its TTL, re-entrancy and release."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pipeline import storage
from pipeline.errors import ConfigError, StorageError
from pipeline.lease import (
    LEASE_FILE,
    Holder,
    LeaseHeld,
    WriterLease,
    lease_ttl,
    process_identity,
    writer_lease,
)

REPO = Path(__file__).resolve().parents[1]
TTL = 2.0


@pytest.fixture(params=["local", "s3"])
def out(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "out")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/out"


@pytest.fixture(autouse=True)
def short_ttl(monkeypatch):
    monkeypatch.setenv("EMBEDPIPE_LEASE_TTL", str(TTL))


def child(code: str, **kw) -> subprocess.Popen:
    """A Python process running ``code`` (with ``from pipeline.lease import *`` done)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    source = "import os, sys, time, json\nfrom pipeline.lease import *\n" + textwrap.dedent(code)
    return subprocess.Popen([sys.executable, "-c", source], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def holder(out: str) -> dict:
    return json.loads(storage.read_bytes(storage.join(out, LEASE_FILE)))


def test_a_second_writer_is_refused_naming_the_holder_until_it_releases(out):
    with writer_lease(out, "embed"):
        proc = child(f"""
            try:
                with writer_lease({out!r}, "index"):
                    print("TOOK IT")
            except LeaseHeld as exc:
                print(exc, file=sys.stderr)
                sys.exit(3)
        """)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 3, stderr
        line = stderr.strip()
        assert "\n" not in line and "TOOK IT" not in stdout
        assert f"{out} is being written by 'embed'" in line
        assert f"pid {os.getpid()} on {os.uname().nodename}" in line and " since 20" in line
        assert "UTC" in line and "pytest" in line  # the holder's command line
    proc = child(f"""
        with writer_lease({out!r}, "index"):
            print("TOOK IT")
    """)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "TOOK IT" in stdout, stderr
    assert holder(out)["released"] is True and holder(out)["command"] == "index"


def test_the_lease_is_renewed_while_held_and_reentrant(out):
    with writer_lease(out, "embed") as outer:
        first = holder(out)
        with writer_lease(out, "index") as inner:  # an embed flow that also indexes
            assert inner is outer
        assert holder(out)["released"] is False  # the inner exit did not release it
        time.sleep(TTL * 1.5)
        renewed = holder(out)
        assert renewed["token"] == first["token"] and renewed["renewals"] >= 1
        assert renewed["renewed"] > first["renewed"]
        with pytest.raises(LeaseHeld):  # still held: the renewals kept it alive past its TTL
            WriterLease(out, "other").acquire()
    assert holder(out)["released"] is True


def test_one_out_spelled_otherwise_is_the_same_lease(out, tmp_path, monkeypatch):
    """``s3a://`` for ``s3://``; a local folder as ``file://``, relative or through a link;
    a trailing slash: one OUT, so the same process re-enters its lease."""
    if out.startswith("s3://"):
        spellings = [out.replace("s3://", "s3a://", 1), out + "/"]
    else:
        link = tmp_path / "link"
        Path(out).mkdir()
        link.symlink_to(out)
        monkeypatch.chdir(tmp_path)
        spellings = [f"file://{out}/", "out", "./out/", str(link)]
    with writer_lease(out, "embed") as outer:
        for spelled in spellings:
            with writer_lease(spelled, "index") as inner:
                assert inner is outer, spelled
        assert holder(out)["released"] is False
    assert holder(out)["released"] is True


def test_waiting_for_one_outs_lease_holds_up_no_other_out(tmp_path):
    busy, free = str(tmp_path / "busy"), str(tmp_path / "free")
    other = WriterLease(busy, "another writer")
    other.acquire()
    took = []

    def wait_for_busy() -> None:
        with writer_lease(busy, "embed", wait=TTL * 3):
            took.append(busy)

    waiting = threading.Thread(target=wait_for_busy)
    waiting.start()
    time.sleep(0.2)  # the thread is in its wait for `busy`
    with writer_lease(free, "index"):  # taken and freed while it waits
        assert holder(free)["released"] is False
    assert holder(free)["released"] is True
    assert waiting.is_alive()  # not after the wait ended
    other.release()
    waiting.join()
    assert took == [busy]  # and then it got `busy` as soon as the other writer let go


def test_the_lease_is_released_when_the_block_raises(out):
    with pytest.raises(RuntimeError), writer_lease(out, "embed"):
        raise RuntimeError("boom")
    lease = WriterLease(out, "next")
    lease.acquire()  # at once, no expiry needed
    lease.release()


def test_writers_in_many_processes_never_overlap(out, tmp_path):
    """Four processes take the lease three times each, waiting for it: no two holds overlap."""
    logs = tmp_path / "holds"
    logs.mkdir()
    procs = [child(f"""
        for round in range(3):
            with writer_lease({out!r}, "w{n}", wait=120):
                start = time.time()
                time.sleep(0.3)
                with open({str(logs / f"{n}.jsonl")!r}, "a") as fh:
                    fh.write(json.dumps([start, time.time()]) + "\\n")
    """) for n in range(4)]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
    holds = sorted(json.loads(line) for f in logs.iterdir() for line in f.read_text().splitlines())
    assert len(holds) == 12
    for (_, end), (start, _) in zip(holds, holds[1:], strict=False):
        assert end <= start, f"two writers held the lease at once: {holds}"


def killed_holder(out: str) -> int:
    """A process that takes the lease and dies holding it (a crash: nothing is released)."""
    proc = child(f"""
        import signal
        lease = WriterLease({out!r}, "embed")
        lease.acquire()
        print(os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    return int(stdout.split()[0])


def test_a_dead_holder_elsewhere_expires_and_is_taken_over(out):
    """A holder on another machine (or one that recorded no process) only expires."""
    dead = killed_holder(out)
    record = holder(out) | {"host": "elsewhere", "process": "other-boot/1/42:7"}
    storage.write_bytes(storage.join(out, LEASE_FILE), json.dumps(record).encode())
    with pytest.raises(LeaseHeld, match=f"pid {dead} on elsewhere"):
        WriterLease(out, "embed").acquire()  # not yet expired
    started = time.monotonic()
    with writer_lease(out, "embed", wait=TTL * 10):
        took = holder(out)
    assert took["pid"] == os.getpid() and took["released"] is False
    assert time.monotonic() - started <= TTL * 10


def test_a_killed_holder_on_this_machine_is_taken_over_at_once(out, monkeypatch):
    """Its process is gone: a rerun right after a kill -9 need not wait out the TTL."""
    monkeypatch.setenv("EMBEDPIPE_LEASE_TTL", "600")
    dead = killed_holder(out)
    assert holder(out)["pid"] == dead and holder(out)["released"] is False
    with writer_lease(out, "embed"):  # no wait
        assert holder(out)["pid"] == os.getpid()


def test_a_pid_of_this_machine_counts_as_its_holder_only_while_the_same_process_runs():
    """A holder's pid later reused by another process is no longer the holder."""
    me = process_identity(os.getpid())
    assert me and process_identity(2**22 + 12345) == ""
    now = time.time()
    alive = Holder(token="t", host="h", pid=os.getpid(), command="embed", since=now,
                   renewed=now, ttl=600, process=me)
    assert not alive.free(now)
    reused = alive.model_copy(update={"process": me.rpartition(":")[0] + ":1"})
    elsewhere = alive.model_copy(update={"process": "other-boot/1/" + me.rpartition("/")[2]})
    assert reused.free(now) and not elsewhere.free(now)
    assert not alive.model_copy(update={"process": ""}).free(now)


def test_a_holder_paused_past_its_ttl_finds_its_lease_lost(out):
    """SIGSTOP the holder past its TTL, take over, SIGCONT it: its renewal finds the new holder,
    ``check`` raises, and it never overwrites the taker's lease."""
    proc = child(f"""
        with writer_lease({out!r}, "embed") as lease:
            print("HELD", flush=True)
            for _ in range(300):
                time.sleep(0.1)
                try:
                    lease.check()
                except LeaseLost as exc:
                    print(exc, file=sys.stderr)
                    sys.exit(3)
        sys.exit(0)
    """)
    assert proc.stdout.readline().strip() == "HELD"
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        with writer_lease(out, "backfill", wait=TTL * 10):
            mine = holder(out)["token"]
            os.kill(proc.pid, signal.SIGCONT)
            _, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 3, stderr
            line = stderr.strip()
            assert "\n" not in line and "lost the writer lease" in line
            assert "'backfill'" in line and f"pid {os.getpid()}" in line
            assert "stopped before finalizing" in line
            assert holder(out)["token"] == mine  # the paused holder wrote nothing over it
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_a_file_that_is_not_a_lease_is_one_line_and_left_alone(out):
    url = storage.join(out, LEASE_FILE)
    storage.write_bytes(url, b'{"host": "../../x"}')
    with pytest.raises(StorageError, match="is not a writer lease; if no embedpipe writer"):
        WriterLease(out, "embed").acquire()
    assert storage.read_bytes(url) == b'{"host": "../../x"}'


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "1e9"])
def test_a_bad_ttl_is_one_line(monkeypatch, raw):
    monkeypatch.setenv("EMBEDPIPE_LEASE_TTL", raw)
    with pytest.raises(ConfigError, match="EMBEDPIPE_LEASE_TTL"):
        lease_ttl()


@pytest.mark.parametrize("ttl", [0.0, -3.0, float("nan"), 1e9])
def test_a_bad_ttl_given_in_python_is_one_line_and_takes_nothing(out, ttl):
    """It was a pydantic traceback as the holder was made (NaN: a lease that never expired)."""
    with pytest.raises(ConfigError, match=f"a lease TTL of {ttl!r}: expected seconds"):
        WriterLease(out, "embed", ttl=ttl)
    assert not storage.exists(storage.join(out, LEASE_FILE))


def test_the_ttl_can_come_from_the_settings_file(tmp_path, monkeypatch):
    from pipeline.settings import CONFIG_ENV, load_settings

    monkeypatch.delenv("EMBEDPIPE_LEASE_TTL")
    config = tmp_path / "embedpipe.toml"
    config.write_text("lease_ttl = 7.5\n")
    monkeypatch.setenv(CONFIG_ENV, str(config))
    load_settings().export_env()
    assert lease_ttl() == 7.5
    config.write_text("lease_ttl = 0.1\n")
    monkeypatch.delenv("EMBEDPIPE_LEASE_TTL")
    with pytest.raises(ConfigError, match="lease_ttl"):
        load_settings()


def test_a_hostile_holder_record_still_gives_one_printable_line(out):
    now = time.time()
    record = {"token": "t", "host": "h\n\x1b[31mred", "pid": 1, "command": "embed\nrm -rf /",
              "argv": "python -c\nimport os", "since": now, "renewed": now, "ttl": 600}
    storage.write_bytes(storage.join(out, LEASE_FILE), json.dumps(record).encode())
    with pytest.raises(LeaseHeld) as caught:
        WriterLease(out, "embed").acquire()
    line = str(caught.value)
    assert "\n" not in line and "\x1b" not in line and "`python -c import os`" in line


def test_a_failed_renewal_is_retried_not_the_end_of_renewing(tmp_path, monkeypatch):
    """A local OUT on NFS: one renewal's read fails (ESTALE). The renewer rides it out and the
    lease stays held past its TTL; before, that OSError ended the renewer thread, the lease
    expired under a running writer and a second writer took OUT over."""
    import errno

    from pipeline import lease as lease_module

    read, fails = lease_module._LocalStore.read, []

    def stale_once(store):
        if not fails and threading.current_thread().name.startswith("lease-renewer"):
            fails.append(1)
            raise OSError(errno.ESTALE, "Stale file handle")
        return read(store)

    monkeypatch.setattr(lease_module._LocalStore, "read", stale_once)
    out = str(tmp_path / "out")
    with writer_lease(out, "embed") as held:
        time.sleep(TTL * 1.5)
        assert fails and held._thread.is_alive()
        with pytest.raises(LeaseHeld):
            WriterLease(out, "backfill").acquire()
        held.check()


def test_a_writer_that_lost_out_writes_no_shard_into_it(out, tmp_path, tiny_model_dir):
    """The run's writer stalls past its TTL after planning (a GC, a frozen VM), another takes
    OUT over; the stalled run's shard then writes nothing (no part, no marker), wherever its
    worker runs: the worker reads the lease before writing."""
    from _flowkit import job, text_for, write_corpus

    from pipeline.config import EmbedJob, parse
    from pipeline.embedder import get_embedder
    from pipeline.job import embed_shard
    from pipeline.lease import LeaseLost, check_holder
    from pipeline.run import prepare
    from pipeline.sets import SetFolder

    corpus = write_corpus(tmp_path / "c" / "a.parquet", list(range(20)),
                          [text_for(i) for i in range(20)])
    spec = parse(EmbedJob, job(corpus, out, tiny_model_dir), "job")
    with writer_lease(out, "embed") as stalled:
        plan = prepare(spec, lambda: get_embedder(spec.encoder, spec.poolers),
                       lease=stalled.token)
        check_holder(out, stalled.token)  # still its own
        stalled._stop.set()
        stalled._thread.join()  # no renewals ...
        time.sleep(TTL * 1.2)  # ... past its TTL
        taker = WriterLease(out, "nightly")
        taker.acquire()
        with pytest.raises(LeaseLost, match=r"lost the writer lease on .* to 'nightly'.*"
                                            r"stopped before writing a shard"):
            embed_shard(plan.requests[0])
        folder = SetFolder(out, "mean")
        assert folder.part_urls() == [] and not folder.unmarked_shards()
        taker.release()


def test_a_writer_that_lost_out_records_no_run_in_it(out, tmp_path, tiny_model_dir):
    """The run's writer stalls past its TTL after its shards (a GC, a frozen VM); another
    takes OUT over, embeds the grown corpus and records its run. The stalled run's finalize
    then stops: it retires none of the taker's shards and records nothing (it retired every
    one of them and wrote its own _SET.json and changes file over the taker's)."""
    from _flowkit import job, out_digest, run_library, text_for, write_corpus

    from pipeline.config import EmbedJob, parse
    from pipeline.embedder import get_embedder
    from pipeline.job import embed_shard
    from pipeline.lease import LeaseLost
    from pipeline.run import finalize, prepare
    from pipeline.sets import scan_set

    corpus = tmp_path / "c"
    write_corpus(corpus / "a.parquet", list(range(20)), [text_for(i) for i in range(20)])
    given = job(corpus, out, tiny_model_dir, rows_per_shard=10)
    run_library(given)
    spec = parse(EmbedJob, given, "job")
    with writer_lease(out, "embed") as stalled:
        plan = prepare(spec, lambda: get_embedder(spec.encoder, spec.poolers),
                       lease=stalled.token)
        results = [embed_shard(r) for r in plan.requests]
        stalled._stop.set()
        stalled._thread.join()  # no renewals ...
        time.sleep(TTL * 1.2)  # ... past its TTL
        write_corpus(corpus / "b.parquet", list(range(100, 120)),
                     [text_for(i) for i in range(100, 120)])
        taker = child(f"""
            sys.path.insert(0, {str(REPO / "tests")!r})
            from _flowkit import run_library
            with writer_lease({out!r}, "nightly"):
                run_library({given!r})
        """)
        _, stderr = taker.communicate(timeout=300)
        assert taker.returncode == 0, stderr
        taken = out_digest(out) if not out.startswith("s3://") else None
        ids = sorted(scan_set(out, "mean").collect()["id"].to_list())
        assert ids == [*range(20), *range(100, 120)]
        with pytest.raises(LeaseLost, match="to 'nightly'"):
            finalize(plan, results, 1.0)
    assert sorted(scan_set(out, "mean").collect()["id"].to_list()) == ids
    if taken is not None:
        assert out_digest(out) == taken  # not a file written, removed or changed
    assert holder(out)["command"] == "nightly" and holder(out)["released"]


def _stall_past_ttl(lease: WriterLease) -> None:
    """The holder stalls (a GC, a frozen VM): no renewals, past its TTL."""
    lease._stop.set()
    lease._thread.join()
    time.sleep(TTL * 1.2)


def _take_over(code: str) -> str:
    """Another process takes OUT over and runs ``code`` (the tests' helpers importable) under
    the lease as 'nightly'; returns what it printed."""
    taker = child(f"sys.path.insert(0, {str(REPO / 'tests')!r})\n" + textwrap.dedent(code))
    stdout, stderr = taker.communicate(timeout=300)
    assert taker.returncode == 0, stderr
    return stdout.strip()


@pytest.mark.parametrize("stall_at", ["_stage", "_prune"])
def test_an_index_writer_that_lost_out_leaves_the_takers_index_alone(stall_at, tmp_path,
                                                                     tiny_model_dir,
                                                                     monkeypatch):
    """An index build stalls past its TTL while it writes its files (``_stage``), or once it
    published them, before it prunes older versions (``_prune``); another writer takes OUT over
    and publishes a newer index. The stalled build then stops with one line: it published its
    stale generation over the newer one, or pruned the newer one's files, so that
    ``_INDEX.json`` named files that were gone and every query failed."""
    from _flowkit import job, run_library, text_for, write_corpus

    from pipeline.index import IndexRequest, index_set, store
    from pipeline.lease import LeaseLost

    out = str(tmp_path / "out")
    corpus = write_corpus(tmp_path / "c.parquet", list(range(40)),
                          [text_for(i) for i in range(40)])
    run_library(job(corpus, out, tiny_model_dir))
    with writer_lease(out, "index"):
        index_set(IndexRequest(out=out, set_name="mean"))
    real = getattr(store, stall_at)
    taken = []

    def stalled(*args, **kwargs):
        _stall_past_ttl(lease)
        taken.append(_take_over(f"""
            from pipeline.index import IndexRequest, index_set
            with writer_lease({out!r}, "nightly"):
                print(index_set(IndexRequest(out={out!r}, set_name="mean",
                                             rebuild=True)).meta.token)
        """))
        return real(*args, **kwargs)

    monkeypatch.setattr(store, stall_at, stalled)
    with writer_lease(out, "index") as lease, pytest.raises(LeaseLost, match="to 'nightly'"):
        index_set(IndexRequest(out=out, set_name="mean", rebuild=True))
    monkeypatch.undo()
    published = store.read_meta(out, "mean")
    assert published.token == taken[0]
    assert store.local_files(out, published)  # its files are there, their SHA-256 as recorded
    assert not store.missing_files(out, published)


def test_a_shard_writer_that_lost_out_removes_none_of_the_takers_work(tmp_path,
                                                                    tiny_model_dir,
                                                                    monkeypatch):
    """A shard whose texts changed stalls past its TTL just before it removes the shard's old
    done marker; another writer takes OUT over and redoes the shard. The stalled shard then
    stops: it removed the taker's marker, so the set silently lacked the shard's rows that
    _SET.json and the index counted."""
    from _flowkit import job, run_library, text_for, write_corpus

    from pipeline.config import EmbedJob, parse
    from pipeline.embedder import get_embedder
    from pipeline.job import embed_shard
    from pipeline.lease import LeaseLost
    from pipeline.run import prepare
    from pipeline.sets import SetFolder, scan_set

    out, corpus = str(tmp_path / "out"), tmp_path / "c.parquet"
    write_corpus(corpus, list(range(20)), [text_for(i) for i in range(20)])
    given = job(corpus, out, tiny_model_dir)
    run_library(given)
    write_corpus(corpus, list(range(20)), [text_for(i, "revised") for i in range(20)])
    spec = parse(EmbedJob, given, "job")
    real = SetFolder.remove_marker

    def stalled(self, *args, **kwargs):
        _stall_past_ttl(lease)
        _take_over(f"""
            from _flowkit import run_library
            with writer_lease({out!r}, "nightly"):
                run_library({given!r})
        """)
        return real(self, *args, **kwargs)

    with writer_lease(out, "embed") as lease:
        plan = prepare(spec, lambda: get_embedder(spec.encoder, spec.poolers),
                       lease=lease.token)
        monkeypatch.setattr(SetFolder, "remove_marker", stalled)
        with pytest.raises(LeaseLost, match="to 'nightly'"):
            embed_shard(plan.requests[0])
    monkeypatch.undo()
    assert sorted(scan_set(out, "mean").collect()["id"].to_list()) == list(range(20))
    assert SetFolder(out, "mean").meta().rows_written == 20


def test_another_thread_of_the_process_is_another_writer(out):
    """Two threads of one process (a service calling ``embedpipe.embed`` from a pool) on one
    OUT: the second waits for the first, or fails naming it; the taker's own thread re-enters."""
    inside, errors = [], []

    def second(wait: float) -> None:
        try:
            with writer_lease(out, "backfill", wait=wait):
                inside.append(time.monotonic())
        except LeaseHeld as exc:
            errors.append(str(exc))

    with writer_lease(out, "embed") as first:
        with writer_lease(out, "index") as again:
            assert again is first  # re-entrant in its own thread
        refused = threading.Thread(target=second, args=(0.0,))
        refused.start()
        refused.join()
        assert inside == [] and "in another thread of this process" in errors[0]
        assert "'embed'" in errors[0]
        waiting = threading.Thread(target=second, args=(TTL * 5,))
        waiting.start()
        time.sleep(0.5)
        left = time.monotonic()
        assert inside == []
    waiting.join()
    assert len(inside) == 1 and inside[0] >= left


def test_taking_out_removes_what_writers_killed_mid_write_left(tmp_path):
    """A writer killed mid-write leaves hidden temporaries no listing shows: a part's
    ``.tmp-*`` file, an index's ``.staging-*`` folder. The next writer to take OUT removes
    those untouched for a TTL; younger ones (a write under way) and others' files stay."""
    out = tmp_path / "out"
    old = [out / "sets" / "mean" / ".tmp-0a-part-x.parquet",
           out / "sets" / "mean" / "_done" / ".tmp-0b-x.json",
           out / "index" / "mean" / ".staging-abc" / "index.faiss"]
    young = out / "sets" / "mean" / ".tmp-0c-part-y.parquet"
    kept = [out / "sets" / "mean" / "part-x.parquet", out / "sets" / "mean" / ".keep-me"]
    for path in [*old, young, *kept]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1000)
    writing = out / "index" / "other" / ".staging-def" / "index.faiss"  # old folder, new file
    writing.parent.mkdir(parents=True)
    writing.write_bytes(b"x")
    past = time.time() - TTL * 3
    for path in [*old, old[2].parent, writing.parent]:
        os.utime(path, (past, past))
    with writer_lease(str(out), "embed"):
        assert not any(p.exists() for p in old[:2]) and not old[2].parent.exists()
        assert young.exists() and writing.exists() and all(p.exists() for p in kept)


def test_a_store_that_ignores_conditional_writes_is_refused(s3_server, s3_bucket, monkeypatch):
    """On a store that ignores If-None-Match / If-Match two writers would both take the lease:
    taking one there fails in one line, before any lease is written; the probe leaves nothing."""
    from pipeline import lease as lease_module

    out = f"s3://{s3_bucket}/ignoring"
    put = lease_module._S3Store._put
    monkeypatch.setattr(lease_module, "_SWAPS_CHECKED", set())
    monkeypatch.setattr(lease_module._S3Store, "_put",
                        lambda store, data, key=None, **condition: put(store, data, key))
    with pytest.raises(StorageError, match=r"ignores conditional writes .* cannot keep two "
                                           r"writers of one OUT apart"):
        WriterLease(out, "embed").acquire()
    listed = s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="ignoring/")
    assert listed["KeyCount"] == 0  # no lease, and no probe left behind
    monkeypatch.setattr(lease_module._S3Store, "_put", put)  # a store that honours them
    with writer_lease(out, "embed"):
        assert holder(out)["command"] == "embed"
    assert {s3_bucket} == lease_module._SWAPS_CHECKED


@pytest.mark.parametrize("field, value", [("renewed", float("nan")), ("since", 1e300),
                                          ("renewed", float("inf")), ("ttl", 1e12),
                                          ("ttl", -1.0)])
def test_a_holder_record_with_impossible_times_is_not_a_lease(out, field, value):
    """A renewal time of NaN never expired (every comparison with it is false), so the lease
    was held for ever; a start time past year 9999 was an OverflowError traceback."""
    now = time.time()
    record = {"token": "t", "host": "h", "pid": 1, "command": "embed", "since": now,
              "renewed": now, "ttl": 600} | {field: value}
    storage.write_bytes(storage.join(out, LEASE_FILE), json.dumps(record).encode())
    with pytest.raises(StorageError, match="is not a writer lease; if no embedpipe writer"):
        WriterLease(out, "embed").acquire()


def test_a_lease_file_too_large_to_be_one_is_refused_unread(out):
    """Read only up to 64 KiB: a record padded past that is refused, though it parses."""
    now = time.time()
    record = {"token": "t", "host": "h", "pid": 1, "command": "embed", "since": now,
              "renewed": now, "ttl": 600}
    storage.write_bytes(storage.join(out, LEASE_FILE),
                        json.dumps(record).encode() + b" " * (1 << 20))
    with pytest.raises(StorageError, match="is not a writer lease"):
        WriterLease(out, "embed").acquire()


def test_a_fifo_in_place_of_the_lease_is_one_line_not_a_hang(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / LEASE_FILE)
    with pytest.raises(StorageError, match="is not a regular file, so not a writer lease"):
        WriterLease(str(out), "embed").acquire()
