"""The testbed trainer's data (scripts/testbed/train.py): packed questions and the
adaptive curriculum. Needs torch (KVBLEND_TRAIN=1 bash scripts/setup.sh); skipped
without it.
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LLAMA = os.path.join(ROOT, "third_party", "llama.cpp")
sys.path.insert(0, os.path.join(ROOT, "scripts", "testbed"))
sys.path.insert(0, os.path.join(LLAMA, "gguf-py"))

import train  # noqa: E402
from spm import Spm  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return Spm(os.path.join(LLAMA, "models", "ggml-vocab-llama-spm.gguf"))


def batch(tok, *flags, seed=5):
    args = train.parse_args(["--out", "unused", "--steps", "1", "--batch", "3", *flags])
    return args, train.Batches(args, tok, seed).make(0.0)


def test_each_packed_question_sees_what_it_would_see_alone(tok):
    torch.manual_seed(0)
    args, (x, y, ylm, pos, blk) = batch(tok, "--questions", "4")
    model = train.build_model(args, len(tok)).eval()
    with torch.no_grad():
        packed = model(torch.from_numpy(x), train.block_mask(blk, torch.device("cpu")), True, torch.from_numpy(pos))
        n_blocks = 0
        for r in range(x.shape[0]):
            n = int((blk[r] == 0).sum())
            assert n > 0 and (blk[r, :n] == 0).all()  # the prompt comes first
            for j in range(1, int(blk[r].max()) + 1):
                idx = (blk[r] == j).nonzero()[0]
                assert pos[r, idx[0]] == n  # every question starts right after the prompt
                alone = model(torch.tensor([list(x[r, :n]) + list(x[r, idx])]), None, True)[0, n:]
                assert float((alone - packed[r, idx]).abs().max()) < 1e-4
                # the targets are the block's own answer: the tokens after its query
                t = y[r, idx]
                k = (t >= 0).nonzero()[0]
                assert len(k) >= 2  # the answer's words and the newline
                assert list(t[k][:-1]) == list(x[r, idx[k[:-1] + 1]])
                assert t[k[-1]] == tok.encode("\n")[-1]
                n_blocks += 1
    assert n_blocks == 3 * 4  # worlds of 3+ people have more than 4 questions each


def test_every_question_of_a_world_is_a_candidate(tok):
    args, (x, y, ylm, pos, blk) = batch(tok, "--questions", "100", "--min-people", "1", "--max-people", "1")
    for r in range(x.shape[0]):
        assert int(blk[r].max()) == 7  # one person: the 7 kinds, each once


def test_level_up_starts_small_and_ends_on_the_dev_range(tok):
    import multiprocessing
    args = train.parse_args(["--out", "unused", "--steps", "1", "--level-up", "0.3", "--min-people", "3",
                             "--max-people", "6"])
    level = multiprocessing.Value("i", 1)
    b = train.Batches(args, tok, 1, level)
    assert b.people(0.0) == (1, 1)
    level.value = 4
    assert b.people(0.0) == (3, 4)
    level.value = 6
    assert b.people(0.0) == (3, 6)


def test_the_schedule_follows_the_tokens_seen_not_a_step_estimate():
    # a run resumed with a larger --tokens: its steps were longer than the
    # length estimate assumed, yet it is where its tokens say on the new schedule
    args = train.parse_args(["--out", "unused", "--tokens", "6.5e7", "--batch", "64"])
    assert train.run_progress(args, step=11000, tokens_seen=5.0e7, elapsed_s=0) == pytest.approx(5.0 / 6.5)
    assert train.run_progress(args, step=0, tokens_seen=0, elapsed_s=0) == 0.0
    assert train.run_progress(args, step=1, tokens_seen=7e7, elapsed_s=0) == 1.0
    # by steps or minutes, whichever is furthest
    args = train.parse_args(["--out", "unused", "--steps", "100", "--minutes", "10"])
    assert train.run_progress(args, step=20, tokens_seen=0, elapsed_s=300) == pytest.approx(0.5)
    assert train.run_progress(args, step=80, tokens_seen=0, elapsed_s=300) == pytest.approx(0.8)
