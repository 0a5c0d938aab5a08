"""The prompts teacher-forced comparisons run on: a built-in set, or the user's own file.

The built-in set is chosen to exercise what breaks engines: short and long contexts (one
past 512 tokens, beyond a DSA indexer's top-k, and one of about 1500 tokens of natural
prose), code with indentation and tabs, numbers and long digit runs, several scripts
(CJK, Cyrillic, Arabic, Devanagari, emoji), and whitespace runs. Everything is embedded
text: the long prompts are assembled deterministically from the paragraphs below, never
sampled, so every run and every engine sees the same tokens.

User files: one prompt per line (blank lines skipped), or JSON Lines with a ``"text"``
field (and an optional ``"name"``) for prompts that span lines. Prompts are tokenized with
the model's own vocabulary (:mod:`ggufcheck.tokenizer`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ggufcheck.errors import GGUFCheckError, UsageError


@dataclass(frozen=True)
class Prompt:
    name: str
    text: str


# -- embedded prose (written for ggufcheck), the source of the long prompts -------------
_PARAGRAPHS = (
    "The lighthouse on the northern cape was built in 1874, after three ships were lost on "
    "the same reef in a single winter. Its keeper lived in a stone cottage at the foot of the "
    "tower with his wife and two daughters, and every evening at dusk he climbed the one "
    "hundred and twelve steps to light the lamp. In the logbook he recorded the weather, the "
    "ships that passed, and the hours the lamp burned. Some entries are only a line long; "
    "others fill a page with descriptions of storms so violent that the glass rattled in its "
    "frame and spray reached the gallery forty metres above the sea.",
    "Bread is one of the oldest prepared foods. A simple loaf needs only flour, water, salt "
    "and yeast, yet the result depends on patience more than on ingredients. The dough is "
    "mixed and left to rest so that the flour absorbs the water; then it is folded, shaped and "
    "left to rise again. During baking, the water in the dough turns to steam and the crust "
    "browns as sugars and proteins react in the heat of the oven. A baker who rushes any of "
    "these steps will notice it in the crumb, which becomes dense and uneven instead of open "
    "and light.",
    "Rivers shape the land they cross. Over thousands of years a river carves valleys, carries "
    "sediment downstream and deposits it where the current slows, building deltas and fertile "
    "plains. The plants and animals that live along its banks depend on its seasonal floods. "
    "When a dam is built, the flow becomes regular and predictable, which helps farmers and "
    "cities, but the sediment settles behind the wall instead of reaching the coast, and the "
    "delta slowly begins to shrink. Engineers now try to release water in pulses that imitate "
    "the natural floods.",
    "The first mechanical clocks appeared in European towers in the late thirteenth century. "
    "They had no face and no hands; they simply struck a bell at each hour. Their accuracy was "
    "poor by modern standards, drifting by a quarter of an hour or more each day, so they were "
    "regularly reset using a sundial. The invention of the pendulum in the seventeenth century "
    "changed this dramatically, reducing the daily error to less than a minute and making it "
    "worthwhile, for the first time, to add a minute hand to the dial.",
    "A good map is a careful set of omissions. No map can show everything, so the cartographer "
    "decides what matters for the reader: a hiking map shows contour lines, springs and "
    "shelters, while a road map shows junctions, distances and fuel stations. Scale forces "
    "further choices. A small village may appear as a dot on one sheet and as a maze of "
    "streets on another. Even the projection, the method used to flatten the curved surface "
    "of the earth, distorts either areas, angles or distances, and every projection chooses "
    "which of these to sacrifice.",
    "Honeybees communicate the location of flowers through a movement called the waggle "
    "dance. A forager returning to the hive walks in a straight line while shaking her body, "
    "then circles back and repeats the run. The angle of the straight run relative to the "
    "vertical comb indicates the direction of the food relative to the sun, and its duration "
    "indicates the distance. Other bees follow the dancer, touching her with their antennae, "
    "and then fly out to search the indicated area. Remarkably, the dancers adjust the angle "
    "as the sun moves across the sky.",
    "When the old railway line closed, the town council debated for years what to do with "
    "the empty tracks. Some wanted to sell the land for housing; others proposed a bicycle "
    "path connecting the villages along the valley. In the end the path was built, and it "
    "changed the town more than anyone expected. Cafes opened near the former stations, "
    "children cycled to school, and on summer weekends visitors arrived from the city with "
    "their bicycles on the train. The station building itself became a small museum of the "
    "railway's history.",
    "Glass is made by melting sand, soda and lime at temperatures above one thousand four "
    "hundred degrees. While it is hot, the glass can be blown, pressed, rolled or drawn into "
    "fibres thinner than a hair. As it cools it becomes rigid, but it never forms an orderly "
    "crystal; its atoms remain in the disordered arrangement of a liquid. If it cools too "
    "quickly, stresses are frozen into it and it may shatter at the slightest knock, which is "
    "why glassmakers anneal their work, letting it cool slowly over many hours in a warm oven.",
    "Learning a second language as an adult is slow, but it is far from hopeless. Adults "
    "often learn grammar and vocabulary faster than children because they can use rules and "
    "analogies. What they find harder is pronunciation and the automatic use of the language "
    "in conversation. Regular practice with native speakers, listening to radio and reading "
    "simple books all help. Many learners find that the first months are the hardest, and "
    "that after a while they begin to think in the new language without noticing it.",
    "In the mountains, the weather can change within minutes. A clear morning can turn into "
    "an afternoon of thunderstorms as warm air rises along the slopes and condenses into tall "
    "clouds. Experienced climbers start early, plan to reach the summit before noon, and "
    "watch the sky constantly. They carry warm clothing even in summer, because the "
    "temperature drops by about six degrees for every thousand metres of altitude, and a wet, "
    "windy ridge at three thousand metres can be dangerously cold in July.",
    "The public library in our neighbourhood opens at nine in the morning. The first visitors "
    "are usually retired people who come to read the newspapers, followed by parents with "
    "small children for the story hour. In the afternoon students arrive with laptops and "
    "fill every table near a power socket. The librarians know many of them by name. Besides "
    "lending books, they help people fill in forms, print documents and find information, "
    "and in winter the warm reading room is a refuge for anyone who needs a quiet place.",
    "Salt was once so valuable that it was used as money. Caravans carried it across deserts, "
    "and cities grew rich by taxing its trade. It preserved meat and fish through the winter, "
    "long before refrigeration existed. Today salt is cheap and plentiful, extracted from mines "
    "or evaporated from sea water in shallow ponds, where the sun and wind do most of the work. "
    "Yet the old importance of salt survives in language: the word salary is often said to "
    "come from the salt rations given to soldiers.",
    "Every autumn the orchard behind the school produced more apples than the village could "
    "eat. One year the teachers decided to turn the harvest into a lesson. The pupils weighed "
    "the baskets, counted the apples in each, and calculated the average weight of a single "
    "fruit. They pressed some of the apples into juice and measured how many litres a kilogram "
    "produced. The oldest class wrote a short report comparing the varieties, and the youngest "
    "drew pictures of the trees through the seasons. The juice was sold at the winter fair, and "
    "the money paid for new books.",
    "Modern ships navigate with satellite receivers that report their position to within a few "
    "metres, yet officers still learn to use a sextant. The instrument measures the angle "
    "between a star, or the sun, and the horizon. Combined with the exact time and a set of "
    "printed tables, that angle gives a line on the chart along which the ship must lie; two "
    "or three such lines cross at its position. The method is slow and demands a steady hand on "
    "a rolling deck, but it needs no electricity and cannot be switched off from afar.",
)

_CODE = '''import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    x: float
    y: float

    def distance(self, other: "Point") -> float:
        """Euclidean distance between two points."""
        return math.hypot(self.x - other.x, self.y - other.y)


def closest_pair(points: list[Point]) -> tuple[Point, Point]:
    best = (points[0], points[1])
    best_d = best[0].distance(best[1])
    for i, p in enumerate(points):
        for q in points[i + 1:]:
            d = p.distance(q)
            if d < best_d:
                best, best_d = (p, q), d
    return best


if __name__ == "__main__":
\tpts = [Point(0, 0), Point(3, 4), Point(1, 1), Point(-2, 5)]
\tprint(closest_pair(pts))  # -> (Point(x=0, y=0), Point(x=1, y=1))
'''

_C_CODE = """#include <stdio.h>

