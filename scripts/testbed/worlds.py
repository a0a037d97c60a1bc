#!/usr/bin/env python3
"""The testbed's prompts: small synthetic worlds whose answers need the other chunks.

A world is a few people (each lives in a town and has a pet of some colour that
eats some food) and their towns (each with a landmark and the toy its children
like). Its text tells each fact once, with pronouns after the first sentence
about a person or a town ("She has a red cow. It eats corn."), the people and
towns in shuffled order, and is cut into 2-6 chunks at sentence boundaries.
A chunk that opens with a pronoun needs an earlier chunk to be understood, so
its true KV depends on the chunks before it: the case CacheBlend exists for.

The question asks for one fact of one person: the town, the pet's colour, food
or kind, the owner of a pet, or, in two hops, the landmark or toy of the town
the person lives in. The answer is one or two words, each a single token of
the Llama 2 SentencePiece vocabulary (`--check-vocab` verifies it).

    python3 scripts/testbed/worlds.py N SEED [MIN_PEOPLE MAX_PEOPLE] > prompts.jsonl
    python3 scripts/testbed/worlds.py --check-vocab third_party/llama.cpp/models/ggml-vocab-llama-spm.gguf

writes N prompts, one JSON object a line, the format `kvblend bench accuracy`
reads: {"system", "chunks": [...], "query": "Question: ...\\nAnswer:",
"answer": " ...", "kind"}. The dev set, dev.jsonl beside this file, is
`worlds.py 400 2002 3 6` with the answers stripped of their leading space.
"""
import json
import random
import sys
from dataclasses import dataclass

WOMEN = ["Sue", "Anna", "Lucy", "Amy", "Kate", "Emma", "Jane", "Rose", "Mary", "Ann",
         "Eva", "Lisa", "Julia", "Sarah", "Laura", "Alice", "Helen", "Grace", "Ruth", "Ellen"]
MEN = ["Tom", "Ben", "Max", "Tim", "Sam", "Jack", "Bob", "Joe", "Leo", "Jim",
       "Dan", "Ted", "John", "Paul", "Mark", "Peter", "Carl", "Adam", "Eric", "Frank"]
PETS = ["dog", "cat", "bird", "fish", "bear", "horse", "cow", "sheep", "mouse", "hen", "ant"]
COLOURS = ["red", "blue", "green", "yellow", "brown", "black", "white", "orange", "gray", "silver", "golden"]
FOODS = ["bread", "soup", "milk", "corn", "rice", "eggs", "meat", "fruit", "sugar", "tea", "pie", "salt", "oil"]
TOWN_FIRST = ["Red", "Green", "Big", "Little", "Old", "Blue", "Happy", "North", "South", "East", "West",
              "New", "High", "Long"]
TOWN_LAST = ["Hill", "Lake", "Park", "Wood", "Farm", "Bay", "Rock", "Field", "Creek", "Valley", "Town",
             "Brook", "River", "Spring", "Forest"]
LANDMARKS = ["tower", "bridge", "tree", "castle", "garden", "school", "shop", "boat", "clock", "bell", "wall",
             "church", "station", "library", "museum", "market"]
TOYS = ["ball", "drum", "doll", "train", "blocks", "car", "swing", "slide", "top", "game", "book"]
SYSTEM_PROMPTS = ["Read the text and answer the question.", "Here is some text. Answer with one word.",
                  "Use the passages to answer.", "Answer the question from the text below."]
QUESTION_KINDS = ["town", "color", "food", "pet", "owner", "thing", "toy"]


@dataclass
class Person:
    name: str
    town: str
    pet: str
    colour: str
    food: str

    @property
    def subject(self):  # the pronoun that opens a sentence about this person
        return "She" if self.name in WOMEN else "He"

    @property
    def possessive(self):
        return "her" if self.name in WOMEN else "his"


@dataclass
class Town:
    name: str
    landmark: str
    toy: str


@dataclass
class World:
    people: list
    towns: dict  # name -> Town


def make_world(rng, n_people):
    """n_people people with distinct names and pets, in 1-4 towns (fewer than the people)"""
    names = rng.sample(WOMEN + MEN, n_people)
    n_towns = max(1, min(n_people - 1, rng.randint(1, 4)))
    town_names = []
    while len(town_names) < n_towns:
        name = rng.choice(TOWN_FIRST) + " " + rng.choice(TOWN_LAST)
        if name not in town_names:
            town_names.append(name)
    towns = {t: Town(t, rng.choice(LANDMARKS), rng.choice(TOYS)) for t in town_names}
    pets = rng.sample(PETS, n_people)
    people = [Person(name, rng.choice(town_names), pet, rng.choice(COLOURS), rng.choice(FOODS))
              for name, pet in zip(names, pets)]
    return World(people, towns)


