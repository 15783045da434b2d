"""The scheduler's promises under misuse: a policy is checked wherever it is built, an admission
that raises loses no request, a callback on the scheduler thread may wait for the scheduler,
every token's delta comes before its request's result (with text that adds up however the
request ended), a batch larger than the queue gets through, and waits and preemption are
checked exactly."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import pytest

from pocketllm import LLM, EngineArgs, GenerationResult, QueueFullError, SamplingParams, SwapSpaceError
from pocketllm.scheduler import PrefillPolicy

from .harness import Gate, drain, swap_size, wait_until

LEAD_BYTE = 0xF0  # the byte-level tokenizer's token for a 4-byte character's first byte: text incomplete


def _params(n: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _batched(path, **options) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=128,
                          backend_options={"enable_batching": True, "background_thread": False, "max_batch_size": 2,
                                           **options}))


def _in_thread(fn, timeout_s: float = 30.0):
    """fn() on a thread, bounded: a deadlock fails the test instead of hanging the suite."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{fn} did not return within {timeout_s}s (deadlock)"
    return box[0] if box else None


def _force_tokens(llm: LLM, monkeypatch, tokens, fail_after: int | None = None) -> list[int]:
    """The sampled tokens become `tokens` (an iterator), in order; with `fail_after`, forwards
    after that many raise. Each forward takes a few milliseconds at least, so a test can act while
    a request runs."""
    real, calls = llm.runner.run, [0]

    def run(seqs):
        time.sleep(0.005)
        calls[0] += 1
        if fail_after is not None and calls[0] > fail_after:
            raise RuntimeError("planted forward failure")
        return [out if out.sampled is None else dataclasses.replace(
                    out, sampled=dataclasses.replace(out.sampled, token=next(tokens))) for out in real(seqs)]

    monkeypatch.setattr(llm.runner, "run", run)
    return calls  # [forwards so far]


# -- 1. a policy is validated wherever it is built; an admission that raises loses nothing -----------

@pytest.mark.parametrize("exact", [True, False])
def test_configure_refuses_what_the_engine_refuses_at_start_up(checkpoint_dir, exact):
    """Without exact positions a step must fit the longest piece beside a decode row per slot; with
    them (pieces cut where the budget runs out) one token per slot."""
    with _batched(checkpoint_dir("qwen3.5"), exact_positions=exact) as llm:
        s = llm.scheduler
        s.configure(PrefillPolicy(max_num_batched_tokens=256, chunk_size=64, snapshot_interval=64))
        with pytest.raises(ValueError, match="prefix_reuse on a model with recurrent states needs snapshot_interval"):
            s.configure(PrefillPolicy(max_num_batched_tokens=256, chunk_size=64, snapshot_interval=0))
        with pytest.raises(ValueError, match=f"max_num_batched_tokens must be >= {2 if exact else 65} "):
            s.configure(PrefillPolicy(max_num_batched_tokens=1 if exact else 8, chunk_size=64, snapshot_interval=64))
        with pytest.raises(TypeError, match="configure\\(\\) takes a PrefillPolicy, got dict"):
            s.configure({"chunk_size": 64})
        # The refused policies left the running one in place: a prompt over the reuse grid still reuses.
        prompt = list(range(1, 100))
        first = s.generate([(prompt, _params(2))])[0]
        again = s.generate([(prompt, _params(2))])[0]
        assert again.token_ids == first.token_ids and s.get_stats().prefix_hits == 1


@pytest.mark.parametrize("field,value", [("chunk_size", 64.0), ("snapshot_interval", 128.0),
                                         ("max_num_batched_tokens", 300.0), ("max_num_batched_tokens", True)])
def test_policy_sizes_must_be_ints(field, value):
    with pytest.raises(TypeError, match=f"{field} must be an int, got"):
        PrefillPolicy(**{field: value})


