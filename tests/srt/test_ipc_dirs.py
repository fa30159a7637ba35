"""IPC socket files: a private 0700 directory per server, removed on a
normal stop; the directories that killed servers left behind are removed at the next start.
A child whose parent died while it started exits instead of living on."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import subprocess
from pathlib import Path

import zmq

from srt.utils.process import IPC_DIR_PREFIX, PortArgs, remove_stale_ipc_dirs, zmq_socket


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_socket_paths_live_in_a_private_directory(short_tmp_path: Path) -> None:
    port_args = PortArgs.new(root=str(short_tmp_path))
    ipc_dir = Path(port_args.ipc_dir)
    assert ipc_dir.parent == short_tmp_path
    assert ipc_dir.name.startswith(f"{IPC_DIR_PREFIX}{os.getpid()}-")
    assert stat.S_IMODE(ipc_dir.stat().st_mode) == 0o700
    paths = [Path(p) for p in port_args.paths()]
    assert len(set(paths)) == 3 and all(p.parent == ipc_dir for p in paths)
    assert all(len(str(p)) < 100 for p in paths)  # sun_path holds 107 bytes
    port_args.cleanup()


def test_cleanup_after_use_leaves_nothing(short_tmp_path: Path) -> None:
    port_args = PortArgs.new(root=str(short_tmp_path))
    ctx = zmq.Context()
    endpoints = (port_args.tokenizer_ipc, port_args.scheduler_input_ipc, port_args.detokenizer_ipc)
    try:
        for endpoint in endpoints:
            pull = zmq_socket(ctx, zmq.PULL, endpoint, bind=True)
            push = zmq_socket(ctx, zmq.PUSH, endpoint, bind=False)
            push.send(b"x")
            assert pull.recv() == b"x"
        assert sorted(os.listdir(port_args.ipc_dir)) == ["detokenizer", "scheduler", "tokenizer"]
    finally:
        ctx.destroy(linger=0)
        port_args.cleanup()
    assert list(short_tmp_path.iterdir()) == []


def test_stale_directory_of_a_dead_server_is_removed_at_next_start(tmp_path: Path) -> None:
    stale = tmp_path / f"{IPC_DIR_PREFIX}{dead_pid()}-abc123"
    stale.mkdir(mode=0o700)
    (stale / "tokenizer").write_text("")
    live = tmp_path / f"{IPC_DIR_PREFIX}{os.getppid()}-def456"  # the pytest runner's parent
    live.mkdir()
    unrelated = [tmp_path / f"{IPC_DIR_PREFIX}cache", tmp_path / "other-123-abc"]
    for path in unrelated:
        path.mkdir()
    not_a_dir = tmp_path / f"{IPC_DIR_PREFIX}{dead_pid()}-file"
    not_a_dir.write_text("")

    port_args = PortArgs.new(root=str(tmp_path))

    assert not stale.exists()
    assert live.is_dir() and not_a_dir.is_file() and all(p.is_dir() for p in unrelated)
    assert Path(port_args.ipc_dir).is_dir()
    port_args.cleanup()
    assert not Path(port_args.ipc_dir).exists()


def test_remove_stale_ignores_a_missing_root(tmp_path: Path) -> None:
    assert remove_stale_ipc_dirs(str(tmp_path / "missing")) == []


def _child_of(parent_pid: int) -> None:
    from srt.utils.process import become_child

    become_child("test child", "error", parent_pid)
    os._exit(0)  # not reached when become_child sees a parent other than parent_pid


def test_child_whose_parent_died_during_startup_exits() -> None:
    """A spawned child arms PR_SET_PDEATHSIG only after its imports; if the parent died
    before that, no signal comes, so become_child checks the parent pid itself."""
    ctx = mp.get_context("spawn")
    orphan = ctx.Process(target=_child_of, args=(os.getpid() + 10**6,))  # a pid not ours
    orphan.start()
    orphan.join(60)
    assert orphan.exitcode == 1
    child = ctx.Process(target=_child_of, args=(os.getpid(),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
