"""Prompts for training and evaluating a drafter on a chat model: what a server is asked.

Four kinds, each made deterministically from the interpreter's standard library (every machine
has it) and from templates written here:

- ``completion``: raw code, a file's text up to a function's first body line;
- ``editing``: a chat request to rewrite a stdlib function (rename, docstring, type hints, fix a
  planted bug, convert to a class, ...): the answer mostly re-types the given code;
- ``chat``: general instructions, templates x topics;
- ``prose``: a chat request to continue the opening of a stdlib docstring.

Files are split into train and held-out by the same path hash as the bundled pair's corpus, and
chat prompts by a hash of their text, so training never sees an evaluation prompt.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

KINDS = ("completion", "editing", "chat", "prose")
HELD_OUT_PERCENT = 5


@dataclass(frozen=True)
class Prompt:
    kind: str
    text: str  # raw text (chat=False) or the user message (chat=True)
    chat: bool

    @property
    def key(self) -> str:
        """Stable identity of the prompt (resuming generation skips done keys)."""
        return hashlib.sha256(f"{self.kind}\0{self.chat}\0{self.text}".encode()).hexdigest()[:24]


def held_out(name: str) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return digest[0] * 100 // 256 < HELD_OUT_PERCENT


def stdlib_sources(split: str) -> list[str]:
    """Texts of the stdlib's Python files (no tests) in the `train` or `held_out` split."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))
    want_held_out = split == "held_out"
    return [
        p.read_text(encoding="utf-8", errors="replace")
        for p in files
        if held_out(str(p.relative_to(root))) == want_held_out
    ]


def _functions(
    source: str, min_lines: int = 4, max_chars: int = 1400
) -> list[tuple[ast.FunctionDef, str]]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.end_lineno:
            if node.end_lineno - node.lineno + 1 < min_lines:
                continue
            text = "".join(lines[node.lineno - 1 : node.end_lineno])
            indent = len(text) - len(text.lstrip(" "))
            text = "".join(line[indent:] if line.startswith(" " * indent) else line
                           for line in text.splitlines(keepends=True))  # fmt: skip
            if len(text) <= max_chars:
                out.append((node, text.rstrip() + "\n"))
    return out


# ----------------------------------------------------------------------------- completion
def completion_prompts(source: str, max_context_chars: int = 1200) -> list[Prompt]:
    lines = source.splitlines(keepends=True)
    prompts = []
    for fn, _ in _functions(source, max_chars=10**9):
        body_start = fn.body[0].lineno - 1
        if isinstance(fn.body[0], ast.Expr) and len(fn.body) > 1:  # keep the docstring
            body_start = fn.body[1].lineno - 1
        text = "".join(lines[:body_start])[-max_context_chars:]
        if text.strip():
            prompts.append(Prompt("completion", text, chat=False))
    return prompts


# ----------------------------------------------------------------------------- editing
def _plant_bug(code: str) -> str | None:
    """One small, plausible bug: a flipped comparison or an off-by-one."""
    for old, new in ((" == ", " != "), (" < ", " <= "), (" + 1", " - 1"), (" > ", " >= ")):
        if old in code:
            return code.replace(old, new, 1)
    return None


def _edits(fn: ast.FunctionDef, code: str, rng: random.Random) -> list[str]:
    block = f"```python\n{code}```"
    names = [a.arg for a in fn.args.args if a.arg not in ("self", "cls") and len(a.arg) > 1]
    edits = []
    if names:
        old = rng.choice(names)
        new = rng.choice([f"{old}_value", f"new_{old}", f"{old}2", "item", "value_in"])
        edits.append(
            f"Rewrite this function with the parameter `{old}` renamed to `{new}`:\n\n{block}"
        )
    edits.append(
        f"Rename the function `{fn.name}` to `{fn.name}_v2` and show the full code:\n\n{block}"
    )
    edits.append(f"Add a docstring to this function and return the complete function:\n\n{block}")
    edits.append(f"Add Python type hints to this function:\n\n{block}")
    edits.append(f"Add a short comment above each important line of this function:\n\n{block}")
    edits.append(f"Convert this function into a method of a class named `Helper`:\n\n{block}")
    buggy = _plant_bug(code)
    if buggy is not None:
        edits.append(
            f"This function has a bug. Fix it and show the corrected code:\n\n```python\n{buggy}```"
        )
    edits.append(
        f"Reformat this function to follow PEP 8 and return the whole function:\n\n{block}"
    )
    return edits