def test_an_admission_that_raises_ends_that_request_in_error_and_the_rest_run(tiny_checkpoint, monkeypatch):
    with _batched(tiny_checkpoint) as llm:
        s = llm.scheduler
        real, calls = s.slots.admit, []

        def admit(request, placement):
            calls.append(request.request_id)
            if len(calls) == 1:
                raise RuntimeError("planted admission failure")
            return real(request, placement)

        monkeypatch.setattr(s.slots, "admit", admit)
        ids = [s.submit_request([i + 1, i + 2], _params()) for i in range(3)]
        drain(s)
        results = [s.poll_result(i) for i in ids]
        assert [r.finish_reason for r in results] == ["error", "length", "length"]
        assert "planted admission failure" in results[0].error
        stats = s.get_stats()
        assert (stats.errored, stats.finished, stats.waiting, stats.running, stats.uncollected) == (1, 2, 0, 0, 0)
        assert llm.slots.num_free == llm.cache.num_slots


def test_a_failed_prefix_copy_frees_the_slot_it_took(tiny_checkpoint, monkeypatch):
    """Admission copies a busy donor's prefix into a free slot; when that copy raises, the slot is
    free again and claims no contents."""
    with _batched(tiny_checkpoint, prefill_chunk_size=64, state_snapshot_interval=64) as llm:
        s = llm.scheduler
        prompt = list(range(1, 100))
        donor = s.submit_request(prompt, _params(8))
        s.step()  # the donor holds its first 64 positions and keeps running
        s.step()
        monkeypatch.setattr(llm.cache, "copy_prefix", lambda *a: (_ for _ in ()).throw(RuntimeError("planted copy")))
        copy = s.submit_request(prompt, _params(2))
        drain(s)
        assert s.poll_result(copy).finish_reason == "error" and s.poll_result(donor).finish_reason == "length"
        assert llm.slots.num_free == llm.cache.num_slots


# -- 2. a callback on the scheduler thread may wait for the scheduler ----------------------------------

@pytest.mark.parametrize("call", ["generate", "poll", "stop_drain", "stream"])
def test_a_callback_on_the_scheduler_thread_may_wait_for_the_scheduler(tiny_checkpoint, call):
    llm = _batched(tiny_checkpoint, background_thread=True)
    s = llm.scheduler
    seen: list = []
    other = s.submit_request([7, 8], _params(6))

    def callback(result: GenerationResult) -> None:
        if call == "generate":
            seen.append(s.generate([([1, 2, 3], _params(3))])[0].finish_reason)
        elif call == "poll":
            seen.append(s.poll_result(other, timeout_ms=None).finish_reason)
        elif call == "stop_drain":
            s.stop(drain=True)
            seen.append(s.poll_result(other).finish_reason)
        else:
            seen.append([item for item in s.stream(s.submit_request([4, 5], _params(3)))][-1].finish_reason)

    s.submit_request([1], _params(1), callback=callback)
    try:
        wait_until(lambda: seen, 30, f"the callback's {call} to return")
        assert seen == ["length"]
    finally:
        _in_thread(llm.close)


def test_a_callback_may_wait_while_another_thread_stops_the_scheduler(tiny_checkpoint):
    """stop() joins the scheduler thread while a callback on it waits for a request without a
    timeout: the thread ends what is left itself, so neither waits for the other."""
    llm = _batched(tiny_checkpoint, background_thread=True)
    s = llm.scheduler
    entered, seen = threading.Event(), []
    other = s.submit_request([7, 8], _params(50))

    def callback(result):
        entered.set()
        time.sleep(0.05)  # stop() below is joining by now
        seen.append(s.poll_result(other, timeout_ms=None).finish_reason)

    s.submit_request([1], _params(1), callback=callback)
    entered.wait(30)
    _in_thread(s.stop)
    assert seen == ["cancelled"]


# -- 3, 4. every delta before its result, with text that adds up however the request ended ------------

