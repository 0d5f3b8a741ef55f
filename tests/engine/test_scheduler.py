"""Continuous batching: a request's tokens are the same batched as alone, in every mode.

The model here is the tiny random Llama with its residual branches scaled up, so that greedy
answers vary from token to token (the plain tiny model repeats one token). Joins and leaves
are made deterministic by holding a prefill turn, which pauses decode steps.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import engine.serving.scheduler as scheduler_module
from engine import EngineConfig
from engine.engine import Engine
from engine.errors import EngineClosed
from engine.model.decode import SamplingParams
from engine.model.loader import wrap_model
from engine.planners import Mode, planner_names
from tests.conftest import build_tiny_model
from tests.engine.batching import (
    BUDGETS,
    QUESTIONS,
    StepRecorder,
    decode_alone,
    decode_joined,
    prefill,
)
from tests.engine.helpers import answer_ids, chunk_inputs


@pytest.fixture(scope="module")
def lively_loaded(smol_tokenizer):
    model = build_tiny_model(len(smol_tokenizer), seed=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(16)
            layer.self_attn.o_proj.weight.mul_(16)
    return wrap_model(model, smol_tokenizer)


def make_engine(loaded, tmp_path_factory, **options) -> Engine:
    return Engine(
        EngineConfig(data_dir=tmp_path_factory.mktemp("sched"), epic_tokens=4, **options), loaded
    )


@pytest.fixture(scope="module")
def engines(lively_loaded, tmp_path_factory):
    built = {
        name: make_engine(lively_loaded, tmp_path_factory, **options)
        for name, options in (
            ("alone", {"batching": False}),
            ("batched", {}),
            ("invariant", {"batch_invariant": True}),
        )
    }
    yield built
    for engine in built.values():
        engine.close()


@pytest.fixture(scope="module")
def chunks(engines):
    return chunk_inputs(engines["alone"])


@pytest.fixture
def steps(monkeypatch):
    recorder = StepRecorder(scheduler_module.decode_batch)
    monkeypatch.setattr(scheduler_module, "decode_batch", recorder)
    return recorder


@pytest.mark.parametrize("mode", planner_names())
def test_greedy_tokens_are_the_same_batched_as_alone(engines, chunks, mode, steps):
    alone = decode_alone(engines["alone"], chunks, mode)
    assert any(len(set(tokens)) > 1 for tokens in alone)  # the answers are not one repeated token
    assert [len(t) for t in alone] == BUDGETS
    assert decode_joined(engines["batched"], chunks, mode, steps) == alone
    assert steps.sizes[:6] == [1, 1, 1, 4, 4, 3]  # alone, then all four, then 3 has left


@pytest.mark.parametrize("mode", ["full", "cacheblend", "cachecraft"])
def test_invariant_batching_is_bitwise_alone(engines, chunks, mode, steps):
    engine = engines["invariant"]
    assert decode_joined(engine, chunks, mode, steps) == decode_alone(engine, chunks, mode)


def test_a_cancelled_request_leaves_and_the_others_go_on(engines, chunks, steps):
    alone = decode_alone(engines["alone"], chunks, "cacheblend")
    joined = decode_joined(engines["batched"], chunks, "cacheblend", steps, cancel=2)
    assert joined[2] == []  # cancelled before its consumer read a token
    assert [joined[i] for i in (0, 1, 3)] == [alone[i] for i in (0, 1, 3)]
    assert steps.sizes[:6] == [1, 1, 1, 4, 3, 2]  # 2 left at once, 3 after its budget
    assert engines["batched"].scheduler.num_active == 0


def test_a_seeded_sampled_request_draws_the_same_tokens_batched(engines, chunks, steps):
    params = SamplingParams(max_new_tokens=14, temperature=0.9, top_p=0.95, seed=1234)
    alone = decode_alone(engines["alone"], chunks, "cacheblend", params)
    assert decode_joined(engines["batched"], chunks, "cacheblend", steps, params) == alone
    assert (
        alone[0]
        != decode_alone(
            engines["alone"],
            chunks,
            "cacheblend",
            SamplingParams(max_new_tokens=14, temperature=0.9, top_p=0.95, seed=99),
        )[0]
    )  # the seed matters


def test_bounds_hold_the_batch_and_everyone_finishes(
    lively_loaded, tmp_path_factory, chunks, steps
):
    engine = make_engine(lively_loaded, tmp_path_factory, max_batch=2)
    try:
        assert decode_joined(engine, chunks, "naive", steps) == decode_alone(
            engine, chunks, "naive"
        )
        assert max(steps.sizes) == 2
    finally:
        engine.close()
    steps.sizes.clear()
    # one request at a time
    engine = make_engine(lively_loaded, tmp_path_factory, max_batch_tokens=1)
    try:
        assert [len(ids) for ids in decode_joined(engine, chunks, "naive", steps)] == BUDGETS
        assert set(steps.sizes) == {1}
    finally:
        engine.close()


def test_no_decode_step_starts_while_a_prefill_is_pending(engines, chunks):
    engine = engines["batched"]
    result = prefill(engine, chunks, 0, "naive")
    steps = engine.scheduler.num_steps
    with engine.scheduler.prefill_turn():
        stream = engine.generate(result, SamplingParams(max_new_tokens=8))
        time.sleep(0.3)
        assert engine.scheduler.num_steps == steps and engine.scheduler.num_waiting == 1
    list(stream)
    assert len(stream.decoded().token_ids) == 8 and engine.scheduler.num_steps >= steps + 7


def test_requests_from_many_threads_match_alone(engines, chunks):
    alone = decode_alone(engines["alone"], chunks, "epic")
    engine, got = engines["batched"], [None] * len(QUESTIONS)

    def ask(i):
        result = prefill(engine, chunks, i, "epic")
        got[i] = answer_ids(engine, result, SamplingParams(max_new_tokens=BUDGETS[i]))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert got == alone


def test_closing_ends_decoding_requests_and_refuses_new_ones(
    lively_loaded, tmp_path_factory, chunks
):
    engine = make_engine(lively_loaded, tmp_path_factory)
    result = prefill(engine, chunks, 0, "naive")
    with engine.scheduler.prefill_turn():
        stream = engine.generate(result, SamplingParams(max_new_tokens=14))
        engine.scheduler.close(timeout=None)
    with pytest.raises(EngineClosed):
        list(stream)
    with pytest.raises(EngineClosed):
        list(engine.generate(prefill(engine, chunks, 1, "naive"), SamplingParams(max_new_tokens=4)))


def test_bad_bounds_are_refused(lively_loaded, tmp_path_factory):
    with pytest.raises(ValueError, match="max_batch"):
        make_engine(lively_loaded, tmp_path_factory, max_batch=0)


def test_engine_compute_runs_on_the_scheduler_thread(engines, chunks, monkeypatch):
    engine = engines["batched"]
    threads = []
    run = engine.runner.run

    def recording_run(*args, **kwargs):
        threads.append(threading.current_thread())
        return run(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", recording_run)
    prefill(engine, chunks, 0, "cacheblend")
    engine.encode_chunk(chunks[0].token_ids)
    assert engine.computes_on_scheduler
    assert threads and all(t is engine.scheduler._thread for t in threads)


def test_a_call_returns_its_value_raises_its_error_and_may_nest(engines):
    scheduler = engines["batched"].scheduler
    assert scheduler.call(lambda: threading.current_thread().name) == "kvmosaic-decode"
    assert scheduler.call(lambda: scheduler.call(lambda: 7) + 1) == 8  # a nested call runs at once
    with pytest.raises(ZeroDivisionError):
        scheduler.call(lambda: 1 / 0)
    assert scheduler.call(lambda: "still serving") == "still serving"


def test_calls_run_while_decode_steps_are_paused(engines, chunks):
    engine = engines["batched"]
    result = prefill(engine, chunks, 0, "naive")
    with engine.scheduler.prefill_turn():  # as with more prefill slots: no step starts
        stream = engine.generate(result, SamplingParams(max_new_tokens=4))
        steps = engine.scheduler.num_steps
        assert engine.scheduler.call(lambda: "ran") == "ran"
        assert engine.scheduler.num_steps == steps
    list(stream)
    assert len(stream.decoded().token_ids) == 4


def test_background_work_run_for_a_marked_thread_counts_as_background(engines, chunks):
    engine = engines["batched"]
    meter = engine.runner.meter
    before, background_before = meter.snapshot(), meter.background_snapshot()

    def builder():
        from engine.model.work import mark_background_thread

        mark_background_thread()
        prefill(engine, chunks, 1, "full")

    thread = threading.Thread(target=builder)
    thread.start()
    thread.join(60)
    prefill(engine, chunks, 2, "full")
    background = meter.background_snapshot() - background_before
    total = meter.snapshot() - before
    assert background.runs == 1 and total.runs == 2 and 0 < background.layer_rows < total.layer_rows


def test_pending_calls_fail_when_the_scheduler_closes(lively_loaded, tmp_path_factory):
    engine = make_engine(lively_loaded, tmp_path_factory)
    started, release = threading.Event(), threading.Event()
    outcome = []

    def blocker():
        started.set()
        release.wait(10)

    first = threading.Thread(target=lambda: engine.scheduler.call(blocker))
    first.start()
    started.wait(10)

    def second_call():
        try:
            engine.scheduler.call(lambda: "never")
        except EngineClosed as error:
            outcome.append(error)

    second = threading.Thread(target=second_call)
    second.start()
    time.sleep(0.2)  # the second call is queued behind the first
    closer = threading.Thread(target=engine.scheduler.close, kwargs={"timeout": None})
    closer.start()
    release.set()
    for thread in (first, second, closer):
        thread.join(10)
    assert len(outcome) == 1
    with pytest.raises(EngineClosed):
        engine.scheduler.call(lambda: "refused")


def test_a_request_whose_token_pick_fails_gets_the_error_and_the_others_go_on(
    engines, chunks, monkeypatch
):
    engine = engines["batched"]
    real_pick = scheduler_module.pick_token
    calls = []

    def failing_once(logits, params, generator):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("probability tensor contains nan")
        return real_pick(logits, params, generator)

    monkeypatch.setattr(scheduler_module, "pick_token", failing_once)
    with pytest.raises(RuntimeError, match="nan"):
        list(engine.generate(prefill(engine, chunks, 0, "naive"), SamplingParams(max_new_tokens=4)))
    result = prefill(engine, chunks, 1, "naive")
    assert len(answer_ids(engine, result, SamplingParams(max_new_tokens=4))) == 4


def test_a_failing_scheduler_thread_fails_its_waiters_and_a_new_one_serves(
    lively_loaded, tmp_path_factory, chunks, monkeypatch
):
    engine = make_engine(lively_loaded, tmp_path_factory)
    real_admit = scheduler_module.DecodeScheduler._admit
    failures = []

    def admit_failing_once(self):
        if not failures:
            failures.append(1)
            raise RuntimeError("a scheduler bug")
        real_admit(self)

    monkeypatch.setattr(scheduler_module.DecodeScheduler, "_admit", admit_failing_once)
    with pytest.raises(RuntimeError, match="scheduler bug"):
        list(engine.generate(prefill(engine, chunks, 0, "naive"), SamplingParams(max_new_tokens=4)))
    result = prefill(engine, chunks, 1, "naive")  # a fresh scheduler thread runs it
    assert len(answer_ids(engine, result, SamplingParams(max_new_tokens=4))) == 4
    engine.close()


def queue_prefill_before_step(engine, chunks, steps, step: int, out: list) -> threading.Thread:
    """Before the scheduler's `step`-th step from now, another thread asks for request 1's full
    prefill; the step starts once that prefill waits in the scheduler's line."""
    thread = threading.Thread(target=lambda: out.append(prefill(engine, chunks, 1, "full")))

    def queue() -> None:
        thread.start()
        deadline = time.monotonic() + 30
        while not engine.scheduler._jobs and time.monotonic() < deadline:
            time.sleep(0.001)

    steps.actions[len(steps.sizes) + step] = queue
    return thread


