"""Tokens per target forward of model-free drafts against the model draft, per workload.

    python -m bench.bench_model_free --per-kind 4 --max-tokens 128
    python -m bench.bench_model_free --kinds code-edit chat --drafts draft-e ngram draft-e+ngram

Acceptance is a property of the draft and the text, not of the machine's load, so this counts
target forwards, not seconds: every configuration decodes the same prompts greedily with the
SmolLM2 target (the goodput planner on the cost profile the CLI loads, or `--planner fixed`), and
the table gives tokens per target forward (bonus included) per kind and whether each output
equals plain decoding token for token. A configuration is a draft of the model set (`draft-e`,
`draft-l`, ...), a model-free draft (`ngram`, `suffix`), a model draft merged with a model-free
one (`draft-e+ngram`: their trees merged, the model drafting only what the copy is not expected
to deliver; `draft-e+ngram=always`: both draft every step; `=runs`: the model planned by the
copy's acceptance after steps that ended as its last one did, `model_beside_copy`), or
`choose:` and drafts
(`choose:draft-e,ngram,suffix`: the counterfactual chooser among them, merging on), or `plan:`
and drafts (`plan:draft-e,draft-l,ngram`: the planner's choice among the model drafts, the
model-free one merged beside them). `@field=value,...` after any of them changes fields of the
drafting method (`draft-e@max_width=2`) or of the scheduler's configuration
(`draft-e+ngram@calibrate_costs=true`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from shared.datasets import eval_prompts
from shared.engine.drafting import Drafter
from shared.engine.model_free import MODEL_FREE_KINDS, ModelFreeDrafter
from shared.engine.presets import DEFAULT_METHOD
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.grammar.matcher import GrammarBook
from shared.model import load_model, load_target
from shared.model.cost_profiles import ProfileChoice, load_or_measure
from shared.model.model_set import MODEL_SETS, SMOLLM2, model_set_drafts, model_set_target
from shared.model.precision import TARGET_DTYPES, check_target_precision
from shared.model.quantized import uses_int8
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.cost_model import CostModel
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tools.workloads import COPY_KINDS, conversation_ids, workload_messages

DATASET_KINDS = ("chat", "everyday", "code", "math")
KV_BYTES = 256 << 20
DEFAULT_DRAFTS = ("draft-e", "ngram", "suffix", "draft-e+ngram", "draft-e+suffix")


def prompts(
    kinds: list[str], per_kind: int, model_set: str = SMOLLM2
) -> dict[str, list[list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_set_target(model_set))
    out = {}
    for kind in kinds:
        if kind in COPY_KINDS:
            conversations = workload_messages(kind, per_kind)
        else:
            conversations = [(("user", text),) for text in eval_prompts(kind, per_kind)]
        out[kind] = [conversation_ids(tokenizer, c) for c in conversations]
    return out


class Models:
    """The target (at `target_dtype`) and every draft a configuration may name, loaded once.
    Their runners cache no prefixes: engines share them, and a cache would hand whichever
    configuration ran a prompt second the first one's prefill (timings would favour it)."""

    def __init__(
        self,
        planner: str,
        model_set: str = SMOLLM2,
        target_dtype: str = "float32",
        *,
        kv_bytes: int = KV_BYTES,
        tokenizer: Any = None,  # engines given one serve structured requests
        exact_attention: bool = False,  # trees attend row by row (`ModelRunner`)
        extra_drafts: dict[str, Path] | None = None,  # draft folders beside the set's, by name
    ) -> None:
        self.target_dir = model_set_target(model_set)
        self.draft_dirs = model_set_drafts(model_set) | (extra_drafts or {})
        precision = check_target_precision(target_dtype, "cpu", setting="--target-dtype")
        self.dtype = precision.dtype
        self.kv_bytes = kv_bytes
        self.target = load_target(self.target_dir, precision)
        eos = self.target.cfg.eos_token_ids
        # one grammar book for every engine: they share the verifier and the model drafts
        self.grammar = None if tokenizer is None else GrammarBook.from_hf(tokenizer, eos)
        self.verifier = Verifier(
            ModelRunner(
                self.target,
                kv_memory_bytes=kv_bytes,
                prefix_caching=False,
                exact_attention=exact_attention,
            )
        )
        self.models: dict[str, Drafter] = {}
        self.planner = planner
        self._costs: dict[tuple[str, ...], CostModel | None] = {}
        # each model's profile, spot-checked once: every engine prices it alike
        self._chosen: dict[str, ProfileChoice] = {}
        if planner == "goodput":
            # the target's profile brings its kernel plan: loaded before any run, so plain
            # decoding multiplies with the kernels speculation verifies with (as `augury
            # generate` does); other planners load no profile and plan no kernels at all
            self._costs[()] = load_or_measure(
                self.verifier.runner, {}, target_name=self.target_dir.name, chosen=self._chosen
            )

    def model_draft(self, name: str) -> Drafter:
        if name not in self.models:
            path = self.draft_dirs[name]
            model = load_model(path, target_path=self.target_dir, int8=uses_int8("auto", "cpu"))
            runner = ModelRunner(model, kv_memory_bytes=self.kv_bytes, prefix_caching=False)
            self.models[name] = Drafter(runner, name=name)
        return self.models[name]

    def plain_engine(self, config: SchedulerConfig | None = None) -> SpecEngine:
        return SpecEngine(
            self.verifier,
            config=config,
            eos_token_ids=self.target.cfg.eos_token_ids,
            grammar=self.grammar,
        )

    def engine(
        self,
        config: str,
        method: DraftMethod = DEFAULT_METHOD,
        max_running_requests: int | None = None,
    ) -> SpecEngine:
        chooser = "fixed"
        # NAME@field=value,...: fields of the method or of the scheduler's configuration changed
        config, _, overrides = config.partition("@")
        method, scheduler_fields = with_overrides(method, overrides)
        # NAME=always: the model planned as if alone beside the copy; =runs: by the copy's
        # acceptance after steps that ended as its last one did (`model_beside_copy`)
        config, _, beside = config.partition("=")
        names = config.split("+")
        if config.startswith("choose:"):
            chooser, names = "counterfactual", config.removeprefix("choose:").split(",")
        if config.startswith("plan:"):
            chooser, names = "planned", config.removeprefix("plan:").split(",")
        drafters: dict = {}
        for name in names:
            drafters[name] = ModelFreeDrafter(name) if name in MODEL_FREE_KINDS else None
            if drafters[name] is None:
                drafters[name] = self.model_draft(name)
        models = {n: d.runner for n, d in drafters.items() if isinstance(d, Drafter)}
        key = tuple(sorted(models))
        if self.planner == "goodput" and key not in self._costs:
            self._costs[key] = load_or_measure(
                self.verifier.runner, models, target_name=self.target_dir.name, chosen=self._chosen
            )
        cost = self._costs.get(key)
        if cost is not None:  # its own calibration: each engine measures its own steps
            cost = cost.fresh()
        if beside:
            scheduler_fields["model_beside_copy"] = beside
        scheduling = SchedulerConfig(
            planner=self.planner, draft_chooser=chooser, **scheduler_fields
        )
        if max_running_requests is not None:
            scheduling = scheduling.model_copy(
                update={"max_running_requests": max_running_requests}
            )
        engine = SpecEngine(
            self.verifier,
            drafters,
            method,
            scheduling,
            eos_token_ids=self.target.cfg.eos_token_ids,
            grammar=self.grammar,
            cost=cost,
        )
        if chooser == "fixed":  # the model draft first, as written
            engine.core.chooser.preferred = list(names)  # type: ignore[attr-defined]
        return engine


