"""Grammar states of requests and of draft-tree nodes, as token masks (llguidance matchers).

A request's matcher follows its committed output: each call names the output so far, the matcher
rolls back to what it shares with the tokens it consumed before (a step redelivered or redone)
and consumes the rest. A tree node's state is that matcher advanced along the node's draft path;
nodes are visited in depth-first order so that siblings share their ancestors' consumption, and
the matcher is rolled back to the committed output afterwards. Masks are kept packed (one bit a
token, llguidance's layout) per path until the committed output moves, so the drafter and the
verifier of one process compute each node's mask once.

A node whose path the grammar refuses (a model-free draft may propose any token) gets a mask
that allows everything: the target gives its token probability zero at its parent, so it is
never accepted, and its own row must not be all -inf.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import torch

from shared.grammar.spec import grammar_text
from shared.values.sampling import StructuredOutput

log = logging.getLogger(__name__)

COMPILED_CACHE_SIZE = 64  # compiled grammars kept per process (copied for each request)
MAX_FORCED_RUN = 64  # forced tokens drafted in one go at most
# bounded compilation and mask computation (llguidance's defaults are 5-10x these)
PARSER_LIMITS = dict(
    max_items_in_row=2000,
    initial_lexer_fuel=200_000,
    step_lexer_fuel=100_000,
    step_max_items=20_000,
    max_lexer_states=50_000,
    max_grammar_size=100_000,
    verbose_errors=False,
)

_TOKENIZERS: dict[tuple[int, tuple[int, ...]], tuple[Any, llguidance.LLTokenizer]] = {}
# A process's services (the verifier and its drafters) share one llguidance tokenizer per
# checkpoint, built under a lock: building one holds the GIL for most of a second (two at once
# starved the event loop of an in-process stack), and transformers' lazy imports are not safe
# from two threads at once (`from transformers import AutoTokenizer` fails in one of them).
_CHECKPOINT_TOKENIZERS: dict[tuple[Path, tuple[int, ...]], llguidance.LLTokenizer] = {}
_BUILDING = threading.Lock()


def ll_tokenizer(hf_tokenizer: Any, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a transformers fast tokenizer (built once per tokenizer: ~1 s);
    every id in `eos_token_ids` ends a grammar's output."""
    import llguidance.hf

    key = (id(hf_tokenizer), tuple(eos_token_ids))
    if key not in _TOKENIZERS:
        eos = list(eos_token_ids) or None
        _TOKENIZERS[key] = (hf_tokenizer, llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos))
    return _TOKENIZERS[key][1]


def checkpoint_tokenizer(checkpoint: Path, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of `checkpoint`'s tokenizer, built once per process (~1-2 s)."""
    key = (Path(checkpoint).resolve(), tuple(int(t) for t in eos_token_ids))
    with _BUILDING:
        if key not in _CHECKPOINT_TOKENIZERS:
            from transformers import AutoTokenizer

            hf_tokenizer = AutoTokenizer.from_pretrained(checkpoint)
            _CHECKPOINT_TOKENIZERS[key] = ll_tokenizer(hf_tokenizer, key[1])
        return _CHECKPOINT_TOKENIZERS[key]


def unpack(bits: np.ndarray, width: int) -> np.ndarray:
    """[N, words] int32 llguidance bitmasks -> [N, width] bool (False past the tokenizer)."""
    flat = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=1, bitorder="little")
    if flat.shape[1] < width:
        flat = np.pad(flat, ((0, 0), (0, width - flat.shape[1])))
    return flat[:, :width].astype(bool)


@dataclass
class GrammarStats:
    """Mask computations so far (a benchmark reads them)."""

    masks: int = 0
    mask_seconds: float = 0.0
    forced_tokens: int = 0
    compile_seconds: float = 0.0


