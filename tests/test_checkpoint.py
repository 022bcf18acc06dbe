"""flashsgd.train.records.checkpoint: the ``latest`` pointer, damaged checkpoints, pruning among runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashsgd.train.records import checkpoint as ckpt


def _write(root: Path, step: int, world: int) -> Path:
    """A checkpoint as :func:`ckpt.save` lays it out, written without a process group."""
    target = root / f"step-{step:08d}"
    target.mkdir(parents=True)
    meta = {"format": ckpt.FORMAT, "step": step, "world_size": world}
    torch.save({"meta": meta, "model": {"w": torch.full((3,), float(step))}}, target / "shared.pt")
    for r in range(world):
        torch.save({"meta": meta, "rank": r}, target / f"rank-{r:05d}.pt")
    return target


def _point(root: Path, text: str) -> None:
    (root / "latest").write_text(text)


def test_the_newest_intact_checkpoint_is_found_whatever_latest_says(tmp_path):
    """One rule (issue 23 item 7): a missing, empty, invalid or dangling ``latest`` resumes from the
    newest intact checkpoint with a note saying why; it is an error only when none is intact."""
    assert ckpt.find_latest(tmp_path) is None and ckpt.resume_point(tmp_path) == (None, None)
    intact = _write(tmp_path, 4, world=2)
    # no `latest` at all (deleted): the intact checkpoint is not discarded
    target, note = ckpt.resume_point(tmp_path)
    assert target == intact and ckpt.find_latest(tmp_path) == intact
    assert note == f"{tmp_path / 'latest'} is missing; resuming from the newest intact checkpoint step-00000004 instead"
    cases = {"": "latest is empty (it should name the newest checkpoint directory",
             "\n": "latest is empty",
             "banana": "names 'banana', which is not a checkpoint name",
             "../step-00000004": "which is not a checkpoint name",
             "step-00000009": "names 'step-00000009', which does not exist"}
    (tmp_path / "step-00000007").mkdir()
    cases["step-00000007"] = "names 'step-00000007', which is not a checkpoint (no shared.pt)"
    for text, expected in cases.items():
        _point(tmp_path, text)
        target, note = ckpt.resume_point(tmp_path)
        assert target == intact and ckpt.find_latest(tmp_path) == intact, text
        assert expected in note and note.endswith("checkpoint step-00000004 instead"), (text, note)
    # no intact checkpoint left: an error that says what `latest` named, never "no checkpoint"
    (intact / "shared.pt").write_bytes(b"")
    for text in ("", "step-00000009"):
        _point(tmp_path, text)
        with pytest.raises(ckpt.CheckpointError, match="intact checkpoint in .* to resume from"):
            ckpt.resume_point(tmp_path)
    # no `latest` and nothing intact (killed while writing the first checkpoint): fresh, and says so
    (tmp_path / "latest").unlink()
    assert ckpt.resume_point(tmp_path) == (
        None, "no intact checkpoint (damaged or unfinished: step-00000004, step-00000007)")


def test_checkpoints_above_the_step_latest_names_are_not_resumed(tmp_path):
    """``latest`` naming a missing step: the newest intact one at or below it (above: another run)."""
    below, above = _write(tmp_path, 4, world=2), _write(tmp_path, 24, world=2)
    _point(tmp_path, "step-00000012\n")
    target, note = ckpt.resume_point(tmp_path)
    assert target == below and "names 'step-00000012', which does not exist" in note
    (tmp_path / "latest").unlink()
    assert ckpt.resume_point(tmp_path)[0] == above


def test_damaged_latest_falls_back_to_the_older_intact_one_with_a_note(tmp_path):
    old, new = _write(tmp_path, 4, world=2), _write(tmp_path, 8, world=2)
    _point(tmp_path, new.name + "\n")
    assert ckpt.resume_point(tmp_path) == (new, None)
    for name, damage in (("rank-00001.pt", b"\x00" * 10), ("shared.pt", b"not a checkpoint")):
        good = (new / name).read_bytes()
        (new / name).write_bytes(damage)
        target, note = ckpt.resume_point(tmp_path)
        assert target == old
        assert f"checkpoint file {new / name} is corrupt" in note
        assert note.endswith("resuming from the older intact checkpoint step-00000004 instead")
        (new / name).write_bytes(good)
    (new / "rank-00001.pt").unlink()
    assert ckpt.resume_point(tmp_path)[0] == old
    (old / "shared.pt").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match="is missing; no older intact checkpoint in"):
        ckpt.resume_point(tmp_path)


def test_loading_a_damaged_checkpoint_offers_the_older_intact_one(tmp_path):
    old, new = _write(tmp_path, 4, world=1), _write(tmp_path, 8, world=1)
    shared, local = ckpt.load(new, 0, 1)
    assert shared["meta"]["step"] == 8 and local["rank"] == 0
    (new / "shared.pt").write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(new, 0, 1)
    assert "is corrupt or not a flashsgd checkpoint" in str(err.value)
    assert f"the newest intact checkpoint before it is {old}: resume from it explicitly" in str(err.value)
    torch.save({"meta": {"format": ckpt.FORMAT, "step": 4, "world_size": 1}},
               new / "shared.pt")  # the rank file says step 8: a stale mix, not this checkpoint
    with pytest.raises(ckpt.CheckpointError, match="rank 0's file is from step 8, shared.pt from 4"):
        ckpt.load(new, 0, 1)


def test_prune_keeps_the_newest_at_or_below_the_step_and_leaves_higher_ones(tmp_path):
    for step in (2, 4, 6, 16, 24):
        _write(tmp_path, step, world=1)
    (tmp_path / "step-notes").mkdir()  # not a checkpoint name: never touched
    deleted = ckpt.prune(tmp_path, 6, keep=2)
    assert [p.name for p in deleted] == ["step-00000002"]
    assert [s for s, _ in ckpt.step_dirs(tmp_path)] == [4, 6, 16, 24]
    assert (tmp_path / "step-notes").is_dir()
    with pytest.raises(ValueError, match="keep must be an integer >= 1"):
        ckpt.prune(tmp_path, 6, keep=0)


def _save_steps(root: str, steps: list[int], keep: int) -> list[str]:
    """Each rank saves at ``steps``; returns what ``latest`` named after each save (rank 0)."""
    rank, seen = dist.get_rank(), []
    for step in steps:
        shared = {"model": {"w": torch.full((3,), float(step))}} if rank == 0 else None
        ckpt.save(root, step, shared, {"rank": rank}, keep=keep)
        dist.barrier()
        seen.append((Path(root) / "latest").read_text().strip())
    return seen


def test_save_never_leaves_latest_dangling_over_an_older_run(tmp_path, run_ranks):
    # an older run of 4 workers finished at step 24 in the same directory
    for step in (16, 24):
        _write(tmp_path, step, world=4)
    _point(tmp_path, "step-00000024\n")
    seen = run_ranks(_save_steps, 2, str(tmp_path), [4, 8, 12], 2)[0]
    assert seen == ["step-00000004", "step-00000008", "step-00000012"]
    assert [s for s, _ in ckpt.step_dirs(tmp_path)] == [8, 12, 16, 24]  # the old run's are kept
    target, note = ckpt.resume_point(tmp_path)
    assert target.name == "step-00000012" and note is None
    shared, local = ckpt.load(target, 1, 2)
    assert shared["model"]["w"].tolist() == [12.0] * 3 and local["rank"] == 1
    # this run reaches the old run's step 16: its directory now holds only this run's files
    run_ranks(_save_steps, 2, str(tmp_path), [16], 2)
    assert sorted(p.name for p in (tmp_path / "step-00000016").iterdir()) == \
        ["manifest.json", "rank-00000.pt", "rank-00001.pt", "shared.pt"]
    assert [s for s, _ in ckpt.step_dirs(tmp_path)] == [12, 16, 24]
    assert ckpt.resume_point(tmp_path)[0].name == "step-00000016"


# ------------------------------------------------------------------------------ RNG states -------
def _draws():
    import random

    import numpy as np
    return torch.rand(3), np.random.rand(3), random.random()


def test_rng_state_round_trip_and_a_cuda_state_is_ignored_without_cuda():
    """CPU, numpy and Python streams continue exactly; a checkpoint written with CUDA (a "cuda"
    entry) restores on a machine without CUDA, its CUDA part ignored (set_rng_state's docstring)."""
    state = ckpt.rng_state()
    assert ("cuda" in state) == torch.cuda.is_initialized()
    first = _draws()
    with_cuda = {**state, "cuda": torch.zeros(16, dtype=torch.uint8)}  # a CUDA generator's 16 bytes
    for saved in (state, with_cuda) if not torch.cuda.is_available() else (state,):
        ckpt.set_rng_state(saved)
        again = _draws()
        assert torch.equal(first[0], again[0]) and (first[1] == again[1]).all() and first[2] == again[2]


def test_rng_state_saves_and_restores_the_current_cuda_generator(monkeypatch):
    """The CUDA branch, on any machine: saved once CUDA is initialised, restored where it is
    available (torch.cuda stood in for by recorders; the real generator is tested below)."""
    restored = []
    fake = torch.arange(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": fake.clone())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.append(s))
    state = ckpt.rng_state()
    assert torch.equal(state["cuda"], fake)
    ckpt.set_rng_state(state)
    assert len(restored) == 1 and torch.equal(restored[0], fake)
    del state["cuda"]  # a CPU run's checkpoint resumed with CUDA: CUDA's generator left as seeded
    ckpt.set_rng_state(state)
    assert len(restored) == 1


@pytest.mark.gpu
def test_cuda_rng_state_round_trip(tmp_path):
    torch.rand(1, device="cuda")  # initialise CUDA
    state = ckpt.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    first = torch.rand(5, device="cuda")
    torch.rand(7, device="cuda")
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(first, torch.rand(5, device="cuda"))


# ------------------------------------------------------------------------------ damage -----------
W = torch.full((300,), 1.2345)  # a tensor whose bytes are easy to find in shared.pt


def _save_two(root: str) -> None:
    """Checkpoints of steps 4 and 8 by 2 ranks, through :func:`ckpt.save`."""
    rank = dist.get_rank()
    for step in (4, 8):
        shared = {"model": {"w": W * step, "b": torch.zeros(7)}} if rank == 0 else None
        ckpt.save(root, step, shared, {"rank": rank, "residual": torch.full((50,), float(step + rank))}, keep=2)


class Payload:
    """Anything but tensors and plain values: what ``weights_only=True`` refuses to unpickle."""


def test_a_byte_flipped_anywhere_in_a_checkpoint_is_found_and_the_older_one_resumed(tmp_path, run_ranks):
    """Issue 33 item 1: torch.load checks no record, so a flipped byte used to load silently. The
    manifest's CRC-32 of every file finds it wherever it is (zip padding included)."""
    import random

    run_ranks(_save_two, 2, str(tmp_path))
    new = tmp_path / "step-00000008"
    assert ckpt.damage(new) is None and ckpt.resume_point(tmp_path) == (new, None)
    rng = random.Random(33)
    for name in ("shared.pt", "rank-00000.pt", "rank-00001.pt"):
        path = new / name
        original = path.read_bytes()
        for offset in rng.sample(range(len(original)), 10):
            flipped = bytearray(original)
            flipped[offset] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(flipped))
            problem = ckpt.damage(new)
            assert problem is not None and str(path) in problem, (name, offset)
            target, note = ckpt.resume_point(tmp_path)
            assert target.name == "step-00000004" and "resuming from the older intact checkpoint" in note
            with pytest.raises(ckpt.CheckpointError, match="newest intact checkpoint before it is"):
                ckpt.load(new, int(name == "rank-00001.pt"), 2)  # what that rank's worker reads
        path.write_bytes(original)
    assert ckpt.damage(new) is None


def test_a_checkpoint_without_manifest_is_checked_record_by_record(tmp_path, run_ranks):
    run_ranks(_save_two, 2, str(tmp_path))
    new = tmp_path / "step-00000008"
    (new / "manifest.json").unlink()  # as a flashsgd before the manifest wrote it
    assert ckpt.damage(new) is None
    path = new / "shared.pt"
    data = bytearray(path.read_bytes())
    at = bytes(data).index((W * 8)[:4].numpy().tobytes())  # inside the tensor's record
    data[at + 1] ^= 0x10
    path.write_bytes(bytes(data))
    assert "fails its CRC-32 check" in ckpt.damage(new)  # torch.load alone loads it


def test_a_file_holding_objects_is_refused_before_start_without_the_unsafe_advice(tmp_path, run_ranks):
    """Issue 33 item 2: a rank file that is not tensors and plain values is refused when the resume
    point is chosen (before any worker starts), the older checkpoint resumed, and torch's advice to
    load it with weights_only=False is never repeated."""
    run_ranks(_save_two, 2, str(tmp_path))
    new = tmp_path / "step-00000008"
    meta = {"format": ckpt.FORMAT, "step": 8, "world_size": 2}
    torch.save({"meta": meta, "rank": 1, "x": Payload()}, new / "rank-00001.pt")
    (new / "manifest.json").unlink()  # the manifest would already refuse it: check the content itself
    problem = ckpt.damage(new)
    assert "rank-00001.pt holds objects other than tensors and plain values" in problem
    assert "weights_only" not in problem and "trust" not in problem
    assert ckpt.resume_point(tmp_path)[0].name == "step-00000004"
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.verify(new)
    assert f"the newest intact checkpoint before it is {tmp_path / 'step-00000004'}" in str(err.value)
    with pytest.raises(ckpt.CheckpointError, match="holds no checkpoint .*the newest intact one in it is"):
        ckpt.verify(tmp_path)  # the checkpoints directory itself, not a step of it


def test_a_run_whose_newest_checkpoint_was_altered_resumes_exactly_from_the_older_one(tmp_path):
    """Issue 33: a byte flipped in the newest checkpoint's weights; the rerun says so, resumes from
    the checkpoint before it, and ends with the uninterrupted run's losses and weights."""
    import json

    from flashsgd.train import config as C
    from flashsgd.train.trainer import train

    def cfg(out, **cli):
        return C.resolve(cli={"num_samples": 2000, "epochs": 2.0, "global_batch": 256, "progress": False,
                              "deterministic": True, "seed": 3, "workers": 2, "checkpoint_every": 3,
                              "out": str(tmp_path / out), **cli})

    def losses(out):  # by step: a step run again after the resume supersedes its first row
        rows = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        by_step = {r["step"]: r["loss"] for r in rows if r.get("kind") == "step"}
        return [by_step[s] for s in sorted(by_step)]

    train(cfg("a"))
    train(cfg("b", max_steps=7))  # checkpoints at steps 3, 6 and the stop at 7
    newest = tmp_path / "b" / "checkpoints" / "step-00000007" / "shared.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x04
    newest.write_bytes(bytes(data))
    train(cfg("b"))
    resumed = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
               if '"resume"' in line]
    assert [r["step"] for r in resumed] == [6]  # the checkpoint before the altered one
    assert losses("a") == losses("b") and len(losses("a")) == 14
    final = [tmp_path / run / "checkpoints" / "step-00000014" / "shared.pt" for run in ("a", "b")]
    fa, fb = (torch.load(f, weights_only=True)["model"] for f in final)
    assert all(torch.equal(fa[k], fb[k]) for k in fa)


