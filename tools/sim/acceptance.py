"""Acceptance recorded from the real engine, replayed by the simulator.

A recording holds, per prompt kind and draft model, sessions of real decoding: for every step,
the tree the drafter proposed (its shape and the draft's log-probabilities, which the scheduler's
planner and tree selectors read) and the deepest node the target accepted. It is recorded with
every drafted tree verified whole (planner "fixed", a budget no tree reaches), so the target's
verdict on every node is known.

The simulator then answers "how many tokens does this tree accept?" for any tree the scheduler
selects from a recorded one: under greedy verification the target accepts the longest prefix of
the recorded accepted path that the selected subtree still holds. A shallower plan gets the
recorded tree cut at its depth (the drafter grows trees level by level, so that is the tree it
would have drafted). Accepted length per step is thus a function of the selected tree's shape,
drawn from real steps of that kind and draft, with the step-to-step correlation of one text.

    python -m tools.sim.acceptance --out profiles/acceptance-SmolLM2-135M-Instruct-3drafts.json.gz \
        --drafts draft-s draft-m draft-l --per-kind 8 --max-tokens 128

`--model-set qwen2.5-coder --target-dtype ...` records the other set (its drafts by name).

Sessions of one prompt under different drafts follow the same text (greedy decoding with the
same target; each session keeps its output's CRC to show it), so the simulator has a request
follow one prompt under every draft (`prompt_for`), and a request whose draft model changes
continues that prompt's session of the new draft where the text has got to: at the first step
the new draft recorded at or after the request's position in the text (`Session.step_at`).

What it does not capture: sampling at temperature > 0 (recorded greedy), and steps where the
drafter proposed nothing (no node reached `min_path_prob`): they are not recorded, so a replayed
session always drafts; `positions` shows where they were.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from shared.values.methods import DraftMethod
from shared.values.tree import TokenTree

FORMAT_VERSION = 1
TOKEN_BASE = 16  # node i of a recorded tree is token TOKEN_BASE + i in the simulator
LOGQ_DECIMALS = 3
# static trees' nodes beyond the recording: tokens no recorded node has, never accepted
FILLER_TOKEN = 1 << 20
FILLER_LOGQ = math.log(0.05)


@dataclass(frozen=True)
class RecordedStep:
    parents: tuple[int, ...]  # of nodes 1.. (node 0 is the root)
    logq: tuple[float, ...]  # of nodes 1..
    accepted_node: int  # deepest node the target accepted (0: none)

    def accepted_path(self) -> list[int]:
        """Accepted nodes, root excluded, in path order."""
        path: list[int] = []
        node = self.accepted_node
        while node > 0:
            path.append(node)
            node = self.parents[node - 1]
        return path[::-1]

    def tree(self, max_depth: int) -> TokenTree:
        """The recorded tree cut at `max_depth`; node i keeps its identity as a token id."""
        keep = [0]
        depth = [0]
        for i, parent in enumerate(self.parents, start=1):
            d = depth[parent] + 1
            depth.append(d)
            if d <= max_depth:
                keep.append(i)
        parents = [-1, *self.parents]
        remap = {old: new for new, old in enumerate(keep)}
        return TokenTree.build(
            [TOKEN_BASE + i for i in keep],
            [-1] + [remap[parents[i]] for i in keep[1:]],
            [0.0] + [self.logq[i - 1] for i in keep[1:]],
        )


@dataclass(frozen=True)
class Session:
    kind: str
    draft: str
    prompt: int  # index of the prompt within its kind
    steps: tuple[RecordedStep, ...]
    # output tokens the request had before each step (steps that drafted nothing are not
    # recorded, so these can skip); None in older recordings
    positions: tuple[int, ...] | None = None
    num_tokens: int | None = None  # output tokens at the end
    output_crc: int | None = None  # CRC-32 of the output token ids: the same text, the same CRC
    # the prompt's and the output's token ids (recordings made with them: the simulator then
    # replays the text itself, which model-free drafts propose from)
    prompt_tokens: tuple[int, ...] | None = None
    output_tokens: tuple[int, ...] | None = None

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """Where each step starts in the text (output tokens before it); recordings without
        positions count one token from prefill plus each step's accepted tokens and bonus."""
        if self.positions is not None:
            return self.positions
        starts, at = [], 1
        for step in self.steps:
            starts.append(at)
            at += 1 + len(step.accepted_path())
        return tuple(starts)

    def step_at(self, offset: int) -> int:
        """The first step that starts at or after `offset` tokens into the text; past the last
        step, the first (the text starts over)."""
        index = bisect.bisect_left(self.starts, offset)
        return index if index < len(self.steps) else 0

    def drafted_nothing_at(self, offset: int) -> bool:
        """Whether the recorded run was at `offset` tokens into the text without drafting
        anything: before its first recorded step, between one step's end and the next's start,
        or after its last."""
        index = bisect.bisect_right(self.starts, offset) - 1
        if index < 0:
            return True
        if offset == self.starts[index]:
            return False
        return offset >= self.end_of(index)  # else inside a step: off the recorded run's path

    def end_of(self, step: int) -> int:
        """Where the text is after `step` (wrapping round): its start plus what it committed."""
        index = step % len(self.steps)
        return self.starts[index] + 1 + len(self.steps[index].accepted_path())