def person_sentences(rng, p):
    said = [f"{p.name} lives in {p.town}.", f"{p.subject} has a {p.colour} {p.pet}."]
    said.append(rng.choice([f"It likes to eat {p.food}.", f"The {p.pet} eats {p.food} every day.",
                            f"It eats {p.food}."]))
    if rng.random() < 0.5:  # a sentence that adds no fact, as real text has
        said.append(rng.choice([f"{p.subject} loves {p.possessive} {p.pet} very much.",
                                f"{p.subject} plays with it in the park.", "They are good friends."]))
    return said


def town_sentences(rng, t):
    return [f"{t.name} is a small town.",
            rng.choice([f"It has a big {t.landmark}.", f"There is an old {t.landmark} in the middle of it."]),
            rng.choice([f"Children there like to play with a {t.toy}.", f"The kids there love the {t.toy}."])]


def world_sentences(rng, world):
    """the world's text as sentences: each person's and each town's sentences stay
    together and in order (their pronouns point back), the groups shuffled"""
    groups = [person_sentences(rng, p) for p in world.people]
    groups += [town_sentences(rng, t) for t in world.towns.values()]
    rng.shuffle(groups)
    return [s for g in groups for s in g]


def questions_about(world, p):
    """every question about person p: (kind, question, answer), in QUESTION_KINDS order"""
    town = world.towns[p.town]
    return [
        ("town", f"Where does {p.name} live?", p.town),
        ("color", f"What color is {p.name}'s {p.pet}?", p.colour),
        ("food", f"What does {p.name}'s {p.pet} eat?", p.food),
        ("pet", f"What animal does {p.name} have?", p.pet),
        ("owner", f"Who has a {p.pet}?", p.name),
        ("thing", f"What big thing is in the town where {p.name} lives?", town.landmark),
        ("toy", f"What do children play with in the town where {p.name} lives?", town.toy),
    ]


def cut_into_chunks(rng, sentences, n_chunks):
    """the sentences joined into n_chunks chunks (at least 2, at most one a sentence),
    cut at random sentence boundaries"""
    n_chunks = max(2, min(n_chunks, len(sentences)))
    cuts = sorted(rng.sample(range(1, len(sentences)), n_chunks - 1)) + [len(sentences)]
    chunks, start = [], 0
    for end in cuts:
        chunks.append(" ".join(sentences[start:end]))
        start = end
    return chunks


def query_text(question):
    return f"Question: {question}\nAnswer:"


def make_context(rng, world):
    """the prompt's system text and chunks for a world"""
    return dict(system=rng.choice(SYSTEM_PROMPTS),
                chunks=cut_into_chunks(rng, world_sentences(rng, world), rng.randint(2, 6)))


def make_prompt(rng, min_people=3, max_people=8):
    """one prompt: a world's text in chunks and one question about one of its people"""
    world = make_world(rng, rng.randint(min_people, max_people))
    prompt = make_context(rng, world)
    kind, question, answer = rng.choice(questions_about(world, rng.choice(world.people)))
    prompt.update(query=query_text(question), answer=" " + answer, kind=kind)
    return prompt


def entity_words():
    """every word an answer can hold"""
    words = WOMEN + MEN + PETS + COLOURS + FOODS + TOWN_FIRST + TOWN_LAST + LANDMARKS + TOYS
    return sorted(set(words))


def check_vocab(vocab_gguf):
    """exit 1 unless every entity word is one token of the vocabulary (as after a space:
    the tokenizer puts one before the text)"""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.path.insert(0, os.path.join(here, "..", "..", "third_party", "llama.cpp", "gguf-py"))
    from spm import Spm
    tok = Spm(vocab_gguf)
    split = [w for w in entity_words() if len(tok.encode(w)) != 1]
    if split:
        raise SystemExit(f"not single tokens of {vocab_gguf}: {', '.join(split)}")
    print(f"{len(entity_words())} entity words, each one token of {vocab_gguf}")


def main(argv):
    if len(argv) == 2 and argv[0] == "--check-vocab":
        return check_vocab(argv[1])
    if len(argv) not in (2, 4):
        raise SystemExit(__doc__)
    n, seed = int(argv[0]), int(argv[1])
    lo, hi = (int(argv[2]), int(argv[3])) if len(argv) == 4 else (3, 8)
    if n < 0 or not 1 <= lo <= hi <= min(len(PETS), len(WOMEN + MEN)):
        raise SystemExit(f"need N >= 0 and 1 <= MIN_PEOPLE <= MAX_PEOPLE <= {len(PETS)}")
    rng = random.Random(seed)
    for _ in range(n):
        print(json.dumps(make_prompt(rng, lo, hi)))


if __name__ == "__main__":
    main(sys.argv[1:])