def test_a_slow_consumer_gets_every_delta_before_the_result_when_another_thread_cancels(tiny_checkpoint):
    """Deltas pile up behind a slow on_token while another thread cancels: every delta still
    comes, in order, before the result, and no two of the request's callbacks ever overlap (one
    thread hands out at a time)."""
    llm = _batched(tiny_checkpoint, background_thread=True)
    s = llm.scheduler
    events: list = []
    inside = threading.Lock()

    def record(event) -> None:
        if not inside.acquire(blocking=False):
            events.append(("overlap", event))
            return
        try:
            time.sleep(0.02)  # slower than a step
            events.append(event)
        finally:
            inside.release()

    rid = s.submit_request([1, 2], _params(60), on_token=lambda d: record(("token", d.index)),
                           callback=lambda r: record(("result", len(r.token_ids))))
    wait_until(lambda: len(events) >= 2, 30, "two deltas")
    for _ in range(3):  # cancels from three threads at once, each one trying to hand out
        threading.Thread(target=s.cancel_request, args=(rid,)).start()
    wait_until(lambda: events and events[-1][0] == "result", 30, "the result")
    n = events[-1][1]
    assert n < 60 and events == [("token", i) for i in range(n)] + [("result", n)]
    _in_thread(llm.close)


@pytest.mark.parametrize("mode", ["stream", "on_token"])
@pytest.mark.parametrize("ending", ["cancelled", "error", "stopped"])
def test_streamed_text_adds_up_to_the_result_text_however_the_request_ends(tiny_checkpoint, monkeypatch,
                                                                            ending, mode):
    """Every token is a character's first byte, so all its text is held back; a request that ends
    otherwise than by a stop token or its length must still flush it, pulled or pushed."""
    llm = _batched(tiny_checkpoint, background_thread=True)
    s = llm.scheduler
    forwards = _force_tokens(llm, monkeypatch, itertools.repeat(LEAD_BYTE), fail_after=4 if ending == "error" else None)
    pushed, results = [], []
    callbacks = {"on_token": pushed.append, "callback": results.append} if mode == "on_token" else {}
    rid = s.submit_request([1, 2], _params(100), **callbacks)
    if ending != "error":
        wait_until(lambda: forwards[0] >= 3, 30, "three forwards")
        s.cancel_request(rid) if ending == "cancelled" else _in_thread(s.stop)
    if mode == "stream":
        *deltas, result = _in_thread(lambda: list(s.stream(rid)))
    else:
        wait_until(lambda: results, 30, "the result")
        deltas, (result,) = pushed, results
    assert result.finish_reason == ("error" if ending == "error" else "cancelled")
    assert [d.token_id for d in deltas] == result.token_ids and len(result.token_ids) < 100
    assert "".join(d.text for d in deltas) == result.text
    assert result.text and set(result.text) == {"\ufffd"}
    _in_thread(llm.close)


def test_text_deltas_are_timely(tiny_checkpoint, monkeypatch):
    """The text handed out so far is the decoded text whenever that does not end inside a character."""
    llm = _batched(tiny_checkpoint)
    s = llm.scheduler
    _force_tokens(llm, monkeypatch, iter([ord("a"), 0xC3, 0xA9, ord("b"), 0xE2, 0x82, 0xAC, ord("c")] * 3))
    deltas = []
    rid = s.submit_request([1], _params(24), on_token=deltas.append)
    while s.has_work:
        s.step()
        tokens = [d.token_id for d in deltas]
        text = llm.tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""
        if not text.endswith("\ufffd"):
            assert "".join(d.text for d in deltas) == text
    assert "".join(d.text for d in deltas) == s.poll_result(rid).text == "aéb€c" * 3
    llm.close()


# -- 5. a batch larger than the queue gets through; a wait without end steps where nobody else does ---

