"""Write the small English corpus that ships with potluck (src/potluck/data/corpus/).

The text is generated from word lists and templates written for potluck, so it
is free of anyone's copyright, varied enough for a tiny model's loss to fall
visibly, and reproducible: run ``python tools/make_corpus.py`` and the files
come out byte for byte the same. ``prose.txt`` is hand-written and kept as is.
"""

from __future__ import annotations

import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "potluck" / "data" / "corpus"

NAMES = ["Ada", "Bram", "Celia", "Dmitri", "Esme", "Farid", "Greta", "Hugo", "Ines", "Jonah",
         "Kiri", "Lena", "Milo", "Nadia", "Oskar", "Priya", "Quinn", "Rosa", "Sami", "Tova",
         "Umar", "Vera", "Wen", "Xavi", "Yara", "Zeno"]
PEOPLE = ["baker", "fisher", "teacher", "miller", "carpenter", "weaver", "gardener", "doctor",
          "sailor", "potter", "shepherd", "painter", "clockmaker", "beekeeper", "librarian"]
PLACES = ["the valley", "the old harbour", "a hill town", "the river bend", "the market square",
          "a quiet village", "the northern forest", "the salt marsh", "an island", "the city"]
ADJECTIVES = ["small", "bright", "quiet", "old", "careful", "patient", "clever", "tired",
              "cheerful", "stubborn", "gentle", "curious", "brave", "hungry", "kind"]
THINGS = ["lantern", "kettle", "map", "basket of apples", "wooden box", "letter", "loaf of bread",
          "blue scarf", "copper pot", "bell", "ladder", "key", "old umbrella", "iron nail"]
VERBS = ["found", "carried", "mended", "lost", "painted", "sold", "borrowed", "hid",
         "polished", "shared", "opened", "weighed"]
TIMES = ["one morning", "late in the evening", "at noon", "before dawn", "after the rain",
         "on a cold night", "in early spring", "at the end of summer", "on market day"]
FEELINGS = ["glad", "surprised", "worried", "proud", "puzzled", "relieved", "amused"]
WEATHER = ["clear skies", "light rain", "heavy rain", "fog", "strong wind", "snow showers",
           "sunshine", "scattered clouds", "thunderstorms", "a cold drizzle"]
DIRECTIONS = ["north", "south", "east", "west", "north-west", "south-east"]
DISHES = ["lentil soup", "barley salad", "apple cake", "bean stew", "flat bread", "onion tart",
          "rice pudding", "pumpkin pie", "noodle salad", "roast potatoes", "plum crumble"]
INGREDIENTS = ["flour", "butter", "salt", "sugar", "eggs", "milk", "onions", "garlic",
               "carrots", "lentils", "rice", "apples", "beans", "honey", "lemon", "pepper",
               "olive oil", "barley", "cheese", "parsley", "plums", "oats"]
ACTIONS = ["Chop", "Stir in", "Mix", "Fold in", "Add", "Simmer", "Whisk", "Toast", "Season"]
UNITS = ["a cup of", "two spoons of", "a pinch of", "half a cup of", "three handfuls of",
         "a little", "a bowl of"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
           "seventeen", "eighteen", "nineteen", "twenty"]


def a(noun_phrase: str) -> str:
    """The phrase with its indefinite article: ``a key``, ``an old umbrella``."""
    return ("an " if noun_phrase[0] in "aeiou" else "a ") + noun_phrase


def story(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    person, thing = rng.choice(PEOPLE), rng.choice(THINGS)
    sentences = [
        f"In {rng.choice(PLACES)} there lived {a(rng.choice(ADJECTIVES))} {person} named {name}.",
        f"{rng.choice(TIMES).capitalize()}, {name} {rng.choice(VERBS)} {a(thing)}.",
        f"{other}, who was {a(rng.choice(PEOPLE))}, came by and asked about the {thing}.",
        f"{name} was {rng.choice(FEELINGS)} and said, \"It is my {thing}, "
        f"and I {rng.choice(VERBS)} it {rng.choice(TIMES)}.\"",
        f"Then the two of them walked to {rng.choice(PLACES)} together.",
    ]
    if rng.random() < 0.5:
        sentences.append(f"By {rng.choice(['supper', 'nightfall', 'the next day'])}, "
                         f"everyone in {rng.choice(PLACES)} knew the story.")
    return " ".join(sentences)


def recipe(rng: random.Random) -> str:
    dish = rng.choice(DISHES)
    items = rng.sample(INGREDIENTS, rng.randint(3, 6))
    lines = [f"Recipe: {dish} for {NUMBERS[rng.randint(2, 12)]} people.", "You need:"]
    lines += [f"- {rng.choice(UNITS)} {item}" for item in items]
    lines += [f"{i}. {rng.choice(ACTIONS)} the {item}." for i, item in enumerate(items, 1)]
    serving = rng.choice(["warm", "cold", "in a covered dish"])
    lines.append(f"Bake or cook for {rng.choice([10, 15, 20, 30, 45, 60])} minutes "
                 f"and bring it to the potluck {serving}.")
    return "\n".join(lines)


def arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 10), rng.randint(0, 10)
    if rng.random() < 0.5:
        return f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
    a, b = max(a, b), min(a, b)
    return f"{NUMBERS[a].capitalize()} minus {NUMBERS[b]} is {NUMBERS[a - b]}."


def weather(rng: random.Random) -> str:
    day = rng.choice(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday",
                      "Sunday"])
    low = rng.randint(-5, 15)
    return (f"Weather for {day} in {rng.choice(PLACES)}: {rng.choice(WEATHER)}, "
            f"wind from the {rng.choice(DIRECTIONS)}, between {low} and {low + rng.randint(3, 12)} "
            f"degrees.")


def letter(rng: random.Random) -> str:
    sender, reader = rng.sample(NAMES, 2)
    dish = rng.choice(DISHES)
    return (f"Dear {reader},\nThank you for the {dish}. The {rng.choice(PEOPLE)} from "
            f"{rng.choice(PLACES)} asked for the recipe, and I promised to send it. "
            f"I will bring {a(rng.choice(THINGS))} next time.\nYours, {sender}")


def section(rng: random.Random, make, count: int, sep: str) -> str:
    return sep.join(make(rng) for _ in range(count)) + "\n"


def main() -> None:
    rng = random.Random(2024)
    parts = {
        "stories.txt": section(rng, story, 300, "\n\n"),
        "recipes.txt": section(rng, recipe, 160, "\n\n"),
        "arithmetic.txt": section(rng, arithmetic, 1000, "\n"),
        "weather.txt": section(rng, weather, 400, "\n"),
        "letters.txt": section(rng, letter, 200, "\n\n"),
    }
    for name, text in parts.items():
        (OUT / name).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