@pytest.mark.parametrize(("gap_ms", "steps_inside"), [(0, 3), (60000, 0)])
def test_a_prefill_lets_decode_steps_run_between_its_layers(
    lively_loaded, tmp_path_factory, chunks, steps, gap_ms, steps_inside
):
    engine = make_engine(lively_loaded, tmp_path_factory, decode_gap_ms=gap_ms)
    params = SamplingParams(max_new_tokens=40)

    def decoding():
        return engine.prefill(chunks, QUESTIONS[0], mode=Mode.named("full"), max_new_tokens=40)

    try:
        assert engine.loaded.spec.num_layers == 4  # three points between layers
        reference = prefill(engine, chunks, 1, "full")  # nobody decoding
        alone = answer_ids(engine, decoding(), params)
        assert len(alone) == 40
        queued: list = []
        thread = queue_prefill_before_step(engine, chunks, steps, 2, queued)
        before = engine.scheduler.num_interleaved
        assert answer_ids(engine, decoding(), params) == alone
        thread.join(60)
        assert engine.scheduler.num_interleaved - before == steps_inside
        (result,) = queued
        assert torch.equal(result.logits, reference.logits)
        length = reference.cache.length
        assert torch.equal(
            result.cache.data[..., :length, :], reference.cache.data[..., :length, :]
        )
    finally:
        engine.close()


