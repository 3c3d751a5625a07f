"""The batching scheduler under faults (runtime/batch.py): an exception inside its thread fails the
generations it touched with that error and the scheduler goes on serving; where it cannot clean up,
it says so (healthy False, /health 503) until a step runs again; if its thread ends, every waiting
generation fails and new ones are refused. No generation ever hangs. Cancelling a generation that
waits for a slot ends it at once."""
from __future__ import annotations

import re
import threading
import time

import pytest

import runtime

PROMPT = list(range(3, 120))
HANG_S = 60  # a generation not ended by then hangs


@pytest.fixture(scope="module")
def path(tiny_artifact):
    return tiny_artifact("tiny-llama", "fp32", max_length=256)


@pytest.fixture(scope="module")
def want(path):
    return runtime.load(path).generate(PROMPT, max_new_tokens=40)


@pytest.fixture
def batched(path):
    gen = runtime.load(path, parallel=2)
    yield gen
    gen.close()


def side_by_side(gen, n, **kwargs):
    """n generations at once, each in its own thread: their outputs or exceptions, in order."""
    results = [None] * n

    def run(i):
        try:
            results[i] = gen.generate(PROMPT, **{"max_new_tokens": 40, **kwargs})
        except Exception as e:
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
        assert not t.is_alive(), "a generation hangs"
    return results


def fail_once(obj, name, error):
    real, calls = getattr(obj, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*args, **kwargs)
    setattr(obj, name, wrapper)


def serves_again(gen, want):
    assert gen.generate(PROMPT, max_new_tokens=40).token_ids == want.token_ids
    assert gen.scheduler.healthy and gen.scheduler.load == (0, 0) and gen.engine.open_sequences == 0


def test_a_fault_of_the_scheduler_fails_the_generations_it_holds(batched, want):
    fail_once(batched.scheduler, "_tree_sizes", RuntimeError("injected scheduler fault"))
    results = side_by_side(batched, 2)
    assert any(isinstance(r, RuntimeError) and "injected" in str(r) for r in results)
    assert all(isinstance(r, RuntimeError) or r.token_ids == want.token_ids for r in results)
    serves_again(batched, want)


def test_a_fault_while_freeing_a_slot_does_not_hang_its_generation(batched, want):
    fail_once(batched.engine, "fit", RuntimeError("injected fit fault"))
    results = side_by_side(batched, 2)
    assert all(isinstance(r, RuntimeError) or r.token_ids == want.token_ids for r in results)
    serves_again(batched, want)


def test_a_fault_it_cannot_clean_up_after_is_reported_until_a_step_runs(batched, want):
    engine, real_close = batched.engine, batched.engine.close_sequence
    fail_once(batched.scheduler, "_tree_sizes", RuntimeError("injected scheduler fault"))
    closes = []

    def close_failing_first(seq):
        closes.append(seq)
        if len(closes) == 1:
            real_close(seq)
            raise RuntimeError("injected close fault")
        real_close(seq)
    engine.close_sequence = close_failing_first
    results = side_by_side(batched, 1)
    assert isinstance(results[0], RuntimeError)
    assert not batched.scheduler.healthy and "injected close fault" in repr(batched.scheduler.fault)
    serves_again(batched, want)  # the next step ran: healthy again


def test_if_the_thread_ends_waiting_generations_fail_and_new_ones_are_refused(batched):
    class Died(BaseException):
        pass
    fail_once(batched.scheduler, "step", Died())
    results = side_by_side(batched, 2)
    # those it held fail with the reason; one submitted after it died is refused
    assert all(isinstance(r, RuntimeError) and re.search("scheduler (is )?stopped", str(r)) for r in results)
    assert not batched.scheduler.healthy
    with pytest.raises(RuntimeError, match="scheduler is stopped"):
        batched.generate(PROMPT, max_new_tokens=4)


def test_cancelling_a_queued_generation_ends_it_at_once(batched, want):
    busy = side_by_side_async(batched, 2, max_new_tokens=200)
    while batched.scheduler.load[0] < 2:
        time.sleep(0.01)
    cancel = threading.Event()
    queued = side_by_side_async(batched, 1, max_new_tokens=40, cancel=cancel)
    while batched.scheduler.load[1] < 1:
        time.sleep(0.01)
    cancel.set()
    start = time.perf_counter()
    (out,) = queued()
    assert out.finish_reason == "cancelled" and out.token_ids == []
    assert time.perf_counter() - start < 1.0 and batched.scheduler.load[1] == 0
    assert all(r.finish_reason in ("length", "stop") for r in busy())
    serves_again(batched, want)


def side_by_side_async(gen, n, **kwargs):
    """side_by_side started now; the returned function waits for it."""
    box = {}
    thread = threading.Thread(target=lambda: box.update(results=side_by_side(gen, n, **kwargs)))
    thread.start()

    def wait():
        thread.join(2 * HANG_S)
        assert not thread.is_alive()
        return box["results"]
    return wait
