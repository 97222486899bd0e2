"""The Kafka-native batch path from a service's side: produce items, read the results from your own topic.

    python -m bench.batch.kafka_native_example --kafka 127.0.0.1:9092 --model SmolLM2-135M-Instruct -n 5

Each item is one JSON message on `ferry.batch.submit.<model>` (a batch input line plus `reply_topic`);
each result is one JSON message on `reply_topic`, keyed by `custom_id`, in the output-file line format.
Needs a running Ferry (`ferry up`) whose frontend has `--batch-kafka-intake` on (the default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from schemas.names import batch_submit_topic


def chat_item(
    custom_id: str, model: str, question: str, reply_topic: str, max_tokens: int = 16
) -> dict[str, Any]:
    """One Kafka-native batch item: a request body for /v1/chat/completions and where its result goes."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
        },
        "reply_topic": reply_topic,
    }


async def submit_and_collect(
    kafka: str, model: str, items: list[dict[str, Any]], reply_topic: str, timeout_s: float = 120.0
) -> dict[str, dict[str, Any]]:
    """Produce `items`, then read `reply_topic` until each custom_id has its result; custom_id -> line."""
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(reply_topic, num_partitions=1, replication_factor=1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        await admin.close()
    # Read the reply topic from its start, so no result can be missed whenever it arrives.
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    producer = AIOKafkaProducer(bootstrap_servers=kafka)
    await consumer.start()
    await producer.start()
    results: dict[str, dict[str, Any]] = {}
    try:
        consumer.assign([TopicPartition(reply_topic, 0)])
        for item in items:
            await producer.send_and_wait(
                batch_submit_topic(model), json.dumps(item).encode(), key=item["custom_id"].encode()
            )
        wanted = {item["custom_id"] for item in items}
        async with asyncio.timeout(timeout_s):
            while not wanted <= results.keys():
                batches = await consumer.getmany(timeout_ms=500)
                for records in batches.values():
                    for r in records:
                        line = json.loads(r.value or b"{}")
                        results[line["custom_id"]] = line
    finally:
        await producer.stop()
        await consumer.stop()
    return results


async def main(argv: list[str] | None = None) -> int:
    """Send a few questions as Kafka-native batch items and print each answer."""
    from schemas.settings import DEFAULT_MODEL_NAME

    p = argparse.ArgumentParser(prog="python -m bench.batch.kafka_native_example", description=__doc__)
    p.add_argument("--kafka", default="127.0.0.1:9092")
    p.add_argument("--model", default=DEFAULT_MODEL_NAME)
    p.add_argument("-n", type=int, default=5, help="items to send")
    p.add_argument("--reply-topic", default=f"my-service.batch-results.{secrets.token_hex(4)}")
    args = p.parse_args(argv)
    items = [chat_item(f"q{i}", args.model, f"What is {i} + {i}?", args.reply_topic) for i in range(args.n)]
    results = await submit_and_collect(args.kafka, args.model, items, args.reply_topic)
    for cid in sorted(results):
        line = results[cid]
        if line["response"] and line["response"]["status_code"] == 200:
            answer = line["response"]["body"]["choices"][0]["message"]["content"]
            print(f"{cid}: {answer!r}")
        else:
            print(f"{cid}: failed: {line['response'] or line['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
