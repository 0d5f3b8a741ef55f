"""engine/threads.py: helper threads run torch single-threaded; one-off work on a passing thread."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.threads import DEFAULT_THREADS, in_own_thread, single_threaded, use_threads


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
    use_threads(DEFAULT_THREADS)  # the process-wide count back, for the threads of later tests
    assert counts == {"helper": 1, "worker": 2, "caller": 2}
