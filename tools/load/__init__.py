"""Load testing: traces, arrivals, the replay client, recording through Redis, reports.

`trace` holds what one trace request is (`TraceRequest`) and `records` what one replayed or
simulated request did (`RequestRecord`); readers, the client and the report build on those two.
"""
