"""A damaged MNIST-1D cache is named in one line and generated again, once, under a lock.

Real files in a tmp cache folder, 100 samples (generated in ~10 ms). Each case damages a good
cache the way a disk, an interrupted copy or a person can, then loads it.
"""

import fcntl
import os
import time

import numpy as np
import pytest

from flashsgd.train.data.mnist1d import CacheError, cache_file, generate_mnist1d, load_mnist1d

N, SEED = 100, 7
KEYS = ("x", "y", "x_test", "y_test")


@pytest.fixture(scope="module")
def reference():
    return dict(zip(KEYS, generate_mnist1d(N, SEED)))


@pytest.fixture
def cache(tmp_path):
    """A good cache file in ``tmp_path``, as load_mnist1d writes it."""
    load_mnist1d(N, SEED, cache_dir_=tmp_path)
    return cache_file(N, SEED, tmp_path)


def _entries(path):
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _save(path, entries):
    with open(path, "wb") as f:
        np.savez(f, **entries)


def truncated(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path):
    path.write_bytes(b"")


def garbage(path):
    path.write_bytes(np.random.RandomState(0).bytes(4096))


def missing_array(path):
    entries = _entries(path)
    del entries["y_test"]
    _save(path, entries)


def labels_zeroed(path):  # the checksum entry kept as it was
    entries = _entries(path)
    entries["y"] = np.zeros_like(entries["y"])
    _save(path, entries)


def old_format(path):  # what flashsgd wrote before the checksum: the four arrays alone
    entries = _entries(path)
    _save(path, {k: entries[k] for k in KEYS})


def pickled_member(path):
    entries = _entries(path)
    entries["y"] = np.array(list(entries["y"]), dtype=object)
    _save(path, entries)


def wrong_dtype(path):
    entries = _entries(path)
    entries["x"] = entries["x"].astype(np.float32)
    _save(path, entries)


CASES = [
    (truncated, "is truncated or damaged"),
    (empty, "is empty (0 bytes)"),
    (garbage, "is not an .npz archive"),
    (missing_array, "lacks the array y_test"),
    (labels_zeroed, "does not match its checksum"),
    (old_format, "has no checksum (an older flashsgd wrote it)"),
    (pickled_member, "is truncated or damaged (an entry is not a plain array)"),
    (wrong_dtype, "has x of float32 (80, 40), expected float64 (n, 40)"),
]


def _assert_right(got, reference):
    for tensor, key in zip(got, KEYS):
        np.testing.assert_array_equal(tensor.numpy(), reference[key].astype(tensor.numpy().dtype), err_msg=key)


@pytest.mark.parametrize("damage,reason", CASES, ids=[c[0].__name__ for c in CASES])
def test_a_damaged_cache_is_named_in_one_line_and_regenerated(cache, reference, capfd, damage, reason):
    damage(cache)
    capfd.readouterr()
    _assert_right(load_mnist1d(N, SEED, cache_dir_=cache.parent), reference)
    err = capfd.readouterr().err
    assert err.startswith(f"[flashsgd] MNIST-1D cache {cache} {reason}")
    assert err.endswith("; regenerated it\n") and err.count("\n") == 1
    assert "allow_pickle" not in err
    healed = _entries(cache)  # the file on disk is whole again: arrays and their checksum
    assert set(healed) == {*KEYS, "sha256"}
    for key in KEYS:
        np.testing.assert_array_equal(healed[key], reference[key])
    _assert_right(load_mnist1d(N, SEED, cache_dir_=cache.parent), reference)
    assert capfd.readouterr().err == ""  # and read without a word the next time


def test_an_old_format_cache_is_regenerated_to_the_same_bytes(cache):
    old_format(cache)
    old = _entries(cache)
    load_mnist1d(N, SEED, cache_dir_=cache.parent)
    new = _entries(cache)
    assert "sha256" in new
    for key in KEYS:  # deterministic generation: the same arrays, bit for bit
        assert new[key].dtype == old[key].dtype and new[key].tobytes() == old[key].tobytes(), key