def test_a_full_disk_inside_torch_save_is_reported_as_the_os_error(tmp_path, monkeypatch):
    """Issue 33 item 5: torch.save turns a refused write into "[enforce fail at inline_container.cc]
    ... unexpected pos"; the cause (ENOSPC, the file) is what is raised, and no temp file is left."""
    import errno

    real = ckpt._Checksummed.write

    def full_after_4k(self, data):
        if self.size > 4096:
            self.failed = OSError(errno.ENOSPC, "No space left on device")
            raise self.failed
        return real(self, data)

    monkeypatch.setattr(ckpt._Checksummed, "write", full_after_4k)
    path = tmp_path / "shared.pt"
    with pytest.raises(OSError) as err:
        ckpt._atomic_save({"w": torch.randn(10_000)}, path)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert "No space left on device" in str(err.value) and "inline_container" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ belonging --------
def _save_runs(root: str) -> None:
    """Run "a" saves steps 4 and 8 in ``root/a``, run "b" step 8 in ``root/b`` (2 ranks)."""
    rank = dist.get_rank()
    for run, steps in (("a", (4, 8)), ("b", (8,))):
        for step in steps:
            shared = {"model": {"w": W * step}} if rank == 0 else None
            ckpt.save(Path(root) / run, step, shared, {"rank": rank}, keep=2, run={"id": run})


