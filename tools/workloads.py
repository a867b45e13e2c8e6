"""Copy-heavy workloads written for this project: requests whose answers repeat their prompts.

Four sets, each item a chat conversation (role, content) ending in a user turn:

| kind | what the answer copies |
|---|---|
| `code-edit` | a function given in the prompt, asked to be changed (rename, fix, extend) |
| `revision` | a paragraph given in the prompt, asked to be corrected or rewritten lightly |
| `passage-qa` | a passage given in the prompt; the question asks for its exact sentences |
| `agent` | a multi-turn tool loop whose tool outputs recur turn after turn |

They were written for Augury (not taken from any data set) and are used by no draft's training
(`distill/` reads `shared.datasets` only), so a draft's acceptance on them is not inflated by
having seen them. `workload_messages(kind, n)` gives the first n conversations of a kind;
`tools.traces synth --kinds ...` mixes them with the chat, code, math and everyday sets, and
`--app-per-kind` names each kind as the request's application (`augury.app`), so a `suffix`
draft shares its cache among the requests of one kind.
"""

from __future__ import annotations

Turn = tuple[str, str]
Conversation = tuple[Turn, ...]

COPY_KINDS = ("code-edit", "revision", "passage-qa", "agent")

# ---- code editing ------------------------------------------------------------------------------

_FUNCTIONS = (
    (
        """def average_rating(reviews):
    total = 0
    count = 0
    for review in reviews:
        if review["stars"] is not None:
            total += review["stars"]
            count += 1
    return total / count""",
        "Change it so that it returns None instead of failing when no review has stars. "
        "Show the whole function.",
    ),
    (
        """def parse_duration(text):
    units = {"s": 1, "m": 60, "h": 3600}
    number = int(text[:-1])
    unit = text[-1]
    return number * units[unit]""",
        "Add a `d` unit for days (86400 seconds) and raise ValueError with a clear message for "
        "an unknown unit. Show the whole function.",
    ),
    (
        """class ShoppingCart:
    def __init__(self):
        self.items = {}

    def add(self, name, price, quantity=1):
        if name in self.items:
            self.items[name]["quantity"] += quantity
        else:
            self.items[name] = {"price": price, "quantity": quantity}

    def total(self):
        return sum(item["price"] * item["quantity"] for item in self.items.values())""",
        "Add a `remove(name, quantity=1)` method that lowers the quantity and deletes the item "
        "when it reaches zero. Show the whole class.",
    ),
    (
        """def find_duplicates(paths):
    seen = {}
    duplicates = []
    for path in paths:
        name = path.split("/")[-1]
        if name in seen:
            duplicates.append((seen[name], path))
        else:
            seen[name] = path
    return duplicates""",
        "Rename the variable `seen` to `first_path_by_name` everywhere and add type hints. "
        "Show the whole function.",
    ),
    (
        """def chunk_text(text, size):
    chunks = []
    start = 0
    while start < len(text):
        chunks.append(text[start:start + size])
        start += size
    return chunks""",
        "Add an `overlap` parameter (default 0): each chunk starts `size - overlap` characters "
        "after the previous one. Keep the rest as it is and show the whole function.",
    ),
    (
        """def load_settings(path):
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=")
            settings[key.strip()] = value.strip()
    return settings""",
        "Values may contain '=' themselves: split only on the first one. Show the corrected "
        "function.",
    ),
    (
        """def celsius_table(start, stop, step):
    rows = []
    for celsius in range(start, stop, step):
        fahrenheit = celsius * 9 / 5 + 32
        rows.append(f"{celsius:>4} C = {fahrenheit:>6.1f} F")
    return "\\n".join(rows)""",
        "Add a docstring that explains the arguments and the returned text. Do not change the "
        "code; show the whole function.",
    ),
    (
        """def merge_intervals(intervals):
    intervals.sort()
    merged = [intervals[0]]
    for start, end in intervals[1:]:
        last_start, last_end = merged[-1]
        if start <= last_end:
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged""",
        "It fails on an empty list and sorts the caller's list in place. Fix both problems and "
        "show the whole function.",
    ),
)