@pytest.mark.parametrize("background", [False, True])
def test_generate_more_prompts_than_max_waiting(tiny_checkpoint, background):
    with _batched(tiny_checkpoint, max_waiting=2, background_thread=background) as llm:
        results = _in_thread(lambda: llm.scheduler.generate([([i + 1], _params(3)) for i in range(7)]))
        assert [r.finish_reason for r in results] == ["length"] * 7
        assert llm.scheduler.get_stats().uncollected == 0


def test_generate_cut_short_leaves_nothing_uncollected(tiny_checkpoint, monkeypatch):
    with _batched(tiny_checkpoint, max_waiting=1) as llm:
        s = llm.scheduler
        real_step, steps = s.step, [0]

        def step():
            steps[0] += 1
            if steps[0] == 3:
                raise KeyboardInterrupt
            return real_step()

        monkeypatch.setattr(s, "step", step)
        with pytest.raises(KeyboardInterrupt):
            s.generate([([i + 1], _params(20)) for i in range(5)])
        monkeypatch.setattr(s, "step", real_step)
        drain(s)
        stats = s.get_stats()
        assert (stats.uncollected, stats.waiting, stats.running) == (0, 0, 0) and stats.cancelled >= 1


def test_generate_stopped_mid_step_leaves_nothing_uncollected(tiny_checkpoint, gate):
    """generate() waits for room while a forward runs; stop() from another thread makes its next
    submission raise. What it queued is cancelled: the request in the forward ends with that step
    and its result is dropped then (nobody will collect it)."""
    llm = _batched(tiny_checkpoint, max_waiting=1, background_thread=True)
    s = llm.scheduler
    g = gate(llm)
    raised: list = []

    def run_generate() -> None:
        try:
            s.generate([([i + 1], _params(20)) for i in range(4)])
        except RuntimeError as exc:
            raised.append(exc)

    caller = threading.Thread(target=run_generate)
    caller.start()
    assert g.entered.wait(30)  # the first request's forward is held; the queue is full behind it
    wait_until(lambda: s.get_stats().waiting == 1, 30, "a full queue")
    stopper = threading.Thread(target=s.stop)
    stopper.start()
    caller.join(30)
    assert raised and "stopped" in str(raised[0])
    g.opened.set()
    stopper.join(30)
    assert not stopper.is_alive() and s.get_stats().uncollected == 0


def test_a_caller_driven_submission_that_waits_without_end_steps_the_loop(tiny_checkpoint):
    with _batched(tiny_checkpoint, max_waiting=1) as llm:
        s = llm.scheduler
        first = s.submit_request([1, 2], _params())
        second = _in_thread(lambda: s.submit_request([3], _params(), wait_ms=None))
        drain(s)
        assert s.poll_result(first).finish_reason == s.poll_result(second).finish_reason == "length"


# -- 9. validation, exact to the byte ---------------------------------------------------------------------

@pytest.mark.parametrize("priority", ["x", None, 1.5, True])
def test_priority_is_checked_in_serial_mode_too(tiny_checkpoint, priority):
    llm = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=64))
    with pytest.raises(ValueError, match="priority must be an int in"):
        llm.generate([1, 2], _params(), priority=priority)


def test_a_bad_wait_names_wait_ms(tiny_checkpoint):
    with _batched(tiny_checkpoint) as llm:
        with pytest.raises(ValueError, match="wait_ms must be >= 0"):
            llm.scheduler.submit_request([1], _params(), wait_ms=-1)
        with pytest.raises(TypeError, match="wait_ms must be a number"):
            llm.scheduler.submit_request([1], _params(), wait_ms="soon")
        assert llm.scheduler.get_stats().waiting == 0


def test_preempt_accepts_a_swap_of_exactly_max_swap_bytes(tiny_checkpoint):
    size = swap_size(tiny_checkpoint, 5)  # a 5-token prompt, prefilled: 5 positions cached
    with _batched(tiny_checkpoint, max_swap_bytes=size) as llm:
        s = llm.scheduler
        rid = s.submit_request([1, 2, 3, 4, 5], _params(4))
        s.step()
        assert s.preempt(rid)
        s.step()
        stats = s.get_stats()
        assert (stats.preemptions, stats.swapped_bytes) == (1, size)
        drain(s)
        assert s.poll_result(rid).finish_reason == "length"


