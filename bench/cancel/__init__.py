"""How long after a client hangs up the engine stops generating for it.

`python -m bench.cancel` starts a Tansu broker and Redis, one sim worker and one frontend in this
process (the worker's engine is read directly, so the moment it drops the sequence is seen to within
a fraction of a millisecond), then, one request at a time, opens a chat completion on a raw socket, lets
it generate, closes the socket and times close -> engine no longer running it. That is an upper bound
of the issue's "within 100 ms of the disconnect being seen": it includes the TCP close reaching the
server and Starlette noticing. Four variants side by side: streaming or not, on an idle worker or next to
`--background` long streams that keep it busy.
"""
