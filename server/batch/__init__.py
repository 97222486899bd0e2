"""The batch API: files, batches, their submission to the pool topic and the coordination of results."""
