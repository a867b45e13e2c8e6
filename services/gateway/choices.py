"""`n` completions of one prompt: each its own request to the scheduler, merged into one answer.

Choice i of request `cmpl-x` is the scheduler's request `cmpl-x-i` (just `cmpl-x` when n = 1),
with the request's sampling options; a seeded request gives choice 0 its seed and each other
choice a seed derived from (seed, i), so that the same request reproduces the same choices. With
prefix caching on, choice 0 goes first and the others once its prefill has committed (its first
token arrived), so that they find the prompt's full KV blocks cached (the app submits them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from services.gateway.body import GenerationRequest, Tokenizer
from services.gateway.progress import Progress
from shared.text.stop_strings import OutputText
from shared.values.sampling import SEED_BITS, SamplingParams
from shared.wire import RequestError, Tokens

T = TypeVar("T")


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 keeps the request's seed; choice i > 0 draws from one derived from (seed, i)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (1 << SEED_BITS)


@dataclass
class Choice:
    index: int
    request_id: str  # the scheduler's request for this choice
    sampling: SamplingParams
    progress: Progress
    text: OutputText
    queue: asyncio.Queue[Tokens | RequestError] | None = None
    cancelled: bool = False  # a Cancel went out for it (a stop string ended it)
    sent_tokens: int = 0  # tokens covered by chunks already sent (continuous usage)
    submitted: bool = False  # its request went to the scheduler


@dataclass(frozen=True)
class ChoiceDelta:
    """New text of one choice, with its state when the text was made."""

    choice: Choice
    text: str
    finish_reason: str | None  # "stop" or "length" on the choice's last delta


def make_choices(
    request_id: str, gen: GenerationRequest, tokenizer: Tokenizer, started: float
) -> list[Choice]:
    return [
        Choice(
            index=i,
            request_id=request_id if gen.n == 1 else f"{request_id}-{i}",
            sampling=dataclasses.replace(gen.sampling, seed=choice_seed(gen.sampling.seed, i))
            if i
            else gen.sampling,
            progress=Progress(started=started),
            text=OutputText(
                tokenizer,
                gen.stop,
                include_stop_str_in_output=gen.include_stop_str_in_output,
            ),
        )
        for i in range(gen.n)
    ]


async def merged(sources: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of several iterators as they come; the first error ends it (and them)."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()

    async def pump(source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                queue.put_nowait((False, item))
        except Exception as error:  # handed to the reader, which raises it
            queue.put_nowait((True, error))
        finally:
            queue.put_nowait((True, None))

    tasks = [asyncio.create_task(pump(source), name="gateway-choice") for source in sources]
    try:
        running = len(tasks)
        while running:
            ended, item = await queue.get()
            if ended and item is None:
                running -= 1
            elif ended:
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


def combined_statistics(choices: Sequence[Choice]) -> dict[str, Any]:
    """The `augury` block of an answer: one choice's statistics, or n choices' summed (their
    objective as the first one's, the slowest measured TPOT)."""
    if len(choices) == 1:
        return choices[0].progress.statistics()
    first = choices[0].progress
    total = Progress(
        started=first.started,
        slo_class=first.slo_class,
        tpot_slo_ms=first.tpot_slo_ms,
        tpot_ms=max(
            (c.progress.tpot_ms for c in choices if c.progress.tpot_ms is not None), default=None
        ),
    )
    for choice in choices:
        progress = choice.progress
        total.drafts += progress.drafts
        total.draft_tokens += progress.draft_tokens
        total.accepted_tokens += progress.accepted_tokens
        for model, steps in progress.steps_by_draft.items():
            total.steps_by_draft[model] = total.steps_by_draft.get(model, 0) + steps
    return total.statistics()
