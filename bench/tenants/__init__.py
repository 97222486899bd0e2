"""Fair sharing between tenants: a quiet tenant's TTFT while another floods at 10× its rate.

`python -m bench.tenants` starts `ferry up` on sim workers with a tenants file (`quiet` and `flood`, equal
weights; `flood` has a `max_concurrent` quota below what it keeps in flight) and runs three phases of open-loop
(Poisson) streamed chat traffic on 127.0.0.1, side by side in one run:

- `alone`: the quiet tenant only;
- `flood_fair`: the quiet tenant and the flood at `--flood-factor` × its rate, weighted-fair admission on
  (with Ferry's `--tenants-reserve` unless `--tenants-reserve` says otherwise);
- `flood_unfair`: the same on a second stack started with `--no-tenants-fair` (arrival order).

Per phase it reports TTFT p50/p90 per tenant, statuses (429s of the flood beyond its quota, 5xx) and lost
requests (no response, or a stream that did not end with `[DONE]`). After each stack's phases it runs
`ferry usage --since <start> --csv` and compares its totals per tenant with the sum of the usage the
responses carried. The workers are kept saturated by the flood (`--busy-waiting` makes a worker with that
many queued requests busy, so requests wait in the frontend, where fairness acts).
"""