def test_a_checkpoint_of_another_run_is_passed_over_like_a_damaged_one(tmp_path, run_ranks):
    """Issue 49 item 3: every file records the run's id; given this run's, a step directory (or a
    rank file) of another run is not resumed, with the note a corrupt one gets."""
    import shutil

    run_ranks(_save_runs, 2, str(tmp_path))
    a, b = tmp_path / "a", tmp_path / "b"
    assert ckpt.resume_point(a, run="a") == (a / "step-00000008", None)
    _, meta, _ = ckpt.resume_checkpoint(a, run="a")
    assert meta["step"] == 8 and ckpt.run_id(meta) == "a"
    shutil.rmtree(a / "step-00000008")
    shutil.copytree(b / "step-00000008", a / "step-00000008")
    assert ckpt.damage(a / "step-00000008") is None  # intact: only the run it belongs to differs
    target, note = ckpt.resume_point(a, run="a")
    assert target == a / "step-00000004"
    assert note == (f"checkpoint {a / 'step-00000008'} belongs to another run (its run id b, this run's "
                    "a): copied from elsewhere; resuming from the older intact checkpoint step-00000004 instead")
    assert ckpt.resume_point(a)[0] == a / "step-00000008"  # without the run's id: any run's
    # one rank file of another run in a checkpoint without manifest (the manifest's CRC finds it first)
    own = a / "step-00000004"
    (own / "manifest.json").unlink()
    torch.save({"meta": {**torch.load(own / "rank-00000.pt", weights_only=True)["meta"], "run": {"id": "b"}},
                "rank": 1}, own / "rank-00001.pt")
    assert "rank 1's file is from another run (run id b, shared.pt's a)" in ckpt.damage(own)
