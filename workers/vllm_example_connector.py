"""vLLM's example shared-storage KV connector, guarded against the negative cache hit that kills its engine.

`ExampleConnector.get_num_new_matched_tokens` (vLLM 0.32) answers `align(len(prompt) - 1) - computed` once a
folder for the prompt's aligned prefix exists, and that can be negative: for a one-token prompt the aligned
length is -block_size, and for a prompt of k·block_size + 1 tokens whose k blocks the engine's own prefix cache
holds it is -block_size again. The scheduler takes the negative count as given and the next step fails
(`IndexError: index out of range in self` in `_prepare_inputs`), which kills the EngineCore: a one-token
prompt, a repeated 33-token prompt or Ferry's own canary takes the worker down (vllm-project/vllm#53495,
fix proposed in #53611). Here the count never goes below zero, which is what it means: nothing to load.

`prepare_connector` (workers/vllm_kv_transfer.py) runs this class wherever the operator names
`ExampleConnector` without a module path of their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

if TYPE_CHECKING:
    from vllm.v1.request import Request

class GuardedExampleConnector(ExampleConnector):
    """ExampleConnector whose external cache hit is never negative."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The tokens to load from shared storage beyond those computed: ExampleConnector's count, at least 0."""
        matched, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (None if matched is None else max(0, matched)), load_async