def with_overrides(method: DraftMethod, overrides: str) -> tuple[DraftMethod, dict[str, str]]:
    """`method` with `field=value,...` changed where the field is the method's (numbers:
    `max_width=2,min_path_prob=0.05`), and the others, for the scheduler's configuration
    (`calibrate_costs=false`; validated there)."""
    changes: dict[str, int | float] = {}
    others: dict[str, str] = {}
    for item in filter(None, overrides.split(",")):
        name, _, value = item.partition("=")
        if name in SchedulerConfig.model_fields:
            others[name] = value
            continue
        current = getattr(method, name)  # an unknown field raises here
        changes[name] = type(current)(value)
    return (dataclasses.replace(method, **changes) if changes else method), others


def plain_outputs(models: Models, batch: dict[str, list[list[int]]], max_tokens: int) -> dict:
    engine = models.plain_engine()
    params = SamplingParams(max_tokens=max_tokens)
    return {
        kind: [engine.generate([p], params)[0].output for p in kind_prompts]
        for kind, kind_prompts in batch.items()
    }


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    batch = prompts(args.kinds, args.per_kind, args.model_set)
    models = Models(args.planner, args.model_set, args.target_dtype)
    plain = plain_outputs(models, batch, args.max_tokens)
    params = SamplingParams(max_tokens=args.max_tokens)
    results: dict = {}
    for config in args.drafts:
        per_kind = {}
        for kind, kind_prompts in batch.items():
            tokens = forwards = equal = 0
            chosen: dict[str, int] = {}
            for prompt, want in zip(kind_prompts, plain[kind], strict=True):
                engine = models.engine(config)
                [request] = engine.generate([prompt], params)
                tokens += len(request.output)
                forwards += engine.stats.num_target_forwards
                equal += request.output == want
                for model, stats in request.draft_stats.items():
                    chosen[model] = chosen.get(model, 0) + stats.num_target_forwards
            per_kind[kind] = {
                "tokens_per_forward": tokens / max(forwards, 1),
                "equal": f"{equal}/{len(kind_prompts)}",
                "steps_by_draft": chosen,
            }
            print(config, kind, per_kind[kind], flush=True)
        results[config] = per_kind
    return results


def report(results: dict, kinds: list[str]) -> str:
    lines = ["| draft | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for config, per_kind in results.items():
        cells = [f"{per_kind[k]['tokens_per_forward']:.2f} ({per_kind[k]['equal']})" for k in kinds]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=[*COPY_KINDS, "chat", "everyday"],
                    choices=[*COPY_KINDS, *DATASET_KINDS])  # fmt: skip
    ap.add_argument("--drafts", nargs="+", default=list(DEFAULT_DRAFTS))
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--planner", choices=["goodput", "fixed"], default="goodput")
    ap.add_argument("--model-set", choices=MODEL_SETS, default=SMOLLM2)
    ap.add_argument("--target-dtype", choices=TARGET_DTYPES, default="float32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = run(args)
    print(report(results, args.kinds))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
