#!/usr/bin/env python3
"""Regenerate conversations.jsonl: the bundled sample conversations (OpenAI `messages` format).

The conversations are templated, seeded and varied: arithmetic, counting, lists, code,
translations of a fixed phrase set (accents, CJK, emoji), unit conversions, and a few long
ones (tables, step-by-step sums, stories). The continuations are predictable on purpose, so
the tiny toy target learns them and an EAGLE drafter trained on its hidden states reaches a
meaningful acceptance rate. Run: python data/sample/generate.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20240611
NUM_CONVERSATIONS = 300
OUT = Path(__file__).resolve().parent / "conversations.jsonl"

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly and exactly.",
    "You are a patient tutor who explains every step.",
    "You are a coding assistant. Use Markdown code blocks for code.",
    "You are a friendly multilingual assistant. 🌍",
    "Tu es un assistant serviable qui répond clairement.",
]

NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]

PHRASES = {
    "Good morning": {
        "French": "Bonjour",
        "Spanish": "Buenos días",
        "German": "Guten Morgen",
        "Japanese": "おはようございます",
        "Chinese": "早上好",
        "Portuguese": "Bom dia",
    },
    "Thank you very much": {
        "French": "Merci beaucoup",
        "Spanish": "Muchas gracias",
        "German": "Vielen Dank",
        "Japanese": "どうもありがとうございます",
        "Chinese": "非常感谢",
        "Portuguese": "Muito obrigado",
    },
    "Where is the train station?": {
        "French": "Où est la gare ?",
        "Spanish": "¿Dónde está la estación de tren?",
        "German": "Wo ist der Bahnhof?",
        "Japanese": "駅はどこですか？",
        "Chinese": "火车站在哪里？",
        "Portuguese": "Onde fica a estação de trem?",
    },
    "I would like a coffee, please": {
        "French": "Je voudrais un café, s'il vous plaît",
        "Spanish": "Quisiera un café, por favor",
        "German": "Ich hätte gern einen Kaffee, bitte",
        "Japanese": "コーヒーをお願いします",
        "Chinese": "请给我一杯咖啡",
        "Portuguese": "Eu gostaria de um café, por favor",
    },
    "The weather is nice today": {
        "French": "Il fait beau aujourd'hui",
        "Spanish": "Hace buen tiempo hoy",
        "German": "Das Wetter ist heute schön",
        "Japanese": "今日はいい天気です",
        "Chinese": "今天天气很好",
        "Portuguese": "O tempo está bom hoje",
    },
    "See you tomorrow": {
        "French": "À demain",
        "Spanish": "Hasta mañana",
        "German": "Bis morgen",
        "Japanese": "また明日",
        "Chinese": "明天见",
        "Portuguese": "Até amanhã",
    },
}

CATEGORIES = {
    "fruits": ["apple", "banana", "cherry", "grape", "mango", "pear", "plum", "kiwi", "lemon"],
    "colors": ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"],
    "animals": ["cat", "dog", "horse", "rabbit", "fox", "owl", "whale", "tiger", "panda"],
    "planets": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"],
    "programming languages": ["Python", "Rust", "Go", "Java", "C", "Haskell", "Julia", "Kotlin"],
    "weekdays": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
}
EMOJI = {
    "fruits": "🍎",
    "colors": "🎨",
    "animals": "🐾",
    "planets": "🪐",
    "programming languages": "💻",
    "weekdays": "📅",
}

WEATHER = [("sunny", "☀️"), ("rainy", "🌧️"), ("snowy", "❄️"), ("cloudy", "☁️"), ("windy", "💨")]
CITIES = [
    "Paris",
    "Tokyo",
    "Berlin",
    "Madrid",
    "Lisbon",
    "Beijing",
    "Montréal",
    "São Paulo",
    "Zürich",
    "Kraków",
]

FUNCTIONS = [
    (
        "sum_list",
        "the sum of a list of numbers",
        "def sum_list(values):\n    total = 0\n"
        "    for value in values:\n        total += value\n    return total",
    ),
    (
        "max_list",
        "the largest number in a list",
        "def max_list(values):\n    best = values[0]\n"
        "    for value in values[1:]:\n        if value > best:\n            best = value\n"
        "    return best",
    ),
    (
        "count_vowels",
        "the number of vowels in a string",
        'def count_vowels(text):\n    return sum(1 for char in text.lower() if char in "aeiou")',
    ),
    (
        "reverse_words",
        "a sentence with its words reversed",
        'def reverse_words(sentence):\n    return " ".join(reversed(sentence.split()))',
    ),
    ("is_even", "whether a number is even", "def is_even(number):\n    return number % 2 == 0"),
    (
        "factorial",
        "the factorial of n",
        "def factorial(n):\n    result = 1\n"
        "    for k in range(2, n + 1):\n        result *= k\n    return result",
    ),
    (
        "fibonacci",
        "the first n Fibonacci numbers",
        "def fibonacci(n):\n    numbers = [0, 1]\n"
        "    while len(numbers) < n:\n        numbers.append(numbers[-1] + numbers[-2])\n"
        "    return numbers[:n]",
    ),
    (
        "square_all",
        "the squares of a list of numbers",
        "def square_all(values):\n    return [value * value for value in values]",
    ),
]

STORY_HEROES = ["a small robot", "an old fisherman", "a curious cat", "a young baker", "a lost owl"]
STORY_PLACES = ["a quiet village", "a busy harbour", "a snowy mountain", "a green valley"]
STORY_GOALS = [
    "find a golden key",
    "bake the perfect bread",
    "reach the top of the tower",
    "learn to sing",
    "map the stars",
]


def arithmetic(rng: random.Random) -> list[dict]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    name = {"+": "plus", "-": "minus", "*": "times"}[op]
    messages = [
        {
            "role": "user",
            "content": rng.choice(
                [
                    f"What is {a} {op} {b}?",
                    f"Compute {a} {name} {b}.",
                    f"Calculate {a} {op} {b}, please.",
                ]
            ),
        },
        {"role": "assistant", "content": f"{a} {op} {b} = {value}."},
    ]
    for _ in range(rng.randint(0, 3)):
        c = rng.randint(2, 20)
        op2 = rng.choice(["+", "*"])
        new = value + c if op2 == "+" else value * c
        word = "add" if op2 == "+" else "multiply by"
        messages += [
            {"role": "user", "content": f"Now {word} {c}."},
            {"role": "assistant", "content": f"{value} {op2} {c} = {new}."},
        ]
        value = new
    return messages


def counting(rng: random.Random) -> list[dict]:
    start = rng.randint(0, 30)
    step = rng.choice([1, 1, 2, 3, 5])
    n = rng.randint(5, 15)
    seq = [start + step * i for i in range(n)]
    end = seq[-1]
    ask = f"Count from {start} to {end}" + (f" in steps of {step}." if step > 1 else ".")
    messages = [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": ", ".join(map(str, seq)) + "."},
    ]
    if rng.random() < 0.5:
        messages += [
            {"role": "user", "content": "Now count backwards."},
            {"role": "assistant", "content": ", ".join(map(str, reversed(seq))) + "."},
        ]
    if rng.random() < 0.4 and end <= 20:
        messages += [
            {"role": "user", "content": "Write the last one as a word."},
            {"role": "assistant", "content": f'{end} is written "{NUMBER_WORDS[end]}".'},
        ]
    return messages


def listing(rng: random.Random) -> list[dict]:
    category = rng.choice(sorted(CATEGORIES))
    items = list(CATEGORIES[category])
    rng.shuffle(items)
    k = rng.randint(3, min(6, len(items)))
    picked = items[:k]
    word = NUMBER_WORDS[k]
    emoji = EMOJI[category] if rng.random() < 0.5 else ""
    body = "\n".join(f"{i}. {item}" for i, item in enumerate(picked, start=1))
    messages = [
        {"role": "user", "content": f"List {word} {category}."},
        {
            "role": "assistant",
            "content": f"Here are {word} {category}{' ' + emoji if emoji else ''}:\n{body}",
        },
    ]
    if rng.random() < 0.5:
        messages += [
            {"role": "user", "content": "Sort them alphabetically."},
            {
                "role": "assistant",
                "content": "\n".join(f"{i}. {item}" for i, item in enumerate(sorted(picked), 1)),
            },
        ]
    if rng.random() < 0.3:
        messages += [
            {"role": "user", "content": "Which one is first?"},
            {"role": "assistant", "content": f"The first one is {picked[0]}."},
        ]
    return messages


def code(rng: random.Random) -> list[dict]:
    name, what, body = rng.choice(FUNCTIONS)
    messages = [
        {"role": "user", "content": f"Write a Python function `{name}` that returns {what}."},
        {
            "role": "assistant",
            "content": f"Here is `{name}`:\n\n```python\n{body}\n```\n\nIt returns {what}.",
        },
    ]
    if rng.random() < 0.6:
        values = [rng.randint(1, 9) for _ in range(rng.randint(3, 6))]
        messages += [
            {"role": "user", "content": f"Show an example call with {values}."},
            {
                "role": "assistant",
                "content": f"```python\nresult = {name}({values})\nprint(result)\n```",
            },
        ]
    if rng.random() < 0.4:
        messages += [
            {"role": "user", "content": "Add a docstring."},
            {
                "role": "assistant",
                "content": "```python\n"
                + body.replace(":\n", f':\n    """Return {what}."""\n', 1)
                + "\n```",
            },
        ]
    return messages


def translation(rng: random.Random) -> list[dict]:
    phrase = rng.choice(sorted(PHRASES))
    languages = sorted(PHRASES[phrase])
    rng.shuffle(languages)
    messages = []
    for language in languages[: rng.randint(1, 4)]:
        messages += [
            {"role": "user", "content": f'Translate "{phrase}" into {language}.'},
            {"role": "assistant", "content": f"In {language}: {PHRASES[phrase][language]}"},
        ]
    return messages


def weather(rng: random.Random) -> list[dict]:
    messages = []
    for city in rng.sample(CITIES, rng.randint(1, 3)):
        kind, emoji = rng.choice(WEATHER)
        temp = rng.randint(-5, 32)
        messages += [
            {
                "role": "user",
                "content": f"Describe the weather in {city} with an emoji: {kind}, {temp} °C.",
            },
            {"role": "assistant", "content": f"{emoji} In {city} it is {kind} and {temp} °C."},
        ]
    return messages


def conversion(rng: random.Random) -> list[dict]:
    messages = []
    for _ in range(rng.randint(1, 3)):
        km = rng.randint(1, 50)
        unit, factor = rng.choice([("meters", 1000), ("centimeters", 100000)])
        messages += [
            {"role": "user", "content": f"How many {unit} are in {km} km?"},
            {"role": "assistant", "content": f"{km} km = {km * factor} {unit}."},
        ]
    return messages


def table(rng: random.Random) -> list[dict]:
    n = rng.randint(2, 12)
    rows = rng.randint(30, 80)
    body = "\n".join(f"{n} x {i} = {n * i}" for i in range(1, rows + 1))
    return [
        {"role": "user", "content": f"Write the multiplication table of {n} up to {rows}."},
        {"role": "assistant", "content": f"The multiplication table of {n}:\n{body}"},
        {"role": "user", "content": f"What is {n} x {rows + 1}?"},
        {"role": "assistant", "content": f"{n} x {rows + 1} = {n * (rows + 1)}."},
    ]


def running_sum(rng: random.Random) -> list[dict]:
    values = [rng.randint(1, 50) for _ in range(rng.randint(20, 60))]
    total, steps = 0, []
    for value in values:
        steps.append(f"{total} + {value} = {total + value}")
        total += value
    return [
        {
            "role": "user",
            "content": f"Add these numbers step by step: {', '.join(map(str, values))}.",
        },
        {
            "role": "assistant",
            "content": "Step by step:\n" + "\n".join(steps) + f"\nThe total is {total}.",
        },
    ]


def story(rng: random.Random) -> list[dict]:
    hero, place, goal = rng.choice(STORY_HEROES), rng.choice(STORY_PLACES), rng.choice(STORY_GOALS)
    days = rng.randint(5, 20)
    lines = [f"Once upon a time, in {place}, there lived {hero} who wanted to {goal}."]
    for day in range(1, days + 1):
        lines.append(
            f"On day {day}, {hero} tried again to {goal}. "
            + rng.choice(
                [
                    "It did not work, but the next try would be better.",
                    "Some progress was made, and hope grew stronger.",
                    "A friend came to help, and they worked together.",
                ]
            )
        )
    lines.append(f"At last, after {days} days, {hero} was able to {goal}. The end.")
    messages = [
        {"role": "user", "content": f"Tell me a story about {hero} in {place}."},
        {"role": "assistant", "content": "\n\n".join(lines)},
    ]
    if rng.random() < 0.5:
        messages += [
            {"role": "user", "content": "Summarize it in one sentence."},
            {
                "role": "assistant",
                "content": f"{hero.capitalize()} in {place} kept trying for {days} days "
                f"and finally managed to {goal}.",
            },
        ]
    return messages


SHORT_KINDS = [arithmetic, counting, listing, code, translation, weather, conversion]
LONG_KINDS = [table, running_sum, story]


def conversation(rng: random.Random) -> dict:
    if rng.random() < 0.15:
        turns = rng.choice(LONG_KINDS)(rng)
    else:
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns += rng.choice(SHORT_KINDS)(rng)
    if rng.random() < 0.6:
        turns = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + turns
    return {"messages": turns}


def main() -> None:
    rng = random.Random(SEED)
    with open(OUT, "w", encoding="utf-8") as f:
        for _ in range(NUM_CONVERSATIONS):
            f.write(json.dumps(conversation(rng), ensure_ascii=False) + "\n")
    print(f"wrote {NUM_CONVERSATIONS} conversations to {OUT}")


if __name__ == "__main__":
    main()