def test_interleave_is_a_no_op_off_the_scheduler_thread(engines, chunks):
    engine = engines["batched"]
    result = prefill(engine, chunks, 0, "naive")
    scheduler = scheduler_module.DecodeScheduler(engine.stack, decode_gap_s=0)  # never started
    # a request waits to join, so a step is due
    waiting = scheduler_module._Sequence(
        result.cache, result.logits, SamplingParams(max_new_tokens=4), ()
    )
    scheduler._waiting.append(waiting)
    assert scheduler._step_due()
    scheduler.interleave()  # this test's thread is not the scheduler's: no step
    assert (scheduler.num_steps, scheduler.num_interleaved) == (0, 0)
    assert scheduler.num_waiting == 1 and waiting.num_picked == 0


def test_decode_weights_are_built_at_start_up(engines):
    stack = engines["batched"].stack
    assert stack.native is not None or stack.native_unfit is not None


def test_a_request_that_joins_gets_its_first_token_at_the_next_pause_point(
    lively_loaded, tmp_path_factory, chunks
):
    engine = make_engine(lively_loaded, tmp_path_factory, decode_gap_ms=60000)
    result = prefill(engine, chunks, 0, "naive")
    scheduler = engine.scheduler

    def computation():  # a prefill's stand-in: a request joins while it runs
        stream = scheduler.submit(result.cache, result.logits, SamplingParams(max_new_tokens=4), ())
        steps = scheduler.num_steps
        scheduler.interleave()  # joining: due at once, whatever the gap
        joined = scheduler.num_steps - steps
        scheduler.interleave()  # decoding, 60 s gap not reached: no step
        return stream, joined, scheduler.num_steps - steps

    try:
        stream, joined, stepped = scheduler.call(computation)
        assert (joined, stepped) == (1, 1)
        assert len(list(stream)) == 4
    finally:
        engine.close()
