"""engine/serving/threads.py: helper threads run torch single-threaded; one-off work on a passing
thread."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.serving.threads import DEFAULT_THREADS, in_own_thread, single_threaded, use_threads


def test_in_own_thread_returns_or_raises_and_runs_elsewhere():
    here = threading.current_thread()
    assert in_own_thread(lambda: threading.current_thread() is not here)
    with pytest.raises(KeyError):
        in_own_thread(lambda: {}["missing"])


def test_a_single_threaded_thread_keeps_one_thread_and_others_keep_theirs():
    counts = {}
    use_threads(2)

    def helper():
        single_threaded()
        counts["helper"] = torch.get_num_threads()

    def worker():
        use_threads(2)
        counts["worker"] = torch.get_num_threads()

    for target in (worker, helper):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    counts["caller"] = torch.get_num_threads()
    assert counts == {"helper": 1, "worker": 2, "caller": 2}


def test_threads_that_have_not_chosen_run_single_threaded_once_one_pins_more():
    """The guard against stray pools (engine/serving/threads.py): after a thread pins two, a new
    thread
    adopts one; the pinned thread keeps two, and so does a passing thread asked for two."""
    counts = {}

    def pinned():
        use_threads(2)
        counts["pinned"] = torch.get_num_threads()
        stray = threading.Thread(target=lambda: counts.update(stray=torch.get_num_threads()))
        stray.start()
        stray.join()
        counts["pinned after"] = torch.get_num_threads()

    in_own_thread(pinned, threads=1)
    counts["passing"] = in_own_thread(torch.get_num_threads, threads=2)
    counts["default passing"] = in_own_thread(torch.get_num_threads)
    assert counts == {
        "pinned": 2,
        "stray": 1,
        "pinned after": 2,
        "passing": 2,
        "default passing": DEFAULT_THREADS,
    }