@dataclass
class AcceptanceModel:
    target: str
    method: DraftMethod
    sessions: list[Session] = field(default_factory=list)
    notes: str = ""
    _by_key: dict[tuple[str, str], list[Session]] = field(default_factory=dict, repr=False)
    _by_prompt: dict[tuple[str, str, int], Session] = field(default_factory=dict, repr=False)
    _trees: dict[tuple[int, int, int], tuple[TokenTree, tuple[int, ...]]] = field(
        default_factory=dict, repr=False
    )

    def __post_init__(self) -> None:
        self._index()

    def _index(self) -> None:
        self._by_key.clear()
        self._by_prompt.clear()
        for session in self.sessions:
            if session.steps:
                self._by_key.setdefault((session.kind, session.draft), []).append(session)
                self._by_prompt.setdefault((session.kind, session.draft, session.prompt), session)

    @property
    def kinds(self) -> list[str]:
        return sorted({k for k, _ in self._by_key})

    def without_text(self) -> AcceptanceModel:
        """The same steps without the prompts' and outputs' token ids: replayed step by step,
        wrapping round past the last, so a request longer than its recorded text keeps the
        recorded acceptance (with the text it follows the text, and past its end drafts
        nothing that is accepted)."""
        sessions = [replace(s, prompt_tokens=None, output_tokens=None) for s in self.sessions]
        return AcceptanceModel(self.target, self.method, sessions, self.notes)

    @property
    def has_text(self) -> bool:
        """Whether sessions keep their prompt's and output's token ids (`--tokens`)."""
        return any(s.output_tokens is not None for s in self.sessions)

    @cached_property
    def max_token_id(self) -> int:
        """The largest token id of the kept texts (-1 without any)."""
        texts = [t for s in self.sessions for t in (s.prompt_tokens, s.output_tokens) if t]
        return max((max(t) for t in texts), default=-1)

    @property
    def drafts(self) -> list[str]:
        return sorted({d for _, d in self._by_key})

    # ---- what the simulator asks -----------------------------------------------------------------
    def prompt_for(
        self, kind: str | None, key: int, drafts: Sequence[str] | None = None
    ) -> tuple[str, int] | None:
        """The recorded prompt, (kind, index), a simulated request follows under every one of
        `drafts` (default: all recorded): picked by the request's key among the prompts of its
        kind that each of them recorded (of any kind when there are none), so that a request
        meets the same text whichever draft speculates for it. None when no prompt was
        recorded with all of them. With one draft this is the prompt `session_for` picks."""
        drafts = list(drafts) if drafts is not None else self.drafts
        if not drafts:
            return None
        first, others = drafts[0], drafts[1:]

        def common(sessions: list[Session]) -> list[tuple[str, int]]:
            found = dict.fromkeys(
                (s.kind, s.prompt)
                for s in sessions
                if all((s.kind, d, s.prompt) in self._by_prompt for d in others)
            )
            return list(found)

        pool = common(self._by_key.get((kind or "", first), []))
        if not pool:
            by_draft = sorted((k, ss) for (k, d), ss in self._by_key.items() if d == first)
            pool = common([s for _, ss in by_draft for s in ss])
        if not pool:
            return None
        return pool[zlib.crc32(str(key).encode()) % len(pool)]

    def session_for(
        self, kind: str | None, draft: str, key: int, prompt: tuple[str, int] | None = None
    ) -> Session:
        """The recorded session a simulated request follows with this draft: the one of
        `prompt` (from `prompt_for`) where this draft recorded it, else one of its kind (any
        kind when the kind was not recorded), picked by the request's key."""
        if prompt is not None:
            found = self._by_prompt.get((prompt[0], draft, prompt[1]))
            if found is not None:
                return found
        pool = self._by_key.get((kind or "", draft))
        if pool is None:
            pool = [s for (_, d), ss in sorted(self._by_key.items()) if d == draft for s in ss]
        if not pool:
            raise KeyError(f"no recorded acceptance for draft {draft!r} (have {self.drafts})")
        return pool[zlib.crc32(str(key).encode()) % len(pool)]

    def drafted(
        self, session: Session, step: int, max_depth: int, method: DraftMethod | None = None
    ) -> tuple[TokenTree, tuple[int, ...]]:
        """What the drafter proposes at the session's `step` (wrapping round), `max_depth` deep,
        shaped by `method` where it differs from the recording's (`shape_tree`), and its nodes
        at each depth 1, 2, ... (what each draft layer costs)."""
        index = step % len(session.steps)
        shape = None if method is None or method == self.method else method
        key = (id(session), index, max_depth, shape)  # the simulator asks for the same trees often
        found = self._trees.get(key)
        if found is None:
            tree = session.steps[index].tree(max_depth)
            if shape is not None:
                tree = shape_tree(tree, shape, max_depth)
            layers = tuple(int(n) for n in np.bincount(tree.depths())[1:])
            found = self._trees[key] = (tree, layers)
        return found

    def num_accepted(self, session: Session, step: int, selected: TokenTree) -> int:
        """Draft tokens the target accepts of `selected` (a subtree of the drafted tree)."""
        present = set(selected.tokens[1:].tolist())
        count = 0
        for token in self.target_tokens(session, step):
            if token not in present:
                break
            count += 1
        return count

    def target_tokens(self, session: Session, step: int) -> list[int]:
        """The tokens the target commits at the session's `step` as far as the recording knows
        them: its accepted path through the whole recorded tree (as the drafted tree's tokens)."""
        recorded = session.steps[step % len(session.steps)]
        return [TOKEN_BASE + node for node in recorded.accepted_path()]

    # ---- summaries ------------------------------------------------------------------------------
    def mean_accepted_length(self) -> dict[tuple[str, str], float]:
        """1 + mean accepted draft tokens per step of the whole recorded trees."""
        return {
            key: 1.0 + float(np.mean([len(s.accepted_path()) for ss in pool for s in ss.steps]))
            for key, pool in sorted(self._by_key.items())
        }

    # ---- files ----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "target": self.target,
            "method": asdict(self.method),
            "notes": self.notes,
            "sessions": [
                {
                    "kind": s.kind,
                    "draft": s.draft,
                    "prompt": s.prompt,
                    "steps": [[list(t.parents), list(t.logq), t.accepted_node] for t in s.steps],
                    **({} if s.positions is None else {"positions": list(s.positions)}),
                    **({} if s.num_tokens is None else {"num_tokens": s.num_tokens}),
                    **({} if s.output_crc is None else {"output_crc": s.output_crc}),
                    **({} if s.prompt_tokens is None else {"prompt_tokens": list(s.prompt_tokens)}),
                    **({} if s.output_tokens is None else {"output_tokens": list(s.output_tokens)}),
                }
                for s in self.sessions
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "acceptance model") -> AcceptanceModel:
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"{where}: version {data.get('version')!r}, expected {FORMAT_VERSION}")
        method = dict(data["method"])
        method["expansion"] = tuple(method.get("expansion", (2, 2, 1, 1)))
        sessions = []
        for s in data["sessions"]:
            steps = tuple(
                RecordedStep(tuple(int(p) for p in parents), tuple(map(float, logq)), int(acc))
                for parents, logq, acc in s["steps"]
            )
            for st in steps:
                bad = any(p >= i for i, p in enumerate(st.parents, start=1))
                if bad or len(st.logq) != len(st.parents) or st.accepted_node > len(st.parents):
                    name = f"{s['kind']}/{s['draft']}"
                    raise ValueError(f"{where}: a malformed step in session {name}")
            positions = s.get("positions")
            if positions is not None:
                positions = tuple(int(p) for p in positions)
                if len(positions) != len(steps) or any(
                    b < a + 1 + len(st.accepted_path())
                    for a, b, st in zip(positions, positions[1:], steps, strict=False)
                ):
                    name = f"{s['kind']}/{s['draft']}"
                    raise ValueError(f"{where}: positions that do not follow the steps in {name}")
            num_tokens = None if s.get("num_tokens") is None else int(s["num_tokens"])
            crc = None if s.get("output_crc") is None else int(s["output_crc"])
            prompt_tokens, output_tokens = (
                None if s.get(name) is None else tuple(int(t) for t in s[name])
                for name in ("prompt_tokens", "output_tokens")
            )
            sessions.append(
                Session(
                    str(s["kind"]), str(s["draft"]), int(s["prompt"]), steps, positions,
                    num_tokens, crc, prompt_tokens, output_tokens,
                )
            )  # fmt: skip
        return cls(str(data["target"]), DraftMethod(**method), sessions, str(data.get("notes", "")))

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_json(), separators=(",", ":"))
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "wt", encoding="utf-8") as f:
            f.write(text)
        return path

    @classmethod
    def load(cls, path: Path) -> AcceptanceModel:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            return cls.from_json(json.load(f), str(path))


