"""A draft step's cost against a target decode step, with the drafts' weights as trained and int8.

    python -m bench.bench_draft_weights [--rounds 15] [--threads 2] [--json out.json]

One process. Loads the target (fp32, its linear-kernel plan measured at start, as the services
run it on a CPU) and each draft three ways: fp32 with plain `F.linear`, fp32 with its own
measured kernel plan, and int8 (`LlamaModel.quantize_int8`, the services' CPU default). Each
model commits a 256-token prefix (a feature-level draft reads random features, which costs the
same as real ones), then every round times, in rotating order, one forward of a root and n - 1
children (n = 1, 4, 16: the widths a tree's layers have) plus its commit. Prints the median
step per model and width, each draft step as a share of the target's 1-token step (what the
issue calls the cost per drafted token), and the int8 step's speed-up over the planned fp32 one.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from distill.evaluate import width_stepper
from shared.model import LlamaModel, load_model
from shared.model.model_set import ALL_DRAFT_NAMES, all_draft_dirs, target_dir

WIDTHS = (1, 4, 16)
PREFIX = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", nargs="+", default=list(ALL_DRAFT_NAMES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tdir = target_dir()
    dirs = all_draft_dirs()

    target = load_model(tdir)
    target.plan_kernels()
    models: dict[tuple[str, str], LlamaModel] = {("target", "fp32, planned"): target}
    for name in args.drafts:
        models[(name, "fp32")] = load_model(dirs[name], target_path=tdir)
        planned = load_model(dirs[name], target_path=tdir)
        planned.plan_kernels()
        models[(name, "fp32, planned")] = planned
        models[(name, "int8")] = load_model(dirs[name], target_path=tdir, int8=True)

    rounds = args.rounds + 2  # two warm-up rounds
    steppers = {
        key: width_stepper(m, PREFIX, room=rounds * len(WIDTHS) + max(WIDTHS), seed=i)
        for i, (key, m) in enumerate(models.items())
    }
    order = [(key, w) for key in models for w in (WIDTHS if key[0] != "target" else (1,))]
    times: dict = {k: [] for k in order}
    with torch.inference_mode():
        for r in range(rounds):
            for key, w in order[r % len(order) :] + order[: r % len(order)]:
                seconds = steppers[key](w)
                if r >= 2:
                    times[(key, w)].append(seconds)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    target_ms = ms[(("target", "fp32, planned"), 1)]
    print(f"target decode step (fp32, planned): {target_ms:.2f} ms; threads {args.threads}")
    header = "| draft | weights | " + " | ".join(f"{w} tokens, ms" for w in WIDTHS)
    print(header + " | 1 token / target step | int8 speed-up |")
    print("|---|---|" + "---:|" * (len(WIDTHS) + 2))
    rows = []
    for (name, weights), _ in models.items():
        if name == "target":
            continue
        cells = [ms[((name, weights), w)] for w in WIDTHS]
        share = cells[0] / target_ms
        planned = ms[((name, "fp32, planned"), 1)]
        gain = f"{planned / cells[0]:.2f}x" if weights == "int8" else ""
        print(
            f"| {name} | {weights} | "
            + " | ".join(f"{c:.2f}" for c in cells)
            + f" | {share:.1%} | {gain} |"
        )
        rows.append(
            {"draft": name, "weights": weights, "ms": dict(zip(WIDTHS, cells, strict=True))}
        )
    if args.json:
        meta = {"threads": args.threads, "rounds": args.rounds, "torch": torch.__version__}
        args.json.write_text(
            json.dumps({"meta": meta, "target_ms": target_ms, "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