# ---- document revision ---------------------------------------------------------------------------

_PARAGRAPHS = (
    (
        "Our team have finished the migration of the billing service last week. All customers "
        "was moved to the new database without downtime, and the old servers will be switched "
        "off on friday. If you notice any diffrence in your invoices, please contact the support "
        "team so we can look into it quickly.",
        "Correct the grammar and spelling mistakes and change nothing else.",
    ),
    (
        "The community garden opens every Saturday from nine to one. Volunteers water the beds, "
        "pull weeds and harvest whatever is ripe. Anyone may take vegetables home, but we ask "
        "that you leave enough for the next visitor. Tools are kept in the green shed next to "
        "the gate, and the key hangs on the hook inside the door.",
        "Rewrite this paragraph in the past tense, as a report of last Saturday.",
    ),
    (
        "hey everyone, quick reminder that the quarterly report is due on the 14th. please send "
        "me your numbers by the 10th so i have time to put it together. if something is missing "
        "just tell me what you have and we'll sort it out. thanks!",
        "Make this message more formal for an email to the department, keeping its content.",
    ),
    (
        "The bridge on Mill Road will be closed from 3 June to 28 June for repairs to the deck. "
        "Traffic will be diverted along Station Street and Oak Avenue. Buses 12 and 14 will use "
        "the diversion and stop at temporary stops marked with yellow signs. Pedestrians and "
        "cyclists can still cross on the footbridge.",
        "The closure now runs from 10 June to 5 July. Update the notice and keep everything "
        "else word for word.",
    ),
    (
        "Thank you for applying to the position of junior analyst. We have read your application "
        "with interest. Unfortunately we have decided to continue with other candidates whose "
        "experience matches the role more closely. We will keep your details on file and may "
        "contact you if a suitable position opens in the future.",
        "Replace 'junior analyst' with 'data engineer' and add a final sentence wishing the "
        "candidate success. Show the whole letter.",
    ),
    (
        "To reset the router, first unplug it from the power socket and wait thirty seconds. "
        "Plug it back in and wait until the light on the front turns solid green, which can "
        "take up to two minutes. Then press and hold the reset button on the back for ten "
        "seconds using a paper clip. The router will restart with its factory settings.",
        "Turn this paragraph into a numbered list of steps, keeping the wording of each step.",
    ),
    (
        "Minutes of the meeting on 4 March. Present: Ana, Bilal, Chen and Dora. Ana presented the "
        "budget for the summer fair, which was approved. Bilal will book the marquee by the end "
        "of the month. Chen raised the question of parking; Dora will ask the school whether its "
        "field can be used. The next meeting is on 1 April at seven in the library.",
        "Bilal cannot attend the next meeting and the meeting moves to 8 April. Update the "
        "minutes accordingly and keep the rest unchanged.",
    ),
    (
        "The museum is open from Tuesday to Sunday between ten and six. Entry is free for "
        "children under twelve and costs eight pounds for adults. Guided tours start at eleven "
        "and at three and last about an hour. The café on the ground floor serves lunch from "
        "twelve until half past two.",
        "Fix the paragraph for a website: the museum now also opens on Mondays in August. Show "
        "the whole paragraph.",
    ),
)

# ---- question answering over a passage ---------------------------------------------------------