@dataclass
class RequestGrammar:
    """One request's matcher, following its committed output."""

    structured: StructuredOutput
    matcher: llguidance.LLMatcher
    words: int  # int32 words of one mask
    consumed: list[int] = field(default_factory=list)
    masks: dict[tuple[int, ...], np.ndarray | None] = field(default_factory=dict)  # None: refused
    eos: frozenset[int] = frozenset()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def sync(self, output: Sequence[int]) -> None:
        """Advance (or roll back) the matcher to exactly the committed `output`."""
        if list(output) == self.consumed or self.matcher.is_error():
            return
        shared = 0
        for a, b in zip(self.consumed, output, strict=False):
            if a != b:
                break
            shared += 1
        self.masks.clear()
        if shared < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - shared)
        self.consumed = list(output[:shared])
        rest = [int(t) for t in output[shared:]]
        if rest:
            self.matcher.consume_tokens(rest)
            self.consumed += rest

    def _mask_here(self, stats: GrammarStats) -> np.ndarray:
        row = np.zeros(self.words, dtype=np.int32)
        started = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        stats.mask_seconds += time.perf_counter() - started
        stats.masks += 1
        return row

    def path_masks(
        self, paths: Sequence[Sequence[int]], stats: GrammarStats
    ) -> list[np.ndarray | None]:
        """Each path's packed mask (None where the grammar refuses the path)."""
        keys = [tuple(int(t) for t in p) for p in paths]
        todo = sorted({k for k in keys if k not in self.masks})
        current: list[int] = []
        for key in todo:
            shared = 0
            for a, b in zip(current, key, strict=False):
                if a != b:
                    break
                shared += 1
            if shared < len(current):
                self.matcher.rollback(len(current) - shared)
                del current[shared:]
            taken = self.matcher.try_consume_tokens(list(key[shared:]))
            current += key[shared : shared + taken]
            refused = len(current) < len(key) or self.matcher.is_error()
            self.masks[key] = None if refused else self._mask_here(stats)
        if current:
            self.matcher.rollback(len(current))
        return [self.masks[k] for k in keys]

    def forced_run(self, path: Sequence[int], limit: int, stats: GrammarStats) -> list[int]:
        """The tokens the grammar forces after `path`: llguidance's fast-forward tokens (the
        forced bytes, tokenized canonically) and, where there are none, a token that is the
        only one allowed (the target's masked distribution is then that token alone)."""
        run: list[int] = []
        while len(run) < limit:
            [bits] = self.path_masks([[*path, *run]], stats)
            if bits is None:
                break
            ahead = self._fast_forward([*path, *run])
            if not ahead:
                ones = np.flatnonzero(unpack(bits[None], bits.size * 32)[0])
                ahead = [int(ones[0])] if len(ones) == 1 else []
            if not ahead:
                break
            run += ahead[: limit - len(run)]
            if run[-1] in self.eos:
                break
        stats.forced_tokens += len(run)
        return run

    def _fast_forward(self, path: Sequence[int]) -> list[int]:
        if not self.matcher.consume_tokens([int(t) for t in path]):
            self.matcher.rollback(len(path))  # not reached: path_masks found the path allowed
            return []
        ahead = [int(t) for t in self.matcher.compute_ff_tokens()]
        self.matcher.rollback(len(path))
        return ahead


