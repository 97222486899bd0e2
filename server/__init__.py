"""The frontend: HTTP routes, preprocessing, routing, reply demultiplexing, SSE; the `ferry` CLI."""