_PASSAGES = (
    (
        "The lighthouse on Gull Point was built in 1871 after two ships ran aground on the reef "
        "in the same winter. Its light could be seen twenty miles out to sea. The last keeper, "
        "Margaret Hale, lived there until 1962, when the light was automated. Today the tower is "
        "a museum, and visitors can climb its 114 steps to the lantern room.",
        "Why was the lighthouse built, and who was its last keeper? Quote the sentences from "
        "the passage that answer this.",
    ),
    (
        "Sourdough bread rises because of a starter, a mixture of flour and water in which wild "
        "yeasts and lactic acid bacteria live. The yeasts produce carbon dioxide, which makes the "
        "dough rise, while the bacteria produce acids that give the bread its sour taste. A "
        "starter must be fed with fresh flour and water regularly, or the microbes run out of "
        "food and the starter weakens.",
        "What makes sourdough taste sour? Answer with the exact sentence from the passage.",
    ),
    (
        "Article 7. Members may borrow up to six items at a time. Books may be kept for three "
        "weeks and renewed twice, unless another member has reserved them. Films and games may be "
        "kept for one week and cannot be renewed. Items returned late are charged twenty pence "
        "per day, up to a maximum of five pounds per item.",
        "Can a film be renewed, and what is the late charge? Quote the rules that apply.",
    ),
    (
        "The city's new recycling scheme starts in September. Paper and cardboard go in the blue "
        "bin, glass bottles and jars in the green box, and plastic bottles, tins and cans in the "
        "grey bin. Food waste is collected every week in the small brown caddy. Garden waste is "
        "collected every two weeks for households that have paid the annual fee.",
        "Where do glass jars go and how often is food waste collected? Quote the passage.",
    ),
    (
        "Photosynthesis takes place mainly in the leaves of a plant, inside small structures "
        "called chloroplasts. Chlorophyll, the green pigment in the chloroplasts, absorbs light "
        "energy. The plant uses this energy to turn water and carbon dioxide into glucose, and "
        "releases oxygen as a by-product. The glucose is used for growth or stored as starch.",
        "List the inputs and outputs of photosynthesis, copying the sentence that names them.",
    ),
    (
        "Warranty. The manufacturer repairs or replaces any part that fails because of a defect "
        "in materials or workmanship within two years of purchase. The warranty does not cover "
        "damage caused by accidents, misuse, or repairs made by anyone other than an authorised "
        "service centre. To make a claim, contact the shop where you bought the product and "
        "bring the receipt.",
        "Is damage from a fall covered, and how do I make a claim? Quote the relevant sentences.",
    ),
    (
        "The expedition left the base camp on 12 May with six climbers and four porters. Bad "
        "weather kept them at the second camp for three days. On 19 May two climbers, Ravi and "
        "Ines, reached the summit at ten in the morning and returned safely the same evening. The "
        "rest of the team turned back at the third camp because of strong winds.",
        "Who reached the summit and when? Answer by quoting the passage.",
    ),
    (
        "Honey bees communicate the location of food with a waggle dance. A forager that has "
        "found flowers returns to the hive and moves in a figure-eight pattern on the comb. The "
        "angle of the straight part of the dance shows the direction of the food relative to the "
        "sun, and the length of the waggle shows how far away it is.",
        "How does the dance show direction and distance? Copy the sentence that explains it.",
    ),
)

# ---- agent loops with recurring tool output -----------------------------------------------------

_AGENT_SYSTEM = (
    "You are a coding assistant working in a repository. To run a command, answer with one "
    "line `RUN: <command>`; its output comes back in the next message. When the task is done, "
    "answer with `DONE:` and a short summary that repeats the relevant output lines exactly."
)

_TEST_LOG = """============================= test session starts ==============================
collected 14 items

tests/test_cart.py ......F.                                              [ 57%]
tests/test_prices.py ..F...                                              [100%]

=================================== FAILURES ===================================
___________________________ test_remove_last_item ______________________________
    def test_remove_last_item():
        cart = ShoppingCart()
        cart.add("pen", 1.5)
>       cart.remove("pen")
E       AttributeError: 'ShoppingCart' object has no attribute 'remove'
tests/test_cart.py:41: AttributeError
___________________________ test_discount_rounding _____________________________
    def test_discount_rounding():
>       assert apply_discount(9.99, 0.15) == 8.49
E       assert 8.4915 == 8.49
tests/test_prices.py:22: AssertionError
========================= 2 failed, 12 passed in 0.41s ========================="""

_LISTING = """src/
  cart.py
  prices.py
  storage.py
tests/
  test_cart.py
  test_prices.py
  test_storage.py
README.md
pyproject.toml"""