def editing_prompts(source: str, rng: random.Random, per_function: int = 2) -> list[Prompt]:
    prompts = []
    for fn, code in _functions(source, max_chars=1400):
        for text in rng.sample(_edits(fn, code, rng), k=per_function):
            prompts.append(Prompt("editing", text, chat=True))
    return prompts


# ----------------------------------------------------------------------------- prose
def _docstrings(source: str, min_words: int = 30) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) >= min_words:
                out.append(" ".join(doc.split()))
    return out


def prose_prompts(source: str, rng: random.Random, words: int = 24) -> list[Prompt]:
    templates = (
        "Continue this text:\n\n{0}",
        "Here is the start of a paragraph. Continue it in the same style:\n\n{0}",
        "Finish writing this documentation paragraph:\n\n{0}",
    )
    return [
        Prompt("prose", rng.choice(templates).format(" ".join(doc.split()[:words])), chat=True)
        for doc in _docstrings(source)
    ]


# ----------------------------------------------------------------------------- chat
_CHAT_TEMPLATES = (
    "Explain {t} in simple terms.",
    "What is {t}? Give a short answer.",
    "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "How would you explain {t} to a ten-year-old?",
    "Write a haiku about {t}.",
    "Write a short poem about {t}.",
    "Summarize the main ideas of {t} in a few sentences.",
    "List five questions a student might ask about {t}.",
    "What are common misconceptions about {t}?",
    "Write a short story that involves {t}.",
    "Give me a step-by-step guide to getting started with {t}.",
    "Compare {t} with something similar and explain the differences.",
    "Why is {t} important?",
    "Write a friendly email to a colleague recommending {t}.",
    "What should a beginner know about {t}?",
    "Describe the history of {t} briefly.",
    "Write a tweet about {t}.",
    "Give an example that illustrates {t}.",
)
_TOPICS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "climate change",
    "the Roman Empire",
    "machine learning",
    "recursion",
    "the stock market",
    "healthy sleep",
    "volcanoes",
    "the French Revolution",
    "renewable energy",
    "gardening",
    "the human heart",
    "bees",
    "the internet",
    "electric cars",
    "meditation",
    "the moon landing",
    "chess",
    "jazz music",
    "the immune system",
    "inflation",
    "plate tectonics",
    "coffee",
    "the printing press",
    "public speaking",
    "time management",
    "the Pythagorean theorem",
    "prime numbers",
    "version control with git",
    "unit testing",
    "databases",
    "the Python programming language",
    "sorting algorithms",
    "binary search",
    "hash tables",
    "cooking pasta",
    "running a marathon",
    "learning a new language",
    "the solar system",
    "dinosaurs",
    "rainbows",
    "earthquakes",
    "the Great Wall of China",
    "democracy",
    "recycling",
    "ocean tides",
    "gravity",
    "magnets",
    "vaccines",
    "the Olympic Games",
    "origami",
    "photography",
    "friendship",
    "saving money",
    "job interviews",
    "remote work",
    "smartphones",
    "social media",
    "cats",
    "dogs",
    "penguins",
    "the Amazon rainforest",
    "deserts",
    "mountains",
    "wind turbines",
    "bread baking",
    "the theory of evolution",
    "DNA",
    "atoms",
    "electricity",
    "the speed of light",
    "artificial intelligence",
    "cybersecurity",
    "passwords",
    "open source software",
    "linked lists",
    "regular expressions",
    "the HTTP protocol",
    "cloud computing",
    "the Renaissance",
    "Shakespeare",
    "ancient Egypt",
    "the Industrial Revolution",
    "yoga",
    "nutrition",
    "drinking water",
    "first aid",
    "volunteering",
    "board games",
    "the periodic table",
    "fractions",
    "probability",
    "statistics",
    "algebra",
    "the northern lights",
    "hurricanes",
    "snowflakes",
    "coral reefs",
    "whales",
)
_CODE_TASKS = (
    "Write a Python function that {t}.",
    "How do I {t} in Python? Show a short example.",
    "Write a Python script that {t}, with comments.",
)
_CODE_TOPICS = (
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a file",
    "merges two sorted lists",
    "finds the largest element in a list",
    "computes a factorial",
    "reads a CSV file and prints each row",
    "removes duplicates from a list",
    "checks if a string is a palindrome",
    "converts Celsius to Fahrenheit",
    "sorts a dictionary by its values",
    "flattens a nested list",
    "computes Fibonacci numbers",
    "parses a JSON string",
    "downloads nothing but prints the current date",
    "validates an email address with a regular expression",
    "implements binary search",
    "counts vowels in a sentence",
    "generates a random password",
    "implements a stack class",
    "implements a queue with two stacks",
    "finds the intersection of two lists",
    "computes the average of a list of numbers",
    "capitalizes every word in a sentence",
    "checks whether two strings are anagrams",
    "writes a list of lines to a text file",
    "measures how long a function takes",
    "groups words by their first letter",
)


