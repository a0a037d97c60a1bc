"""The testbed generator (scripts/testbed/worlds.py): its dev set is what it writes,
every answer is told in the chunks, chunks lean on earlier ones, and every
entity is one token of the Llama 2 SPM vocabulary."""

import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.join(ROOT, "scripts", "testbed")
sys.path.insert(0, HERE)

import worlds  # noqa: E402


def test_the_dev_set_is_what_the_generator_writes():
    out = subprocess.run([sys.executable, os.path.join(HERE, "worlds.py"), "400", "2002", "3", "6"],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    with open(os.path.join(HERE, "dev.jsonl")) as f:
        dev = [json.loads(line) for line in f]
    assert len(out) == len(dev) == 400
    for line, d in zip(out, dev):
        made = json.loads(line)
        assert made["answer"] == " " + d["answer"]  # dev.jsonl strips the leading space
        made["answer"] = d["answer"]
        assert made == d


def test_every_answer_is_told_and_chunks_lean_on_earlier_ones():
    rng = random.Random(7)
    kinds, pronoun_led = set(), 0
    for _ in range(300):
        p = worlds.make_prompt(rng, 2, 6)
        text = " ".join(p["chunks"])
        assert 2 <= len(p["chunks"]) <= 6
        assert p["query"].startswith("Question: ") and p["query"].endswith("\nAnswer:")
        assert p["answer"].startswith(" ") and p["answer"].strip() in text
        kinds.add(p["kind"])
        pronoun_led += sum(c.split()[0] in ("He", "She", "It", "The", "They", "There", "Children")
                           for c in p["chunks"][1:])
    assert kinds == set(worlds.QUESTION_KINDS)
    assert pronoun_led > 100  # many chunks need an earlier one to be understood


def test_two_hop_answers_follow_the_persons_town():
    rng = random.Random(3)
    world = worlds.make_world(rng, 5)
    for person in world.people:
        answers = {kind: a for kind, _, a in worlds.questions_about(world, person)}
        town = world.towns[answers["town"]]
        assert answers["thing"] == town.landmark and answers["toy"] == town.toy
        assert answers["owner"] == person.name


def test_entities_are_single_tokens_of_the_llama_spm_vocabulary():
    pytest.importorskip("numpy")  # gguf-py reads the vocabulary with it
    vocab = os.path.join(ROOT, "third_party", "llama.cpp", "models", "ggml-vocab-llama-spm.gguf")
    if not os.path.exists(vocab):
        pytest.skip("the pinned llama.cpp source is not fetched (scripts/setup.sh)")
    r = subprocess.run([sys.executable, os.path.join(HERE, "worlds.py"), "--check-vocab", vocab],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