def test_preempt_sets_the_bytes_aside_so_a_true_is_kept(tiny_checkpoint):
    """Two preemptions that together exceed max_swap_bytes: the second is refused at once, naming
    the bytes it would hold; the first happens."""
    size = swap_size(tiny_checkpoint, 5)
    with _batched(tiny_checkpoint, max_swap_bytes=size + size // 2) as llm:
        s = llm.scheduler
        ids = [s.submit_request([1, 2, 3, 4, 5], _params(4)), s.submit_request([6, 7, 8, 9, 10], _params(4))]
        s.step()
        assert s.preempt(ids[0])
        refused = f"would hold {2 * size} bytes .* over max_swap_bytes={size + size // 2}"
        with pytest.raises(SwapSpaceError, match=refused):
            s.preempt(ids[1])
        s.step()
        assert s.get_stats().preemptions == 1
        drain(s)
        assert [s.poll_result(i).finish_reason for i in ids] == ["length", "length"]


def _hold_forwards(llm: LLM, monkeypatch, decode: bool) -> Gate:
    """A gate on the forwards of one kind: all decode rows, or with a prefill piece."""
    return Gate(llm, monkeypatch, holds=lambda seqs: all(s.decode for s in seqs) == decode)


def test_a_preemption_during_a_decode_step_is_sized_after_it(tiny_checkpoint, monkeypatch):
    """preempt() while the forward runs sizes the swap as the automatic path will: the positions
    cached once that forward is done (here the prompt's 5 and the decode row's 1)."""
    size = swap_size(tiny_checkpoint, 6)
    with _batched(tiny_checkpoint, max_swap_bytes=size) as llm:
        s = llm.scheduler
        rid = s.submit_request([1, 2, 3, 4, 5], _params(6))
        s.step()  # the prompt: 5 positions cached, one token sampled
        held = _hold_forwards(llm, monkeypatch, decode=True)
        stepping = threading.Thread(target=s.step)
        stepping.start()
        held.entered.wait(30)
        assert s.preempt(rid)
        held.opened.set()
        stepping.join(30)
        s.step()
        assert (s.get_stats().preemptions, s.get_stats().swapped_bytes) == (1, size)
        drain(s)
        assert s.poll_result(rid).finish_reason == "length"


def test_a_preemption_during_a_prefill_step_is_refused_when_the_piece_will_not_fit(tiny_checkpoint, monkeypatch):
    """A prefill piece in flight will cache all its positions: a swap of that size over
    max_swap_bytes is refused now, not accepted and then silently dropped."""
    size = swap_size(tiny_checkpoint, 40)
    with _batched(tiny_checkpoint, max_swap_bytes=size - 1) as llm:
        s = llm.scheduler
        rid = s.submit_request(list(range(1, 41)), _params(3))
        held = _hold_forwards(llm, monkeypatch, decode=False)
        stepping = threading.Thread(target=s.step)
        stepping.start()
        held.entered.wait(30)
        try:
            with pytest.raises(SwapSpaceError, match=f"would hold {size} bytes"):
                s.preempt(rid)
        finally:
            held.opened.set()
            stepping.join(30)
        drain(s)
        assert s.poll_result(rid).finish_reason == "length" and s.get_stats().preemptions == 0


def test_queue_full_error_still_names_the_queue(tiny_checkpoint):
    with _batched(tiny_checkpoint, max_waiting=1) as llm:
        llm.scheduler.submit_request([1], _params())
        with pytest.raises(QueueFullError, match="max_waiting=1"):
            llm.scheduler.submit_request([2], _params())