# A second tier (added 2026-12-06, when the drafter corpus had used up the first): its prompts
# come after every first-tier one in each list, so the lists a data run or an eval has already
# taken from keep their prefixes.
_MORE_TOPICS = (
    "the Silk Road",
    "the Vikings",
    "the Cold War",
    "the Byzantine Empire",
    "the Aztecs",
    "the invention of the telephone",
    "the steam engine",
    "the Wright brothers",
    "Marie Curie",
    "Isaac Newton",
    "Ada Lovelace",
    "Leonardo da Vinci",
    "the Beatles",
    "classical music",
    "opera",
    "hip hop",
    "the violin",
    "learning the guitar",
    "impressionism",
    "street art",
    "architecture",
    "skyscrapers",
    "bridges",
    "tunnels",
    "trains",
    "airplanes",
    "submarines",
    "rockets",
    "the International Space Station",
    "Mars",
    "Jupiter",
    "comets",
    "telescopes",
    "microscopes",
    "bacteria",
    "viruses",
    "antibiotics",
    "the brain",
    "memory",
    "dreams",
    "habits",
    "motivation",
    "stress",
    "happiness",
    "empathy",
    "leadership",
    "teamwork",
    "negotiation",
    "budgeting",
    "credit cards",
    "compound interest",
    "taxes",
    "insurance",
    "starting a small business",
    "marketing",
    "customer service",
    "supply chains",
    "shipping containers",
    "the postal service",
    "libraries",
    "museums",
    "national parks",
    "camping",
    "hiking",
    "cycling",
    "swimming",
    "football",
    "basketball",
    "tennis",
    "the Tour de France",
    "knitting",
    "woodworking",
    "pottery",
    "painting with watercolors",
    "houseplants",
    "composting",
    "beekeeping",
    "chickens",
    "horses",
    "octopuses",
    "sharks",
    "elephants",
    "owls",
    "butterflies",
    "ants",
    "spiders",
    "mushrooms",
    "trees",
    "forests",
    "rivers",
    "glaciers",
    "islands",
    "caves",
    "tornadoes",
    "lightning",
    "fog",
    "the seasons",
    "solar panels",
    "nuclear power",
    "batteries",
    "hydrogen fuel",
    "3D printing",
    "robots",
    "self-driving cars",
    "virtual reality",
    "blockchain",
    "quantum computing",
    "compilers",
    "operating systems",
    "computer networks",
    "encryption",
    "web browsers",
    "search engines",
    "email",
    "spreadsheets",
    "functional programming",
    "object-oriented programming",
    "code review",
    "technical debt",
    "debugging",
    "APIs",
    "microservices",
    "containers",
    "continuous integration",
    "graph algorithms",
    "dynamic programming",
    "big-O notation",
    "floating point numbers",
    "binary numbers",
    "geometry",
    "calculus",
    "logic puzzles",
    "maps",
    "time zones",
    "calendars",
    "languages of the world",
    "writing a resume",
    "studying for exams",
    "taking notes",
    "reading more books",
    "poetry",
    "mythology",
    "fairy tales",
    "science fiction",
    "chocolate",
    "tea",
    "spices",
    "fermentation",
    "vegetarian cooking",
    "breakfast",
    "picnics",
    "birthdays",
    "weddings",
    "holidays",
)