/* Sum the digits of n, for n >= 0. */
static int digit_sum(long n) {
\tint s = 0;
\twhile (n > 0) {
\t\ts += n % 10;
\t\tn /= 10;
\t}
\treturn s;
}

int main(void) {
\tfor (long n = 1; n <= 1000000; n *= 10)
\t\tprintf("%ld -> %d\\n", n, digit_sum(n));
\treturn 0;
}
"""

_NUMBERS = (
    "Invoice 2024-0117: 3 items at $19.99, 12 items at $4.50 and 1 item at $1,249.00. "
    "Subtotal $1,363.97; tax 8.25% = $112.53; total $1,476.50. "
    "Pi is 3.14159265358979323846264338327950288419716939937510, e is 2.718281828459045, "
    "and 2^64 = 18446744073709551616. Dates: 1969-07-20, 03/12/2026, 12:45:07. "
    "Phone +1 (555) 010-4477. 0x7FFF_FFFF, 1e-9, -273.15, 6.022e23."
)

_MULTILINGUAL = (
    "English: The weather is lovely today.\n"
    "Deutsch: Das Wetter ist heute schön, und die Straßen sind voller Menschen.\n"
    "Français : Il fait très beau aujourd'hui ; allons au marché.\n"
    "Español: ¿Dónde está la estación de tren? ¡Muchas gracias!\n"
    "Русский: Сегодня прекрасная погода, и мы идём гулять в парк.\n"
    "中文：今天天气很好，我们去公园散步吧。\n"
    "日本語：今日はとても良い天気ですね。カタカナとひらがなも使います。\n"
    "한국어: 오늘 날씨가 정말 좋네요.\n"
    "العربية: الطقس جميل اليوم، لنذهب إلى الحديقة.\n"
    "हिन्दी: आज मौसम बहुत अच्छा है, चलो पार्क चलते हैं।\n"
    "Ελληνικά: Ο καιρός είναι υπέροχος σήμερα.\n"
    "Emoji: 😀 🎉 👍🏽 🇫🇷 ❤️ 👩‍💻\n"
)

_WHITESPACE = (
    "Columns:\tname\t\tvalue\n"
    "    indented by four\n"
    "        indented by eight\n"
    "\n\n\n"
    "   leading spaces, trailing spaces   \n"
    "a  b   c    d     e\r\n"
    "end."
)


def _long_text(n_paragraphs: int) -> str:
    """The first ``n_paragraphs`` paragraphs, in order, separated by blank lines."""
    return "\n\n".join(_PARAGRAPHS[:n_paragraphs])


def builtin_prompts() -> list[Prompt]:
    """The built-in prompt set (same texts on every call, in a fixed order)."""
    return [
        Prompt("short-en", "The capital of France is"),
        Prompt("question", "Q: Why is the sky blue?\nA:"),
        Prompt("prose", _PARAGRAPHS[0]),
        Prompt("code-python", _CODE),
        Prompt("code-c", _C_CODE),
        Prompt("numbers", _NUMBERS),
        Prompt("multilingual", _MULTILINGUAL),
        Prompt("whitespace", _WHITESPACE),
        # about 650-700 tokens with common vocabularies: past a DSA indexer's top_k of 512
        Prompt("long-600", _long_text(6)),
        # about 1500 tokens of natural prose
        Prompt("long-1500", _long_text(len(_PARAGRAPHS))),
    ]


def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a user's file: JSON Lines (``{"text": ...}``) or one prompt per line.

    The format is JSON Lines when the file name ends in ``.jsonl`` or its first non-blank
    line starts with ``{``. Errors name the file and the line.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"{path}: cannot read the prompt file: {e.strerror or e}") from None
    lines = raw.split(b"\n")
    texts: list[str] = []
    for number, line in enumerate(lines, start=1):
        try:
            texts.append(line.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as e:
            raise UsageError(f"{path}:{number}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
    first = next((t for t in texts if t.strip()), None)
    if first is None:
        raise UsageError(f"{path}: the prompt file has no prompts", tip="one prompt per line, or JSONL with \"text\"")
    as_jsonl = path.suffix.lower() == ".jsonl" or first.lstrip().startswith("{")
    prompts = _parse_jsonl(path, texts) if as_jsonl else _parse_lines(path, texts)
    return prompts


def _parse_lines(path: Path, texts: list[str]) -> list[Prompt]:
    return [Prompt(f"{path.name}:{n}", t) for n, t in enumerate(texts, start=1) if t.strip()]


def _parse_jsonl(path: Path, texts: list[str]) -> list[Prompt]:
    prompts: list[Prompt] = []
    for number, line in enumerate(texts, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: expected a JSON object with a \"text\" field, got {type(obj).__name__}")
        text = obj.get("text")
        if not isinstance(text, str):
            problem = "has no \"text\" field" if text is None else f"\"text\" is {type(text).__name__}, not a string"
            raise UsageError(f"{where}: the object {problem}")
        if not text:
            raise UsageError(f"{where}: \"text\" is empty")
        name = obj.get("name", f"{path.name}:{number}")
        if not isinstance(name, str):
            raise UsageError(f"{where}: \"name\" must be a string, got {type(name).__name__}")
        prompts.append(Prompt(name, text))
    return prompts


def tokenize_prompts(prompts: Iterable[Prompt], tokenizer, max_tokens: int | None = None) -> list[list[int]]:
    """Token ids of each prompt with the model's own vocabulary (BOS as the vocab asks).

    ``max_tokens`` truncates each prompt (BOS included). A prompt that gives no token is an
    error naming it.
    """
    if max_tokens is not None and max_tokens < 1:
        raise UsageError(f"max_tokens must be at least 1, got {max_tokens}")
    out: list[list[int]] = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt.text, add_special=True, parse_special=False)
        if not ids:
            raise GGUFCheckError(f"prompt {prompt.name!r} gives no tokens")
        out.append(ids[:max_tokens] if max_tokens is not None else ids)
    return out
