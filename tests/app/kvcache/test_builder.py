"""The variant builder: jobs wait for idle capacity, a full queue skips, failures are counted."""

from __future__ import annotations

import threading

from app.kvcache.builder import VariantBuilder


class FakeVariants:
    def __init__(self, fail: bool = False):
        self.calls: list[tuple] = []
        self.fail = fail
        self.started = threading.Event()

    def build(self, result, contexts, decoded) -> int:
        self.started.set()
        if self.fail:
            raise RuntimeError("boom")
        self.calls.append((result, contexts, decoded))
        return 2


def test_a_job_waits_until_no_request_runs_or_waits():
    idle = threading.Event()
    cache = FakeVariants()
    builder = VariantBuilder(cache, wait_idle=idle.wait)
    assert builder.submit("result", [(), (1,)], "decoded")
    assert not cache.started.wait(0.3)  # requests are running: nothing builds
    idle.set()
    builder.join()
    assert cache.calls == [("result", ((), (1,)), "decoded")] and builder.built == 2
    builder.close()


def test_a_full_queue_skips_and_a_failed_build_is_counted():
    gate = threading.Event()
    cache = FakeVariants(fail=True)
    builder = VariantBuilder(cache, max_pending=1, wait_idle=gate.wait)
    assert builder.submit("a", [], "decoded")
    while builder._jobs.qsize():  # the thread holds "a", waiting for idle
        threading.Event().wait(0.01)
    assert builder.submit("b", [], "decoded")
    assert not builder.submit("c", [], "decoded") and builder.skipped == 1
    gate.set()
    builder.join()
    assert builder.failed == 2 and builder.built == 0
    builder.close()


def test_close_finishes_queued_jobs_without_waiting_for_idle():
    cache = FakeVariants()
    builder = VariantBuilder(cache, wait_idle=threading.Event().wait)  # never idle
    builder.submit("a", [], "decoded")
    builder.close()
    assert [c[0] for c in cache.calls] == ["a"]


def test_a_build_runs_on_one_thread_or_on_a_passing_thread_with_the_engines_count():
    import torch

    from engine.model.work import is_background_thread

    class CountingVariants(FakeVariants):
        def build(self, result, contexts, decoded) -> int:
            self.calls.append((threading.current_thread().name, torch.get_num_threads()))
            assert is_background_thread()  # its work is counted as the builder's
            return 1

    for threads in (1, 2):
        cache = CountingVariants()
        builder = VariantBuilder(cache, build_threads=threads)
        builder.submit("a", [], "decoded")
        builder.close()
        ((name, count),) = cache.calls
        assert count == threads
        assert (name == "variant-builder") == (threads == 1)