# ---- recording from the real engine ------------------------------------------------------------
def shape_tree(tree: TokenTree, method: DraftMethod, max_depth: int) -> TokenTree:
    """A recorded tree as a drafter of `method` would have grown it `max_depth` deep, as far
    as the recording knows: a beam keeps, layer by layer, the w children of kept nodes with
    the highest path probability; a static expansion keeps each node's k_i most probable
    children and fills the rest with nodes the target never accepts (SpecInfer drafts them
    whatever their probability, and the verifier pays for them). Chains and dynamic trees are
    the recorded tree.

    Nodes the recording lacks had a path probability under its `min_path_prob`: a beam with
    the same cut-off would not have drafted them either; the filler nodes of a static tree
    stand for them. From a recording of unpruned beams of width W (`--beam`), a beam of width W
    and any depth up to the recording's is exact, and so is one of depth 1; a narrower, deeper
    one can come out short (its best children may have ranked below the recording's W)."""
    if method.kind not in ("beam", "static"):
        return tree
    lp = tree.path_logprob()
    kids = tree.children()
    tokens, parents, logq = [int(tree.tokens[0])], [-1], [0.0]
    layer = [(0, 0)]  # (node in `tree` or -1 for filler, its index in the new tree)
    filler = FILLER_TOKEN
    for depth in range(1, min(method.num_layers, max_depth) + 1):
        nxt: list[tuple[int, int]] = []
        if method.kind == "beam":
            children = [(c, i) for node, i in layer if node >= 0 for c in kids[node]]
            children.sort(key=lambda ci: -lp[ci[0]])
            for child, parent in children[: method.width]:
                nxt.append((child, len(tokens)))
                tokens.append(int(tree.tokens[child]))
                parents.append(parent)
                logq.append(float(tree.logq[child]))
        else:
            per_node = method.expansion[depth - 1]
            for node, i in layer:
                recorded = sorted(kids[node], key=lambda c: -lp[c]) if node >= 0 else []
                for child in recorded[:per_node]:
                    nxt.append((child, len(tokens)))
                    tokens.append(int(tree.tokens[child]))
                    parents.append(i)
                    logq.append(float(tree.logq[child]))
                for _ in range(per_node - min(per_node, len(recorded))):
                    nxt.append((-1, len(tokens)))
                    tokens.append(filler)
                    filler += 1
                    parents.append(i)
                    logq.append(FILLER_LOGQ)
        if not nxt:
            break
        layer = nxt
    return TokenTree.build(tokens, parents, logq)


