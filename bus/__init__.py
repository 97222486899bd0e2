"""Everything Kafka: topic admin, producing, the one consumer-loop owner every reader uses, log-reset detection."""
