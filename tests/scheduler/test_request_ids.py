"""Request ids are unique per engine: the serial path and the scheduler draw from one counter, so
a result can never be mistaken for another request's."""

from __future__ import annotations

from pocketllm import LLM, EngineArgs, SamplingParams


def test_serial_and_scheduled_requests_share_one_id_counter(tiny_checkpoint):
    options = {"enable_batching": True, "background_thread": False, "max_batch_size": 2}
    with LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=32, backend_options=options)) as llm:
        params = SamplingParams(max_tokens=1)
        serial_ids = [llm.make_request([1, 2], params).request_id for _ in range(3)]
        scheduled_ids = [llm.scheduler.submit_request([3], params) for _ in range(3)]
        assert len(set(serial_ids + scheduled_ids)) == 6
        assert min(scheduled_ids) > max(serial_ids)