_STATUS = """{"service": "orders", "status": "degraded", "instances": 3, "healthy": 2,
 "unhealthy": ["orders-2"], "last_error": "connection refused: db-primary:5432",
 "checked_at": "2026-03-02T10:15:00Z"}"""

_AGENTS: tuple[Conversation, ...] = (
    (
        ("system", _AGENT_SYSTEM),
        ("user", "Find out why the tests fail."),
        ("assistant", "RUN: pytest -q"),
        ("user", _TEST_LOG),
        ("assistant", "RUN: sed -n 1,40p src/cart.py"),
        ("user", "class ShoppingCart:\n    def __init__(self):\n        self.items = {}"),
        ("assistant", "RUN: pytest -q"),
        ("user", _TEST_LOG),
    ),
    (
        ("system", _AGENT_SYSTEM),
        ("user", "List the project's files, then tell me which source files have no tests."),
        ("assistant", "RUN: tree -F --noreport"),
        ("user", _LISTING),
        ("assistant", "RUN: tree -F --noreport src tests"),
        ("user", _LISTING),
    ),
    (
        ("system", _AGENT_SYSTEM),
        ("user", "Watch the orders service and report when it is healthy again."),
        ("assistant", "RUN: status orders"),
        ("user", _STATUS),
        ("assistant", "RUN: sleep 30 && status orders"),
        ("user", _STATUS),
        ("assistant", "RUN: sleep 30 && status orders"),
        ("user", _STATUS),
    ),
    (
        ("system", _AGENT_SYSTEM),
        ("user", "The discount test fails. Show me the failing assertion and fix it."),
        ("assistant", "RUN: pytest -q tests/test_prices.py"),
        ("user", _TEST_LOG),
        ("assistant", "RUN: grep -n 'def apply_discount' -A 3 src/prices.py"),
        (
            "user",
            "12:def apply_discount(price, rate):\n13:    return price * (1 - rate)",
        ),
        ("assistant", "RUN: pytest -q"),
        ("user", _TEST_LOG),
    ),
    (
        ("system", _AGENT_SYSTEM),
        ("user", "Check the service status and the tests, then summarize both."),
        ("assistant", "RUN: status orders"),
        ("user", _STATUS),
        ("assistant", "RUN: pytest -q"),
        ("user", _TEST_LOG),
        ("assistant", "RUN: status orders"),
        ("user", _STATUS),
    ),
)


def _code_edit(i: int) -> Conversation:
    code, ask = _FUNCTIONS[i]
    return (("user", f"Here is a Python function.\n\n```python\n{code}\n```\n\n{ask}"),)


def _revision(i: int) -> Conversation:
    text, ask = _PARAGRAPHS[i]
    return (("user", f"{ask}\n\n{text}"),)


def _passage_qa(i: int) -> Conversation:
    passage, question = _PASSAGES[i]
    return (("user", f"Read the passage and answer the question.\n\n{passage}\n\n{question}"),)


SIZES = {
    "code-edit": len(_FUNCTIONS),
    "revision": len(_PARAGRAPHS),
    "passage-qa": len(_PASSAGES),
    "agent": len(_AGENTS),
}


def workload_messages(kind: str, n: int | None = None) -> list[Conversation]:
    """The first `n` conversations of a copy-heavy kind (all of them when n is None)."""
    if kind not in COPY_KINDS:
        raise ValueError(f"unknown workload {kind!r}; known: {list(COPY_KINDS)}")
    size = SIZES[kind]
    n = size if n is None else n
    if not 0 <= n <= size:
        raise ValueError(f"only {size} {kind} conversations, asked for {n}")
    match kind:
        case "code-edit":
            return [_code_edit(i) for i in range(n)]
        case "revision":
            return [_revision(i) for i in range(n)]
        case "passage-qa":
            return [_passage_qa(i) for i in range(n)]
    return list(_AGENTS[:n])


def conversation_ids(tokenizer: object, conversation: Conversation) -> list[int]:
    """The token ids of a conversation under the tokenizer's chat template, generation prompt
    added."""
    messages = [{"role": role, "content": text} for role, text in conversation]
    ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)