def test_a_good_cache_is_read_not_rewritten(cache, capfd):
    before = cache.stat().st_mtime_ns, cache.read_bytes()
    capfd.readouterr()
    load_mnist1d(N, SEED, cache_dir_=cache.parent)
    assert (cache.stat().st_mtime_ns, cache.read_bytes()) == before
    assert capfd.readouterr().err == ""
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name, cache.name + ".lock"]


def test_a_cache_that_cannot_be_rewritten_is_refused_in_one_line(tmp_path, capfd):
    path = cache_file(N, SEED, tmp_path)
    (path / "inside").mkdir(parents=True)  # a folder where the file should be: not replaceable
    with pytest.raises(CacheError) as info:
        load_mnist1d(N, SEED, cache_dir_=tmp_path)
    assert capfd.readouterr().err == ""  # the refusal is the one line
    assert not path.with_name(path.name + ".tmp").exists()
    msg = str(info.value)
    assert msg.startswith(f"the MNIST-1D cache {path} cannot be read (Is a directory) and cannot be rewritten")
    assert "data.data_dir or $FLASHSGD_CACHE" in msg and "\n" not in msg


def test_a_cache_folder_that_cannot_be_created_is_refused_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CacheError, match=r"^cannot write the MNIST-1D cache .*/file/sub/mnist1d_100_7\.npz: "):
        load_mnist1d(N, SEED, cache_dir_=tmp_path / "file" / "sub")


def _hold_lock(path):
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def test_a_lock_held_too_long_is_named(cache):
    labels_zeroed(cache)
    fd = _hold_lock(cache)
    try:
        with pytest.raises(CacheError) as info:
            load_mnist1d(N, SEED, cache_dir_=cache.parent, lock_timeout_s=0.2)
    finally:
        os.close(fd)
    assert str(info.value) == (f"waited 0.2 s for the lock {cache}.lock on the MNIST-1D cache {cache} "
                               f"(held by pid {os.getpid()}); rerun when it is done")


def _child(cache_dir, out, go, ready):
    go.wait(60)  # until the test holds the lock (forked before it took it: not inherited)
    ready.set()
    np.savez(out, *[t.numpy() for t in load_mnist1d(N, SEED, cache_dir_=cache_dir, lock_timeout_s=60)])


def test_two_processes_loading_a_damaged_cache_regenerate_it_once(cache, reference, tmp_path, capfd):
    """Both wait for the lock (held here until both have started), one regenerates, both read it.

    Forked (torch is imported already: a spawned child takes seconds to import it); the children
    run numpy and scipy only, no OpenMP region.
    """
    import multiprocessing

    labels_zeroed(cache)
    damaged = cache.read_bytes()
    ctx = multiprocessing.get_context("fork")
    outs = [tmp_path / f"out{i}.npz" for i in range(2)]
    go, readies = ctx.Event(), [ctx.Event() for _ in outs]
    children = [ctx.Process(target=_child, args=(cache.parent, out, go, ready)) for out, ready in zip(outs, readies)]
    capfd.readouterr()
    try:
        for child in children:
            child.start()
        fd = _hold_lock(cache)
        try:
            go.set()
            assert all(ready.wait(60) for ready in readies), "the child processes did not start in 60 s"
            time.sleep(0.3)  # time to read the damaged file and reach the lock (the outcome does not depend on it)
            assert all(c.is_alive() for c in children), "a child finished while the lock was held"
            assert cache.read_bytes() == damaged, "the cache was rewritten while the lock was held"
        finally:
            os.close(fd)
        for child in children:
            child.join(120)
        assert [c.exitcode for c in children] == [0, 0]
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
                child.join()
    assert capfd.readouterr().err.splitlines() == [
        f"[flashsgd] MNIST-1D cache {cache} does not match its checksum (its contents were changed); regenerated it"]
    for out in outs:
        with np.load(out) as z:
            got = [z[f"arr_{i}"] for i in range(4)]
        for array, key in zip(got, KEYS):
            np.testing.assert_array_equal(array, reference[key].astype(array.dtype), err_msg=key)
    assert set(_entries(cache)) == {*KEYS, "sha256"}