# A third tier (added 2026-12-07, when the second was nearly generated): the same templates
# over more topics, after both earlier tiers in the list.
_THIRD_TOPICS = (
    "the Maya civilization",
    "the Ottoman Empire",
    "the Magna Carta",
    "the samurai",
    "the Incas",
    "the Phoenicians",
    "the history of money",
    "the history of medicine",
    "the heart",
    "the lungs",
    "digestion",
    "vitamins",
    "hydration",
    "posture",
    "running",
    "breathing exercises",
    "procrastination",
    "curiosity",
    "creativity",
    "critical thinking",
    "decision making",
    "giving feedback",
    "active listening",
    "making friends",
    "saving for retirement",
    "interest rates",
    "renting versus buying a home",
    "plastic pollution",
    "ocean currents",
    "tides",
    "rainforests",
    "the Arctic",
    "the Amazon river",
    "wetlands",
    "pollination",
    "migration of birds",
    "dolphins",
    "wolves",
    "frogs",
    "turtles",
    "fossils",
    "evolution",
    "genetics",
    "cells",
    "friction",
    "sound waves",
    "light",
    "chemical reactions",
    "acids and bases",
    "the Sun",
    "the Milky Way",
    "satellites",
    "GPS",
    "Wi-Fi",
    "version control",
    "SQL",
    "caching",
    "trees in computer science",
    "memory management",
    "concurrency",
    "the command line",
    "Linux",
    "data visualization",
    "puzzles",
    "video games",
    "film making",
    "jazz",
    "the piano",
    "drums",
    "dance",
    "theater",
    "sculpture",
    "calligraphy",
    "baking bread",
    "making pizza",
    "cheese",
    "rice",
    "soup",
    "street food",
    "farmers markets",
    "recycling at home",
    "minimalism",
    "moving to a new city",
    "travel on a budget",
    "train journeys",
    "road trips",
    "lighthouses",
    "castles",
    "old maps",
    "clocks",
    "the history of writing",
    "alphabets",
    "libraries of the ancient world",
    "newspapers",
    "radio",
    "podcasts",
    "blogging",
    "kindness",
    "gratitude",
    "patience",
    "honesty",
    "family traditions",
    "festivals",
    "lanterns",
    "fireworks",
)


def chat_prompts() -> list[Prompt]:
    """The first tier: general instructions (templates x topics), then code questions."""
    prompts = [
        Prompt("chat", t.format(t=topic), chat=True) for t in _CHAT_TEMPLATES for topic in _TOPICS
    ]
    prompts += [
        Prompt("chat", t.format(t=task), chat=True) for t in _CODE_TASKS for task in _CODE_TOPICS
    ]
    return prompts


def more_chat_prompts(topics: tuple[str, ...] = _MORE_TOPICS) -> list[Prompt]:
    """A later tier: the same templates over `topics` (the second tier's by default)."""
    return [
        Prompt("chat", t.format(t=topic), chat=True) for t in _CHAT_TEMPLATES for topic in topics
    ]


# ----------------------------------------------------------------------------- the mix
def build_prompts(split: str, per_kind: int, seed: int = 0) -> list[Prompt]:
    """Up to `per_kind` prompts of each kind from the `train` or `held_out` split, interleaved.

    Deterministic for a given (split, seed): a larger `per_kind` extends the same lists, so a
    data run can grow without redoing what it generated.
    """
    rng = random.Random(seed)
    sources = stdlib_sources(split)
    by_kind: dict[str, list[Prompt]] = {"completion": [], "editing": [], "prose": []}
    for source in sources:
        by_kind["completion"] += completion_prompts(source)
        by_kind["editing"] += editing_prompts(source, rng)
        by_kind["prose"] += prose_prompts(source, rng)
    want_held_out = split == "held_out"
    by_kind["chat"] = [p for p in chat_prompts() if held_out(p.text) == want_held_out]
    for kind in KINDS:
        random.Random(f"{seed}-{kind}").shuffle(by_kind[kind])
    # later tiers after the first, in order: earlier lists keep their prefixes
    for tier, topics in ((2, _MORE_TOPICS), (3, _THIRD_TOPICS)):
        later = [p for p in more_chat_prompts(topics) if held_out(p.text) == want_held_out]
        random.Random(f"{seed}-chat-{tier}").shuffle(later)
        by_kind["chat"] += later
    for kind in KINDS:
        by_kind[kind] = _dedupe(by_kind[kind])[:per_kind]
    mixed = []
    for i in range(max(len(v) for v in by_kind.values())):
        mixed += [by_kind[k][i] for k in KINDS if i < len(by_kind[k])]
    return mixed


def _dedupe(prompts: list[Prompt]) -> list[Prompt]:
    seen: set[str] = set()
    out = []
    for p in prompts:
        norm = re.sub(r"\s+", " ", p.text)
        if norm not in seen:
            seen.add(norm)
            out.append(p)
    return out
