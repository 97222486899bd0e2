"""The `ferry` command: up, frontend, worker, batch, usage, planner, model prepare."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from launch.log_setup import setup_logging

USAGE = """usage: ferry COMMAND [flags]

commands:
  up              the whole system on this machine: embedded Kafka and Redis, a frontend, N workers
  frontend        one frontend process (OpenAI API)
  worker          one worker process (engine behind a Kafka topic)
  model prepare   build a model directory once: the default model (SmolLM2-135M-Instruct) or a GGUF file
  batch           submit a JSONL batch, follow it, fetch its results, cancel it (`ferry batch --help`)
  usage           tenants' usage from the usage topic, by tenant, model or key (`ferry usage --help`)
  planner         the autoscaler: sizes the worker fleet to TTFT/ITL targets (Kubernetes, KEDA)

Run `ferry COMMAND --help` for the flags of a command. Every flag can also be set through a
FERRY_<FLAG> environment variable (e.g. --kafka -> FERRY_KAFKA).
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "up":
        import uvloop

        from launch.stack import load_stack, resolve_stack_model, run_stack

        stack = load_stack(rest)
        setup_logging(stack.frontend.log_level)
        return uvloop.run(run_stack(resolve_stack_model(stack)))
    if cmd == "frontend":
        from launch.frontend import main as frontend_main

        return frontend_main(rest)
    if cmd == "worker":
        from launch.worker import main as worker_main

        return worker_main(rest)
    if cmd == "batch":
        from launch.batch import main as batch_main

        return batch_main(rest)
    if cmd == "usage":
        from launch.usage import main as usage_main

        return usage_main(rest)
    if cmd == "planner":
        from launch.planner import main as planner_main

        return planner_main(rest)
    if cmd == "model" and rest[:1] == ["prepare"]:
        from launch.model_prepare import main as prepare_main

        return prepare_main(rest[1:])
    print(f"ferry: unknown command {' '.join(args[:2])!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