class GrammarBook:
    """Every request's grammar state in one process (the engine's, a verifier's, a drafter's):
    the `NodeConstraints` the verifier and the drafters read."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, eos_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.vocab = int(tokenizer.vocab_size)
        self.words = (self.vocab + 31) // 32
        self.eos = frozenset(int(t) for t in (eos_token_ids or tokenizer.eos_tokens))
        self.limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self.stats = GrammarStats()
        self._requests: dict[str, RequestGrammar] = {}
        self._compiled: dict[StructuredOutput, llguidance.LLMatcher] = {}

    @classmethod
    def from_hf(cls, hf_tokenizer: Any, eos_token_ids: Sequence[int]) -> GrammarBook:
        return cls(ll_tokenizer(hf_tokenizer, eos_token_ids), eos_token_ids)

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start: a copy of the one compiled for the same
        constraint before (compiling takes milliseconds, bounded by `PARSER_LIMITS`; the
        last `COMPILED_CACHE_SIZE` constraints are kept)."""
        template = self._compiled.pop(structured, None)
        if template is None:
            started = time.perf_counter()
            template = llguidance.LLMatcher(
                self.tokenizer, grammar_text(structured), log_level=0, limits=self.limits
            )
            self.stats.compile_seconds += time.perf_counter() - started
        self._compiled[structured] = template  # most recently used last
        while len(self._compiled) > COMPILED_CACHE_SIZE:
            del self._compiled[next(iter(self._compiled))]
        return template.deep_copy()

    def request(
        self, request_id: str, structured: StructuredOutput, output: Sequence[int]
    ) -> RequestGrammar:
        """The request's grammar state at its committed `output`."""
        state = self._requests.get(request_id)
        if state is None or state.structured != structured:
            state = RequestGrammar(structured, self.compile(structured), self.words, eos=self.eos)
            self._requests[request_id] = state
        state.sync(output)
        return state

    def allowed(
        self,
        request_id: str,
        structured: StructuredOutput,
        output: Sequence[int],
        paths: Sequence[Sequence[int]],
        width: int,
    ) -> torch.Tensor:
        """[len(paths), width] bool: the tokens the grammar allows after each path. Every token
        where it refuses the path itself or allows nothing after it (past the end of the
        output, which the scheduler cuts at EOS); none anywhere after a dead end, which
        `dead_end` reports before a step."""
        state = self.request(request_id, structured, output)
        rows = np.ones((len(paths), width), dtype=bool)
        if state.error is not None:
            rows[:] = False
            return torch.from_numpy(rows)
        masks = state.path_masks(paths, self.stats)
        packed = [i for i, m in enumerate(masks) if m is not None]
        if packed:
            rows[packed] = unpack(np.stack([masks[i] for i in packed]), width)
            if self.eos:  # every end-of-sequence id ends the output where one does
                ends = [t for t in self.eos if t < width]
                may_end = rows[packed][:, ends].any(axis=1)
                rows[np.asarray(packed)[may_end][:, None], np.asarray(ends)[None, :]] = True
        rows[~rows.any(axis=1)] = True
        return torch.from_numpy(rows)

    def forced(
        self,
        request_id: str,
        structured: StructuredOutput,
        output: Sequence[int],
        path: Sequence[int],
        limit: int = MAX_FORCED_RUN,
    ) -> list[int]:
        """The run of tokens the grammar forces after `path` (empty: a choice is left)."""
        state = self.request(request_id, structured, output)
        if state.error is not None or limit <= 0:
            return []
        return state.forced_run(path, limit, self.stats)

    def canonical(self, tokens: Sequence[int]) -> list[int]:
        """The tokenizer's own tokenization of the tokens' text (end-of-sequence ids at the
        end kept as they are): what a model trained on that tokenizer writes."""
        tail = len(tokens)
        while tail > 0 and int(tokens[tail - 1]) in self.eos:
            tail -= 1
        body = [int(t) for t in tokens[:tail]]
        if len(body) < 2:
            return [int(t) for t in tokens]
        text = self.tokenizer.decode_bytes(body)
        return [*self.tokenizer.tokenize_bytes(text), *(int(t) for t in tokens[tail:])]

    def dead_end(
        self, request_id: str, structured: StructuredOutput, output: Sequence[int]
    ) -> str | None:
        """Why the grammar allows no next token after the committed output (None: it does)."""
        state = self.request(request_id, structured, output)
        if state.error is not None:
            return state.error
        [bits] = state.path_masks([[]], self.stats)
        if bits is None or not bits.any():
            return "the grammar allows no next token"
        return None


class CheckpointGrammar:
    """A service's `GrammarBook`, built with the tokenizer of `checkpoint` at its first
    structured request (on the model thread, off the event loop; ~1-2 s), so services that
    never see one pay nothing. Without a usable tokenizer every structured request ends with a
    `grammar_dead_end` naming why."""

    def __init__(self, checkpoint: Path, eos_token_ids: Sequence[int]) -> None:
        self.checkpoint = checkpoint
        self.eos_token_ids = tuple(eos_token_ids)
        self._book: GrammarBook | None = None
        self._problem: str | None = None

    def book(self) -> GrammarBook | None:
        if self._book is None and self._problem is None:
            try:
                tokenizer = checkpoint_tokenizer(self.checkpoint, self.eos_token_ids)
                self._book = GrammarBook(tokenizer, self.eos_token_ids)
            except (OSError, ValueError, TypeError) as error:
                self._problem = f"no usable tokenizer in {self.checkpoint}: {error}"
                log.warning("structured output is off: %s", self._problem)
        return self._book

    def allowed(
        self,
        request_id: str,
        structured: StructuredOutput,
        output: Sequence[int],
        paths: Sequence[Sequence[int]],
        width: int,
    ) -> torch.Tensor:
        book = self.book()
        if book is None:
            return torch.ones(len(paths), width, dtype=torch.bool)
        return book.allowed(request_id, structured, output, paths, width)

    def forced(
        self,
        request_id: str,
        structured: StructuredOutput,
        output: Sequence[int],
        path: Sequence[int],
        limit: int = MAX_FORCED_RUN,
    ) -> list[int]:
        book = self.book()
        return [] if book is None else book.forced(request_id, structured, output, path, limit)

    def dead_end(
        self, request_id: str, structured: StructuredOutput, output: Sequence[int]
    ) -> str | None:
        book = self.book()
        if book is None:
            return self._problem
        return book.dead_end(request_id, structured, output)

    def canonical(self, tokens: Sequence[int]) -> list[int]:
        book = self.book()
        return [int(t) for t in tokens] if book is None else book.canonical(tokens)

    def free(self, request_id: str) -> None:
        if self._book is not None:
            self._book.free(request_id)
