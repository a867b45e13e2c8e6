"""Format fixtures for a smoke run of the documented commands: tiny synthetic files, under the
names the docs use, in the exact format of the public traces the reader downloads (no network
here). They exercise the readers on the real format; their numbers mean nothing.

- `AzureLLMInferenceTrace_conv.csv`: Azure's LLM inference trace (TIMESTAMP with 7-digit
  fractional seconds, ContextTokens, GeneratedTokens), as `tools/load/readers.py` reads it.
- `conversation_trace.jsonl`: Mooncake's FAST'25 trace (timestamp in ms, input_length,
  output_length, hash_ids of 512-token blocks)."""

from __future__ import annotations

import json
import random
from pathlib import Path

NOTE_NAME = "FORMAT-FIXTURES.txt"
ROWS = 40
MOONCAKE_BLOCK_TOKENS = 512


def azure_csv(rows: int = ROWS, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    ticks = 10 * 10_000_000  # 100 ns ticks past 18:15:00, rising
    for _ in range(rows):
        ticks += rng.randint(1_000_000, 5_000_000)
        seconds, fraction = divmod(ticks, 10_000_000)
        lines.append(
            f"2023-11-16 18:15:{seconds:02d}.{fraction:07d},"
            f"{rng.randint(16, 512)},{rng.randint(4, 64)}"
        )
    return "\n".join(lines) + "\n"


def mooncake_jsonl(rows: int = ROWS, seed: int = 0) -> str:
    """Conversations that share their first blocks (a few system prompts, growing histories)."""
    rng = random.Random(seed)
    lines = []
    histories: list[list[int]] = [[i * 100] for i in range(4)]
    next_id = 1000
    for i in range(rows):
        history = histories[rng.randrange(len(histories))]
        new_blocks = rng.randint(0, 2)
        hash_ids = [*history, *range(next_id, next_id + new_blocks)]
        next_id += new_blocks
        history[:] = hash_ids[:4]
        input_length = (len(hash_ids) - 1) * MOONCAKE_BLOCK_TOKENS + rng.randint(1, 512)
        record = {
            "timestamp": i * 250,
            "input_length": input_length,
            "output_length": rng.randint(4, 32),
            "hash_ids": hash_ids,
        }
        lines.append(json.dumps(record))
    return "\n".join(lines) + "\n"


FIXTURES = {
    "AzureLLMInferenceTrace_conv.csv": azure_csv,
    "conversation_trace.jsonl": mooncake_jsonl,
}


def write_fixtures(into: Path) -> list[str]:
    """Write each fixture under `into` where no file of its name is, and a note saying what
    they are; the names written."""
    written = []
    for name, make in FIXTURES.items():
        if not (into / name).exists():
            (into / name).write_text(make())
            written.append(name)
    if written:
        (into / NOTE_NAME).write_text(
            "Synthetic format fixtures written by tools/doc_fixtures.py for a smoke run of the "
            "documented commands (the public traces are not downloaded): "
            + ", ".join(written)
            + ". Same format as the real files; the values are made up.\n"
        )
    return written
