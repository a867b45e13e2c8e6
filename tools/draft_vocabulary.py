"""Write a draft whose output head keeps only the tokens text uses most
(`shared/model/draft_vocabulary.py`), counted over the distillation documents (chat, code and
math conversations, disjoint from every evaluation prompt).

    python -m tools.draft_vocabulary --draft DIR --size 32768 --out DIR
    python -m tools.draft_vocabulary --model-set qwen2.5-coder   # the set's 0.5B-32k, once
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from shared import datasets
from shared.model import qwen_coder
from shared.model.draft_vocabulary import build

# documents per kind counted: about 4 M tokens with the qwen2 tokenizer, a few seconds
CORPUS_DOCUMENTS = {"chat": 3000, "code": 1500, "math": 500}


def corpus(documents: dict[str, int] = CORPUS_DOCUMENTS) -> Iterator[list[tuple[str, str]]]:
    """The conversations counted: distillation documents of every kind (never evaluation text)."""
    for kind, n in documents.items():
        yield from datasets.distill_documents(kind, n)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", type=Path, help="the draft checkpoint folder")
    ap.add_argument("--size", type=int, default=qwen_coder.CUT_DRAFT_TOKENS, help="tokens kept")
    ap.add_argument("--out", type=Path, help="where the new checkpoint goes")
    ap.add_argument(
        "--model-set",
        choices=[qwen_coder.MODEL_SET],
        help="write the set's cut draft from its installed 0.5B (nothing if already written)",
    )
    args = ap.parse_args(argv)
    if args.model_set:
        out = qwen_coder.cut_draft_dir()
        if (out / "config.json").is_file():
            print(f"{qwen_coder.CUT_DRAFT_NAME}: {out} (already written)")
            return
        args.draft, args.out = qwen_coder.checkpoint_dir(qwen_coder.DRAFT), out
    elif args.draft is None or args.out is None:
        ap.error("give --draft and --out, or --model-set")
    documents = {"distillation documents": CORPUS_DOCUMENTS}
    print(json.dumps(build(args.draft, args.out, args.size, corpus(), documents)))


if __name__ == "__main__":
    main()
