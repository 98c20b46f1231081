"""Text for the tiny model: a built-in generated corpus, or any local file.

The built-in corpus is *generated* by the code below from a fixed seed, so it
needs no download, carries no licence, and is byte-for-byte the same on every
machine. It mixes three kinds of lines, each with structure that a small
model can learn in a minute on a laptop CPU:

* **Sentences** from a small grammar: ``the old cat sees a red ball near the
  river.`` Subjects are singular or plural and the verb agrees with them
  (``the cat sees`` / ``the cats see``); possessives agree too (``the girl
  lost her hat`` / ``the boys lost their hats``), and ``a`` becomes ``an``
  before a vowel. A model that learned agreement predicts the ``s`` after
  the verb.
* **Arithmetic**: ``17 + 25 = 42`` and ``61 - 19 = 42``. The format is easy;
  the answer digits need actual addition, so they stay the hardest bytes.
* **Records** with a copy task: ``record 4821: name=ana city=lima age=31 |
  check 4821 -> ana lima``. The ids and names are random, so the ``check``
  part can only be predicted by copying from earlier in the same line, the
  kind of in-context lookup that attention heads are good at.

Because the validation text is drawn from the same generator but is never
seen in training (different random ids, sums, sentences), a falling
validation loss means the model learned the *rules*, not the lines.

The lines are mixed in proportion 50/25/25 (sentences/arithmetic/records).
About 300 KB of text is generated in well under a second, every time it is
needed; nothing is cached on disk.
"""

from __future__ import annotations

import random
from pathlib import Path

END_OF_TEXT = "<|endoftext|>"  # GPT-2's document separator; the BPE tokenizer makes it one token
BUILTIN_SEED = 1234
BUILTIN_TARGET_BYTES = 300_000

# (singular, plural) noun pairs.
_NOUNS = [
    ("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("farmer", "farmers"),
    ("teacher", "teachers"), ("child", "children"), ("robot", "robots"),
    ("fox", "foxes"), ("baker", "bakers"), ("sailor", "sailors"),
]
# (third person singular, plural) verb pairs.
_VERBS = [
    ("sees", "see"), ("likes", "like"), ("chases", "chase"), ("finds", "find"),
    ("carries", "carry"), ("watches", "watch"), ("paints", "paint"),
    ("wants", "want"),
]
_ADJECTIVES = ["old", "small", "happy", "red", "quiet", "clever", "tired", "green"]
_OBJECTS = ["ball", "apple", "book", "boat", "kite", "cake", "box", "hat", "key", "map"]
_PLACES = [
    "near the river", "in the garden", "at the market", "on the hill",
    "under the bridge", "in the morning", "after lunch", "by the sea",
]
# (singular, plural) subjects for the possessive-agreement template.
_PEOPLE = [
    (("girl", "her"), ("girls", "their")), (("boy", "his"), ("boys", "their")),
    (("woman", "her"), ("women", "their")), (("man", "his"), ("men", "their")),
]
_PAST_VERBS = ["lost", "found", "washed", "sold", "dropped", "painted"]
_NAMES = ["ana", "bo", "cai", "dev", "eli", "fay", "gus", "hana", "ivo", "jun",
          "kim", "lea", "milo", "nia", "omar", "pia", "ravi", "sol", "tess", "uma"]
_CITIES = ["lima", "oslo", "rome", "kyiv", "pune", "baku", "doha", "riga",
           "quito", "accra", "hanoi", "minsk"]


def _plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def _noun_phrase(rng: random.Random, noun: str) -> str:
    """``the cat``, ``a red ball``, ``an old apple``: "a" becomes "an" before a vowel."""
    words = [rng.choice(_ADJECTIVES), noun] if rng.random() < 0.5 else [noun]
    det = rng.choice(["the", "a"])
    if det == "a" and words[0][0] in "aeiou":
        det = "an"
    return " ".join([det, *words])


def _sentence(rng: random.Random) -> str:
    if rng.random() < 0.25:
        (sing, sing_pos), (plur, plur_pos) = rng.choice(_PEOPLE)
        noun, pos, obj = (
            (sing, sing_pos, rng.choice(_OBJECTS))
            if rng.random() < 0.5
            else (plur, plur_pos, _plural(rng.choice(_OBJECTS)))
        )
        return f"the {noun} {rng.choice(_PAST_VERBS)} {pos} {obj}."
    plural = rng.random() < 0.5
    noun = rng.choice(_NOUNS)[1 if plural else 0]
    verb = rng.choice(_VERBS)[1 if plural else 0]
    obj = _noun_phrase(rng, rng.choice(_OBJECTS))
    subject = f"the {noun}" if plural else _noun_phrase(rng, noun)
    place = f" {rng.choice(_PLACES)}" if rng.random() < 0.6 else ""
    return f"{subject} {verb} {obj}{place}."


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if rng.random() < 0.5:
        return f"{a} + {b} = {a + b}"
    a, b = max(a, b), min(a, b)
    return f"{a} - {b} = {a - b}"


def _record(rng: random.Random) -> str:
    rid = rng.randint(1000, 9999)
    name, city = rng.choice(_NAMES), rng.choice(_CITIES)
    return (f"record {rid}: name={name} city={city} age={rng.randint(18, 90)}"
            f" | check {rid} -> {name} {city}")


# --8<-- [start:generate-corpus]
def generate_corpus(seed: int = BUILTIN_SEED, target_bytes: int = BUILTIN_TARGET_BYTES) -> str:
    """Deterministic synthetic text: the same seed gives the same string everywhere."""
    rng = random.Random(seed)  # a private generator: never touches global RNG state
    lines, size = [], 0
    while size < target_bytes:
        kind = rng.random()
        if kind < 0.5:
            line = _sentence(rng)
        elif kind < 0.75:
            line = _arithmetic(rng)
        else:
            line = _record(rng)
        lines.append(line)
        size += len(line) + 1  # all ASCII: one byte per character, plus "\n"
    return "\n".join(lines) + "\n"
# --8<-- [end:generate-corpus]


class DataError(ValueError):
    """The text a run was pointed at cannot be used (missing, unreadable, too short)."""


# --8<-- [start:load-text]
def load_text(path: str | Path | None) -> str:
    """The built-in corpus when ``path`` is None, else the UTF-8 file at ``path``."""
    if path is None:
        return generate_corpus()
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path} (pass --data with a UTF-8 text file, "
                        "or leave it out to use the built-in generated corpus)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text: {err}") from None
# --8<-- [end:load-text]