def accepted_node(tree: TokenTree, accepted_tokens: Sequence[int]) -> int:
    """The node reached by following `accepted_tokens` down from the root."""
    kids = tree.children()
    node = 0
    for token in accepted_tokens:
        node = next(k for k in kids[node] if int(tree.tokens[k]) == int(token))
    return node


def recorded_step(tree: TokenTree, accepted_tokens: Sequence[int]) -> RecordedStep:
    logq = np.round(tree.logq[1:], LOGQ_DECIMALS)
    return RecordedStep(
        tuple(int(p) for p in tree.parents[1:]),
        tuple(float(x) for x in logq),
        accepted_node(tree, accepted_tokens),
    )


def record(
    kinds: Sequence[str],
    drafts: Sequence[str],
    per_kind: int,
    max_tokens: int,
    method: DraftMethod | None = None,
    keep_tokens: bool = False,
    model_set: str | None = None,  # None: SmolLM2's
    target_dtype: str = "float32",
) -> AcceptanceModel:
    """Decode `per_kind` evaluation prompts of each kind (the copy-heavy kinds of
    `tools.workloads` included) with each draft of `model_set`, greedily, the target at
    `target_dtype`, every drafted tree verified whole, and keep every step; the drafts grow
    trees by `method` (None: the default method); `keep_tokens`: each session keeps its
    prompt's and output's token ids."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from shared.engine.drafting import Drafter
    from shared.engine.presets import DEFAULT_METHOD
    from shared.engine.spec_engine import SpecEngine
    from shared.engine.verifier import Verifier
    from shared.model import load_model
    from shared.model.loader import load_target
    from shared.model.model_set import SMOLLM2, model_set_drafts, model_set_target
    from shared.model.precision import check_target_precision
    from shared.model.quantized import uses_int8
    from shared.model.runner import ModelRunner
    from shared.scheduling.config import SchedulerConfig
    from shared.values.sampling import SamplingParams
    from tools.prompts import kind_prompt_ids

    method = method or DEFAULT_METHOD
    model_set = model_set or SMOLLM2
    tdir = model_set_target(model_set)
    draft_dirs = model_set_drafts(model_set)
    unknown = [d for d in drafts if d not in draft_dirs]
    if unknown:
        raise ValueError(f"model set {model_set} has no draft(s) {unknown} ({list(draft_dirs)})")
    precision = check_target_precision(target_dtype, "cpu", setting="--target-dtype")
    tokenizer = AutoTokenizer.from_pretrained(tdir)
    target = ModelRunner(load_target(tdir, precision), kv_memory_bytes=64 << 20)
    verifier = Verifier(target)
    config = SchedulerConfig(planner="fixed", tree_selection="global-greedy")
    sessions: list[Session] = []
    jobs = [(k, d, i) for d in drafts for k in kinds for i in range(per_kind)]
    prompts = {k: kind_prompt_ids(tokenizer, k, per_kind) for k in kinds}
    engines: dict[str, SpecEngine] = {}
    steps: list[RecordedStep] = []
    positions: list[int] = []

    def observe(batch: Any, results: Mapping[str, Any]) -> None:
        for request in batch.decode:
            tree = batch.trees.get(request.request_id)
            result = results.get(request.request_id)
            if tree is not None and tree.num_nodes > 1 and result is not None:
                steps.append(recorded_step(tree, result.tokens[: result.num_accepted]))
                positions.append(len(request.output))  # observed before the step commits

    for kind, draft, i in tqdm(jobs, desc="recording acceptance", unit="prompt"):
        if draft not in engines:
            model = load_model(draft_dirs[draft], target_path=tdir, int8=uses_int8("auto", "cpu"))
            runner = ModelRunner(model, kv_memory_bytes=64 << 20)
            engines[draft] = SpecEngine(
                verifier,
                Drafter(runner, name=draft),
                method,
                config,
                target.cfg.eos_token_ids,
                observer=observe,
            )
        steps.clear()
        positions.clear()
        [done] = engines[draft].generate([prompts[kind][i]], SamplingParams(max_tokens=max_tokens))
        output_crc = zlib.crc32(np.asarray(done.output, dtype=np.int64).tobytes())
        text = (tuple(prompts[kind][i]), tuple(done.output)) if keep_tokens else (None, None)
        sessions.append(
            Session(
                kind, draft, i, tuple(steps), tuple(positions), len(done.output), output_crc, *text
            )
        )
    notes = (
        f"recorded {time.strftime('%Y-%m-%d')}: {per_kind} evaluation prompts per kind, greedy, "
        f"max {max_tokens} tokens, every drafted tree verified whole, {method.kind} trees, "
        f"{target_dtype} target"
    )
    return AcceptanceModel(tdir.name, method, sessions, notes)


def beam_method(depth: int, width: int) -> DraftMethod:
    """AdaServe's candidate beam as the paper states it: `width` nodes at every one of `depth`
    layers, whatever their path probability (no `min_path_prob` cut-off)."""
    return DraftMethod("beam", depth=depth, width=width, min_path_prob=0.0)


def main(argv: Sequence[str] | None = None) -> int:
    from shared.datasets import KINDS
    from shared.engine.presets import DEFAULT_DRAFT
    from shared.model.model_set import ALL_DRAFT_NAMES, MODEL_SETS, SMOLLM2, model_set_drafts
    from shared.model.precision import TARGET_DTYPES
    from shared.model.qwen_coder import CUT_DRAFT_NAME, DRAFT_NAME
    from tools.workloads import COPY_KINDS

    parser = argparse.ArgumentParser(
        prog="python -m tools.sim.acceptance",
        description="Record the acceptance model the simulator replays, from the real engine.",
    )
    parser.add_argument("--out", type=Path, required=True, help="file to write (.json or .json.gz)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=(*KINDS, *COPY_KINDS))
    parser.add_argument(
        "--drafts",
        nargs="+",
        choices=(*ALL_DRAFT_NAMES, DRAFT_NAME, CUT_DRAFT_NAME),
        help="draft models (default: draft-s for SmolLM2, else the draft the set serves first)",
    )
    parser.add_argument("--model-set", choices=MODEL_SETS, default=SMOLLM2)
    parser.add_argument("--target-dtype", choices=TARGET_DTYPES, default="float32")
    parser.add_argument("--per-kind", type=int, default=8, help="prompts per kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--beam", type=int, nargs=2, metavar=("DEPTH", "WIDTH"),
        help="record unpruned beams of this depth and width (AdaServe's candidates) instead of "
        "the default method's trees",
    )  # fmt: skip
    parser.add_argument(
        "--tokens", action="store_true",
        help="keep each session's prompt and output token ids (the simulator's model-free drafts "
        "propose from them)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.per_kind < 1 or args.max_tokens < 2:
        parser.error("--per-kind must be >= 1 and --max-tokens >= 2")
    method = None if args.beam is None else beam_method(*args.beam)
    # SmolLM2's recordings replay the simulator's default draft; another set's, the one it serves
    served = next(iter(model_set_drafts(args.model_set, served=True)))
    drafts = args.drafts or [DEFAULT_DRAFT if args.model_set == SMOLLM2 else served]
    model = record(
        args.kinds, drafts, args.per_kind, args.max_tokens, method, args.tokens,
        args.model_set, args.target_dtype,
    )  # fmt: skip
    model.save(args.out)
    for (kind, draft), length in model.mean_accepted_length().items():
        print(f"{kind:6s} {draft:8s} mean accepted length {length:.2f} (whole trees)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
