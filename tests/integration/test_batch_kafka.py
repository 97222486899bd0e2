"""The Kafka-native batch path, driven by the runnable example in bench/batch/."""

from __future__ import annotations

import uuid
from pathlib import Path

from bench.batch.kafka_native_example import chat_item, submit_and_collect
from tests.harness import harness
from tests.integration.test_batch_api import model_name


async def test_kafka_native_items_get_one_result_each_on_the_named_topic(
    kafka: str, redis_url: str, prefix: str, model_path: Path, tmp_path: Path
) -> None:
    model = model_name()
    async with harness(kafka, redis_url, prefix, model_path) as h:
        await h.add_worker(pool=True, served_model_name=model, speedup=200.0)
        await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path))
        reply = f"svc.results.{uuid.uuid4().hex[:6]}"
        items = [chat_item(f"k{i}", model, f"Question {i}?", reply) for i in range(6)]
        items.append(chat_item("wrong-model", "no-such-model", "hi", reply))
        bad = chat_item("too-long", model, "hi", reply)
        bad["body"]["max_tokens"] = 10**6
        items.append(bad)
        results = await submit_and_collect(kafka, model, items, reply, timeout_s=60)
        assert set(results) == {item["custom_id"] for item in items}
        for i in range(6):
            line = results[f"k{i}"]
            assert line["error"] is None and line["response"]["status_code"] == 200
            body = line["response"]["body"]
            assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert results["wrong-model"]["response"]["status_code"] == 404
        assert results["too-long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
