"""Fault injection (`python -m tools.chaos`): SIGKILL each service in turn during a replay.

The services run as separate processes on one Redis (an embedded one, or `--redis-url`), in a
fresh cell: gateway, scheduler, verifier and one drafter of one draft model (`cluster.py`).
Requests (`workload.py`) are the repo's chat, code and math evaluation prompts, templated and
cut to their last `--prompt-tokens` ids, sent open loop (Poisson, `--rate`, a fixed seed) as
streamed greedy `/v1/completions` of token ids with `max_tokens` and `ignore_eos`
(`client.py`). While they run, each service of `--kill` is SIGKILLed in turn (its whole process
group), started again `--restart-after-s` later with the same settings and a new replica name,
and the next kill waits until it is back (`faults.py`). Every service gets settings for quick
recovery (claim idle 3 s, heartbeat TTL 1.5 s, verify timeout 5 s, draft timeout 3 s, the
scheduler lease 2 s; the gateway's 60 s idle timeout), see `run.RECOVERY_SETTINGS`.

The reference is plain greedy decoding of the target in this process, before the services
start (`reference.py`): the engine with no draft model, all requests batched. It costs about
40-70 s for 100 requests of 32 tokens on a 2-core CPU with SmolLM2-135M, less than a fault-free
pass through the services would, and it is the stronger check: lossless speculation must give
exactly plain decoding's tokens, and a fault-free pass could share a bug with the faulty one.

The API streams text, so answers are compared as text, decoded from the reference ids with the
gateway's tokenizer (`compare.py`, which also explains how lost, repeated and wrong tokens are
counted from a text difference; each chunk's usage gives the token count).

A request that cannot connect (the gateway is down, nothing listens on its port) never reached
the system: the client retries it until the gateway is back and the table counts such requests
("retried connecting") but holds them to the same standard as any other. A request whose
gateway died under it may fail (its connection drops); any other failure, any hung request,
any answer different from the reference and any lost, repeated or wrong token is a problem
(`report.py`), and the run exits 1.
"""
